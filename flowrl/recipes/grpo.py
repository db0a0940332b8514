"""Online trajectory RL for flow models: GRPO (Flow-GRPO) with window and tree rollouts.

Choices, all set in the config (``flowrl/config/schema.py``):
- rollouts: full SDE, an SDE window (Flow-GRPO-Fast: a random start per rollout batch and process, each
  row training at its own steps / MixGRPO sliding start) or a
  tree that branches at fixed steps (BranchGRPO / TreeGRPO) or at steps that move per epoch (TMPO's
  dynamic tree, ``sampling.tree.schedule``), with BranchGRPO's width and depth pruning acting on the
  loss mask; only stochastic steps are stored;
- advantages: per-prompt group mean, batch (global) or per-group std, clipped to +-advantage_clip;
  tree edges are trained once, on BranchGRPO's per-tree, per-step z-score of the mean leaf reward below
  them (``flowrl/algorithms/branch.py``; ``sampling.tree.backup: leaf_mean``: the mean leaf advantage), and
  branch steps draw BranchGRPO's scaled split noise; ``loss: tmpo`` trains TMPO's Softmax Trajectory Balance
  over whole paths instead (``flowrl/recipes/tmpo_paths.py``), its tree's split steps optionally drawn by
  TMPO's reward-adaptive scheduler (``sampling.tree.schedule: beta``); ``loss: sdpo`` trains SDPO's dense reward
  difference loss on pairs of a group that share their initial noise, each pair's steps in a shuffled order
  (``flowrl/recipes/sdpo.py``);
- credit (``train.credit``): every trained step gets its row's advantage (terminal), a share of it by
  how far the step moves the predicted clean latent toward the final one (dense_cosine), or its own
  group-normalised reward gain measured by ODE look-ahead from the states around it (dense_ode,
  DenseGRPO; see ``flowrl/algorithms/dense.py``), or its group-normalised discounted return of SDPO's dense
  rewards, scored on a few steps' clean predictions and predicted by latent similarity on the others (sdpo);
- loss: PPO-clipped ratio with separate lower/upper ranges (``train.ratio_norm: grpo_guard`` takes
  GRPO-Guard's unbiased per-step log-ratio and divides each step's policy loss by ``|dt|``; see
  ``flowrl/algorithms/ratio_norm.py``), plus beta * KL to the reference
  (the same transformer with the LoRA switched off), CFG inside the trained velocity. The KL is
  Flow-GRPO's, so its published beta carries over: per step ``||mu - mu_ref||^2 / (2 std_t^2)``
  (mean over non-batch dims) with ``std_t = a * sqrt(sigma / (1 - sigma))`` for SDE steps, i.e.
  WITHOUT the ``sqrt(-dt)`` of the transition std (``|dt|`` times the exact Gaussian KL), and the
  step std ``sigma_next * sin(a * pi / 2)`` for CPS steps (``flowrl.sampling.steps.kl_std``);
- optimisation: several inner passes over shuffled transitions (``train.drop_zero_advantage``: without the rows
  of zero advantage, Flow-GRPO's filter), gradient accumulation over micro-batches and steps, clipping, AdamW,
  EMA of the LoRA weights for eval and export.

Rollout batch i is scored in a worker thread while batch i+1 is sampled. Under
``accelerate launch`` prompts are sharded, rewards are gathered so advantages see whole groups and
the global std, and row seeds come from global row indices, so N processes reproduce one (except
under Flow-GRPO-Fast's windows, which each process draws for itself, as the reference does).

Run: ``flowrl train configs/smoke/sd3_tiny.yaml`` (CPU, seconds) or
``accelerate launch --num_processes 8 -m flowrl train configs/sd35_medium/grpo_ocr.yaml``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from functools import partial
from typing import Callable

import numpy as np
import torch
from accelerate import Accelerator

from flowrl.algorithms.advantages import ADVANTAGE_ESTIMATORS
from flowrl.algorithms.combine import COMBINERS
from flowrl.algorithms.credit import (
    CREDIT, EDGE_BACKUPS, CreditInputs, gardo_weighted, same_step_parts, trained_mask, zero_advantage_kept,
)
from flowrl.algorithms.losses import POLICY_LOSSES
from flowrl.algorithms.ratio_norm import RATIO_NORMS
from flowrl.algorithms.transition import TransitionSettings, transition_loss
from flowrl.algorithms.tree import prune_mask
from flowrl.config import GRPOConfig
from flowrl.recipes.epoch_end import end_epoch, log_base_model, optimizer_step, out_of_time, progress_bar
from flowrl.recipes.finish import finish_run
from flowrl.recipes.objectives import objective_of
from flowrl.recipes.rollouts import (
    GroupAdvantages, each_reward_advantages, group_advantages, sample_and_score,
)
from flowrl.recipes.gardo_shaping import gardo_reference, gardo_shaping
from flowrl.recipes.run import Run, RowShaping
from flowrl.recipes.start import start_run
from flowrl.rewards_api import AsyncScorer
from flowrl.sampling.epoch_plan import beta_split_scheduler, step_plan
from flowrl.training.accumulate import micro_batch
from flowrl.training.lr import skip_scheduled_step
from flowrl.training.row_shards import RowShards
from flowrl.training.stats import StatsAccumulator


def train(cfg: GRPOConfig, *, accelerator: Accelerator | None = None) -> dict[str, float]:
    """Run the GRPO loop described by ``cfg``; returns the last epoch's metrics as a flat dict."""
    run = start_run(cfg, accelerator, extras=GRPO_EXTRAS)  # processes, run dir, model + LoRA, optimizer, resume
    s, t = cfg.sampling, cfg.train
    estimator = ADVANTAGE_ESTIMATORS[t.advantage]
    objective = objective_of(t.loss)  # per transition, TMPO's whole paths or SDPO's pairs
    credit, ratio_norm = CREDIT[t.credit], RATIO_NORMS[t.ratio_norm]
    scorer = AsyncScorer(run.rewards, on_error=t.reward_errors, asynchronous=t.async_rewards)
    split_scheduler = run.extras.get("split_scheduler")  # TMPO's reward-adaptive tree splits
    metrics: dict[str, float] = {}
    log_base_model(run)
    bar = progress_bar(run, "grpo")
    for epoch in bar:
        epoch_start = time.perf_counter()
        # 1. Plan: the epoch's stochastic, stored steps (full SDE, a window, tree splits).
        plan = step_plan(s, epoch, cfg.seed, split_scheduler)
        if objective.own_split_noise:  # BranchGRPO's split noise is GRPO's; TMPO's splits draw the step's own noise
            plan = replace(plan, split_noise_scale=1.0)
        phase_metrics = run.begin_epoch(epoch)  # HRF: a new phase re-anchors the weights

        # 2. Sample and score: each prompt's group rolled out, batch b scored in a worker while b+1 samples.
        traj, sample_done, reward_done = sample_and_score(
            run, scorer, epoch, plan=plan, noise_level=s.noise_level, kind=s.kind,
            same_noise_in_group=s.same_noise_in_group, same_noise_in_pairs=objective.pairs_share_noise,
            store_x0_preds=credit.store_x0_preds, store_means=ratio_norm.store_means or objective.store_means,
            batch_windows=True)

        # 3. Advantages over whole groups (every process's rewards gathered), then each stored edge's: shaped by an
        #    extra (GARDO's diversity weights), backed up over tree edges, on the steps that train (the rows' windows,
        #    scored, first visits, unpruned).
        groups = group_advantages(run, traj, estimator)
        steps = trained_steps(cfg, traj, plan, objective, epoch)
        rewards = groups.advantages.where(torch.isfinite(groups.combined), torch.tensor(float("nan")))  # [N_all] R
        if split_scheduler is not None:
            split_scheduler.observe(rewards)  # TMPO's split scheduler follows R
        shaping = run.shape_rows(traj, groups)  # GARDO: positive advantages scaled, the KL's rows
        edges = edge_advantages(cfg, traj, groups, steps, plan, objective, shaping)
        scoring_metrics = run.after_scoring(epoch, traj, groups.combined)  # the diversity guard: may raise the KL

        # 4. Credit (train.credit): terminal keeps each edge's advantage; a dense rule puts per-step ones in its
        #    place. Flow-GRPO's filter (train.drop_zero_advantage) then drops rows with nothing to learn.
        stats = StatsAccumulator()
        advantages, mask = credit.assign(credit_inputs(run, traj, scorer, groups, steps, edges, estimator),
                                         edges.advantages, edges.mask, stats)
        kept, mask, drop_metrics = drop_zero_advantage_rows(run, advantages, mask)

        # 5. Update: inner passes over shuffled chunks of rows, one optimizer step each (MARBLE-balanced where on).
        update = objective(run, traj, steps.columns, steps.noise_levels, rewards[groups.local], advantages, mask)
        per_reward = reward_edge_advantages(run, groups, edges, estimator)
        settings = TransitionSettings(
            policy_loss=partial(POLICY_LOSSES[t.loss], config=t) if t.loss in POLICY_LOSSES else None,
            guidance=run.guidance, kind=s.kind, beta=run.beta, ratio_norm=t.ratio_norm, kl_gate=shaping.kl_rows,
            sensitivity=ratio_norm.sensitivities(traj.row_sigmas[0], steps.columns, noise_level=s.noise_level,
                                                 kind=s.kind),  # one window for every row (GRPOConfig.validate)
            reference=run.kl_reference)  # GARDO's resets move it
        if run.updates_policy(epoch):  # unless the epoch trains only a trainable reward (Adv-GRPO's schedule)
            update_policy(run, epoch, update, traj, advantages, mask, kept, steps, settings, per_reward, stats)
        update_metrics = run.after_update(epoch, traj, stats)  # GARDO's reference resets, the trainable rewards
        train_done = time.perf_counter()

        # 6. End of epoch: log, held-out points, eval grids, checkpoint.
        metrics = end_epoch(run, epoch, gathered=groups.gathered, combined=groups.combined,
                            group_ids=groups.all_groups, stats=stats,
                            extra={"advantages/abs_mean": update.advantage_size(groups.advantages, t.advantage_clip),
                                   "policy/trained_fraction": edges.trained_fraction, **shaping.metrics,
                                   **update_metrics, **phase_metrics, **scoring_metrics, **drop_metrics,
                                   **traj.sampling_metrics},
                            rollouts=traj.rollouts_sampled, times=(epoch_start, sample_done, reward_done, train_done),
                            bar=bar)
        if out_of_time(run) or run.stopped:
            break

    # 7. Export the final adapter (EMA weights when kept) and report before/after on held-out prompts.
    scorer.close()
    return finish_run(run, metrics)


# --- the steps of one epoch ----------------------------------------------------------------------------------

@dataclass
class TrainedSteps:
    """The stored steps of one epoch's rollouts that train, and the schedule they sit on."""

    mask: torch.Tensor  # [N, K] bool: each row's own window, less the last near-clean step and ODE steps
    columns: list[int]  # the stored steps some row trains
    levels: list[float]  # [K] each stored step's noise level (0: an ODE step)
    host_steps: list[list[int]]  # [N][K] schedule step of each stored step, read once per epoch
    host_sigmas: list[list[float]]  # [N][K + 1] sigma of each stored state

    @property
    def noise_levels(self) -> list[float]:
        """Each trained column's noise level."""
        return [self.levels[k] for k in self.columns]


def trained_steps(cfg: GRPOConfig, traj, plan, objective, epoch: int) -> TrainedSteps:
    """Each row's trained steps: its own window (Flow-GRPO-Fast draws one per batch), the last step left out
    where Flow-GRPO leaves it out, ``train.timestep_fraction`` of the rest, and no ODE step between tree splits
    (per-split noise levels come only where every row stores the same steps)."""
    s, t = cfg.sampling, cfg.train
    skip_last = t.skip_last_step if t.skip_last_step is not None else \
        s.window.size is None and not objective.trains_last_step
    trained = trained_mask(traj.row_step_indices, s.num_steps, skip_last, t.timestep_fraction, seed=cfg.seed,
                           epoch=epoch)
    host_steps, host_sigmas = traj.row_step_indices.tolist(), traj.row_sigmas.tolist()  # [N][K], [N][K+1]
    levels = [plan.noise_level_at(host_steps[0][k], s.noise_level) for k in range(traj.num_stored_steps)]
    trained[:, [k for k, level in enumerate(levels) if level == 0]] = False  # ODE steps between splits
    columns = [k for k in range(traj.num_stored_steps) if trained[:, k].any()]
    return TrainedSteps(trained, columns, levels, host_steps, host_sigmas)


@dataclass
class EdgeAdvantages:
    """One epoch's advantage of each stored edge and the steps that train, before credit."""

    advantages: torch.Tensor  # [N, K]
    mask: torch.Tensor  # [N, K] bool: trained, scored, first visit, unpruned
    row_advantages: torch.Tensor  # [N] clipped, positive ones scaled by the shaping
    of: Callable[[torch.Tensor], torch.Tensor]  # [N] row advantages -> [N, K] edges, as the advantages were made
    trained_fraction: float  # of the stored transitions


def edge_advantages(cfg: GRPOConfig, traj, groups: GroupAdvantages, steps: TrainedSteps, plan, objective,
                    shaping: RowShaping) -> EdgeAdvantages:
    """Each stored edge's advantage: the row's clipped advantage, positive ones scaled by ``shaping`` (GARDO's
    distances), backed up over a tree's edges by ``sampling.tree.backup`` (without a tree, or for an objective that
    trains whole paths, each edge is its row's); and the steps that train: each row's trained steps, scored, first
    visits, unpruned (BranchGRPO)."""
    s, t, local = cfg.sampling, cfg.train, groups.local
    backup = EDGE_BACKUPS[s.tree.backup if plan.branch_steps and objective.backs_up_edges else "leaf_mean"]
    distances = shaping.positive_scale
    row_advantages = gardo_weighted(groups.advantages[local].clamp(-t.advantage_clip, t.advantage_clip),
                                    distances)  # [N]
    scored = torch.isfinite(groups.combined[local])  # [N]
    of = partial(backup, traj=traj, scored=scored, distances=distances, clip=t.advantage_clip)
    mask = traj.first_visit_mask() & scored[:, None]  # [N, K]
    # Trees need a fixed window or a full-SDE rollout (SamplingConfig.validate): row 0's steps are every row's.
    mask &= prune_mask(groups.combined[local], traj.group_ids, traj.edge_ids, traj.row_step_indices[0],
                       keep_width=s.tree.prune_width, pruned_steps=plan.pruned_steps)  # BranchGRPO pruning
    mask &= steps.mask
    return EdgeAdvantages(advantages=of(groups.advantages[local]), mask=mask, row_advantages=row_advantages, of=of,
                          trained_fraction=float(mask.float().mean()))


def credit_inputs(run: Run, traj, scorer, groups: GroupAdvantages, steps: TrainedSteps, edges: EdgeAdvantages,
                  estimator) -> CreditInputs:
    t = run.cfg.train
    return CreditInputs(
        # accelerator: the row shards, so the rules' gathers take every row once (a context group's copy once)
        policy=run.policy, accelerator=run.shards, traj=traj, scorer=scorer, settings=t, weights=run.weights,
        combine=COMBINERS[t.combine], estimator=partial(estimator, std_scope=t.std_scope), guidance=run.guidance,
        num_steps=run.cfg.sampling.num_steps, row_advantages=edges.row_advantages, trained=steps.mask,
        columns=steps.columns, all_groups=groups.all_groups, local=groups.local,
        batch_size=run.cfg.sampling.rollout_chunk or run.cfg.sampling.prompts_per_batch * run.cfg.sampling.group_size)


def drop_zero_advantage_rows(run: Run, advantages: torch.Tensor, mask: torch.Tensor):
    """``train.drop_zero_advantage`` (Flow-GRPO's filter): (kept rows [N] bool or None, the mask without the
    dropped rows, the metrics); each process drops its own, policy loss and KL alike."""
    if not run.cfg.train.drop_zero_advantage:
        return None, mask, {}
    kept = zero_advantage_kept(advantages, mask)  # [N]
    dropped = run.shards.reduce((~kept).sum().float().to(run.shards.device), "sum").item()
    return kept, mask & kept[:, None], {"policy/dropped_rows": dropped}


def reward_edge_advantages(run: Run, groups: GroupAdvantages, edges: EdgeAdvantages, estimator):
    """Where an extra balances the rewards' gradients (MARBLE): each weighted reward's own clipped advantage on
    every edge ``{name: [N, K]}``, made as the combined one is; None otherwise."""
    per_reward = each_reward_advantages(run, groups, estimator)
    return None if per_reward is None else {name: edges.of(advantages) for name, advantages in per_reward.items()}


# --- the update ----------------------------------------------------------------------------------------------

def update_policy(run: Run, epoch: int, update, traj, advantages: torch.Tensor, mask: torch.Tensor,
                  kept: torch.Tensor | None, steps: TrainedSteps, settings: TransitionSettings,
                  per_reward: dict[str, torch.Tensor] | None, stats: StatsAccumulator) -> None:
    """``train.inner_epochs`` passes over the epoch's rows in shuffled chunks, one optimizer step per chunk: the
    objective's gradient (per transition: micro-batches of rows at one trained step each), clipped and stepped;
    the EMA follows its schedule of the step index."""
    cfg, t, accelerator, ema, shards = run.cfg, run.cfg.train, run.accelerator, run.ema, run.shards
    rank = shards.process_index  # the data rank: a context group shuffles its rows alike
    for inner in range(t.inner_epochs):
        order = np.random.default_rng([cfg.seed, epoch, inner, rank, 0x7EA1]).permutation(traj.num_rows)
        if kept is not None:  # the kept rows, in the same shuffled order, share the optimizer steps
            order = order[kept.cpu().numpy()[order]]
        chunks = update.chunks(order, t.optimizer_steps_per_epoch)  # TMPO: whole groups
        for chunk_index, chunk in enumerate(chunks):
            chunk = torch.as_tensor(chunk, dtype=torch.long)
            weight = shards.reduce(mask[chunk].sum().float().to(shards.device), "sum").item()  # each row once
            done = (epoch * t.inner_epochs + inner) * len(chunks) + chunk_index + 1  # SDPO: steps x chunks
            on_policy = inner == 0 and chunk_index == 0
            if kept is not None and weight == 0:  # every process dropped this step's rows: nothing to learn
                skip_scheduled_step(run.extras["lr_scheduler"])  # no pass, no step; the LR schedule advances
            else:
                work = transition_work(chunk, steps, mask, t.micro_batch_size, shards, padded=kept is not None)

                def chunk_backward(chunk_advantages: torch.Tensor, chunk_stats: StatsAccumulator) -> None:
                    for i, (rows, k, sigmas, weights) in enumerate(work):
                        with micro_batch(accelerator, run.policy.forward_module, last=i == len(work) - 1):
                            loss_sum = transition_loss(run.policy, traj, chunk_advantages, rows, k, weights,
                                                       settings=settings, accelerator=accelerator, sigmas=sigmas,
                                                       noise_level=steps.levels[k],
                                                       stats=chunk_stats, on_policy=on_policy)
                            accelerator.backward(loss_sum * shards.gradient_scale / max(weight, 1.0))

                def transitions_backward() -> None:  # the per-transition update, reward-balanced where an extra does
                    step = (epoch * t.inner_epochs + inner) * t.optimizer_steps_per_epoch + chunk_index
                    run.backward(step, advantages, per_reward, chunk_backward, stats)

                update.backward(chunk, stats, on_policy=on_policy, transitions=transitions_backward)
                optimizer_step(run, stats)
            if ema is not None:  # steps so far: train.ema_start_step / ema_every / ema_warmup count them
                ema.scheduled_step(done, start=t.ema_start_step, every=t.ema_every, warmup=t.ema_warmup)


def transition_work(chunk: torch.Tensor, steps: TrainedSteps, mask: torch.Tensor, micro: int, shards: RowShards, *,
                    padded: bool) -> list[tuple]:
    """One chunk's model passes: (rows, stored step k, (sigma, sigma_next), mask) per micro-batch of rows at one
    trained step (rows of one step share its sigma). ``padded`` (rows dropped per process): every process runs as
    many passes as the one with most (:func:`matched_work`)."""
    rows_of_chunk, host_sigmas = chunk.tolist(), steps.host_sigmas
    work = [(torch.tensor(part, dtype=torch.long), k, tuple(host_sigmas[part[0]][k:k + 2]), mask)
            for start in range(0, len(rows_of_chunk), micro) for k in steps.columns
            for part in same_step_parts(steps.host_steps, rows_of_chunk[start:start + micro], k)]
    if not padded:
        return work
    first = steps.columns[0]  # a pass of row 0 at a trained step, weighted 0
    return matched_work(work, shards, idle=(torch.tensor([0]), first, tuple(host_sigmas[0][first:first + 2]),
                                            torch.zeros_like(mask)))


def matched_work(work: list[tuple], shards: RowShards, *, idle: tuple) -> list[tuple]:
    """``work`` (one model pass per item) padded with ``idle`` items, passes with an all-zero weight mask, to the
    longest list of any process. Dropped rows leave the processes with different numbers of passes, but DDP
    all-reduces the gradients in the last backward of each and FSDP2 gathers the weights in every forward, so
    every process must run the same number; a process with no kept row still runs one (its loss 0 on the whole
    graph), so it joins the all-reduce instead of leaving the others waiting."""
    count = torch.tensor([len(work)], device=shards.device)
    longest = int(shards.gather(count).max()) if shards.accelerator.num_processes > 1 else len(work)
    return work + [idle] * (max(longest, 1) - len(work))


# --- the recipe's extras -------------------------------------------------------------------------------------

# The recipe's own run extras, by trainer-state name (flowrl/recipes/extras.py has the common ones).
GRPO_EXTRAS = {"reference_resets": gardo_reference, "gardo": gardo_shaping,  # GARDO (flowrl/recipes/gardo_shaping.py)
               "split_scheduler": lambda run: beta_split_scheduler(run.cfg.sampling)}  # TMPO's adaptive splits
