"""Preference mode collapse in miniature: GRPO on the hackable ToyProxy without KL
(configs/toy/grpo_proxy.yaml) collapses the ground-truth diversity of a free attribute.

The proxy prefers one background (black), which no prompt asks for. Optimising it must drive the
background entropy of each prompt's samples down: the exact signature of preference mode collapse
that `flowrl.toy.diversity` measures. Before and after use the same seeds (ODE sampling).
"""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch

from flowrl.toy.diversity import diversity
from tools.toy_runs import ode_images, train_on_prompts

PROMPTS = ("a red square", "a blue circle", "two green squares", "a yellow circle and a purple triangle")
EVAL_SEEDS = list(range(7000, 7016))
EPOCHS = 12  # enough for the drop asked: 18 epochs give no more, 30 about 0.29


@pytest.mark.slow
def test_proxy_grpo_collapses_background_diversity(tmp_path, monkeypatch):
    policy, cfg, _ = train_on_prompts("configs/toy/grpo_proxy.yaml", PROMPTS, tmp_path, monkeypatch, epochs=EPOCHS,
                                       overrides=["train.ema=false"])
    groups = torch.arange(len(PROMPTS)).repeat_interleave(len(EVAL_SEEDS))

    def background_entropy():
        return diversity(ode_images(policy, cfg, PROMPTS, EVAL_SEEDS), groups)["diversity/background"]

    after = background_entropy()
    with policy.reference():
        before = background_entropy()
    print(f"background entropy per prompt: {before:.3f} -> {after:.3f}")
    # measured 0.686 -> 0.567 at 12 epochs x 32 rollouts (53 s, one thread), 0.565 at 18, 0.402 at 30; the
    # shipped 60-epoch config reaches 0.061 on 64 held-out prompts (scripts/toy_collapse.py)
    assert after < before - 0.05, (before, after)
