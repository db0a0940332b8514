"""Short RL runs on the shipped toy model fix far more images than they break on the prompts they train on.

This is the toy world's promise in miniature. The base model is an early checkpoint of pre-training on the whole
grammar, so the right image is among its samples for most prompts but not reliably first; the verifiable reward
says which samples are right, and a minute or two of RL on a 2-core CPU moves the model onto them. Two recipes
are held to it:

* DiffusionNFT, the main job's config (``configs/toy/nft.yaml``) at the rate four prompts bear, at 2.5 paired
  standard errors (measured 4.8 / 6.1 / 2.9 over seeds 0, 1, 2 at one thread: assets/toy/README.md);
* full-SDE GRPO at Flow-GRPO-like settings (``configs/toy/grpo.yaml``) is listed in RUNS but not yet held to a
  gain (run it with ``FLOWRL_TOY_RL_RECIPES=nft,grpo``).

Before and after are scored on the same seeds (common random numbers) with ODE sampling, so the comparison is
paired: an image is "fixed" when it is wrong before and right after, "broken" the other way round. Under no
effect F and B are equally likely, so ``(F - B) / sqrt(F + B)`` is the gain in standard errors (McNemar's
statistic).

``FLOWRL_TOY_RL_SEEDS=0,1,2`` runs the tests for several run seeds (the default is seed 0).
"""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch

from rewards.toyeval import ToyEval
from tools.toy_runs import FOUR_PROMPTS, ode_images, paired_gain, train_on_prompts

EVAL_SEEDS = list(range(5000, 5096))
SEEDS = [int(s) for s in os.environ.get("FLOWRL_TOY_RL_SEEDS", "0").split(",")]
RUNS = {  # config, epochs, overrides, the gain asked for in paired standard errors
    "nft": ("configs/toy/nft.yaml", 12, ["train.learning_rate=3e-3"], 2.5),  # four prompts bear a faster rate
    "grpo": ("configs/toy/grpo.yaml", 16, [], 4.0),
}
RECIPES = os.environ.get("FLOWRL_TOY_RL_RECIPES", "nft").split(",")


@pytest.mark.slow
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("recipe", RECIPES)
def test_toy_rl_fixes_more_images_than_it_breaks(tmp_path, monkeypatch, recipe, seed):
    config, epochs, overrides, wanted = RUNS[recipe]
    policy, cfg, metas = train_on_prompts(config, FOUR_PROMPTS, tmp_path, monkeypatch, epochs=epochs,
                                          overrides=[f"seed={seed}", *overrides])
    prompts = [p for p in FOUR_PROMPTS for _ in EVAL_SEEDS]
    meta = [m for m in metas for _ in EVAL_SEEDS]

    def scores():
        return ToyEval()(ode_images(policy, cfg, FOUR_PROMPTS, EVAL_SEEDS), prompts, meta)

    after = scores()
    with policy.reference():
        before = scores()
    strict_before, strict_after = before["toyeval"].float(), after["toyeval"].float()
    fixed, broken, gain = paired_gain(strict_before, strict_after)
    print(f"{recipe} seed {seed}, {torch.get_num_threads()} threads: strict ToyEval {strict_before.mean():.3f} -> "
          f"{strict_after.mean():.3f}, fixed {fixed}, broken {broken}: {gain:.1f} standard errors")
    assert torch.isfinite(after["toyeval/partial"]).all()
    assert gain >= wanted, (fixed, broken, float(strict_before.mean()), float(strict_after.mean()))
