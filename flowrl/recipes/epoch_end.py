"""The steps that close every optimizer step and epoch in every recipe: the clipped, fault-checked optimizer
step; the epoch's metrics, held-out points, the extras' end of epoch (the held-out guard), eval grids, the
log and the checkpoint; and the time limit."""

from __future__ import annotations

import math
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from flowrl.algorithms.advantages import zero_std_fraction
from flowrl.config import Config, ConfigError
from flowrl.data.prompts import PromptSet
from flowrl.eval.held_out import evaluate_rows, render
from flowrl.recipes.checkpointing import save_run_checkpoint
from flowrl.recipes.run import Run
from flowrl.rewards_api import nan_summary
from flowrl.training.ema import ema_weights
from flowrl.training.faults import TrainingAborted
from flowrl.training.faults import grad_norm as total_grad_norm
from flowrl.training.lr import skip_scheduled_step
from flowrl.training.stats import StatsAccumulator


def progress_bar(run: Run, name: str) -> tqdm:
    """The run's epochs, from the one it starts at, behind a progress bar on the main process (``log.progress``)."""
    cfg = run.cfg
    return tqdm(range(run.start_epoch, cfg.train.epochs), desc=name, dynamic_ncols=True,
                disable=not (cfg.log.progress and run.accelerator.is_main_process) or
                run.start_epoch >= cfg.train.epochs)  # nothing left to train: no empty bar


def optimizer_step(run: Run, stats: StatsAccumulator) -> None:
    """Clip the accumulated gradients (``train.max_grad_norm``, 0: no clipping), step, clear them;
    the pre-clip norm goes into ``stats``. A non-finite norm (NaN/inf loss or gradient) skips the step with the
    gradients zeroed, so the weights stay finite; ``train.max_skipped_steps`` in a row stop the run.

    Under fp16 autocast on GPU accelerate scales the loss (``accelerator.scaler``, torch's GradScaler): a gradient
    that overflows float16 at the current scale is how the scaler finds its scale, so that step goes to the
    scaler, which skips it and halves the scale, and is not counted as a fault while the scale is >= 1 (below,
    the gradient itself is non-finite). Every skipped step passes through the scaler, which must see each step."""
    for before_step in run.hook("before_step"):  # HRF's pull toward its anchor
        before_step(run)
    max_norm = run.cfg.train.max_grad_norm
    grad_norm = run.accelerator.clip_grad_norm_(run.params, max_norm) if max_norm > 0 else None
    norm = float(grad_norm) if grad_norm is not None else float(total_grad_norm(run.params))
    scheduler = run.extras["lr_scheduler"]
    scaler = getattr(run.accelerator, "scaler", None)  # fp16 autocast on GPU: accelerate's GradScaler
    if scaler is not None:
        stats.add_scalar("optim/loss_scale", scaler.get_scale())  # the epoch's mean
    if scaler is not None and not math.isfinite(norm) and scaler.get_scale() >= 1:  # the loss scale overflowed
        skip = True
    else:
        skip = run.faults.step(norm)  # after the all-reduce: every process sees the same norm and skips alike
        if skip and run.accelerator.is_main_process:
            tqdm.write(f"flowrl train: warning: non-finite gradient (norm {norm}); optimizer step skipped "
                       f"({run.faults.skipped_in_a_row} in a row, train.max_skipped_steps="
                       f"{run.cfg.train.max_skipped_steps})")
    if skip:
        if scaler is not None:  # accelerate's optimizer step: the scaler skips an inf step and lowers its scale
            run.optimizer.step()
        run.optimizer.zero_grad(set_to_none=True)
        skip_scheduled_step(scheduler)
        return
    run.optimizer.step()
    run.optimizer.zero_grad(set_to_none=True)
    scheduler.step()
    if grad_norm is not None:
        stats.add_scalar("optim/grad_norm", grad_norm)


def end_epoch(run: Run, epoch: int, *, gathered: dict[str, torch.Tensor], combined: torch.Tensor,
              group_ids: torch.Tensor, stats: StatsAccumulator, extra: dict[str, float], rollouts: int,
              times: tuple[float, float, float, float], bar, idle: str | None = None) -> dict[str, float]:
    """Collect the epoch's metrics (rewards, training stats, the recipe's ``extra``, stage times), count,
    score the held-out prompts, render the eval grid, log, checkpoint, update the progress bar.

    ``times``: when the epoch started, sampling ended, scoring ended and training ended. ``idle``: why the update
    had nothing to train on, where it had not (a warning, and toward ``train.max_nan_epochs``).
    """
    cfg, accelerator, t = run.cfg, run.accelerator, run.cfg.train
    epoch_start, sample_done, reward_done, train_done = times
    metrics = {"epoch": epoch}
    metrics.update(reward_metrics(gathered, combined, [r.name for r in run.rewards]))  # NaN counts: main scores
    metrics["policy/zero_std_groups"] = zero_std_fraction(combined, group_ids)  # groups that teach nothing
    metrics.update(stats.reduce(accelerator))
    metrics.update(extra)
    aborted = None
    try:  # every trained reward NaN: nothing trained this epoch (a dead reward server under reward_errors=nan)
        warning = run.faults.epoch(gathered, [k for k, w in run.weights.items() if w != 0], epoch=epoch, idle=idle)
    except TrainingAborted as error:
        warning, aborted = None, error
    if warning and accelerator.is_main_process:
        tqdm.write(warning)
    for extra_metrics in run.hook("metrics"):  # MARBLE's weights, TMPO's split scheduler, the fault counts
        metrics.update(extra_metrics())
    metrics["optim/lr"] = float(run.optimizer.param_groups[0]["lr"])  # a tensor under torchao's AdamW8bit
    metrics["perf/sample_s"] = sample_done - epoch_start
    metrics["perf/reward_wait_s"] = reward_done - sample_done
    metrics["perf/train_s"] = train_done - reward_done
    run.counters["rollouts"] += rollouts
    run.counters["train_wall_s"] += train_done - epoch_start
    metrics.update({f"perf/{k}": v for k, v in run.counters.items()})
    if aborted is not None:  # logged, but no checkpoint of this epoch: the last one on disk stays the latest
        run.logger.log(metrics, step=epoch)
        raise aborted
    last = out_of_time(run) or run.stopped  # the run ends after this epoch, before train.epochs
    held_out = None  # per-image held-out scores, at a point of the curve
    if cfg.log.test_every and ((epoch + 1) % cfg.log.test_every == 0 or last):  # the curve's last point
        points, held_out = held_out_scores(run.policy, run.exported_ema, run.rewards, run.test_set, cfg,
                                           run.eval_guidance)
        metrics.update(points)
    metrics.update(run.end_epoch(epoch, metrics, held_out))  # the held-out guard: warn, stop or roll back
    last = last or run.stopped
    if cfg.log.eval_every and (epoch + 1) % cfg.log.eval_every == 0:  # every rank samples (sharded models)
        eval_grid(run.policy, run.exported_ema, run.eval_prompts, cfg, run.eval_guidance,
                  run.run_dir / "grids" / f"epoch_{epoch:05d}.png", save=accelerator.is_main_process)
    metrics["perf/epoch_s"] = time.perf_counter() - epoch_start
    run.logger.log(metrics, step=epoch)  # before the checkpoint: a resumed run redoes later epochs only
    if epoch + 1 == t.epochs or last or (t.checkpoint_every and (epoch + 1) % t.checkpoint_every == 0):
        save_run_checkpoint(run, epoch=epoch)
    bar.set_postfix(reward=f"{metrics['reward/combined_mean']:.3f}", loss=f"{metrics.get('loss/total', 0):.4f}",
                    sample=f"{metrics['perf/sample_s']:.1f}s", train=f"{metrics['perf/train_s']:.1f}s")
    return metrics


def out_of_time(run: Run) -> bool:
    """Whether ``train.time_limit_s`` of sampling, scoring and training time has been spent."""
    limit = run.cfg.train.time_limit_s
    return limit is not None and run.counters["train_wall_s"] >= limit


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


def log_base_model(run: Run) -> None:
    """With ``log.test_every``, the held-out score of the base model: the curve's starting point."""
    if run.cfg.log.test_every and run.start_epoch == 0:
        points, held_out = held_out_scores(run.policy, run.exported_ema, run.rewards, run.test_set, run.cfg,
                                           run.eval_guidance)
        metrics = {"epoch": -1, **points, **{f"perf/{k}": v for k, v in run.counters.items()}}
        run.logger.log({**metrics, **run.end_epoch(-1, metrics, held_out)}, step=-1)  # the guard's first point


def held_out_metrics(policy, ema, rewards, prompts, cfg: Config, guidance: float, accelerator) -> dict[str, float]:
    """test/<reward> on held-out prompts: ODE samples with fixed seeds and the EMA weights; with task
    metadata also test/<reward>/task/<task> and test/<reward>/task_mean (the mean over tasks)."""
    return held_out_scores(policy, ema, rewards, prompts, cfg, guidance)[0]


def held_out_scores(policy, ema, rewards, prompts, cfg: Config,
                    guidance: float) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
    """:func:`held_out_metrics` and the per-image scores ``{key: [P * n]}`` (prompt-major) behind them."""
    n = cfg.log.eval_images_per_prompt
    with ema_weights(ema), eval_size(policy, cfg):
        images = render(policy, prompts, images_per_prompt=n, guidance=guidance, seed=cfg.seed + 3,
                        num_steps=cfg.log.eval_num_steps or cfg.sampling.num_steps)
    summary, scores = evaluate_rows(images, prompts, n, rewards, cfg.log.report_diversity)
    return {f"test/{k.removeprefix('eval/')}": v for k, v in summary.items()}, scores


def check_eval_size(policy, cfg: Config) -> None:
    """A size the model cannot sample (``eval.height``/``width``/``num_frames``) is a config error at start."""
    e = cfg.eval
    try:
        policy.check_size(e.height or policy.height, e.width or policy.width, e.num_frames)
    except ValueError as error:
        raise ConfigError(str(error), key="eval") from None


def eval_size(policy, cfg: Config):
    """The policy at the evaluation size (``eval.height``, ``width``, ``num_frames``; training's where null)."""
    return policy.sized(cfg.eval.height, cfg.eval.width, cfg.eval.num_frames)


@torch.no_grad()
def eval_grid(policy, ema, prompts: PromptSet, cfg: Config, guidance: float, out: Path, *, save: bool = True) -> Path:
    """ODE samples of the fixed eval prompts (EMA weights when kept), one grid row per prompt.

    Every process calls this (a sharded model needs all ranks for a forward); only ``save`` writes."""
    from torchvision.utils import save_image

    from flowrl.eval.held_out import render
    from flowrl.core.media import stills

    n = cfg.log.eval_images_per_prompt
    with ema_weights(ema), eval_size(policy, cfg):
        images = render(policy, prompts, images_per_prompt=n, guidance=guidance, seed=cfg.seed + 1,
                        num_steps=cfg.log.eval_num_steps or cfg.sampling.num_steps)
    if save:
        out.parent.mkdir(parents=True, exist_ok=True)
        save_image(stills(images), out, nrow=n, padding=2)
    return out
