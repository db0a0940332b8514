"""Preference mode collapse in miniature: GRPO on the hackable ToyProxy without KL
(configs/toy/grpo_proxy.yaml) collapses the ground-truth diversity of a free attribute.

The proxy prefers one background (black), which no prompt asks for. Optimising it must drive the
background entropy of each prompt's samples down: the exact signature of preference mode collapse
that `flowrl.toy.diversity` measures. Before and after use the same seeds (ODE sampling).
"""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import json

import torch

from flowrl.config import Config, load_config
from flowrl.recipes.grpo import train
from flowrl.sampling import rollout
from flowrl.toy.diversity import diversity
from flowrl.toy.prompts import train_prompts

PROMPTS = ("a red circle", "a blue square", "two green circles", "a yellow circle and a purple square")
EVAL_SEEDS = list(range(7000, 7016))


def test_proxy_grpo_collapses_background_diversity(tmp_path, monkeypatch):
    import flowrl.recipes.grpo as grpo

    captured = {}
    real_build = grpo.build_training_policy
    monkeypatch.setattr(grpo, "build_training_policy",
                        lambda cfg, device: captured.setdefault("policy", real_build(cfg, device)))
    meta = dict(train_prompts(0))
    prompts_file = tmp_path / "prompts.jsonl"
    prompts_file.write_text("".join(json.dumps({"prompt": p, "metadata": meta[p]}) + "\n" for p in PROMPTS))
    cfg = load_config(Config, "configs/toy/grpo_proxy.yaml", [
        f"run_dir={tmp_path / 'run'}", "train.epochs=30", f"data.prompts={prompts_file}",
        f"data.test_prompts={prompts_file}", "sampling.prompts_per_batch=4", "log.progress=false",
        "log.eval_every=0", "log.report_prompts=0", "train.checkpoint_every=0", "train.ema=false"])
    train(cfg)
    policy = captured["policy"]
    groups = torch.arange(len(PROMPTS)).repeat_interleave(len(EVAL_SEEDS))

    def background_entropy():
        traj = rollout(policy, list(PROMPTS), group_size=len(EVAL_SEEDS), num_steps=cfg.sampling.num_steps,
                       guidance_scale=cfg.sampling.guidance_scale, noise_level=0.0, seeds=EVAL_SEEDS * len(PROMPTS))
        return diversity(traj.images, groups)["diversity/background"]

    with torch.no_grad():
        after = background_entropy()
        with policy.reference():
            before = background_entropy()
    print(f"background entropy per prompt: {before:.3f} -> {after:.3f}")
    # measured 0.721 -> 0.617 (30 epochs x 32 rollouts, ~90 s); the shipped 60-epoch config
    # reaches 0.015 on 64 held-out prompts
    assert after < before - 0.05, (before, after)
