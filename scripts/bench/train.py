"""Benchmark a GRPO epoch: time per stage, and the framework's overhead over a bare training step.

Prints
1. the mean time per epoch split by stage (sample, reward wait, train, other), from the recipe's
   own ``perf/*`` metrics, skipping the first (warm-up) epoch;
2. the framework overhead: one flowrl train step (velocity with CFG, exact SDE log-prob, clipped
   loss, backward) divided by a bare transformer forward + backward on the same batch (same
   latents, timesteps, embeddings, CFG-doubled batch). ``beta=0`` so both do the same number of
   transformer passes; the KL reference pass is an algorithmic cost, reported separately.

    python scripts/bench/train.py                                  # tiny SD3 on CPU
    python scripts/bench/train.py configs/sd35_medium/grpo_ocr_1gpu.yaml --epochs 3   # a real model
"""

from __future__ import annotations

from functools import partial
import argparse
import statistics
import tempfile
import time

import torch

from flowrl.algorithms.losses import POLICY_LOSSES
from flowrl.config import GRPOConfig, load_config
from flowrl.recipes.build import build_training_policy
from flowrl.training.stats import StatsAccumulator
from flowrl.recipes.build import make_accelerator
from flowrl.algorithms.transition import TransitionSettings, transition_loss
from flowrl.recipes.grpo import train
from flowrl.sampling import RolloutSettings, rollout, root_seeds
from flowrl.training.metrics import read_metrics


def stage_times(cfg: GRPOConfig) -> dict[str, float]:
    train(cfg)
    records = read_metrics(cfg.run_dir)[1:] or read_metrics(cfg.run_dir)
    mean = lambda key: statistics.fmean(r[key] for r in records)  # noqa: E731
    out = {"sample": mean("perf/sample_s"), "reward wait": mean("perf/reward_wait_s"), "train": mean("perf/train_s")}
    out["other"] = mean("perf/epoch_s") - sum(out.values())
    out["epoch"] = mean("perf/epoch_s")
    return out


def _timed(functions: list, repeats: int) -> list[float]:
    """Median seconds of each function, run interleaved so machine load hits all of them alike."""
    for fn in functions:
        fn()  # warm-up
    times: list[list[float]] = [[] for _ in functions]
    for _ in range(repeats):
        for fn, bucket in zip(functions, times):
            start = time.perf_counter()
            fn()
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            bucket.append(time.perf_counter() - start)
    return [statistics.median(bucket) for bucket in times]


def overhead(cfg: GRPOConfig, repeats: int) -> tuple[float, float, float]:
    """(flowrl step s, bare forward+backward s, reference pass s) on one micro-batch."""
    accelerator = make_accelerator(cfg)
    policy = build_training_policy(cfg, accelerator.device)
    s, t = cfg.sampling, cfg.train
    n = min(t.micro_batch_size, s.group_size)
    settings = RolloutSettings(num_steps=s.num_steps, guidance_scale=s.guidance_scale, noise_level=s.noise_level)
    traj = rollout(policy, ["a photo of a cat"], settings, group_size=n, seeds=root_seeds(cfg.seed, 0, n))
    advantages = torch.randn(traj.num_rows, traj.num_stored_steps)  # [N, K]
    rows, k = torch.arange(n), 0
    mask = torch.ones(n, traj.num_stored_steps, dtype=torch.bool)

    def flowrl_step(beta: float = 0.0):
        settings = TransitionSettings(policy_loss=partial(POLICY_LOSSES[t.loss], config=t), guidance=s.guidance_scale,
                                      kind=s.kind, beta=beta)
        loss = transition_loss(policy, traj, advantages, rows, k, mask, settings=settings, accelerator=accelerator,
                               noise_level=s.noise_level, stats=StatsAccumulator(), on_policy=False)
        loss.backward()

    cond = traj.cond.select(traj.prompt_ids)
    x = traj.latents[:, k].to(accelerator.device)
    timestep = torch.full((n,), float(traj.sigmas[k]) * 1000, device=x.device)

    def bare_step():
        with accelerator.autocast():
            if policy.family == "sd3" and s.guidance_scale > 1:
                out = policy.transformer(hidden_states=torch.cat([x, x]), timestep=torch.cat([timestep, timestep]),
                                         encoder_hidden_states=torch.cat([cond.negative_prompt_embeds, cond.prompt_embeds]),
                                         pooled_projections=torch.cat([cond.negative_pooled_prompt_embeds,
                                                                       cond.pooled_prompt_embeds]),
                                         return_dict=False)[0]
            else:
                out = policy.velocity(x, float(traj.sigmas[k]), cond, s.guidance_scale)
        out.float().square().mean().backward()

    ours, bare, with_kl = _timed([flowrl_step, bare_step, lambda: flowrl_step(beta=0.04)], repeats)
    return ours, bare, with_kl - ours


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config", nargs="?", default="configs/smoke/sd3_tiny.yaml")
    parser.add_argument("overrides", nargs="*")
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as run_dir:
        settings = [f"run_dir={run_dir}", f"train.epochs={args.epochs}", "log.progress=false", "log.eval_every=0",
                    "train.export_lora=false", "train.checkpoint_every=1000000"]
        cfg = load_config(GRPOConfig, args.config, [*args.overrides, *settings])  # the GRPO loop: recipe grpo only
        times = stage_times(cfg)
        ours, bare, reference = overhead(cfg, args.repeats)
    print(f"config: {args.config}  epochs: {args.epochs} (first skipped)")
    print(f"{'stage':<12} {'seconds/epoch':>14} {'share':>7}")
    for stage in ("sample", "reward wait", "train", "other"):
        print(f"{stage:<12} {times[stage]:>14.3f} {times[stage] / times['epoch']:>7.1%}")
    print(f"{'epoch':<12} {times['epoch']:>14.3f}")
    print(f"train step: flowrl {ours * 1e3:.2f} ms, bare forward+backward {bare * 1e3:.2f} ms, "
          f"KL reference pass +{reference * 1e3:.2f} ms")
    print(f"framework overhead (flowrl step / bare step): {ours / bare:.3f}")


if __name__ == "__main__":
    main()
