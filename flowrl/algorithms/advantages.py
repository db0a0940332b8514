"""Advantage estimators: rewards [N] + explicit group ids [N] -> advantages [N].

Every estimator is a plain function with one signature, registered by name:
``fn(rewards, group_ids, *, std_scope, eps) -> Tensor[N]``.

- ``grpo``: ``(r - mean_group) / (std + eps)``; ``std_scope="global"`` (Flow-GRPO's default)
  divides by the std of the whole batch, ``"group"`` by each group's own std.
- ``mean``: ``r - mean_group`` (no scaling; Dr.GRPO-style).

A NaN reward means "could not score": NaN rows are left out of every statistic and get
advantage 0 (the recipe also masks them out of the loss). Tree rollouts then lift row (leaf)
advantages to per-step edge advantages: BranchGRPO's per-depth z-scores (:mod:`flowrl.algorithms.branch`)
or the mean over the leaves below each edge (:func:`edge_advantages`).
"""

from __future__ import annotations

import math
from typing import Callable

import torch

AdvantageFn = Callable[..., torch.Tensor]


def _group_stats(rewards: torch.Tensor, group_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row mean and (population) std of the finite rewards of its group -> ([N], [N])."""
    finite = torch.isfinite(rewards)
    values = torch.where(finite, rewards, torch.zeros_like(rewards)).double()
    _, inverse = torch.unique(group_ids, return_inverse=True)
    groups = int(inverse.max()) + 1 if inverse.numel() else 0
    count = torch.zeros(groups, dtype=torch.float64).index_add_(0, inverse, finite.double())
    total = torch.zeros(groups, dtype=torch.float64).index_add_(0, inverse, values)
    mean = total / count.clamp(min=1)
    squared = torch.zeros(groups, dtype=torch.float64).index_add_(0, inverse, finite.double() * (values - mean[inverse]) ** 2)
    std = (squared / count.clamp(min=1)).sqrt()
    return mean[inverse], std[inverse]


def grpo_advantages(rewards, group_ids, *, std_scope: str = "global", eps: float = 1e-4) -> torch.Tensor:
    mean, group_std = _group_stats(rewards, group_ids)
    finite = torch.isfinite(rewards)
    if std_scope == "global":
        std = rewards[finite].double().std(unbiased=False) if finite.any() else torch.tensor(0.0, dtype=torch.float64)
    elif std_scope == "group":
        std = group_std
    else:
        raise ValueError(f"unknown std_scope {std_scope!r}; use global or group")
    advantages = (rewards.double() - mean) / (std + eps)
    return torch.where(finite, advantages, torch.zeros_like(advantages)).float()


def mean_advantages(rewards, group_ids, *, std_scope: str = "global", eps: float = 1e-4) -> torch.Tensor:
    mean, _ = _group_stats(rewards, group_ids)
    finite = torch.isfinite(rewards)
    return torch.where(finite, rewards.double() - mean, torch.zeros_like(mean)).float()


ADVANTAGE_ESTIMATORS: dict[str, AdvantageFn] = {"grpo": grpo_advantages, "mean": mean_advantages}


def group_variances(rewards: torch.Tensor, group_ids: torch.Tensor, num_groups: int) -> torch.Tensor:
    """[num_groups] float64 population variance of each group's finite rewards ``rewards [N]`` (ids in
    ``[0, num_groups)``); exactly 0 where they are all equal or fewer than two (NaN means "could not
    score", never a value), so a flat group is told apart without a float threshold."""
    rewards, group_ids = rewards.detach().cpu().double(), group_ids.detach().cpu().long()
    variances = torch.zeros(num_groups, dtype=torch.float64)
    for g in range(num_groups):
        values = rewards[(group_ids == g) & torch.isfinite(rewards)]
        if values.numel() >= 2 and bool(values.max() != values.min()):
            variances[g] = values.var(unbiased=False)
    return variances


def zero_std_fraction(rewards: torch.Tensor, group_ids: torch.Tensor, *, tol: float | None = None) -> float:
    """Fraction of the groups (``group_ids`` [N]) whose rewards ``rewards`` [N] do not vary: their
    group-normalised advantages are 0, so their rollouts teach GRPO nothing. Range [0, 1], lower is better.

    Two rules, for two questions, chosen by ``tol``:

    - ``tol=None`` (training's ``policy/zero_std_groups``: which of this batch's groups give no gradient):
      a group is flat when its finite rewards are exactly equal, or fewer than two (no float threshold,
      as :func:`group_variances`); every group counts, 0.0 without rows.
    - ``tol`` a float (``flowrl eval``'s ``diversity/zero_std_prompts``: has the model collapsed to one
      answer per prompt): a group is flat when the population std of its non-NaN rewards is <= tol, so
      near-ties count too; a group with fewer than two such rewards has no spread to measure and is left
      out, an infinite reward makes the std NaN (not flat); NaN when no group is left.
    """
    if tol is None:
        if not group_ids.numel():
            return 0.0
        _, inverse = torch.unique(group_ids, return_inverse=True)
        return float((group_variances(rewards, inverse, int(inverse.max()) + 1) == 0).double().mean())
    rewards = rewards.detach().double().reshape(-1)  # [N]
    group_ids = torch.as_tensor(group_ids, device=rewards.device)
    flat, counted = 0, 0
    for group in torch.unique(group_ids):
        values = rewards[group_ids == group]
        values = values[~values.isnan()]
        if len(values) < 2:
            continue
        counted += 1
        flat += int(float(values.std(correction=0)) <= tol)
    return flat / counted if counted else math.nan


def edge_advantages(row_advantages: torch.Tensor, edge_ids: torch.Tensor) -> torch.Tensor:
    """[N] leaf advantages -> [N, K]: each tree edge gets the mean advantage of the leaves below it.

    Tree rollouts use it under ``sampling.tree.backup: leaf_mean``; BranchGRPO's default standardises each
    depth instead (:mod:`flowrl.algorithms.branch`), since this mean shrinks a shared edge's signal by how
    much its subtrees' rewards cancel (16 leaves split at steps 0/3/6/9: mean |A| 0.21 on the first edge,
    0.71 under BranchGRPO's backup).

    Rows sharing an edge id at step k are exactly the leaves under that edge, so averaging over them
    is the backup "an inner node's advantage is the mean of its children's" (balanced trees).
    Without a tree every edge belongs to one row and this is a broadcast.
    """
    out = torch.empty(edge_ids.shape, dtype=row_advantages.dtype, device=row_advantages.device)
    for k in range(edge_ids.shape[1]):
        _, inverse = torch.unique(edge_ids[:, k], return_inverse=True)
        groups = int(inverse.max()) + 1
        total = torch.zeros(groups, dtype=row_advantages.dtype).index_add_(0, inverse, row_advantages)
        count = torch.zeros(groups, dtype=row_advantages.dtype).index_add_(0, inverse, torch.ones_like(row_advantages))
        out[:, k] = (total / count)[inverse]
    return out
