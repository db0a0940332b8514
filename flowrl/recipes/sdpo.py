"""SDPO's pair objective in recipe grpo (``train.loss: sdpo``). The math is :mod:`flowrl.algorithms.sdpo` (the
reference repository and commit are named there); its dense-reward credit (``train.credit: sdpo``) is
:func:`flowrl.algorithms.credit.sdpo_credit`.

Objective: the rows of a group are paired two by two, and the rollout gives both members of a pair the same
initial noise (``pairs_share_noise``). Each pair trains its steps in its own shuffled order: position ``j`` of
every pair's order is one optimizer step per chunk of pairs, as the reference runs ``for j: for batch:
step``. Each step's advantage comes from the credit rule; SDPO's own scores the clean latent predicted at the
state the step starts from, so the two rows of a pair share step 0's reward. Each pair's loss at step ``k`` is the
squared, clipped mismatch between the difference of its members' log-ratios (weighted by ``lam**k / log_scale``)
and the difference of their advantages. ``train.timestep_fraction`` below 1 picks the trained steps per epoch for
every pair alike (the reference trains the first positions of each pair's own shuffled order).

Run: ``flowrl train configs/toy/grpo_sdpo.yaml``.
"""

from __future__ import annotations

from collections import deque

import numpy as np
import torch

from flowrl.algorithms.sdpo import (
    pair_difference_loss, temporal_weights,
)
from flowrl.sampling import sde_step
from flowrl.training.accumulate import micro_batch
from flowrl.training.stats import StatsAccumulator


# --- objective: the pair difference loss over shuffled steps ---------------------------------------------------

def group_pairs(group_ids: torch.Tensor) -> torch.Tensor:
    """[P, 2] rows paired two by two inside each group, in row order: the rows the rollout gave one noise."""
    groups = group_ids.cpu()
    pairs = [rows.view(-1, 2) for g in dict.fromkeys(groups.tolist()) for rows in [(groups == g).nonzero()[:, 0]]]
    return torch.cat(pairs)


class SdpoPairs:
    """``train.loss: sdpo``: the GRPO recipe's objective for SDPO's dense reward difference loss (module doc), with
    the interface of :class:`~flowrl.recipes.objectives.TransitionObjective`; it trains on the per-step advantages
    [N, K] the credit rule gives (SDPO's own with ``train.credit: sdpo``)."""

    own_split_noise = False
    store_means = False
    backs_up_edges = True
    pairs_share_noise = True  # the two rows of a pair start from the same noise
    trains_last_step = True  # the reference trains every step, the last included

    def __init__(self, run, traj, columns: list[int], noise_levels: list[float], rewards: torch.Tensor,
                 advantages: torch.Tensor, mask: torch.Tensor):
        self.run, self.traj, self.columns, self.levels = run, traj, columns, noise_levels
        self.advantages, self.mask = advantages, mask  # [N, K] each step's, and the steps that train
        self.t, self.kind = run.cfg.train, run.cfg.sampling.kind
        self.pairs = group_pairs(traj.group_ids)  # [P, 2]
        self.weights = temporal_weights(traj.num_stored_steps, self.t.sdpo_lam, self.t.sdpo_log_scale)  # [K]
        self.plan: deque = deque()  # (pairs [B], position) of each chunk, in the order the recipe trains them
        self.steps = torch.zeros(len(self.pairs), len(columns), dtype=torch.long)  # [P, S] each pair's step order

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
        return float(self.advantages.abs()[self.mask].mean()) if self.mask.any() else 0.0

    def backward(self, rows: torch.Tensor, stats: StatsAccumulator, *, on_policy: bool, transitions=None) -> None:
        """Accumulate one chunk's gradient: each of its pairs at the step its shuffled order puts at this chunk's
        position, the loss averaged over the pairs of every process; ``transitions`` is not used."""
        run, accelerator, shards, mask = self.run, self.run.accelerator, self.run.shards, self.mask
        pairs, position = self.plan.popleft()
        columns = self.steps[pairs, position]  # [B] index into self.columns
        members = self.pairs[pairs]  # [B, 2]
        keep = torch.tensor([bool(mask[m, self.columns[c]].all()) for m, c in zip(members, columns.tolist())],
                            dtype=torch.bool)
        pairs, columns, members = pairs[keep], columns[keep], members[keep]
        total = shards.reduce(torch.tensor(float(len(pairs)), device=shards.device), "sum").item()  # each pair once
        scale = shards.gradient_scale / max(total, 1.0)
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
            self.advantages[rows, k].to(device).view(shape),
            self.weights[k].to(device, torch.float32).expand(len(members)), clip_range=self.t.clip_range)
        ones = torch.full((len(members),), weight, device=device)
        for name, values in (("loss/policy", loss), ("loss/total", loss), ("policy/ratio", loss_stats["ratio"].mean(1)),
                             ("policy/clipfrac", loss_stats["clipped"]), ("policy/approx_kl", loss_stats["approx_kl"])):
            stats.add(name, values.detach(), ones)
        if on_policy:
            stats.add_scalar("policy/onpolicy_ratio_maxdev", float((loss_stats["ratio"] - 1).abs().max()),
                             reduce="max")
        return loss
