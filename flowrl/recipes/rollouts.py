"""An epoch's rollouts and their advantages, as every recipe takes them: prompts sharded over processes,
groups rolled out with the epoch's step plan (:mod:`flowrl.sampling.epoch_plan`) and scored in a worker while the
next batch samples (or allocated by Pilot-Commit), ParetoSlider's per-group preferences, and the advantages
over whole groups gathered from every process."""

from __future__ import annotations

import math
import time
from dataclasses import replace
from functools import partial
from typing import NamedTuple

import torch

from flowrl.algorithms.advantages import group_variances
from flowrl.algorithms.combine import COMBINERS, reward_advantages
from flowrl.algorithms.preference import draw_preferences, row_weights, subgroup_ids
from flowrl.data.prompts import PromptSet, epoch_prompt_indices
from flowrl.sampling.epoch_plan import batch_plan
from flowrl.recipes.run import Run
from flowrl.rewards_api import check_whole_groups
from flowrl.sampling import (
    RolloutSettings,
    StepPlan,
    chunked_rollout,
    concat_trajectories,
    rollout,
    root_seeds,
)
from flowrl.sampling.pilot import commit_candidates, join_committed, slot_seeds
from flowrl.sampling.self_guidance import SelfGuidance


def sample_and_score(run: Run, scorer, epoch: int, *, plan: StepPlan, noise_level: float, kind: str = "sde",
                     same_noise_in_group: bool = False, same_noise_in_pairs: bool = False,
                     store_x0_preds: bool = False, store_means: bool = False, batch_windows: bool = False,
                     rollout_fn=None):
    """This epoch's rollouts on this process, scored: batch b is scored in a worker while b+1 is sampled.

    With ``batch_windows`` and ``sampling.window.mode: random`` each batch rolls out with its own window,
    drawn from (seed, epoch, batch, process) (:func:`step_plan`), as Flow-GRPO-Fast draws one per sampling
    call; otherwise every batch uses ``plan``.

    Prompts are sharded over data ranks (``run.shards``: a context group's processes sample the same rows) and row
    seeds come from global row indices, so N data ranks reproduce one.
    A prompt's group_size rows are sampled on one process, in one batch, so a group-wise reward scores whole groups
    with no gather (``check_whole_groups`` holds it). With ``sampling.pilot.candidates`` the batches are allocated by
    Pilot-Commit (:func:`pilot_sample_and_score`). Returns (trajectory with rewards, time sampling ended, time scoring
    ended); it also carries ``rollouts_sampled`` (rollouts of every process this epoch, dropped pilot ones included)
    and ``sampling_metrics`` (``perf/*``). ``rollout_fn`` samples (None: :func:`rollout`; Pilot-Commit's is its own).
    """
    cfg, policy = run.cfg, run.policy
    s, rank, world = cfg.sampling, run.shards.process_index, run.shards.num_processes  # this data rank of data_world
    key = cfg.data.balance_by  # equal shares of each batch per metadata value (checked in load_prompt_splits)
    strata = [m[key] for m in run.train_prompts.metadata] if key else None
    if s.pilot.candidates:
        return pilot_sample_and_score(run, scorer, epoch, plan=plan, noise_level=noise_level, kind=kind,
                                      strata=strata, store_x0_preds=store_x0_preds, store_means=store_means,
                                      batch_windows=batch_windows)
    roots_per_group = s.group_size // plan.leaves_per_root
    # Self-guidance only where configured for rollouts (recipe grpo's config refuses it: see its validate).
    guide = SelfGuidance.maybe(**s.self_guidance.settings()) if s.self_guidance.in_rollouts else None
    settings = RolloutSettings(num_steps=s.num_steps, guidance_scale=run.guidance, noise_level=noise_level, kind=kind,
                               ode_solver=s.ode_solver, same_noise_in_group=same_noise_in_group,
                               same_noise_in_pairs=same_noise_in_pairs, store_x0_preds=store_x0_preds,
                               store_means=store_means, self_guidance=guide)  # each batch's plan goes in below
    parts, futures = [], []
    for b in range(cfg.train.batches_per_epoch):
        batch_index = epoch * cfg.train.batches_per_epoch + b
        index = epoch_prompt_indices(len(run.train_prompts), s.prompts_per_batch, seed=cfg.seed, epoch=batch_index,
                                     rank=rank, world_size=world, strata=strata)
        batch = run.train_prompts.subset(index)
        first_root = (batch_index * world + rank) * s.prompts_per_batch * roots_per_group
        first_group = (batch_index * world + rank) * s.prompts_per_batch  # this batch's groups' run-wide ids
        cond = preference_cond(run, batch, torch.arange(first_group, first_group + len(batch)))
        subgroups = preference_subgroups(run)  # ParetoSlider: each prompt's group rolls out as S subgroups
        entries = batch.subset([p for p in range(len(batch)) for _ in range(subgroups)])  # [P * S], prompt-major
        batch_settings = replace(settings, plan=batch_plan(plan, s, batch_windows, seed=cfg.seed, epoch=epoch,
                                                           batch=b, rank=rank))
        with policy.local_forward():
            part = chunked_rollout(policy, entries.prompts, batch_settings, group_size=s.group_size // subgroups,
                                   chunk=s.rollout_chunk, cond=cond, metadata=entries.metadata,
                                   seeds=root_seeds(cfg.seed, first_root, len(batch) * roots_per_group),
                                   rollout_fn=rollout_fn)
        part.group_ids = part.group_ids // subgroups + first_group  # a prompt's S subgroups are one group
        check_whole_groups(scorer.rewards, part.group_ids, s.group_size)  # a group-wise reward sees whole groups
        futures.append(scorer.submit(part.images, part.row_prompts, part.row_metadata, part.group_ids))
        parts.append(part)
    sample_done = time.perf_counter()
    for part, future in zip(parts, futures):
        part.rewards = future.result()
    traj = concat_trajectories(parts)
    traj.rollouts_sampled, traj.sampling_metrics = traj.num_rows * world, {}
    return traj, sample_done, time.perf_counter()


def preference_subgroups(run: Run) -> int:
    """S, the (prompt, preference) subgroups of a prompt group: ``model.preference.per_prompt``, 1 without it."""
    return run.cfg.model.preference.per_prompt if run.cfg.model.preference.rewards else 1


def preference_cond(run: Run, batch: PromptSet, group_ids: torch.Tensor):
    """ParetoSlider: the conditioning of the batch's P prompts repeated S times, prompt-major (``[P * S]``), entry
    (p, s) with subgroup s's w of group ``group_ids[p]`` (``TextCond.preference`` ``[P * S, K]``, drawn from the run
    seed and the group's run-wide id); None without ``model.preference`` (the rollout encodes)."""
    names, subgroups = run.cfg.model.preference.rewards, preference_subgroups(run)
    if not names:
        return None
    cond = run.policy.encode(list(batch.prompts), metadata=batch.metadata)
    cond = cond.select(torch.arange(len(batch)).repeat_interleave(subgroups))
    w = draw_preferences(run.cfg.seed, group_ids.repeat_interleave(subgroups), len(names),
                         torch.arange(subgroups).repeat(len(batch)))  # [P * S, K]
    cond.preference = w.to(cond.prompt_embeds.device)
    return cond


def normalising_groups(run: Run, traj, all_groups: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """The ids the combiner normalises within and the reward weights of every process's rows (``all_groups``
    ``[N_all]``): the groups and the configured weights, or with ``model.preference`` the (prompt, preference)
    subgroups and each subgroup's w in place of the slider's rewards' weights (per row)."""
    names, subgroups = run.cfg.model.preference.rewards, preference_subgroups(run)
    if not names:
        return all_groups, run.weights
    shards = run.shards
    slots = shards.gather((traj.prompt_ids % subgroups).to(shards.device)).cpu()  # [N_all] entry p*S+s -> s
    ids = subgroup_ids(all_groups, slots, subgroups)
    unique, inverse = torch.unique(ids, return_inverse=True)
    w = draw_preferences(run.cfg.seed, unique // subgroups, len(names), unique % subgroups)[inverse]  # [N_all, K]
    return ids, row_weights(w, names, run.weights)


def pilot_sample_and_score(run: Run, scorer, epoch: int, *, plan: StepPlan, noise_level: float, kind: str,
                           strata: list | None, store_x0_preds: bool = False, store_means: bool = False,
                           batch_windows: bool = False):
    """Pilot-Commit (``flowrl.sampling.pilot``): every batch pilots ``pilot.candidates`` prompts with
    ``pilot.group_size`` rollouts each, commits the ``prompts_per_batch`` whose pilot rewards vary most
    and rolls out the rest of their groups; uncommitted pilot rollouts are dropped.

    Each process pilots its own shard of candidates (the same balanced sampler) and commits locally,
    so every process keeps ``prompts_per_batch`` groups of ``group_size`` rows (N processes draw the
    candidates and seeds of one with N times the candidates, but choose among their own). All pilots are sampled
    first, so pilot b+1 samples while pilot b is scored and each commit waits only for its own pilot.
    Same return value as :func:`sample_and_score`; ``sampling_metrics`` holds, summed over processes
    and batches, ``perf/rollouts_saved`` (skipped candidates x the commit rollouts each would have
    had), ``perf/pilot_dropped`` (pilot rollouts not trained on) and ``perf/pilot_zero_std`` (the
    fraction of candidates whose pilot rewards did not vary).
    """
    cfg, shards, policy = run.cfg, run.shards, run.policy
    s, rank, world = cfg.sampling, shards.process_index, shards.num_processes  # this data rank of data_world
    candidates, pilot_size, commit_size = s.pilot.candidates, s.pilot.group_size, s.group_size - s.pilot.group_size
    settings = RolloutSettings(num_steps=s.num_steps, guidance_scale=run.guidance, noise_level=noise_level, kind=kind,
                               ode_solver=s.ode_solver, store_x0_preds=store_x0_preds, store_means=store_means)
    batch_settings = [replace(settings, plan=batch_plan(plan, s, batch_windows, seed=cfg.seed, epoch=epoch, batch=b,
                                                        rank=rank))
                      for b in range(cfg.train.batches_per_epoch)]  # a batch's pilot and commit share its window

    # 1. Pilot: a few rollouts per candidate; candidate c owns root rows first_root + c * group_size + [0, G).
    pilots = []
    for b in range(cfg.train.batches_per_epoch):
        batch_index = epoch * cfg.train.batches_per_epoch + b
        slot = batch_index * world + rank  # this process's batch among all processes' batches of the run
        index = epoch_prompt_indices(len(run.train_prompts), candidates, seed=cfg.seed, epoch=batch_index, rank=rank,
                                     world_size=world, strata=strata)
        batch = run.train_prompts.subset(index)
        first_root = slot * candidates * s.group_size
        with policy.local_forward():
            pilot = rollout(policy, batch.prompts, batch_settings[b], group_size=pilot_size, metadata=batch.metadata,
                            seeds=slot_seeds(cfg.seed, first_root, range(len(batch)), s.group_size, 0, pilot_size))
        pilots.append((slot, first_root, pilot, scorer.submit(pilot.images, pilot.row_prompts, pilot.row_metadata),
                       batch_settings[b]))

    # 2. Commit the candidates whose combined pilot reward varies most; roll out the rest of their groups.
    commits, skipped, flat = [], 0, 0
    for slot, first_root, pilot, future, pilot_settings in pilots:
        pilot.rewards = future.result()
        n = pilot.num_rows
        signal = {k: pilot.rewards.get(k, torch.full((n,), math.nan)) for k in run.weights}  # a failed reward: NaN
        _, combined = COMBINERS[cfg.train.combine](signal, run.weights, pilot.prompt_ids.cpu(), lambda r, g: r)
        variances = group_variances(combined, pilot.prompt_ids, len(pilot.prompts))  # [C]: a candidate is a group
        committed = commit_candidates(variances, s.prompts_per_batch)  # [P]
        skipped += len(pilot.prompts) - len(committed)
        flat += int((variances == 0).sum())
        chosen = committed.tolist()
        with policy.local_forward():
            commit = rollout(policy, [pilot.prompts[c] for c in chosen], pilot_settings, group_size=commit_size,
                             metadata=[pilot.metadata[c] for c in chosen] if pilot.metadata else None,
                             cond=pilot.cond.select(committed),
                             seeds=slot_seeds(cfg.seed, first_root, chosen, s.group_size, pilot_size, s.group_size))
        group_ids = slot * s.prompts_per_batch + torch.arange(len(chosen))  # [P] globally unique
        commits.append((pilot, committed, group_ids, commit,
                        scorer.submit(commit.images, commit.row_prompts, commit.row_metadata)))
    sample_done = time.perf_counter()

    # 3. Each committed group: its pilot rows (already scored) then its commit rows.
    parts = []
    for pilot, committed, group_ids, commit, future in commits:
        commit.rewards = future.result()
        parts.append(join_committed(pilot, commit, committed, group_ids))
    traj = concat_trajectories(parts)
    batches = cfg.train.batches_per_epoch
    counts = shards.reduce(torch.tensor([skipped, flat], dtype=torch.float64, device=shards.device), "sum").cpu()
    traj.rollouts_sampled = (candidates * pilot_size + s.prompts_per_batch * commit_size) * batches * world
    traj.sampling_metrics = {"perf/rollouts_saved": float(counts[0]) * commit_size,
                             "perf/pilot_dropped": float(counts[0]) * pilot_size,
                             "perf/pilot_zero_std": float(counts[1]) / (candidates * batches * world)}
    return traj, sample_done, time.perf_counter()


class GroupAdvantages(NamedTuple):
    """One epoch's advantages over whole groups, every row gathered once (one copy per context group)."""

    gathered: dict[str, torch.Tensor]  # {reward: [N_all]}
    advantages: torch.Tensor  # [N_all] combined, normalised per group (NaN where unscored)
    combined: torch.Tensor  # [N_all] the combined reward
    local: slice  # this process's rows of N_all (its data rank's)
    all_groups: torch.Tensor  # [N_all] group ids


def group_advantages(run: Run, traj, estimator) -> GroupAdvantages:
    """Advantages over whole groups: gather every row's rewards once, combine them, normalise per group."""
    shards, t = run.shards, run.cfg.train
    gathered = {k: shards.gather(v.to(shards.device)).cpu() for k, v in traj.rewards.items()}
    all_groups = shards.gather(traj.group_ids.to(shards.device)).cpu()
    ids, weights = normalising_groups(run, traj, all_groups)
    advantages, combined = COMBINERS[t.combine]({key: gathered[key] for key in run.weights}, weights, ids,
                                                lambda r, g: estimator(r, g, std_scope=t.std_scope))
    rank = shards.process_index
    return GroupAdvantages(gathered, advantages, combined, slice(rank * traj.num_rows, (rank + 1) * traj.num_rows),
                           all_groups)


def each_reward_advantages(run: Run, groups: GroupAdvantages, estimator) -> dict[str, torch.Tensor] | None:
    """Where an extra balances the rewards' gradients (:attr:`Run.balances_rewards`: MARBLE), each weighted reward's
    own advantages over whole groups, this process's rows ``{name: [N]}``, for the recipe to shape as it shapes the
    combined one; None otherwise."""
    if not run.balances_rewards:
        return None
    estimate = partial(estimator, std_scope=run.cfg.train.std_scope)
    per_reward = reward_advantages({key: groups.gathered[key] for key in run.weights}, run.weights, groups.all_groups,
                                   estimate)
    return {name: advantages[groups.local] for name, advantages in per_reward.items()}
