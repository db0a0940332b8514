"""A short RL run on the shipped toy model fixes images on the prompts it trains on.

This is the toy world's promise in miniature: the base model is imperfect on shapes and counts,
the verifiable reward says exactly where, and about two minutes of DiffusionNFT
(configs/toy/nft.yaml, the main job's config, trained on four prompts) on a 2-core CPU fix far
more images than they break. Before and after are scored on the same seeds (common random numbers) with ODE sampling,
so the comparison is paired: an image is "fixed" when it is wrong before and right after, "broken"
the other way round. Under no effect F and B are equally likely, so ``(F - B) / sqrt(F + B)`` is
the gain in standard errors (McNemar's statistic); the test asks for 4.

``FLOWRL_TOY_RL_SEEDS=0,1,2`` runs the test for several run seeds (the default is seed 0).
"""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch

from rewards.toyeval import ToyEval
from tests.toy_runs import ode_images, train_on_prompts

# Training prompts of the toy split that the base model gets right 19-31% of the time (16 seeds).
PROMPTS = ("a green triangle", "two purple triangles", "three red circles", "three blue diamonds")
EVAL_SEEDS = list(range(5000, 5096))
SEEDS = [int(s) for s in os.environ.get("FLOWRL_TOY_RL_SEEDS", "0").split(",")]
EPOCHS = 16  # the shipped config's settings otherwise (strict reward, lr 1e-3, 2 passes of 2 timesteps)
MIN_STANDARD_ERRORS = 4.0


@pytest.mark.parametrize("seed", SEEDS)
def test_toy_nft_fixes_more_images_than_it_breaks(tmp_path, monkeypatch, seed):
    policy, cfg, metas = train_on_prompts("configs/toy/nft.yaml", PROMPTS, tmp_path, monkeypatch, epochs=EPOCHS,
                                          overrides=[f"seed={seed}"])
    prompts = [p for p in PROMPTS for _ in EVAL_SEEDS]
    meta = [m for m in metas for _ in EVAL_SEEDS]

    def scores():
        return ToyEval()(ode_images(policy, cfg, PROMPTS, EVAL_SEEDS), prompts, meta)

    after = scores()
    with policy.reference():
        before = scores()
    strict_before, strict_after = before["toyeval"].float(), after["toyeval"].float()
    fixed = int(((strict_after == 1) & (strict_before == 0)).sum())
    broken = int(((strict_after == 0) & (strict_before == 1)).sum())
    gain = (fixed - broken) / max(fixed + broken, 1) ** 0.5
    print(f"seed {seed}, {torch.get_num_threads()} threads: strict ToyEval {strict_before.mean():.3f} -> "
          f"{strict_after.mean():.3f}, fixed {fixed}, broken {broken}: {gain:.1f} standard errors; partial "
          f"{before['toyeval/partial'].mean():.3f} -> {after['toyeval/partial'].mean():.3f}")
    assert torch.isfinite(after["toyeval/partial"]).all()
    assert gain >= MIN_STANDARD_ERRORS, (fixed, broken, float(strict_before.mean()), float(strict_after.mean()))
