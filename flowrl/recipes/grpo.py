"""Online trajectory RL for flow models: GRPO (Flow-GRPO) with window and tree rollouts.

Choices, all set in the config (``flowrl/config/schema.py``):
- rollouts: full SDE, an SDE window (Flow-GRPO-Fast random start / MixGRPO sliding start) or a
  tree that branches at fixed steps (BranchGRPO / TreeGRPO); only stochastic steps are stored;
- advantages: per-prompt group mean, batch (global) or per-group std, clipped to +-advantage_clip;
  tree edges get the mean advantage of the leaves below them and are trained once;
- loss: PPO-clipped ratio with separate lower/upper ranges, plus beta * KL to the reference
  (the same transformer with the LoRA switched off), CFG inside the trained velocity;
- optimisation: several inner passes over shuffled transitions, gradient accumulation over
  micro-batches and steps, clipping, AdamW, EMA of the LoRA weights for eval and export.

Rollout batch i is scored in a worker thread while batch i+1 is sampled. Under
``accelerate launch`` prompts are sharded, rewards are gathered so advantages see whole groups and
the global std, and row seeds come from global row indices, so N processes reproduce one.

Run: ``flowrl train configs/smoke/sd3_tiny.yaml`` (CPU, seconds) or
``accelerate launch --num_processes 8 -m flowrl train configs/sd35_medium/grpo_ocr.yaml``.
"""

from __future__ import annotations

import math
import time

import numpy as np
import torch
from accelerate import Accelerator
from tqdm.auto import tqdm

from flowrl.algorithms.advantages import ADVANTAGE_ESTIMATORS, edge_advantages
from flowrl.algorithms.combine import COMBINERS
from flowrl.algorithms.losses import POLICY_LOSSES, gaussian_mean_kl
from flowrl.config import Config
from flowrl.data import epoch_prompt_indices
from flowrl.recipes.common import (  # noqa: F401  (make_accelerator: re-exported for callers of this module)
    eval_grid, export_final_lora, make_accelerator, save_run_checkpoint, start_run, step_plan,
)
from flowrl.report import evaluate, render, write_report
from flowrl.rewards_api import AsyncScorer, nan_summary
from flowrl.sampling import concat_trajectories, rollout, root_seeds, sde_step, transition
from flowrl.training.ema import ema_weights


def train(cfg: Config, *, accelerator: Accelerator | None = None) -> dict[str, float]:
    """Run the GRPO loop described by ``cfg``; returns the last epoch's metrics as a flat dict."""
    # 0. Set-up: processes, run directory, model + LoRA, optimizer, EMA, rewards, prompts, resume.
    run = start_run(cfg, accelerator)
    accelerator, policy, params, optimizer, ema = run.accelerator, run.policy, run.params, run.optimizer, run.ema
    rewards, weights, logger, counters = run.rewards, run.weights, run.logger, run.counters
    train_prompts = run.train_prompts
    rank, world, run_dir, guidance, start_epoch = (accelerator.process_index, accelerator.num_processes, run.run_dir,
                                                   run.guidance, run.start_epoch)
    s, t = cfg.sampling, cfg.train
    estimator = ADVANTAGE_ESTIMATORS[t.advantage]
    policy_loss = POLICY_LOSSES[t.loss]
    clip_high = t.clip_range if t.clip_range_high is None else t.clip_range_high
    roots_per_group = s.group_size // (s.tree.branch_factor ** len(s.tree.branch_steps) if s.tree.branch_steps else 1)
    scorer = AsyncScorer(rewards, on_error=t.reward_errors, asynchronous=t.async_rewards)
    bar = tqdm(range(start_epoch, t.epochs), disable=not (cfg.log.progress and accelerator.is_main_process),
               desc="grpo", dynamic_ncols=True)
    metrics: dict[str, float] = {}
    if cfg.log.test_every and start_epoch == 0:  # the curve's starting point: the base model
        logger.log({"epoch": -1, **held_out_metrics(policy, ema, rewards, run.test_set, cfg, guidance, accelerator),
                    **{f"perf/{k}": v for k, v in counters.items()}}, step=-1)
    for epoch in bar:
        epoch_start = time.perf_counter()
        plan = step_plan(s, epoch, cfg.seed)

        # 1-3. Sample prompts, roll out groups, score batch b while batch b+1 is sampled.
        parts, futures = [], []
        for b in range(t.batches_per_epoch):
            batch_index = epoch * t.batches_per_epoch + b
            index = epoch_prompt_indices(len(train_prompts), s.prompts_per_batch, seed=cfg.seed, epoch=batch_index,
                                         rank=rank, world_size=world)
            batch = train_prompts.subset(index)
            first_root = (batch_index * world + rank) * s.prompts_per_batch * roots_per_group
            with policy.local_forward():
                part = rollout(policy, batch.prompts, group_size=s.group_size, num_steps=s.num_steps,
                               guidance_scale=guidance, noise_level=s.noise_level, kind=s.kind, plan=plan,
                               same_noise_in_group=s.same_noise_in_group, metadata=batch.metadata,
                               seeds=root_seeds(cfg.seed, first_root, len(batch) * roots_per_group))
            part.group_ids = part.group_ids + (batch_index * world + rank) * s.prompts_per_batch
            futures.append(scorer.submit(part.images, part.row_prompts, part.row_metadata))
            parts.append(part)
        sample_done = time.perf_counter()
        for part, future in zip(parts, futures):
            part.rewards = future.result()
        traj = concat_trajectories(parts)
        reward_done = time.perf_counter()

        # 4. Advantages over whole groups: gather every process's rewards, keep this process's slice.
        gathered = {k: accelerator.gather(v.to(accelerator.device)).cpu() for k, v in traj.rewards.items()}
        all_groups = accelerator.gather(traj.group_ids.to(accelerator.device)).cpu()
        combined_adv, combined = COMBINERS[t.combine](
            {key: gathered[key] for key in weights}, weights, all_groups,
            lambda r, g: estimator(r, g, std_scope=t.std_scope))
        local = slice(rank * traj.num_rows, (rank + 1) * traj.num_rows)
        row_adv = combined_adv[local].clamp(-t.advantage_clip, t.advantage_clip)
        traj.advantages = edge_advantages(row_adv, traj.edge_ids)  # [N, K]
        trained_cols = trained_columns(traj.step_indices, s.num_steps, t.skip_last_step, t.timestep_fraction,
                                       seed=cfg.seed, epoch=epoch)
        mask = traj.first_visit_mask() & torch.isfinite(combined[local])[:, None]  # [N, K]
        mask[:, [k for k in range(traj.num_stored_steps) if k not in trained_cols]] = False

        # 5-6. Inner passes: shuffled chunks -> micro-batches x trained steps -> one optimizer step per chunk.
        stats = StatsAccumulator()
        for inner in range(t.inner_epochs):
            order = np.random.default_rng([cfg.seed, epoch, inner, rank, 0x7EA1]).permutation(traj.num_rows)
            for chunk_index, chunk in enumerate(np.array_split(order, t.optimizer_steps_per_epoch)):
                chunk = torch.as_tensor(chunk, dtype=torch.long)
                weight = accelerator.reduce(mask[chunk].sum().float().to(accelerator.device), "sum").item()
                work = [(rows, k) for rows in chunk.split(t.micro_batch_size) for k in trained_cols]
                for i, (rows, k) in enumerate(work):
                    sync = i == len(work) - 1
                    with (torch.enable_grad() if sync else accelerator.no_sync(policy.forward_module)):
                        loss_sum = transition_loss(policy, traj, rows, k, mask, accelerator=accelerator,
                                                   guidance=guidance, noise_level=s.noise_level, kind=s.kind,
                                                   beta=t.beta, policy_loss=policy_loss, clip_low=t.clip_range,
                                                   clip_high=clip_high, stats=stats,
                                                   on_policy=inner == 0 and chunk_index == 0)
                        accelerator.backward(loss_sum * world / max(weight, 1.0))
                grad_norm = accelerator.clip_grad_norm_(params, t.max_grad_norm) if t.max_grad_norm > 0 else None
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                if ema is not None:
                    ema.step()
                if grad_norm is not None:
                    stats.add_scalar("optim/grad_norm", float(grad_norm))
        train_done = time.perf_counter()

        # 7. Log, render eval grids, checkpoint.
        metrics = {"epoch": epoch}
        metrics.update(reward_metrics(gathered, combined, [r.name for r in rewards]))  # NaN counts: main scores
        metrics.update(stats.reduce(accelerator))
        metrics["advantages/abs_mean"] = float(combined_adv.clamp(-t.advantage_clip, t.advantage_clip).abs().mean())
        metrics["optim/lr"] = optimizer.param_groups[0]["lr"]
        metrics["perf/sample_s"] = sample_done - epoch_start
        metrics["perf/reward_wait_s"] = reward_done - sample_done
        metrics["perf/train_s"] = train_done - reward_done
        counters["rollouts"] += traj.num_rows * world
        counters["train_wall_s"] += train_done - epoch_start
        metrics.update({f"perf/{k}": v for k, v in counters.items()})
        if cfg.log.test_every and (epoch + 1) % cfg.log.test_every == 0:
            metrics.update(held_out_metrics(policy, ema, rewards, run.test_set, cfg, guidance, accelerator))
        if cfg.log.eval_every and (epoch + 1) % cfg.log.eval_every == 0:  # every rank samples (sharded models)
            eval_grid(policy, ema, run.eval_prompts, cfg, guidance, run_dir / "grids" / f"epoch_{epoch:05d}.png",
                      save=accelerator.is_main_process)
        metrics["perf/epoch_s"] = time.perf_counter() - epoch_start
        logger.log(metrics, step=epoch)  # before the checkpoint: a resumed run redoes later epochs only
        if epoch + 1 == t.epochs or (t.checkpoint_every and (epoch + 1) % t.checkpoint_every == 0):
            save_run_checkpoint(cfg, policy, optimizer, ema, accelerator, epoch=epoch, counters=counters)
        bar.set_postfix(reward=f"{metrics['reward/combined_mean']:.3f}", loss=f"{metrics.get('loss/total', 0):.4f}",
                        sample=f"{metrics['perf/sample_s']:.1f}s", train=f"{metrics['perf/train_s']:.1f}s")

    # 8. Export the final adapter (EMA weights when kept) and report before/after on held-out prompts.
    scorer.close()
    if t.export_lora and accelerator.is_main_process:
        export_final_lora(policy, ema, run_dir / "lora")
    if cfg.log.report_prompts:
        report = write_report(run_dir, policy=policy, ema=ema, rewards=rewards,
                              prompts=run.test_prompts.subset(range(min(cfg.log.report_prompts,
                                                                         len(run.test_prompts)))),
                              images_per_prompt=cfg.log.eval_images_per_prompt, num_steps=s.num_steps,
                              guidance=guidance, seed=cfg.seed + 2, diversity=cfg.log.report_diversity,
                              save=accelerator.is_main_process)
        metrics.update({f"report/{when}/{k}": v for when in ("before", "after") for k, v in report[when].items()})
    accelerator.wait_for_everyone()
    accelerator.end_training()
    return metrics


def held_out_metrics(policy, ema, rewards, prompts, cfg: Config, guidance: float, accelerator) -> dict[str, float]:
    """test/<reward> on held-out prompts: ODE samples with fixed seeds and the EMA weights."""
    n = cfg.log.eval_images_per_prompt
    with ema_weights(ema):
        images = render(policy, prompts, images_per_prompt=n, num_steps=cfg.sampling.num_steps, guidance=guidance,
                        seed=cfg.seed + 3)
    scores = evaluate(images, prompts, n, rewards, cfg.log.report_diversity)
    return {f"test/{k.removeprefix('eval/')}": v for k, v in scores.items()}


def trained_columns(step_indices: torch.Tensor, num_steps: int, skip_last_step: bool, fraction: float, *,
                    seed: int, epoch: int) -> list[int]:
    """Stored-step columns to train: drop the final near-clean step, then keep a per-epoch fraction."""
    columns = [k for k, step in enumerate(step_indices.tolist()) if not (skip_last_step and step == num_steps - 1)]
    if not columns:
        raise ValueError("no trainable steps: the SDE window holds only the last step; widen it or set "
                         "train.skip_last_step=false")
    if fraction < 1:
        keep = max(1, round(fraction * len(columns)))
        chosen = np.random.default_rng([seed, epoch, 0x51E9]).choice(len(columns), size=keep, replace=False)
        columns = [columns[i] for i in sorted(chosen.tolist())]
    return columns


def transition_loss(policy, traj, rows, k, mask, *, accelerator, guidance, noise_level, kind, beta, policy_loss,
                    clip_low, clip_high, stats, on_policy) -> torch.Tensor:
    """Summed (not averaged) loss of stored transitions ``rows`` at stored step ``k``."""
    device = accelerator.device
    x = traj.latents[rows, k].to(device)  # [B, C, h, w]
    x_next = traj.latents[rows, k + 1].to(device)
    sigma, sigma_next = traj.sigmas[k].item(), traj.sigmas[k + 1].item()
    cond = traj.cond.select(traj.prompt_ids[rows])
    with accelerator.autocast():
        velocity = policy.velocity(x, sigma, cond, guidance)
    step = sde_step(velocity, x, sigma, sigma_next, noise_level=noise_level, kind=kind, prev_sample=x_next)
    old_log_probs = traj.log_probs[rows, k].to(device)
    advantages = traj.advantages[rows, k].to(device)
    loss, loss_stats = policy_loss(step.log_prob, old_log_probs, advantages, clip_low=clip_low, clip_high=clip_high)
    weights = mask[rows, k].to(device).float()  # [B]
    kl = torch.zeros_like(loss)
    if beta > 0:
        with torch.no_grad(), policy.reference(), accelerator.autocast():
            ref_velocity = policy.velocity(x, sigma, cond, guidance)
        ref_mean, _ = transition(ref_velocity, x, sigma, sigma_next, noise_level=noise_level, kind=kind)
        kl = gaussian_mean_kl(step.mean, ref_mean, step.std)
    total = loss + beta * kl
    stats.add("loss/policy", loss, weights)
    stats.add("loss/kl", kl, weights)
    stats.add("loss/total", total, weights)
    stats.add("policy/ratio", loss_stats["ratio"], weights)
    stats.add("policy/clipfrac", loss_stats["clipped"], weights)
    stats.add("policy/approx_kl", loss_stats["approx_kl"], weights)
    if on_policy:
        deviation = ((loss_stats["ratio"] - 1).abs() * weights).max()
        stats.add_scalar("policy/onpolicy_ratio_maxdev", float(deviation), reduce="max")
    return (total * weights).sum()


def reward_metrics(rewards: dict[str, torch.Tensor], combined: torch.Tensor, main: list[str]) -> dict[str, float]:
    """reward/<name>_mean and _std for every (sub-)score, plus the combined reward and NaN counts."""
    out = {}
    for name, values in rewards.items():
        finite = values[torch.isfinite(values)]
        out[f"reward/{name}_mean"] = float(finite.mean()) if finite.numel() else math.nan
        out[f"reward/{name}_std"] = float(finite.std(unbiased=False)) if finite.numel() else math.nan
    finite = combined[torch.isfinite(combined)]
    out["reward/combined_mean"] = float(finite.mean()) if finite.numel() else math.nan
    out.update({k: float(v) for k, v in nan_summary({n: rewards[n] for n in main}).items()})
    return out


class StatsAccumulator:
    """Weighted means of per-transition statistics, reduced across processes at the end of an epoch."""

    def __init__(self):
        self.sums: dict[str, float] = {}
        self.weights: dict[str, float] = {}
        self.scalars: dict[str, list[float]] = {}
        self.scalar_reduce: dict[str, str] = {}

    def add(self, name: str, values: torch.Tensor, weights: torch.Tensor) -> None:
        self.sums[name] = self.sums.get(name, 0.0) + float((values.detach().float() * weights).sum())
        self.weights[name] = self.weights.get(name, 0.0) + float(weights.sum())

    def add_scalar(self, name: str, value: float, reduce: str = "mean") -> None:
        self.scalars.setdefault(name, []).append(value)
        self.scalar_reduce[name] = reduce

    def reduce(self, accelerator: Accelerator) -> dict[str, float]:
        names = sorted(self.sums)
        packed = torch.tensor([[self.sums[n], self.weights[n]] for n in names] or [[0.0, 0.0]], dtype=torch.float64)
        packed = accelerator.reduce(packed.to(accelerator.device), "sum").cpu()
        out = {n: float(packed[i, 0] / max(packed[i, 1], 1e-12)) for i, n in enumerate(names)}
        for name, values in sorted(self.scalars.items()):
            if self.scalar_reduce[name] == "max":
                tensor = torch.tensor([max(values)], dtype=torch.float64, device=accelerator.device)
                out[name] = float(accelerator.gather(tensor).max())
            else:
                tensor = torch.tensor(sum(values) / len(values), dtype=torch.float64, device=accelerator.device)
                out[name] = float(accelerator.reduce(tensor, "mean"))
        return out
