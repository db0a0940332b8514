"""The builders of the run extras (:class:`flowrl.recipes.run.Run`) that either recipe may carry, read off the
config. :func:`flowrl.recipes.start.start_run` calls each in order on the new run (an extra built later sees the
ones before it) and keeps what they return under their names; a builder returns None where its feature is off.
A recipe passes builders of its own (GRPO: GARDO's reference, TMPO's split scheduler) the same way.

The names are the trainer-state keys (and the extras' snapshots the file names) of every checkpoint written so
far: renaming one breaks resuming old runs.
"""

from __future__ import annotations

from typing import Any, Callable

from tqdm.auto import tqdm

from flowrl.algorithms.combine import COMBINERS, marble_initial
from flowrl.algorithms.gardo import build_features
from flowrl.algorithms.marble import MarbleBalancer
from flowrl.recipes.guard import DiversityGuard
from flowrl.recipes.held_out_guard import HeldOutGuard, HeldOutWeights
from flowrl.recipes.reward_updates import RewardUpdates
from flowrl.recipes.run import Run
from flowrl.recipes.snapshots import PhaseAnchor
from flowrl.rewards_api import TrainableReward
from flowrl.training.ema import AdapterSnapshot
from flowrl.training.faults import FaultCounter
from flowrl.training.lr import build_lr_scheduler

ExtraBuilder = Callable[[Run], Any]


def snapshot(run: Run, *, taken: bool = True) -> AdapterSnapshot:
    """A copy of the run's current (initial) adapter weights."""
    return AdapterSnapshot(run.policy.named_trainable_parameters(), taken=taken)


def marble(run: Run) -> MarbleBalancer | None:
    """train.combine=marble: the per-reward advantage weights in force (the combiner starts from its initial
    weights; the balancer moves them per optimizer step)."""
    t = run.cfg.train
    if COMBINERS[t.combine] is not marble_initial:
        return None
    return MarbleBalancer({k: w for k, w in run.weights.items() if w != 0}, refresh_every=t.marble.refresh_every,
                          ema=t.marble.ema)


def lr_scheduler(run: Run):
    """train.lr_scheduler, one step per optimizer step (not prepared by accelerate)."""
    t = run.cfg.train
    return build_lr_scheduler(run.optimizer, t.lr_scheduler, warmup_steps=t.lr_warmup_steps,
                              total_steps=t.epochs * t.inner_epochs * t.optimizer_steps_per_epoch)


def anchor(run: Run) -> PhaseAnchor | None:
    """hrf.anchor_weight > 0: HRF's phase anchor."""
    h = run.cfg.hrf
    if h.anchor_weight <= 0:
        return None
    return PhaseAnchor(snapshot(run), weight=h.anchor_weight, phase_length=h.phase_length(run.cfg.sampling))


def guard(run: Run) -> DiversityGuard | None:
    """guard.enabled: the diversity guard, its best weights an (empty until measured) snapshot."""
    gd = run.cfg.guard
    if not gd.enabled:
        return None
    return DiversityGuard(every=gd.every, warmup=gd.warmup, max_drop=gd.max_drop, policy=gd.policy,
                          beta=run.cfg.train.beta, beta_factor=gd.beta_factor, beta_floor=gd.beta_floor,
                          cooldown=gd.cooldown, diversity_weight=gd.diversity_weight,
                          write=tqdm.write if run.accelerator.is_main_process else None,
                          best=snapshot(run, taken=False), features=build_features(gd.features, gd.feature_kwargs))


def held_out_guard(run: Run) -> HeldOutGuard | None:
    """guard.held_out.reward: the held-out guard; stop keeps the best point's weights and every adapter copy of the
    run (:meth:`Run.adapter_copies`), rollback also AdamW's moments (warn keeps none)."""
    h = run.cfg.guard.held_out
    if not h.enabled:
        return None
    weights = None if h.policy == "warn" else HeldOutWeights(
        run.policy.named_trainable_parameters(), run.params, run.adapter_copies, moments=h.policy == "rollback")
    return HeldOutGuard(reward=h.reward, margin=h.margin, z=h.z, patience=h.patience, policy=h.policy,
                        lr_factor=h.lr_factor, kl_factor=h.kl_factor, max_rollbacks=h.max_rollbacks,
                        train_weights=dict(run.weights), weights=weights,
                        write=tqdm.write if run.accelerator.is_main_process else None)


def reward_updates(run: Run) -> RewardUpdates | None:
    """The rewards that train during the run (Adv-GRPO's discriminator), by name; None where none does."""
    found = {reward.name: reward for reward in run.rewards if isinstance(reward, TrainableReward)}
    return RewardUpdates(found) if found else None


def faults(run: Run) -> FaultCounter:
    """Skipped non-finite steps and NaN epochs in a row, counted on across a restart."""
    t = run.cfg.train
    return FaultCounter(max_skipped_steps=t.max_skipped_steps, max_nan_epochs=t.max_nan_epochs)


# Before a recipe's own extras: marble, lr_scheduler, anchor, guard, held_out_guard, reward_updates; after them:
# faults.
COMMON_EXTRAS: dict[str, ExtraBuilder] = {"marble": marble, "lr_scheduler": lr_scheduler, "anchor": anchor,
                                          "guard": guard, "held_out_guard": held_out_guard,
                                          "reward_updates": reward_updates}
LAST_EXTRAS: dict[str, ExtraBuilder] = {"faults": faults}
