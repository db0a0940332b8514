"""Test-only rewards (importable by dotted path, e.g. ``tests.reward_fixtures:RedMinusBlue``)."""

import torch


class RedMinusBlue:
    """Mean red minus mean blue: a global colour direction, which per-channel latent offsets move
    even through the tiny random VAE."""

    name = "redness"

    @torch.no_grad()
    def __call__(self, images, prompts, metadata):
        return {self.name: (images[:, 0] - images[:, 2]).mean(dim=(1, 2))}
