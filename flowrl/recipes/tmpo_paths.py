"""TMPO's update over whole paths, for the GRPO recipe's inner loop (``train.loss: tmpo``).

The loss (:mod:`flowrl.algorithms.tmpo`) is a function of each path's log-prob, the sum of its edges' log-probs
over the trained (stochastic) steps; a shared edge belongs to every leaf below it, so its gradient is counted
once per leaf, as in the release, which recomputes every leaf's path. Here each edge is computed once and its
gradient weighted by the leaves below it, in two passes per optimizer step, so that every backward follows its
own forward (what DDP / FSDP gradient accumulation expects):

1. without gradient: every edge's current log-prob and mean, hence path log-probs, advantages, RatioNorm weights,
   the loss and its gradient ``g`` with respect to each path log-prob;
2. with gradient, in micro-batches of edges: backward of ``sum_e c_e log p_e`` with ``c_e`` the sum of ``g`` over
   the paths through edge ``e``. The gradient is exactly that of the path loss.

The rollout's step means (for RatioNorm's shift) and log-probs are the ones the rollout kept (``store_means``); a
trajectory without them gets them from one gradient-free pass before the first update. On the first chunk, before
any update, pass 1 takes them as they are. Chunks hold whole groups: the ratio is centred, and the loss averaged,
per group (the release's batch is one prompt's leaves per process).
"""

from __future__ import annotations

import numpy as np
import torch

from flowrl.algorithms.tmpo import (
    TMPO_TARGETS, cps_log_prob, path_surrogate, ratio_norm_weights, reference_term,
)
from flowrl.sampling import sde_step, transition
from flowrl.training.accumulate import micro_batch
from flowrl.training.stats import StatsAccumulator


class TmpoPaths:
    """One epoch's paths: which edges they are made of, the rollout's values, and the update (see module doc).

    The GRPO recipe's objective for ``train.loss: tmpo`` (its ``OBJECTIVES``), with the interface of the
    per-transition one: TMPO's tree splits draw the step's own noise, the rollout keeps its step means, and
    tree edges need no backup (each path is trained as a whole)."""

    own_split_noise = True
    store_means = True
    backs_up_edges = False
    pairs_share_noise = False
    trains_last_step = False

    def __init__(self, run, traj, columns: list[int], noise_levels: list[float], rewards: torch.Tensor,
                 advantages: torch.Tensor | None = None, mask: torch.Tensor | None = None):
        """``columns``: the trained stored steps (stochastic ones); ``noise_levels``: theirs; ``rewards`` [N]: R.
        The per-step ``advantages`` and ``mask`` [N, K] are not used: TMPO's targets come from R and the paths."""
        cfg = run.cfg
        self.run, self.traj, self.columns, self.levels = run, traj, columns, noise_levels
        self.kind, self.t = cfg.sampling.kind, cfg.train
        self.rewards = rewards.detach().cpu().float()  # [N]
        # Edges: one slot per distinct (column, edge id); index [N, S] gives each path's slot at each column.
        index, rows, slot_columns, offset = [], [], [], 0
        for j, k in enumerate(columns):
            ids, inverse = torch.unique(traj.edge_ids[:, k].cpu(), return_inverse=True)
            first = torch.full((len(ids),), traj.num_rows, dtype=torch.long).scatter_reduce(
                0, inverse, torch.arange(traj.num_rows), "amin")  # a row on each edge
            index.append(inverse + offset)
            rows.append(first)
            slot_columns += [j] * len(ids)
            offset += len(ids)
        self.index = torch.stack(index, dim=1)  # [N, S]
        self.edge_rows, self.edge_columns = torch.cat(rows), torch.tensor(slot_columns)  # [E], [E]
        self.stds = torch.tensor([float(transition(torch.zeros(1, 1), torch.zeros(1, 1), float(traj.sigmas[k]),
                                                   float(traj.sigmas[k + 1]), noise_level=level, kind=self.kind)[1])
                                  for k, level in zip(columns, noise_levels)])  # [S] each step's std
        every = torch.arange(offset)
        if traj.means is None:  # recomputed by the policy that sampled (no update has happened yet)
            self.old_log_probs, self.old_means = self._edges(every)  # [E], [E, ...] the rollout's
        else:  # kept by the rollout, as the release keeps them
            columns_of = torch.tensor(columns)[self.edge_columns]  # [E] stored column of each slot
            self.old_means = traj.means[self.edge_rows, columns_of].float().cpu()  # [E, ...]
            outputs = traj.latents[self.edge_rows, columns_of + 1]
            self.old_log_probs = cps_log_prob(outputs, self.old_means) if self.kind == "cps" else \
                traj.log_probs[self.edge_rows, columns_of].float().cpu()
        self.reference = self.old_log_probs
        if self.t.tmpo_reference == "base":
            with run.policy.reference():
                self.reference = self._edges(every)[0]
        self.old_paths, self.reference_paths = self._paths(self.old_log_probs), self._paths(self.reference)  # [N]
        self.advantage_abs_mean = float(self._targets(self.old_paths).abs().mean())

    def _paths(self, edge_values: torch.Tensor) -> torch.Tensor:
        return edge_values[self.index].sum(dim=1)  # [N]

    def _targets(self, path_log_probs: torch.Tensor) -> torch.Tensor:
        groups = self.traj.group_ids.cpu()
        return TMPO_TARGETS[self.t.tmpo_target](path_log_probs, self.rewards, groups, beta=self.t.tmpo_beta)

    def _edge_step(self, slots: torch.Tensor):
        """(log-probs [B], means [B, ...]) of edges ``slots`` (one column) under the current weights."""
        run, traj = self.run, self.traj
        j = int(self.edge_columns[slots[0]])
        k, rows = self.columns[j], self.edge_rows[slots]
        device = run.accelerator.device
        x, x_next = traj.latents[rows, k].to(device), traj.latents[rows, k + 1].to(device)
        sigma, sigma_next = traj.sigmas[k].item(), traj.sigmas[k + 1].item()
        with run.accelerator.autocast():
            velocity = run.policy.velocity(x, sigma, traj.cond.select(traj.prompt_ids[rows]), run.guidance)
        step = sde_step(velocity, x, sigma, sigma_next, noise_level=self.levels[j], kind=self.kind, prev_sample=x_next)
        log_probs = cps_log_prob(x_next, step.mean) if self.kind == "cps" else step.log_prob
        return log_probs, step.mean

    def _batches(self, slots: torch.Tensor) -> list[torch.Tensor]:
        """``slots`` split by column, then into micro-batches."""
        return [part for j in self.edge_columns[slots].unique().tolist()
                for part in slots[self.edge_columns[slots] == j].split(self.t.micro_batch_size)]

    @torch.no_grad()
    def _edges(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Gradient-free log-probs [E] and means [E, ...] (CPU; zero outside ``slots``)."""
        log_probs, means = torch.zeros(len(self.edge_rows)), None
        with self.run.policy.local_forward():
            for part in self._batches(slots):
                lp, mean = self._edge_step(part)
                log_probs[part] = lp.float().cpu()
                if means is None:
                    means = torch.zeros(len(self.edge_rows), *mean.shape[1:])
                means[part] = mean.float().cpu()
        return log_probs, means

    def chunks(self, order: np.ndarray, count: int) -> list[np.ndarray]:
        """Rows of whole groups in ``count`` chunks; groups in the order their rows first appear in ``order``."""
        groups = self.traj.group_ids.cpu().numpy()
        _, first = np.unique(groups[order], return_index=True)
        ordered = groups[order][np.sort(first)]
        return [np.flatnonzero(np.isin(groups, part)) for part in np.array_split(ordered, count)]

    def advantage_size(self, combined_advantages: torch.Tensor, clip: float) -> float:
        """The epoch's ``advantages/abs_mean``: the mean absolute TMPO target of the rollout's paths."""
        return self.advantage_abs_mean

    def backward(self, rows: torch.Tensor, stats: StatsAccumulator, *, on_policy: bool, transitions=None) -> None:
        """Accumulate the gradient of the mean group loss of the groups of ``rows`` (one optimizer step's chunk);
        ``transitions``, the recipe's per-transition update, is not used (unscored rows are left out by their
        reward)."""
        run, t, accelerator, shards = self.run, self.t, self.run.accelerator, self.run.shards
        rows = rows[torch.isfinite(self.rewards[rows])]
        slots = self.index[rows].flatten().unique()
        if on_policy:
            current, current_means = self.old_log_probs, self.old_means
        else:
            current, current_means = self._edges(slots)
        groups = self.traj.group_ids.cpu()[rows]
        weight = shards.reduce(torch.tensor(float(groups.unique().numel()), device=shards.device), "sum")  # once
        scale = shards.gradient_scale / max(float(weight), 1.0)
        paths = self._paths(current)
        advantages = self._targets(paths)  # [N], from the current path log-probs, as the release recomputes them
        dims = tuple(range(1, current_means.ndim))
        shifts = ((current_means - self.old_means) ** 2).mean(dim=dims)  # [E]
        gradient = torch.zeros(self.traj.num_rows)
        for group in groups.unique().tolist():
            members = rows[groups == group]
            edges = self.index[members]  # [K, S]
            weights = ratio_norm_weights(current[edges] - self.old_log_probs[edges], shifts[edges], self.stds,
                                         clip=t.tmpo_clip_range)
            path = paths[members].clone().requires_grad_(True)
            surrogate, ratio_stats = path_surrogate(path, self.old_paths[members], advantages[members], weights,
                                                    clip=t.tmpo_clip_range)
            regulariser = reference_term(path, self.reference_paths[members], len(self.columns))
            total = surrogate + t.tmpo_ref_weight * regulariser  # [K]
            (gradient[members],) = torch.autograd.grad(total.mean(), path)
            ones = torch.ones(len(members))
            for name, values in (("loss/policy", surrogate), ("loss/reference", regulariser), ("loss/total", total),
                                 ("policy/ratio", ratio_stats["ratio"]), ("policy/clipfrac", ratio_stats["clipped"]),
                                 ("policy/approx_kl", ratio_stats["approx_kl"]), ("policy/ratio_norm_weight", weights),
                                 ("advantages/tmpo_abs", advantages[members].abs())):
                stats.add(name, values.detach(), ones / len(members))
            if on_policy:
                stats.add_scalar("policy/onpolicy_ratio_maxdev", (ratio_stats["ratio"] - 1).abs().max(),
                                 reduce="max")
        coefficients = torch.zeros(len(self.edge_rows)).index_add_(
            0, self.index[rows].flatten(), gradient[rows].repeat_interleave(len(self.columns)))  # [E]
        batches = self._batches(slots)
        for i, part in enumerate(batches):
            with micro_batch(accelerator, run.policy.forward_module, last=i == len(batches) - 1):
                log_probs, _ = self._edge_step(part)
                accelerator.backward((coefficients[part].to(log_probs) * log_probs).sum() * scale)
