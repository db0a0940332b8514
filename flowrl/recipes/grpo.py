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
from tqdm.auto import tqdm

from flowrl.algorithms.advantages import ADVANTAGE_ESTIMATORS, edge_advantages
from flowrl.algorithms.branch import branch_advantages
from flowrl.algorithms.combine import COMBINERS, reward_advantages
from flowrl.algorithms.gardo import (
    build_features, diversity_weighted, gated_rows, nearest_neighbour_distances, uncertainty,
)
from flowrl.algorithms.marble import balanced_backward
from flowrl.algorithms.dense import (
    cosine_advantages, cosine_gain_weights, lookahead_rewards, lookahead_states, predict_x0,
    reward_gains, stepwise_advantages, top_step_share,
)
from flowrl.algorithms.tree import prune_mask
from flowrl.algorithms.losses import POLICY_LOSSES, gaussian_mean_kl
from flowrl.algorithms.ratio_norm import RATIO_NORMS
from flowrl.config import GRPOConfig
from flowrl.recipes.common import (  # noqa: F401  (re-exported for callers of this module)
    StatsAccumulator, end_epoch, finish_run, group_advantages, log_base_model, make_accelerator, optimizer_step,
    out_of_time, sample_and_score, start_run, step_plan,
)
from flowrl.recipes.guard import exported_weights, finite_mean, in_group_diversity
from flowrl.recipes.extras import snapshot
from flowrl.recipes.plans import beta_split_scheduler
from flowrl.recipes.run import Run
from flowrl.recipes.snapshots import GardoReference
from flowrl.recipes.sdpo import SdpoPairs, sdpo_credit
from flowrl.recipes.tmpo_paths import TmpoPaths
from flowrl.rewards_api import AsyncScorer
from flowrl.sampling import sde_step, transition
from flowrl.sampling.steps import kl_std
from flowrl.training.accumulate import micro_batch
from flowrl.training.lr import skip_scheduled_step


def train(cfg: GRPOConfig, *, accelerator: Accelerator | None = None) -> dict[str, float]:
    """Run the GRPO loop described by ``cfg``; returns the last epoch's metrics as a flat dict."""
    # 0. Set-up: processes, run directory, model + LoRA, optimizer, EMA, rewards, prompts, resume.
    run = start_run(cfg, accelerator, extras=GRPO_EXTRAS)
    accelerator, policy, ema = run.accelerator, run.policy, run.ema
    rank, world, guidance = accelerator.process_index, accelerator.num_processes, run.guidance
    s, t = cfg.sampling, cfg.train
    rollout_batch = s.rollout_chunk or s.prompts_per_batch * s.group_size  # rows per model batch: the look-ahead's
    estimator = ADVANTAGE_ESTIMATORS[t.advantage]
    objective = OBJECTIVES[t.loss]  # per transition (grpo-clip) or over whole paths (tmpo)
    policy_loss = POLICY_LOSSES.get(t.loss)  # the per-transition loss; None where the objective trains paths
    credit = CREDIT[t.credit]
    ratio_norm = RATIO_NORMS[t.ratio_norm]  # the per-step log-ratio normalisation (none: the plain log-ratio)
    clip_high = t.clip_range if t.clip_range_high is None else t.clip_range_high
    scorer = AsyncScorer(run.rewards, on_error=t.reward_errors, asynchronous=t.async_rewards)
    bar = tqdm(range(run.start_epoch, t.epochs), disable=not (cfg.log.progress and accelerator.is_main_process),
               desc="grpo", dynamic_ncols=True)
    features = build_features(cfg.gardo.features, cfg.gardo.feature_kwargs) if cfg.gardo.diversity else None
    auxiliary = cfg.gardo.auxiliary or [key for key, w in run.weights.items() if w == 0]
    marble, guard = run.extras.get("marble"), run.extras.get("guard")
    gardo_reference, split_scheduler = run.extras.get("reference_resets"), run.extras.get("split_scheduler")
    reference = None if gardo_reference is None else partial(gardo_reference.weights, policy)  # None: the base model
    guard_features = build_features(cfg.guard.features, cfg.guard.feature_kwargs) if guard else None
    metrics: dict[str, float] = {}
    log_base_model(run)
    for epoch in bar:
        epoch_start = time.perf_counter()
        plan = step_plan(s, epoch, cfg.seed, split_scheduler)
        if objective.own_split_noise:  # BranchGRPO's split noise is GRPO's; TMPO's splits draw the step's own noise
            plan = replace(plan, split_noise_scale=1.0)
        # Tree edges: sampling.tree.backup (BranchGRPO's per-tree, per-step z-scores, or the mean leaf advantage);
        # without a tree, or for an objective that trains whole paths, each edge is its row's.
        backup = EDGE_BACKUPS[s.tree.backup if plan.branch_steps and objective.backs_up_edges else "leaf_mean"]
        phase_metrics = run.begin_epoch(epoch)  # HRF: a new phase re-anchors the weights

        # 1-3. Sample prompts, roll out groups, score batch b while batch b+1 is sampled.
        traj, sample_done, reward_done = sample_and_score(
            run, scorer, epoch, plan=plan, noise_level=s.noise_level, kind=s.kind,
            same_noise_in_group=s.same_noise_in_group, same_noise_in_pairs=objective.pairs_share_noise,
            store_x0_preds=credit.store_x0_preds,
            store_means=ratio_norm.store_means or objective.store_means, batch_windows=True)

        # 4. Advantages over whole groups: gather every process's rewards, keep this process's slice.
        #    TMPO's objective takes that (unclipped) as its reward R and trains whole paths (TmpoPaths) on Softmax-TB.
        gathered, combined_adv, combined, local, all_groups = group_advantages(run, traj, estimator)
        # Each row's own window (Flow-GRPO-Fast draws one per batch): which of its stored steps train [N, K].
        skip_last = t.skip_last_step if t.skip_last_step is not None else \
            s.window.size is None and not objective.trains_last_step
        trained = trained_mask(traj.row_step_indices, s.num_steps, skip_last, t.timestep_fraction, seed=cfg.seed,
                               epoch=epoch)
        # Per-step noise levels come with per-split levels only, where every row stores the same steps.
        # The rows' steps and sigmas as host lists, read once: the update below looks them up per micro-batch.
        host_steps, host_sigmas = traj.row_step_indices.tolist(), traj.row_sigmas.tolist()  # [N][K], [N][K+1]
        noise_at = lambda k: plan.noise_level_at(host_steps[0][k], s.noise_level)  # noqa: E731
        trained[:, [k for k in range(traj.num_stored_steps) if noise_at(k) == 0]] = False  # ODE steps between splits
        trained_cols = [k for k in range(traj.num_stored_steps) if trained[:, k].any()]
        scored_adv = combined_adv.where(torch.isfinite(combined), torch.tensor(float("nan")))  # [N_all] NaN: unscored
        if split_scheduler is not None:
            split_scheduler.observe(scored_adv)  # TMPO's split scheduler follows R
        update = objective(run, traj, trained_cols, [noise_at(k) for k in trained_cols], scored_adv[local])
        row_adv = combined_adv[local].clamp(-t.advantage_clip, t.advantage_clip)
        # GARDO: positive advantages times the nearest-neighbour distance in the group; the KL gate.
        distances = None if features is None else nearest_neighbour_distances(
            features(traj.images, traj.final_latents), traj.group_ids)  # [N]
        row_adv = gardo_weighted(row_adv, distances)
        kl_gate = None
        if cfg.gardo.kl_fraction < 1:
            scores = uncertainty(combined, {key: gathered[key] for key in auxiliary}, all_groups)  # [N_all]
            kl_gate = gated_rows(scores, cfg.gardo.kl_fraction)[local]  # [N]
        scored = torch.isfinite(combined[local])  # [N]
        edges_of = partial(backup, traj=traj, scored=scored, distances=distances, clip=t.advantage_clip)
        traj.advantages = edges_of(combined_adv[local])  # [N, K]
        # Diversity guard: these rollouts' in-group diversity against its start; past guard.max_drop it warns,
        # raises the live KL beta (run.beta, this epoch's update on) or stops the run after this epoch.
        guard_metrics = {} if guard is None or not guard.due(epoch) else guard.observe(
            epoch, in_group_diversity(guard_features(traj.images, traj.final_latents), traj.group_ids, accelerator),
            reward=finite_mean(combined), weights=lambda: exported_weights(policy, ema))
        # ratio_norm batch_sensitivity: each trained step's velocity sensitivity over their mean (the others: none).
        # It runs only where every row shares one window (GRPOConfig.validate), so row 0's sigmas are all of them.
        sensitivity = ratio_norm.sensitivities(traj.row_sigmas[0], trained_cols, noise_level=s.noise_level,
                                               kind=s.kind)
        mask = traj.first_visit_mask() & scored[:, None]  # [N, K]
        # Trees need a fixed window or a full-SDE rollout (SamplingConfig.validate): row 0's steps are every row's.
        mask &= prune_mask(combined[local], traj.group_ids, traj.edge_ids, traj.row_step_indices[0],
                           keep_width=s.tree.prune_width, pruned_steps=plan.pruned_steps)  # BranchGRPO pruning
        mask &= trained
        trained_fraction = float(mask.float().mean())  # stored transitions that train (first visit, scored, unpruned)

        # 5. Credit (train.credit): terminal keeps each edge's advantage; dense rules put per-step advantages in
        #    place of the row's one on every trained step.
        stats = StatsAccumulator()
        mask = credit.assign(CreditInputs(run, traj, scorer, row_adv, trained, trained_cols, all_groups, local,
                                          estimator, rollout_batch), mask, stats)
        # train.drop_zero_advantage (Flow-GRPO's filter): rows with a zero advantage on every trained step leave the
        # update, policy loss and KL alike; each process drops its own.
        kept = zero_advantage_kept(traj.advantages, mask) if t.drop_zero_advantage else None  # [N] bool
        drop_metrics = {}
        if kept is not None:
            mask &= kept[:, None]
            drop_metrics["policy/dropped_rows"] = accelerator.reduce(
                (~kept).sum().float().to(accelerator.device), "sum").item()

        # MARBLE: each weighted reward's own clipped advantage on every edge, balanced per optimizer step.
        per_reward = None if marble is None else {
            name: edges_of(adv[local])  # [N, K]
            for name, adv in reward_advantages({key: gathered[key] for key in run.weights}, run.weights, all_groups,
                                               partial(estimator, std_scope=t.std_scope)).items()}

        # 6-7. Inner passes: shuffled chunks -> micro-batches x trained steps -> one optimizer step per chunk.
        for inner in range(t.inner_epochs):
            order = np.random.default_rng([cfg.seed, epoch, inner, rank, 0x7EA1]).permutation(traj.num_rows)
            if kept is not None:  # the kept rows, in the same shuffled order, share the optimizer steps
                order = order[kept.cpu().numpy()[order]]
            chunks = update.chunks(order, t.optimizer_steps_per_epoch)  # TMPO: whole groups
            for chunk_index, chunk in enumerate(chunks):
                chunk = torch.as_tensor(chunk, dtype=torch.long)
                weight = accelerator.reduce(mask[chunk].sum().float().to(accelerator.device), "sum").item()
                done = (epoch * t.inner_epochs + inner) * len(chunks) + chunk_index + 1  # SDPO: steps x chunks
                if kept is not None and weight == 0:  # every process dropped this step's rows: nothing to learn
                    skip_optimizer_step(run)
                    if ema is not None:  # the EMA's schedule is one of the step index
                        ema.scheduled_step(done, start=t.ema_start_step, every=t.ema_every, warmup=t.ema_warmup)
                    continue
                rows_of_chunk, micro = chunk.tolist(), t.micro_batch_size
                work = [(torch.tensor(part, dtype=torch.long), k, tuple(host_sigmas[part[0]][k:k + 2]), mask)
                        for start in range(0, len(rows_of_chunk), micro) for k in trained_cols
                        for part in same_step_parts(host_steps, rows_of_chunk[start:start + micro], k)]
                if kept is not None:  # processes dropped different numbers of rows: match their passes
                    first = trained_cols[0]  # a pass of row 0 at a trained step, weighted 0
                    work = matched_work(work, accelerator, idle=(torch.tensor([0]), first,
                                                                 tuple(host_sigmas[0][first:first + 2]),
                                                                 torch.zeros_like(mask)))

                def chunk_backward(advantages: torch.Tensor, chunk_stats: StatsAccumulator) -> None:
                    traj.advantages = advantages  # [N, K]
                    for i, (rows, k, sigmas, weights) in enumerate(work):
                        sync = i == len(work) - 1
                        with micro_batch(accelerator, policy.forward_module, last=sync):
                            loss_sum = transition_loss(policy, traj, rows, k, weights, accelerator=accelerator,
                                                       sigmas=sigmas,
                                                       guidance=guidance, noise_level=noise_at(k), kind=s.kind,
                                                       beta=run.beta, policy_loss=policy_loss, clip_low=t.clip_range,
                                                       clip_high=clip_high, stats=chunk_stats,
                                                       on_policy=inner == 0 and chunk_index == 0,
                                                       ratio_norm=t.ratio_norm, sensitivity=sensitivity.get(k),
                                                       kl_gate=kl_gate,
                                                       reference=reference)
                            accelerator.backward(loss_sum * world / max(weight, 1.0))

                def transitions_backward() -> None:  # the per-transition update, MARBLE-balanced where on
                    if per_reward is None:
                        chunk_backward(traj.advantages, stats)
                    else:
                        step = (epoch * t.inner_epochs + inner) * t.optimizer_steps_per_epoch + chunk_index
                        balanced_backward(marble, run.params, step, per_reward, chunk_backward, stats,
                                          StatsAccumulator)

                update.backward(chunk, stats, on_policy=inner == 0 and chunk_index == 0,
                                transitions=transitions_backward, mask=mask)
                optimizer_step(run, stats)
                if ema is not None:  # steps so far: train.ema_start_step / ema_every / ema_warmup count them
                    ema.scheduled_step(done, start=t.ema_start_step, every=t.ema_every, warmup=t.ema_warmup)
        reference_metrics = {} if gardo_reference is None else gardo_reference.after_update(run, epoch, stats)
        update_metrics = run.after_epoch(epoch, traj)  # trainable rewards learn from these rollouts
        train_done = time.perf_counter()

        # 8. Log, render eval grids, checkpoint.
        advantage_size = update.advantage_size(combined_adv, t.advantage_clip)
        metrics = end_epoch(run, epoch, gathered=gathered, combined=combined, group_ids=all_groups, stats=stats,
                            extra={"advantages/abs_mean": advantage_size, "policy/trained_fraction": trained_fraction,
                                   **gardo_metrics(distances, kl_gate), **reference_metrics, **update_metrics,
                                   **phase_metrics, **guard_metrics, **drop_metrics, **traj.sampling_metrics},
                            rollouts=traj.rollouts_sampled,
                            times=(epoch_start, sample_done, reward_done, train_done), bar=bar)
        if out_of_time(run) or run.stopped:
            break

    # 9. Export the final adapter (EMA weights when kept) and report before/after on held-out prompts.
    scorer.close()
    return finish_run(run, metrics)


def zero_advantage_kept(advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[N] bool: the rows ``train.drop_zero_advantage`` keeps, those with a nonzero advantage ``advantages`` [N, K]
    on at least one trained step (``mask`` [N, K]). Flow-GRPO's rule (yifan123/flow_grpo, scripts/train_sd3.py at
    ac4c86e8, ``mask = samples["advantages"].abs().sum(dim=1) != 0``): exactly zero, no threshold, which is what a
    group of equal rewards gives (its mean is exact), so only saturated groups go. A row with no trained step has
    nothing to train and goes too; an untrained step's advantage (NaN where dense_ode could not score) is not read."""
    return torch.where(mask, advantages.abs(), 0.0).sum(1) != 0


def matched_work(work: list[tuple], accelerator: Accelerator, *, idle: tuple) -> list[tuple]:
    """``work`` (one model pass per item) padded with ``idle`` items, passes with an all-zero weight mask, to the
    longest list of any process. Dropped rows leave the processes with different numbers of passes, but DDP
    all-reduces the gradients in the last backward of each and FSDP2 gathers the weights in every forward, so
    every process must run the same number; a process with no kept row still runs one (its loss 0 on the whole
    graph), so it joins the all-reduce instead of leaving the others waiting."""
    count = torch.tensor([len(work)], device=accelerator.device)
    longest = int(accelerator.gather(count).max()) if accelerator.num_processes > 1 else len(work)
    return work + [idle] * (max(longest, 1) - len(work))


def skip_optimizer_step(run: Run) -> None:
    """An optimizer step with nothing to train on any process (``train.drop_zero_advantage`` dropped all its rows):
    no pass and no step (AdamW would still move the weights by its moments and weight decay); the LR schedule
    advances, so it stays a function of the step index as after a skipped non-finite step."""
    skip_scheduled_step(run.extras["lr_scheduler"])


def gardo_reference(run: Run) -> GardoReference | None:
    """gardo.reset_every / reset_kl: GARDO's adaptive KL reference."""
    g = run.cfg.gardo
    if g.reset_every is None and g.reset_kl is None:
        return None
    return GardoReference(snapshot(run), reset_every=g.reset_every, reset_kl=g.reset_kl)


# The recipe's own run extras, by trainer-state name (flowrl/recipes/extras.py has the common ones).
GRPO_EXTRAS = {"reference_resets": gardo_reference,
               "split_scheduler": lambda run: beta_split_scheduler(run.cfg.sampling)}  # TMPO's adaptive splits


def gardo_weighted(advantages: torch.Tensor, distances: torch.Tensor | None) -> torch.Tensor:
    return advantages if distances is None else diversity_weighted(advantages, distances)


def leaf_mean_edges(row_advantages: torch.Tensor, *, traj, scored: torch.Tensor, distances: torch.Tensor | None,
                    clip: float) -> torch.Tensor:
    """[N] unclipped row advantages -> [N, K] each stored edge's mean clipped, GARDO-weighted leaf advantage (a
    broadcast without a tree)."""
    return edge_advantages(gardo_weighted(row_advantages.clamp(-clip, clip), distances), traj.edge_ids)


def depth_standardised_edges(row_advantages: torch.Tensor, *, traj, scored: torch.Tensor,
                             distances: torch.Tensor | None, clip: float) -> torch.Tensor:
    """[N] unclipped row advantages -> [N, K] BranchGRPO's per-tree, per-step z-scores of the mean GARDO-weighted
    leaf advantages below each edge, clipped after."""
    return branch_advantages(gardo_weighted(row_advantages, distances), scored, traj.edge_ids, traj.parent,
                             clip=clip)


# sampling.tree.backup: the advantage each stored edge trains on, one signature.
EDGE_BACKUPS = {"leaf_mean": leaf_mean_edges, "depth_standardised": depth_standardised_edges}


class TransitionObjective:
    """``train.loss`` grpo-clip (:data:`POLICY_LOSSES`): the loss of each stored transition on its edge's advantage
    (:func:`transition_loss`), the edges backed up by ``sampling.tree.backup``. The other objective,
    :class:`~flowrl.recipes.tmpo_paths.TmpoPaths`, has the same interface and trains whole paths."""

    own_split_noise = False  # tree splits draw BranchGRPO's scaled split noise
    store_means = False  # the rollout's step means are not needed (ratio_norm grpo_guard asks for them itself)
    backs_up_edges = True  # tree edges train on sampling.tree.backup's advantages
    pairs_share_noise = False  # rows draw their own initial noise (SDPO's pairs share theirs)
    trains_last_step = False  # a full-SDE rollout's last, near-clean step is not trained (Flow-GRPO)

    def __init__(self, run, traj, columns: list[int], noise_levels: list[float], rewards: torch.Tensor):
        pass  # everything it needs is the recipe's per-transition update

    def chunks(self, order: np.ndarray, count: int) -> list[np.ndarray]:
        """Rows of the epoch in ``count`` chunks, one optimizer step each."""
        return np.array_split(order, count)

    def backward(self, chunk: torch.Tensor, stats: StatsAccumulator, *, on_policy: bool, transitions,
                 mask: torch.Tensor) -> None:
        """Accumulate one chunk's gradient: ``transitions()``, the recipe's per-transition update (which holds the
        mask [N, K] of the steps that train itself)."""
        transitions()

    def advantage_size(self, combined_advantages: torch.Tensor, clip: float) -> float:
        """The epoch's ``advantages/abs_mean``: the mean clipped row advantage."""
        return float(combined_advantages.clamp(-clip, clip).abs().mean())


# train.loss: what one epoch trains, built per epoch from its rollouts.
OBJECTIVES = {"grpo-clip": TransitionObjective, "tmpo": TmpoPaths, "sdpo": SdpoPairs}


@dataclass
class CreditInputs:
    """What a credit rule reads of one epoch."""

    run: Run
    traj: object
    scorer: AsyncScorer
    row_advantages: torch.Tensor  # [N] clipped, GARDO-weighted
    trained: torch.Tensor  # [N, K] bool: the stored steps each row trains
    columns: list[int]  # the trained stored steps
    all_groups: torch.Tensor  # [N_all] every process's group ids
    local: slice  # this process's rows of N_all
    estimator: Callable  # train.advantage's
    batch_size: int  # rows per model batch


@dataclass(frozen=True)
class Credit:
    """A credit rule (``train.credit``): ``assign(inputs, mask, stats) -> mask`` leaves in ``traj.advantages`` [N, K]
    what each trained step trains on and returns the mask [N, K] of the steps that train; ``store_x0_preds``: it
    reads the rollout's x0 predictions."""

    assign: Callable
    store_x0_preds: bool = False


def terminal_credit(inputs: CreditInputs, mask: torch.Tensor, stats: StatsAccumulator) -> torch.Tensor:
    """Every trained step keeps its edge's advantage."""
    return mask


def cosine_dense_credit(inputs: CreditInputs, mask: torch.Tensor, stats: StatsAccumulator) -> torch.Tensor:
    """dense_cosine: the row's advantage split over its steps by their x0-prediction gains (:func:`cosine_credit`)."""
    run = inputs.run
    inputs.traj.advantages = cosine_credit(run.policy, inputs.traj, inputs.row_advantages, inputs.trained,
                                           guidance=run.guidance, batch_size=inputs.batch_size)
    return mask


def ode_dense_credit(inputs: CreditInputs, mask: torch.Tensor, stats: StatsAccumulator) -> torch.Tensor:
    """dense_ode: each step's group-normalised reward gain from ODE look-ahead (:func:`ode_credit`); a look-ahead
    that could not be scored trains nothing."""
    run, traj, t = inputs.run, inputs.traj, inputs.run.cfg.train
    traj.advantages, gains = ode_credit(
        run.policy, traj, inputs.scorer, inputs.columns, inputs.all_groups, inputs.local,
        accelerator=run.accelerator, schedule=run.policy.sigmas(run.cfg.sampling.num_steps), guidance=run.guidance,
        weights=run.weights, combine=COMBINERS[t.combine], estimator=partial(inputs.estimator, std_scope=t.std_scope),
        clip=t.advantage_clip, steps=t.dense_lookahead, batch_size=inputs.batch_size)
    mask &= torch.isfinite(gains)
    stats.add("reward/dense_gain_mean", gains.nan_to_num().flatten(), mask.flatten().float())
    return mask


def dense(rule: Callable) -> Callable:
    """A dense credit rule, with the statistics every dense rule logs (size, top-step share, time)."""
    def assign(inputs: CreditInputs, mask: torch.Tensor, stats: StatsAccumulator) -> torch.Tensor:
        start = time.perf_counter()
        mask = rule(inputs, mask, stats)
        advantages = inputs.traj.advantages
        stats.add("advantages/dense_abs_mean", advantages.abs().flatten(), mask.flatten().float())
        share, has_credit = top_step_share(advantages, mask)
        stats.add("advantages/dense_top_share", share, has_credit.float())
        stats.add_scalar("perf/dense_s", time.perf_counter() - start, reduce="max")
        return mask
    return assign


CREDIT = {"terminal": Credit(terminal_credit), "dense_cosine": Credit(dense(cosine_dense_credit), store_x0_preds=True),
          "dense_ode": Credit(dense(ode_dense_credit)), "sdpo": Credit(dense(sdpo_credit), store_x0_preds=True)}


def gardo_metrics(distances: torch.Tensor | None, kl_gate: torch.Tensor | None) -> dict[str, float]:
    out = {} if distances is None else {"gardo/nn_distance_mean": float(distances.mean())}
    if kl_gate is not None:
        out["gardo/kl_gated_fraction"] = float(kl_gate.float().mean())
    return out


def trained_mask(row_step_indices: torch.Tensor, num_steps: int, skip_last_step: bool, fraction: float, *,
                 seed: int, epoch: int) -> torch.Tensor:
    """[N, K] bool: the stored steps each row trains, by :func:`trained_columns` applied to each distinct window
    (rows of one epoch hold different windows when they are drawn per batch)."""
    mask = torch.zeros(row_step_indices.shape, dtype=torch.bool)
    for window in torch.unique(row_step_indices.cpu(), dim=0):
        rows = (row_step_indices.cpu() == window).all(1)  # [N]
        columns = trained_columns(window, num_steps, skip_last_step, fraction, seed=seed, epoch=epoch)
        mask[rows.nonzero()[:, 0, None], torch.tensor(columns)] = True
    return mask


def same_step_rows(row_step_indices: torch.Tensor, rows: torch.Tensor, k: int) -> list[torch.Tensor]:
    """``rows`` split by the schedule step their stored column ``k`` holds (one part when they share a window),
    so each model call runs at one sigma; parts in order of first appearance, rows in their order."""
    return [torch.tensor(part, dtype=torch.long)
            for part in same_step_parts(row_step_indices.tolist(), rows.tolist(), k)]


def same_step_parts(host_steps: list[list[int]], rows: list[int], k: int) -> list[list[int]]:
    """:func:`same_step_rows` on host lists (``host_steps`` [N][K]), which the recipe reads once per epoch, so
    splitting a micro-batch reads no tensor."""
    steps = [host_steps[r][k] for r in rows]
    return [[r for r, s in zip(rows, steps) if s == step] for step in dict.fromkeys(steps)]


def trained_columns(step_indices: torch.Tensor, num_steps: int, skip_last_step: bool, fraction: float, *,
                    seed: int, epoch: int) -> list[int]:
    """Stored-step columns of one window [K] to train: drop the final near-clean step (``skip_last_step``), then
    keep a per-epoch fraction."""
    columns = [k for k, step in enumerate(step_indices.tolist()) if not (skip_last_step and step == num_steps - 1)]
    if not columns:
        raise ValueError("no trainable steps: the SDE window holds only the last step; widen it or set "
                         "train.skip_last_step=false")
    if fraction < 1:
        keep = max(1, round(fraction * len(columns)))
        chosen = np.random.default_rng([seed, epoch, 0x51E9]).choice(len(columns), size=keep, replace=False)
        columns = [columns[i] for i in sorted(chosen.tolist())]
    return columns


def cosine_credit(policy, traj, row_advantages, trained, *, guidance, batch_size) -> torch.Tensor:
    """dense_cosine advantages [N, K]: the row's clipped advantage split over its trained steps (``trained``
    [N, K] bool) by their x0-prediction gains, from the rollout's stored predictions or, when it kept none,
    recomputed."""
    x0_preds = traj.x0_preds
    if x0_preds is None:
        with policy.local_forward():
            x0_preds = predict_x0(policy, traj.latents, traj.row_sigmas, traj.cond.select(traj.prompt_ids), guidance,
                                  batch_size=batch_size)
    weights = cosine_gain_weights(x0_preds, traj.final_latents, trained)  # [N, K]
    return cosine_advantages(row_advantages.cpu(), weights.cpu(), trained.sum(1))


def ode_credit(policy, traj, scorer, columns, all_groups, local, *, accelerator, schedule, guidance, weights, combine,
               estimator, clip, steps, batch_size) -> tuple[torch.Tensor, torch.Tensor]:
    """dense_ode advantages [N, K] and combined reward gains [N, K] (NaN where unknown) of this process's
    rows: look-ahead rewards of the stored states, gains against the next state's, normalised per step
    over whole groups (every process's gains gathered, as the terminal rewards are)."""
    def score(images: torch.Tensor) -> dict[str, torch.Tensor]:  # same rewards, same error policy as the rollouts
        return scorer.submit(images, traj.row_prompts, traj.row_metadata, traj.group_ids).result()  # whole groups

    with policy.local_forward():  # gradient-free passes need no distributed syncing
        step_rewards = lookahead_rewards(policy, traj.latents, schedule, traj.row_step_indices,
                                         traj.cond.select(traj.prompt_ids), guidance, score,
                                         states=lookahead_states(columns, traj.num_stored_steps), steps=steps,
                                         batch_size=batch_size)
    unscored = torch.full(traj.log_probs.shape, float("nan"))  # a reward that failed (reward_errors: nan)
    gains = {key: accelerator.gather(reward_gains(step_rewards.get(key, unscored), traj.rewards[key].cpu())
                                     .to(accelerator.device)).cpu() for key in weights}  # {key: [N_all, K]}
    advantages, combined = stepwise_advantages(gains, weights, all_groups, combine, estimator, clip=clip)
    return advantages[local], combined[local]


def transition_loss(policy, traj, rows, k, mask, *, accelerator, guidance, noise_level, kind, beta, policy_loss,
                    clip_low, clip_high, stats, on_policy, ratio_norm: str = "none", sensitivity: float | None = None,
                    kl_gate: torch.Tensor | None = None, reference=None,
                    sigmas: tuple[float, float] | None = None) -> torch.Tensor:
    """Summed (not averaged) loss of stored transitions ``rows`` at stored step ``k``; ``ratio_norm``
    grpo_guard uses GRPO-Guard's log-ratio (from ``traj.means``) and divides the policy loss by ``|dt|``,
    batch_sensitivity centres the log-ratio and divides it by ``sensitivity``; with ``kl_gate`` [N] (bool)
    the KL acts on the gated rows only (GARDO); ``reference()`` gives the KL reference's weights as a
    context (default: the base model, adapter off)."""
    device = accelerator.device
    x = traj.latents[rows, k].to(device)  # [B, C, h, w]
    x_next = traj.latents[rows, k + 1].to(device)
    # rows share step k; ``sigmas`` (sigma, sigma_next), when given, saves reading them here
    sigma, sigma_next = sigmas or (traj.row_sigmas[rows[0], k].item(), traj.row_sigmas[rows[0], k + 1].item())
    cond = traj.cond.select(traj.prompt_ids[rows])
    with accelerator.autocast():
        velocity = policy.velocity(x, sigma, cond, guidance)
    step = sde_step(velocity, x, sigma, sigma_next, noise_level=noise_level, kind=kind, prev_sample=x_next)
    old_log_probs = traj.log_probs[rows, k].to(device)
    advantages = traj.advantages[rows, k].to(device)
    norm = RATIO_NORMS[ratio_norm]  # none: the plain log-ratio; else normalised, against a zero baseline
    log_probs, old_log_probs = norm.log_ratio(step.log_prob, old_log_probs, mean=step.mean,
                                              old_mean=lambda: traj.means[rows, k].to(device), prev_sample=x_next,
                                              std=step.std, sensitivity=sensitivity)
    loss, loss_stats = policy_loss(log_probs, old_log_probs, advantages, clip_low=clip_low, clip_high=clip_high)
    loss = loss * norm.loss_scale(sigma, sigma_next)  # grpo_guard: 1 / |dt|; the others 1 (exact)
    weights = mask[rows, k].to(device).float()  # [B]
    kl = torch.zeros_like(loss)
    if beta > 0:
        with torch.no_grad(), (reference or policy.reference)(), accelerator.autocast():
            ref_velocity = policy.velocity(x, sigma, cond, guidance)
        ref_mean, _ = transition(ref_velocity, x, sigma, sigma_next, noise_level=noise_level, kind=kind)
        # Flow-GRPO's scale, not step.std: for SDE steps it leaves out sqrt(-dt) (see kl_std).
        kl = gaussian_mean_kl(step.mean, ref_mean,
                              kl_std(x, sigma, sigma_next, noise_level=noise_level, kind=kind))
        if kl_gate is not None:
            kl = kl * kl_gate[rows].to(kl)
    total = loss + beta * kl
    stats.add("loss/policy", loss, weights)
    stats.add("loss/kl", kl, weights)
    stats.add("loss/total", total, weights)
    stats.add("policy/ratio", loss_stats["ratio"], weights)
    stats.add("policy/clipfrac", loss_stats["clipped"], weights)
    stats.add("policy/approx_kl", loss_stats["approx_kl"], weights)
    if on_policy:
        deviation = ((loss_stats["ratio"] - 1).abs() * weights).max()
        stats.add_scalar("policy/onpolicy_ratio_maxdev", deviation, reduce="max")
    return (total * weights).sum()
