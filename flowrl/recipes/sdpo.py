"""SDPO in recipe grpo: its dense-reward credit (``train.credit: sdpo``) and its pair objective (``train.loss:
sdpo``). The math is :mod:`flowrl.algorithms.sdpo` (the reference repository and commit are named there).

Credit: the rollout keeps every step's predicted clean latent (``store_x0_preds``); the state each step leads to
is scored on its x̂0 for the first step, ``sdpo_queries - 2`` anchors and the last step (the sample itself, whose
reward the rollout already has), in batches through the run's scorer; the other steps' rewards are predicted by
latent similarity, discounted into returns and normalised per step over each prompt's group (every process's
returns gathered, as the terminal rewards are).

Objective: the rows of a group are paired two by two, and the rollout gives both members of a pair the same
initial noise (``pairs_share_noise``). Each pair trains its steps in its own shuffled order: position ``j`` of
every pair's order is one optimizer step per chunk of pairs, as the reference runs ``for j: for batch:
step``. Each pair's loss at step ``k`` is the squared, clipped mismatch between the difference of its members'
log-ratios (weighted by ``lam**k / log_scale``) and the difference of their advantages. ``train.timestep_fraction``
below 1 picks the trained steps per epoch for every pair alike (the reference trains the first positions of each
pair's own shuffled order).

Run: ``flowrl train configs/toy/grpo_sdpo.yaml``.
"""

from __future__ import annotations

import time
from collections import deque
from functools import partial

import numpy as np
import torch

from flowrl.algorithms.combine import COMBINERS
from flowrl.algorithms.dense import stepwise_advantages
from flowrl.algorithms.sdpo import (
    cosine_similarities, discounted_returns, least_similar_anchors, pair_difference_loss, predicted_rewards,
    temporal_weights,
)
from flowrl.sampling import sde_step
from flowrl.training.accumulate import micro_batch
from flowrl.training.stats import StatsAccumulator


# --- credit: dense rewards from a few queried clean predictions ------------------------------------------------

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
                    batch_size: int) -> tuple[dict[str, torch.Tensor], int]:
    """{key: [N, Q]} rewards of the queried states and how many images were scored: the last state's is the
    rollout's own reward; each other distinct (row, state) is decoded from its x̂0 and scored once, in batches."""
    n, states = x0_preds.shape[:2]
    out = {key: traj.rewards[key].float().cpu()[:, None].repeat(1, queried.shape[1]) for key in keys}
    pairs = sorted({(row, state) for row, state in zip(
        torch.arange(n).repeat_interleave(queried.shape[1]).tolist(), queried.flatten().tolist())
        if state != states - 1})
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
            if state != states - 1:
                for key in keys:
                    out[key][row, q] = scored[(row, state)][key]
    return out, len(pairs)


def sdpo_credit(inputs, mask: torch.Tensor, stats: StatsAccumulator) -> torch.Tensor:
    """train.credit sdpo: each step's advantage from its discounted dense return, normalised per step over its
    group; the dense rewards are queried at a few states and predicted by latent similarity at the others. A row
    with a reward that could not be scored trains nothing."""
    run, traj, t = inputs.run, inputs.traj, inputs.run.cfg.train
    start = time.perf_counter()
    x0 = traj.x0_preds[:, 1:].cpu()  # [N, K, ...] the x̂0 of the state each step leads to; the last: the sample
    queried = query_states(x0, t.sdpo_queries, t.sdpo_anchor, traj.seeds)  # [N, Q]
    keys = list(run.weights)
    with run.policy.local_forward():
        rewards, count = queried_rewards(run.policy, inputs.scorer, traj, x0, queried, keys,
                                         batch_size=inputs.batch_size)
    similarities = cosine_similarities(x0, queried)  # [N, K, Q]
    accelerator = run.accelerator
    returns = {key: accelerator.gather(discounted_returns(predicted_rewards(rewards[key], similarities, queried),
                                                          t.sdpo_gamma).float().to(accelerator.device)).cpu()
               for key in keys}  # {key: [N_all, K]}
    advantages, combined = stepwise_advantages(returns, run.weights, inputs.all_groups, COMBINERS[t.combine],
                                               partial(inputs.estimator, std_scope=t.std_scope),
                                               clip=t.advantage_clip)
    traj.advantages = advantages[inputs.local]  # [N, K]
    mask &= torch.isfinite(combined[inputs.local]).all(dim=1, keepdim=True)
    stats.add("reward/sdpo_return_mean", combined[inputs.local].nan_to_num().flatten(), mask.flatten().float())
    stats.add_scalar("perf/sdpo_queried_images", float(count))  # images scored for the credit, per process
    stats.add_scalar("perf/sdpo_credit_s", time.perf_counter() - start, reduce="max")
    return mask


# --- objective: the pair difference loss over shuffled steps ---------------------------------------------------

def group_pairs(group_ids: torch.Tensor) -> torch.Tensor:
    """[P, 2] rows paired two by two inside each group, in row order: the rows the rollout gave one noise."""
    groups = group_ids.cpu()
    pairs = [rows.view(-1, 2) for g in dict.fromkeys(groups.tolist()) for rows in [(groups == g).nonzero()[:, 0]]]
    return torch.cat(pairs)


class SdpoPairs:
    """``train.loss: sdpo``: the GRPO recipe's objective for SDPO's dense reward difference loss (module doc), with
    the interface of :class:`~flowrl.recipes.grpo.TransitionObjective`; it reads the per-step advantages the credit
    rule leaves in ``traj.advantages`` [N, K] (SDPO's own with ``train.credit: sdpo``)."""

    own_split_noise = False
    store_means = False
    backs_up_edges = True
    pairs_share_noise = True  # the two rows of a pair start from the same noise
    trains_last_step = True  # the reference trains every step, the last included

    def __init__(self, run, traj, columns: list[int], noise_levels: list[float], rewards: torch.Tensor):
        self.run, self.traj, self.columns, self.levels = run, traj, columns, noise_levels
        self.t, self.kind = run.cfg.train, run.cfg.sampling.kind
        self.pairs = group_pairs(traj.group_ids)  # [P, 2]
        self.weights = temporal_weights(traj.num_stored_steps, self.t.sdpo_lam, self.t.sdpo_log_scale)  # [K]
        self.plan: deque = deque()  # (pairs [B], position) of each chunk, in the order the recipe trains them
        self.steps = torch.zeros(len(self.pairs), len(columns), dtype=torch.long)  # [P, S] each pair's step order
        self.mask = None  # [N, K] the steps that train, as the recipe passes it

    def chunks(self, order: np.ndarray, count: int) -> list[np.ndarray]:
        """Rows of whole pairs: for each position of the pairs' shuffled step orders, the pairs (in the order
        their first row appears in ``order``) in ``count`` chunks; one optimizer step each."""
        pair_of = torch.empty(self.traj.num_rows, dtype=torch.long)
        pair_of[self.pairs.flatten()] = torch.arange(len(self.pairs)).repeat_interleave(2)
        _, first = np.unique(pair_of[order].numpy(), return_index=True)
        ordered = pair_of[order].numpy()[np.sort(first)]  # pairs by first appearance
        rng = np.random.default_rng([int(self.run.cfg.seed), 0x5D91, *order.tolist()])
        self.steps = torch.as_tensor(np.stack([rng.permutation(len(self.columns)) for _ in range(len(self.pairs))]))
        out, self.plan = [], deque()
        for position in range(len(self.columns)):
            for part in np.array_split(ordered, count):
                self.plan.append((torch.as_tensor(part, dtype=torch.long), position))
                out.append(self.pairs[torch.as_tensor(part, dtype=torch.long)].flatten().numpy())
        return out

    def advantage_size(self, combined_advantages: torch.Tensor, clip: float) -> float:
        """The epoch's ``advantages/abs_mean``: the mean |per-step advantage| over the trained steps."""
        mask = self.mask if self.mask is not None else torch.ones_like(self.traj.advantages, dtype=torch.bool)
        return float(self.traj.advantages.abs()[mask].mean()) if mask.any() else 0.0

    def backward(self, rows: torch.Tensor, stats: StatsAccumulator, *, on_policy: bool, transitions=None,
                 mask: torch.Tensor) -> None:
        """Accumulate one chunk's gradient: each of its pairs at the step its shuffled order puts at this chunk's
        position, the loss averaged over the pairs of every process; ``transitions`` is not used."""
        run, traj, accelerator = self.run, self.traj, self.run.accelerator
        self.mask = mask
        pairs, position = self.plan.popleft()
        columns = self.steps[pairs, position]  # [B] index into self.columns
        members = self.pairs[pairs]  # [B, 2]
        keep = torch.tensor([bool(mask[m, self.columns[c]].all()) for m, c in zip(members, columns.tolist())],
                            dtype=torch.bool)
        pairs, columns, members = pairs[keep], columns[keep], members[keep]
        total = accelerator.reduce(torch.tensor(float(len(pairs)), device=accelerator.device), "sum").item()
        scale = accelerator.num_processes / max(total, 1.0)
        per_batch = max(1, self.t.micro_batch_size // 2)
        work = []  # (pairs [b, 2], column, weight): every process makes as many model calls per column (FSDP
        for c in range(len(self.columns)):  # gathers weights in each), padding with a weight-0 pair
            local = [part for part in members[columns == c].split(per_batch) if len(part)]
            most = int(accelerator.reduce(torch.tensor(len(local), device=accelerator.device), "max").item())
            work += [(part, c, 1.0) for part in local] + [(self.pairs[:1], c, 0.0)] * (most - len(local))
        for i, (part, c, weight) in enumerate(work):
            with micro_batch(accelerator, run.policy.forward_module, last=i == len(work) - 1):
                loss = self._pair_loss(part, c, stats, on_policy and weight > 0, weight)
                accelerator.backward(loss.sum() * scale * weight)

    def _pair_loss(self, members: torch.Tensor, c: int, stats: StatsAccumulator, on_policy: bool,
                   weight: float = 1.0) -> torch.Tensor:
        """Loss [B] of pairs ``members`` [B, 2] at trained column ``self.columns[c]``; ``weight`` 0: a padding
        call, left out of the statistics."""
        run, traj, device = self.run, self.traj, self.run.accelerator.device
        k, rows = self.columns[c], members.flatten()  # rows [2B]: pair members side by side
        x, x_next = traj.latents[rows, k].to(device), traj.latents[rows, k + 1].to(device)
        sigma, sigma_next = traj.row_sigmas[rows[0], k].item(), traj.row_sigmas[rows[0], k + 1].item()
        with run.accelerator.autocast():
            velocity = run.policy.velocity(x, sigma, traj.cond.select(traj.prompt_ids[rows]), run.guidance)
        step = sde_step(velocity, x, sigma, sigma_next, noise_level=self.levels[c], kind=self.kind, prev_sample=x_next)
        shape = (len(members), 2)
        loss, loss_stats = pair_difference_loss(
            step.log_prob.view(shape), traj.log_probs[rows, k].to(device).view(shape),
            traj.advantages[rows, k].to(device).view(shape),
            self.weights[k].to(device, torch.float32).expand(len(members)), clip_range=self.t.clip_range)
        ones = torch.full((len(members),), weight, device=device)
        for name, values in (("loss/policy", loss), ("loss/total", loss), ("policy/ratio", loss_stats["ratio"].mean(1)),
                             ("policy/clipfrac", loss_stats["clipped"]), ("policy/approx_kl", loss_stats["approx_kl"])):
            stats.add(name, values.detach(), ones)
        if on_policy:
            stats.add_scalar("policy/onpolicy_ratio_maxdev", float((loss_stats["ratio"] - 1).abs().max()),
                             reduce="max")
        return loss
