"""Test-only rewards (importable by dotted path, e.g. ``tests.reward_fixtures:RedMinusBlue``)."""

import torch


class RedMinusBlue:
    """Mean red minus mean blue: a global colour direction, which per-channel latent offsets move
    even through the tiny random VAE."""

    name = "redness"

    @torch.no_grad()
    def __call__(self, images, prompts, metadata):
        return {self.name: (images[:, 0] - images[:, 2]).mean(dim=(1, 2))}


class FlatOnSomePrompts:
    """Brightness, except a constant 0.5 for prompts that contain "flat" (a saturated group: its advantages are
    exactly 0) and, under torch.distributed, for every prompt of rank 1 (that process's groups are all saturated)."""

    name = "flat_or_bright"

    @torch.no_grad()
    def __call__(self, images, prompts, metadata):
        rank1 = torch.distributed.is_available() and torch.distributed.is_initialized() and \
            torch.distributed.get_rank() == 1
        flat = torch.tensor([rank1 or "flat" in p for p in prompts])
        return {self.name: torch.where(flat, torch.tensor(0.5), images.mean(dim=(1, 2, 3)).float().cpu())}


class GroupBrightness:
    """``brightness`` (rewards.simple's, same name and numbers) declared group-wise: the scorer calls it once per group.
    With ``record``, each call appends a JSON line to that file: how many rows it got and how many distinct prompts
    they had (processes append to the same file)."""

    scores_groups = True
    name = "brightness"

    def __init__(self, record: str | None = None) -> None:
        from rewards.simple import Brightness

        self.brightness, self.record = Brightness(), record

    @torch.no_grad()
    def __call__(self, images, prompts, metadata):
        if self.record:
            import json

            with open(self.record, "a") as log:
                log.write(json.dumps({"rows": len(prompts), "prompts": len(set(prompts))}) + "\n")
        return self.brightness(images, prompts, metadata)


class GroupProbe:
    """A group-wise reward (``scores_groups``) that reports how it was called: every row of a call scores the
    call's row count, and ``group_probe/prompts`` the number of distinct prompts the call held. It runs inside the
    reward service's replicas (tests/rewards/test_reward_service.py), so what it saw comes back over HTTP."""

    name = "group_probe"
    scores_groups = True

    @torch.no_grad()
    def __call__(self, images, prompts, metadata):
        n = images.shape[0]
        return {self.name: torch.full((n,), float(n)),
                f"{self.name}/prompts": torch.full((n,), float(len(set(prompts))))}
