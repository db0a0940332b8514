"""Credit: which stored steps of a rollout train, and on what advantage each trains.

A GRPO epoch gives each row one advantage. This module turns it into the advantage of every stored step
[N, K] and the mask of the steps that train:

- the steps: each row's own window (:func:`trained_mask`: the last near-clean step left out where Flow-GRPO
  leaves it out, ``train.timestep_fraction`` of the rest per epoch), and Flow-GRPO's filter of rows whose
  advantage is zero on every trained step (:func:`zero_advantage_kept`);
- tree edges (``sampling.tree.backup``, :data:`EDGE_BACKUPS`): the mean leaf advantage below each edge, or
  BranchGRPO's per-tree, per-step z-scores of it;
- the credit rules (``train.credit``, :data:`CREDIT`): terminal keeps each edge's advantage; dense_cosine splits
  it by how far each step moves the predicted clean latent toward the final one; dense_ode (DenseGRPO) and sdpo
  (SDPO) put each step's own group-normalised reward gain or discounted dense return in its place. The math of
  the dense rules is :mod:`flowrl.algorithms.dense` and :mod:`flowrl.algorithms.sdpo`; the rules here run the
  model and the scorer for them.

Every rule returns new tensors: the rollout's trajectory is never written. Statistics go to a ``stats``
accumulator (``add(name, values, weights)``, ``add_scalar(name, value, reduce=...)``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch

from flowrl.algorithms.advantages import edge_advantages
from flowrl.algorithms.branch import branch_advantages
from flowrl.algorithms.dense import (
    cosine_advantages, cosine_gain_weights, lookahead_rewards, lookahead_states, predict_x0, reward_gains,
    stepwise_advantages, top_step_share,
)
from flowrl.algorithms.gardo import diversity_weighted
from flowrl.algorithms.sdpo import (
    cosine_similarities, discounted_returns, least_similar_anchors, predicted_rewards,
)


# --- the steps that train -----------------------------------------------------------------------------------

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


def zero_advantage_kept(advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[N] bool: the rows ``train.drop_zero_advantage`` keeps, those with a nonzero advantage ``advantages`` [N, K]
    on at least one trained step (``mask`` [N, K]). Flow-GRPO's rule (yifan123/flow_grpo, scripts/train_sd3.py at
    ac4c86e8, ``mask = samples["advantages"].abs().sum(dim=1) != 0``): exactly zero, no threshold, which is what a
    group of equal rewards gives (its mean is exact), so only saturated groups go. A row with no trained step has
    nothing to train and goes too; an untrained step's advantage (NaN where dense_ode could not score) is not read."""
    return torch.where(mask, advantages.abs(), 0.0).sum(1) != 0


# --- tree edges ---------------------------------------------------------------------------------------------

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


# --- credit rules -------------------------------------------------------------------------------------------

@dataclass
class CreditInputs:
    """What a credit rule reads of one epoch."""

    policy: Any
    accelerator: Any
    traj: Any  # the epoch's rollouts, scored
    scorer: Any  # the run's scorer: the same rewards and error policy as the rollouts
    settings: Any  # recipe grpo's ``train`` section: each rule reads its own keys
    weights: dict[str, float]  # the rewards' weights
    combine: Callable  # train.combine's combiner
    estimator: Callable  # train.advantage's estimator, train.std_scope bound
    guidance: float
    num_steps: int  # the sampling schedule's
    row_advantages: torch.Tensor  # [N] clipped, GARDO-weighted
    trained: torch.Tensor  # [N, K] bool: the stored steps each row trains
    columns: list[int]  # the trained stored steps
    all_groups: torch.Tensor  # [N_all] every process's group ids
    local: slice  # this process's rows of N_all
    batch_size: int  # rows per model batch


CreditRule = Callable[[CreditInputs, torch.Tensor, torch.Tensor, Any], tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class Credit:
    """A credit rule (``train.credit``): ``assign(inputs, advantages [N, K], mask [N, K], stats) -> (advantages,
    mask)``, from each stored edge's advantage to what each trained step trains on, and the steps that train;
    ``store_x0_preds``: it reads the rollout's x0 predictions."""

    assign: CreditRule
    store_x0_preds: bool = False


def terminal_credit(inputs: CreditInputs, advantages: torch.Tensor, mask: torch.Tensor, stats):
    """Every trained step keeps its edge's advantage."""
    return advantages, mask


def cosine_dense_credit(inputs: CreditInputs, advantages: torch.Tensor, mask: torch.Tensor, stats):
    """dense_cosine: the row's advantage split over its steps by their x0-prediction gains (:func:`cosine_credit`)."""
    return cosine_credit(inputs.policy, inputs.traj, inputs.row_advantages, inputs.trained, guidance=inputs.guidance,
                         batch_size=inputs.batch_size), mask


def ode_dense_credit(inputs: CreditInputs, advantages: torch.Tensor, mask: torch.Tensor, stats):
    """dense_ode: each step's group-normalised reward gain from ODE look-ahead (:func:`ode_credit`); a look-ahead
    that could not be scored trains nothing."""
    t = inputs.settings
    advantages, gains = ode_credit(
        inputs.policy, inputs.traj, inputs.scorer, inputs.columns, inputs.all_groups, inputs.local,
        accelerator=inputs.accelerator, schedule=inputs.policy.sigmas(inputs.num_steps), guidance=inputs.guidance,
        weights=inputs.weights, combine=inputs.combine, estimator=inputs.estimator, clip=t.advantage_clip,
        steps=t.dense_lookahead, batch_size=inputs.batch_size)
    mask = mask & torch.isfinite(gains)
    stats.add("reward/dense_gain_mean", gains.nan_to_num().flatten(), mask.flatten().float())
    return advantages, mask


def sdpo_credit(inputs: CreditInputs, advantages: torch.Tensor, mask: torch.Tensor, stats):
    """train.credit sdpo: each step's advantage from its discounted dense return, normalised per step over its
    group; the dense rewards (:func:`sdpo_dense_rewards`) are queried at a few states and predicted by latent
    similarity at the others. A row with a reward that could not be scored trains nothing."""
    traj, t, accelerator = inputs.traj, inputs.settings, inputs.accelerator
    start = time.perf_counter()
    keys = list(inputs.weights)
    dense_rewards, count = sdpo_dense_rewards(inputs.policy, inputs.scorer, traj, keys, queries=t.sdpo_queries,
                                              anchor=t.sdpo_anchor, reward_at=t.sdpo_reward_at,
                                              batch_size=inputs.batch_size)  # {key: [N, K]}
    returns = {key: accelerator.gather(discounted_returns(dense_rewards[key], t.sdpo_gamma).float()
                                       .to(accelerator.device)).cpu() for key in keys}  # {key: [N_all, K]}
    advantages, combined = stepwise_advantages(returns, inputs.weights, inputs.all_groups, inputs.combine,
                                               inputs.estimator, clip=t.advantage_clip)
    mask = mask & torch.isfinite(combined[inputs.local]).all(dim=1, keepdim=True)
    stats.add("reward/sdpo_return_mean", combined[inputs.local].nan_to_num().flatten(), mask.flatten().float())
    stats.add_scalar("perf/sdpo_queried_images", float(count))  # images scored for the credit, per process
    stats.add_scalar("perf/sdpo_credit_s", time.perf_counter() - start, reduce="max")
    return advantages[inputs.local], mask  # [N, K]


def step_start_states(x0_preds: torch.Tensor) -> tuple[torch.Tensor, int | None]:
    """The x̂0 of the state each step starts from, [N, K, ...] of the rollout's [N, K+1, ...]; none is the sample."""
    return x0_preds[:, :-1], None


def step_end_states(x0_preds: torch.Tensor) -> tuple[torch.Tensor, int | None]:
    """The x̂0 of the state each step leads to, [N, K, ...]; the last (index K-1) is the sample itself."""
    return x0_preds[:, 1:], x0_preds.shape[1] - 2


# train.sdpo_reward_at: (x0_preds [N, K+1, ...]) -> (the states whose x̂0 gives each step's dense reward [N, K, ...],
# the index among them of the sample, whose reward the rollout has, or None).
SDPO_REWARD_STATES = {"step_start": step_start_states, "step_end": step_end_states}


def sdpo_dense_rewards(policy, scorer, traj, keys, *, queries: int, anchor: str, reward_at: str,
                       batch_size: int) -> tuple[dict[str, torch.Tensor], int]:
    """SDPO's dense rewards {key: [N, K]} float64 of this process's rows and how many images were scored: step k's
    reward is that of the x̂0 the rollout stored at the state ``reward_at`` names (``step_start``: the state step k
    starts from, the reference's), scored at the :func:`query_states` and predicted by latent similarity at the
    others (:func:`flowrl.algorithms.sdpo.predicted_rewards`)."""
    states, sample_state = SDPO_REWARD_STATES[reward_at](traj.x0_preds.cpu())  # [N, K, ...]
    queried = query_states(states, queries, anchor, traj.seeds)  # [N, Q]
    with policy.local_forward():  # gradient-free decodes need no distributed syncing
        rewards, count = queried_rewards(policy, scorer, traj, states, queried, keys, sample_state=sample_state,
                                         batch_size=batch_size)
    similarities = cosine_similarities(states, queried)  # [N, K, Q]
    return {key: predicted_rewards(rewards[key], similarities, queried) for key in keys}, count


def dense(rule: CreditRule) -> CreditRule:
    """A dense credit rule, with the statistics every dense rule logs (size, top-step share, time)."""
    def assign(inputs: CreditInputs, advantages: torch.Tensor, mask: torch.Tensor, stats):
        start = time.perf_counter()
        advantages, mask = rule(inputs, advantages, mask, stats)
        stats.add("advantages/dense_abs_mean", advantages.abs().flatten(), mask.flatten().float())
        share, has_credit = top_step_share(advantages, mask)
        stats.add("advantages/dense_top_share", share, has_credit.float())
        stats.add_scalar("perf/dense_s", time.perf_counter() - start, reduce="max")
        return advantages, mask
    return assign


# train.credit: which steps a row's advantage reaches, and how.
CREDIT = {"terminal": Credit(terminal_credit), "dense_cosine": Credit(dense(cosine_dense_credit), store_x0_preds=True),
          "dense_ode": Credit(dense(ode_dense_credit)), "sdpo": Credit(dense(sdpo_credit), store_x0_preds=True)}

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


def query_states(x0_preds: torch.Tensor, queries: int, anchor: str, seeds: torch.Tensor) -> torch.Tensor:
    """[N, Q] the states scored per row: the first, the last, then ``queries - 2`` anchors (``anchor``:
    least_similar, the reference's rule; random, distinct middle states drawn from the row's seed); ``x0_preds``
    [N, S, ...]. Fewer states than queries: every state is scored."""
    n, states = x0_preds.shape[:2]
    count = min(queries, states) - min(2, states)  # anchors beyond the first and last states
    ends = torch.tensor([0, states - 1]).repeat(n, 1)  # [N, 2] (one state: the same one twice)
    if count <= 0:
        return ends
    if count >= states - 2:  # every middle state
        return torch.cat([ends, torch.arange(1, states - 1).repeat(n, 1)], dim=1)
    if anchor == "least_similar":
        return torch.cat([ends, least_similar_anchors(x0_preds, count)], dim=1)
    drawn = [np.random.default_rng([int(seed), 0x5D90]).choice(np.arange(1, states - 1), count, replace=False)
             for seed in seeds.tolist()]
    return torch.cat([ends, torch.as_tensor(np.stack(drawn), dtype=torch.long)], dim=1)


@torch.no_grad()
def queried_rewards(policy, scorer, traj, x0_preds: torch.Tensor, queried: torch.Tensor, keys, *,
                    sample_state: int | None, batch_size: int) -> tuple[dict[str, torch.Tensor], int]:
    """{key: [N, Q]} rewards of the queried states and how many images were scored: the state ``sample_state`` (the
    sample itself; None: no state is) takes the rollout's own reward; each other distinct (row, state) is decoded
    from its x̂0 (``x0_preds`` [N, S, ...]) and scored once, in batches."""
    n = x0_preds.shape[0]
    out = {key: traj.rewards[key].float().cpu()[:, None].repeat(1, queried.shape[1]) for key in keys}
    pairs = sorted({(row, state) for row, state in zip(
        torch.arange(n).repeat_interleave(queried.shape[1]).tolist(), queried.flatten().tolist())
        if state != sample_state})
    prompts, metadata, futures = traj.row_prompts, traj.row_metadata, []
    for start in range(0, len(pairs), batch_size):
        part = pairs[start:start + batch_size]
        rows, chosen = torch.tensor([r for r, _ in part]), torch.tensor([s for _, s in part])
        images = policy.decode(x0_preds[rows, chosen].to(policy.device))
        futures.append(scorer.submit(images, [prompts[r] for r in rows.tolist()],
                                     [metadata[r] for r in rows.tolist()]))
    scored = {}
    for start, future in zip(range(0, len(pairs), batch_size), futures):
        values = future.result()
        for i, pair in enumerate(pairs[start:start + batch_size]):
            scored[pair] = {key: float(values[key][i]) for key in keys}
    for row in range(n):
        for q, state in enumerate(queried[row].tolist()):
            if state != sample_state:
                for key in keys:
                    out[key][row, q] = scored[(row, state)][key]
    return out, len(pairs)
