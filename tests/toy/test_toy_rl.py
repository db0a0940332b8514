"""Short RL runs on the shipped toy model fix far more images than they break on the prompts they train on.

This is the toy world's promise in miniature. The base model is an early checkpoint of pre-training on the whole
grammar, so the right image is among its samples for most prompts but not reliably first; the verifiable reward
says which samples are right, and a few minutes of RL on a 2-core CPU move the model onto them. The runs train on
eight counting prompts of the training split (``tools.toy_runs.COUNTING_PROMPTS``), where the base's right image is
most often among its samples without being first. Two recipes are held to it:

* DiffusionNFT, the main job's config (``configs/toy/nft.yaml``) at its own rate, with groups of 8 instead of 16:
  16 epochs of them gain as many standard errors as 12 epochs of 16 (7.6-8.2 against 7.4-8.3) in two thirds
  of the time;
* full-SDE GRPO at Flow-GRPO-like settings (``configs/toy/grpo.yaml`` as shipped: noise 0.7, KL 0.04, clip).

Each asks a margin below every figure measured on seeds 0, 1, 2 at one and two torch threads (NFT 7.6-8.2, GRPO
4.4-8.3 paired standard errors; assets/toy/README.md, "The learning tests").

Before and after are scored on the same seeds (common random numbers) with ODE sampling, so the comparison is
paired: an image is "fixed" when it is wrong before and right after, "broken" the other way round. Under no
effect F and B are equally likely, so ``(F - B) / sqrt(F + B)`` is the gain in standard errors (McNemar's
statistic).

``FLOWRL_TOY_RL_SEEDS=0,1,2`` runs the tests for several run seeds (the default is seed 0);
``FLOWRL_TOY_RL_RECIPES=nft`` runs one recipe.
"""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch

from rewards.toyeval import ToyEval
from tools.toy_runs import COUNTING_PROMPTS, ode_images, paired_gain, train_on_prompts

EVAL_SEEDS = list(range(5000, 5096))
SEEDS = [int(s) for s in os.environ.get("FLOWRL_TOY_RL_SEEDS", "0").split(",")]
RUNS = {  # config, its overrides, epochs, the gain asked for in paired standard errors
    "nft": ("configs/toy/nft.yaml", ["sampling.group_size=8"], 16, 6.0),
    "grpo": ("configs/toy/grpo.yaml", [], 16, 4.0),
}
RECIPES = os.environ.get("FLOWRL_TOY_RL_RECIPES", "nft,grpo").split(",")
BASE_SCORES: dict[tuple, dict] = {}  # (model path, ODE steps, guidance) -> the base's ToyEval scores


@pytest.mark.slow
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("recipe", RECIPES)
def test_toy_rl_fixes_more_images_than_it_breaks(tmp_path, monkeypatch, recipe, seed):
    config, overrides, epochs, wanted = RUNS[recipe]
    policy, cfg, metas = train_on_prompts(config, COUNTING_PROMPTS, tmp_path, monkeypatch, epochs=epochs,
                                          overrides=[*overrides, f"seed={seed}"])
    prompts = [p for p in COUNTING_PROMPTS for _ in EVAL_SEEDS]
    meta = [m for m in metas for _ in EVAL_SEEDS]

    def scores():
        return ToyEval()(ode_images(policy, cfg, COUNTING_PROMPTS, EVAL_SEEDS), prompts, meta)

    after = scores()
    # The base's scores depend on the model and the ODE settings only: both recipes' configs sample the shipped
    # base at the same steps and guidance, so a worker that runs both scores the base once.
    key = (cfg.model.path, cfg.sampling.num_steps, cfg.sampling.guidance_scale)
    if key not in BASE_SCORES:
        with policy.reference():
            BASE_SCORES[key] = scores()
    before = BASE_SCORES[key]
    strict_before, strict_after = before["toyeval"].float(), after["toyeval"].float()
    fixed, broken, gain = paired_gain(strict_before, strict_after)
    print(f"{recipe} seed {seed}, {torch.get_num_threads()} threads: strict ToyEval {strict_before.mean():.3f} -> "
          f"{strict_after.mean():.3f}, fixed {fixed}, broken {broken}: {gain:.1f} standard errors")
    assert torch.isfinite(after["toyeval/partial"]).all()
    assert gain >= wanted, (fixed, broken, float(strict_before.mean()), float(strict_after.mean()))
