"""Keep the policy a recipe builds, with a copy of its weights as built, so a test or a tool can inspect training.

In tools/ because ``tools.toy_runs`` (and through it ``python -m tools.toy_short_rl``) needs it, and tools must
not import the test suite; the tests import it from here."""

import torch


def lora_and_base(policy) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Copies of the transformer's LoRA and base weights, by parameter name."""
    lora = {n: p.detach().clone() for n, p in policy.transformer.named_parameters() if "lora_" in n}
    base = {n: p.detach().clone() for n, p in policy.transformer.named_parameters() if "lora_" not in n}
    return lora, base


def capture_training_policy(monkeypatch) -> dict:
    """Patch the recipes' policy builder; the returned dict gets ``policy`` (the live object the run
    trains) and ``before`` (``lora_and_base`` of it as built) from the first policy built."""
    import flowrl.recipes.start as start

    captured = {}
    real_build = start.build_training_policy

    def build_and_capture(cfg, device):
        policy = real_build(cfg, device)
        if "policy" not in captured:
            captured.update(policy=policy, before=lora_and_base(policy))
        return policy

    monkeypatch.setattr(start, "build_training_policy", build_and_capture)
    return captured


def random_lora_policy(family: str, rank: int, alpha: float):
    """A tiny ``family`` policy whose LoRA (default targets) holds seeded random non-zero A and B, so an export
    carries a visible update: what a trained adapter looks like to the LoRA writers and readers."""
    from flowrl.models import build_policy

    policy = build_policy(family, "tiny", seed=0)
    policy.add_lora(rank=rank, alpha=alpha, init_seed=0)
    randomize_lora(policy, seed=3, scale=0.05)
    return policy


@torch.no_grad()
def randomize_lora(policy, seed: int = 1, scale: float = 0.1) -> None:
    """Fill ``policy``'s trainable (LoRA) parameters with seeded normal values times ``scale``: an adapter far from
    its zero init, so that it visibly changes the images an export check compares."""
    generator = torch.Generator().manual_seed(seed)
    for param in policy.trainable_parameters():
        param.copy_(torch.randn(param.shape, generator=generator) * scale)
