"""Shared scaffolding of the short toy-world RL runs: train a shipped toy config on a few training prompts,
keep the trained policy, and sample it with ODE on common seeds.

It lives in tools/ rather than tests/ because ``python -m tools.toy_short_rl`` runs the same training as the
toy tests, and tools must not import the test suite; the tests import it from here."""

import json

import torch

from flowrl.commands.train import recipe_train
from flowrl.config import Config, load_config
from flowrl.sampling import RolloutSettings, chunked_rollout
from flowrl.toy.prompts import train_prompts
from tools.policy_capture import capture_training_policy

# Eight counting prompts of the toy split's training set, four of "two" and four of "three", one per colour:
# tests/toy/test_toy_rl.py trains on them, and so does python -m tools.toy_short_rl. Counting is the task where the
# base's right image is most often among its samples but not first (pass@1 0.31, pass@16 0.94), so a short run
# fixes the most images per epoch there (assets/toy/README.md, "The learning tests").
COUNTING_PROMPTS = ("three red diamonds", "two green squares", "three blue circles", "two yellow triangles",
                    "three purple squares", "two orange squares", "three cyan diamonds", "two pink circles")
# The earlier learning tests' set, a single object and three counts (the figures measured on it name it).
FOUR_PROMPTS = ("a green triangle", "two purple circles", "three blue circles", "three cyan diamonds")
PROMPT_SETS = {"counting": COUNTING_PROMPTS, "four": FOUR_PROMPTS}


def train_on_prompts(config: str, prompts, tmp_path, monkeypatch, epochs: int, overrides=()):
    """Run ``config`` on ``prompts`` (training prompts of the toy split) -> (policy, cfg, metadata per prompt).

    The policy keeps its live (last) weights: sampling it shows what training did, EMA or not.
    """
    meta = dict(train_prompts(0))
    missing = [p for p in prompts if p not in meta]
    assert not missing, f"not training prompts of the toy split: {missing}"
    prompts_file = tmp_path / "prompts.jsonl"
    prompts_file.write_text("".join(json.dumps({"prompt": p, "metadata": meta[p]}) + "\n" for p in prompts))
    captured = capture_training_policy(monkeypatch)
    cfg = load_config(Config, config, [
        f"run_dir={tmp_path / 'run'}", f"train.epochs={epochs}", f"data.prompts={prompts_file}",
        f"data.test_prompts={prompts_file}", f"sampling.prompts_per_batch={len(prompts)}", "log.progress=false",
        "log.eval_every=0", "log.test_every=0", "log.report_prompts=0", "train.checkpoint_every=0", *overrides])
    recipe_train(cfg.recipe)(cfg)
    return captured["policy"], cfg, [meta[p] for p in prompts]


# Images per model call when sampling many seeds: on a CPU the toy transformer's activations for one 768-image call
# (1536 rows with guidance) overflow the caches, and a call of 32 images is about twice as fast per image
# (scripts/bench/toy_batch_size.py).
EVAL_CHUNK = 32


def eval_chunk(seeds_per_prompt: int) -> int:
    """The rollout chunk nearest :data:`EVAL_CHUNK` that :func:`flowrl.sampling.chunked_rollout` accepts for groups of
    ``seeds_per_prompt``: whole groups when they are smaller, else the largest divisor of the group not above it."""
    if seeds_per_prompt <= EVAL_CHUNK:
        return seeds_per_prompt * (EVAL_CHUNK // seeds_per_prompt)
    return max(d for d in range(1, EVAL_CHUNK + 1) if seeds_per_prompt % d == 0)


@torch.no_grad()
def ode_images(policy, cfg, prompts, seeds) -> torch.Tensor:
    """[len(prompts) * len(seeds), 3, H, W]: each prompt sampled on the same seeds, prompt-major, in model calls of
    about :data:`EVAL_CHUNK` images (each row's noise comes from its seed, so the chunking changes no image beyond
    kernels' float rounding)."""
    ode = RolloutSettings(num_steps=cfg.sampling.num_steps, guidance_scale=cfg.sampling.guidance_scale, noise_level=0.0)
    traj = chunked_rollout(policy, list(prompts), ode, group_size=len(seeds), seeds=list(seeds) * len(prompts),
                           chunk=eval_chunk(len(seeds)))
    return traj.images


def paired_gain(before: torch.Tensor, after: torch.Tensor) -> tuple[int, int, float]:
    """(fixed, broken, (fixed - broken) / sqrt(fixed + broken)) of two strict-score vectors on the same seeds:
    McNemar's statistic, the gain in standard errors of a paired before/after comparison."""
    fixed = int(((after == 1) & (before == 0)).sum())
    broken = int(((after == 0) & (before == 1)).sum())
    return fixed, broken, (fixed - broken) / max(fixed + broken, 1) ** 0.5
