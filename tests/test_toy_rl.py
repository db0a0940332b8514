"""A short GRPO run on the shipped toy model (configs/toy/grpo.yaml) raises ToyEval on its training prompts.

This is the toy world's promise in miniature: the base model is imperfect on counts, pairs and
positions, the verifiable reward says exactly where, and a few minutes of GRPO on a CPU fix part
of it. Before and after are scored on the same seeds (common random numbers) with ODE sampling,
so the comparison is paired and the margin is not sampling noise.
"""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest

from rewards.toyeval import ToyEval
from tests.toy_runs import ode_images, train_on_prompts

# Training prompts the base model gets right 19-31% of the time (16 seeds), so groups carry signal.
PROMPTS = ("a blue diamond", "a red square", "two red circles", "a green triangle")
EVAL_SEEDS = list(range(5000, 5024))


@pytest.mark.xfail(strict=True, reason="GRPO does not yet move ToyEval on the shipped toy model within this budget "
                   "(30 epochs x 32 rollouts: strict 0.30 -> 0.28..0.32; see assets/toy/README.md)")
def test_toy_grpo_raises_toyeval_on_its_training_prompts(tmp_path, monkeypatch):
    policy, cfg, metas = train_on_prompts("configs/toy/grpo.yaml", PROMPTS, tmp_path, monkeypatch, epochs=30)
    prompts = [p for p in PROMPTS for _ in EVAL_SEEDS]
    meta = [m for m in metas for _ in EVAL_SEEDS]

    def strict():
        return ToyEval()(ode_images(policy, cfg, PROMPTS, EVAL_SEEDS), prompts, meta)["toyeval"].float().mean()

    after = strict()
    with policy.reference():
        before = strict()
    print(f"ToyEval strict on the training prompts: {before:.3f} -> {after:.3f}")
    assert after > before + 0.1, (before.item(), after.item())
