"""A short GRPO run on the shipped toy model (configs/toy/grpo.yaml) raises ToyEval on its training prompts.

This is the toy world's promise in miniature: the base model is imperfect on counts, pairs and
positions, the verifiable reward says exactly where, and a few minutes of GRPO on a CPU fix part
of it. Before and after are scored on the same seeds (common random numbers) with ODE sampling,
so the comparison is paired and the margin is not sampling noise.
"""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import json

import pytest
import torch

from flowrl.config import Config, load_config
from flowrl.recipes.grpo import train
from flowrl.sampling import rollout
from flowrl.toy.prompts import train_prompts
from rewards.toyeval import ToyEval

TOY_CONFIG = "configs/toy/grpo.yaml"
# Training prompts the base model gets right 19-31% of the time (16 seeds), so groups carry signal.
PROMPTS = ("a blue diamond", "a red square", "two red circles", "a green triangle")
EVAL_SEEDS = list(range(5000, 5024))


def _write_prompts(path):
    meta = {p: m for p, m in train_prompts(0)}
    missing = [p for p in PROMPTS if p not in meta]
    assert not missing, f"not training prompts of the toy split: {missing}"
    path.write_text("".join(json.dumps({"prompt": p, "metadata": meta[p]}) + "\n" for p in PROMPTS))
    return [meta[p] for p in PROMPTS]


@pytest.mark.xfail(strict=True, reason="GRPO does not yet move ToyEval on the shipped toy model within this budget "
                   "(30 epochs x 32 rollouts: strict 0.30 -> 0.28..0.32; see assets/toy/README.md)")
def test_toy_grpo_raises_toyeval_on_its_training_prompts(tmp_path, monkeypatch):
    import flowrl.recipes.grpo as grpo

    captured = {}
    real_build = grpo.build_training_policy
    monkeypatch.setattr(grpo, "build_training_policy",
                        lambda cfg, device: captured.setdefault("policy", real_build(cfg, device)))
    prompts_file = tmp_path / "prompts.jsonl"
    metas = _write_prompts(prompts_file)
    cfg = load_config(Config, TOY_CONFIG, [
        f"run_dir={tmp_path / 'run'}", "train.epochs=30", f"data.prompts={prompts_file}",
        f"data.test_prompts={prompts_file}", "sampling.prompts_per_batch=4", "log.progress=false",
        "log.eval_every=0", "log.report_prompts=0", "train.checkpoint_every=0", "train.ema=false"])
    train(cfg)
    policy, reward = captured["policy"], ToyEval()
    prompts = [p for p in PROMPTS for _ in EVAL_SEEDS]
    meta = [m for m in metas for _ in EVAL_SEEDS]

    def strict():
        traj = rollout(policy, list(PROMPTS), group_size=len(EVAL_SEEDS), num_steps=cfg.sampling.num_steps,
                       guidance_scale=cfg.sampling.guidance_scale, noise_level=0.0,
                       seeds=EVAL_SEEDS * len(PROMPTS))
        return reward(traj.images, prompts, meta)["toyeval"].float()

    with torch.no_grad():
        after = strict()
        with policy.reference():
            before = strict()
    print(f"ToyEval strict on the training prompts: {before.mean():.3f} -> {after.mean():.3f}")
    assert after.mean() > before.mean() + 0.1, (before.mean().item(), after.mean().item())
