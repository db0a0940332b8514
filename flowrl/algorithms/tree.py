"""BranchGRPO's pruning of tree rollouts: which stored transitions still train.

Pruning cuts gradient computation, never the rollout: every leaf is sampled, scored and kept in the
:class:`~flowrl.sampling.Trajectory`, and its reward still counts in the backup of the shared edges
above it (:func:`flowrl.algorithms.branch.branch_advantages`, or ``edge_advantages`` under
``sampling.tree.backup: leaf_mean``, runs before pruning, as in BranchGRPO).
Pruning only turns entries of the loss mask off, so it composes with the first-visit mask
(``mask &= prune_mask(...)``).

- Width pruning keeps, per group, the ``keep_width`` leaves with the most extreme rewards: the
  ``keep_width - keep_width // 2`` best and the ``keep_width // 2`` worst (BranchGRPO's "best and
  worst" mode, which ranks the whole batch; here each group keeps its own extremes, since groups
  are what the advantages compare). An unkept leaf loses the transitions only it carries, i.e. its
  whole edge from the last branch point on; edges it shares with siblings still train once.
  BranchGRPO keeps the branching transition itself and prunes the steps after it; here a pruned
  child is pruned from the branch point on.
- Depth pruning drops whole steps (``pruned_steps``, placed per epoch by
  :func:`flowrl.sampling.plan.depth_pruned_steps`).
"""

from __future__ import annotations

from collections.abc import Collection

import torch


def extreme_leaves(rewards: torch.Tensor, group_ids: torch.Tensor, keep: int) -> torch.Tensor:
    """[N] bool: per group, the ``keep - keep // 2`` highest and ``keep // 2`` lowest finite rewards.

    NaN rewards ("could not score") are never kept; a group with at most ``keep`` finite rewards keeps
    them all. Ties go to the lower row index among the lowest and the higher one among the highest.
    """
    rewards, group_ids = rewards.detach().cpu().double(), group_ids.detach().cpu()
    kept = torch.zeros(rewards.shape, dtype=torch.bool)
    finite = torch.isfinite(rewards)
    best, worst = keep - keep // 2, keep // 2
    for group in torch.unique(group_ids[finite]).tolist():
        rows = torch.nonzero(finite & (group_ids == group)).flatten()  # ascending row index
        if len(rows) <= keep:
            kept[rows] = True
            continue
        order = rows[torch.sort(rewards[rows], stable=True).indices]  # lowest reward first
        kept[order[:worst]] = True
        kept[order[len(order) - best:]] = True
    return kept


def prune_mask(rewards: torch.Tensor, group_ids: torch.Tensor, edge_ids: torch.Tensor, step_indices: torch.Tensor, *,
               keep_width: int | None = None, pruned_steps: Collection[int] = ()) -> torch.Tensor:
    """[N, K] bool: False on the stored transitions that width and depth pruning leave untrained.

    ``rewards`` [N] (the combined training reward), ``group_ids`` [N], ``edge_ids`` [N, K] and
    ``step_indices`` [K] come from the trajectory; ``keep_width`` (None or 0: off) is the number of
    leaves kept per group; ``pruned_steps`` are schedule steps left untrained. An edge carried by a
    single row is that leaf's own; only those edges are width-pruned.
    """
    device, edge_ids = edge_ids.device, edge_ids.detach().cpu()
    mask = torch.ones(edge_ids.shape, dtype=torch.bool)
    if keep_width:
        kept = extreme_leaves(rewards, group_ids, keep_width)  # [N]
        for k in range(edge_ids.shape[1]):
            _, inverse, counts = torch.unique(edge_ids[:, k], return_inverse=True, return_counts=True)
            own = counts[inverse] == 1  # [N] the edge at column k belongs to this leaf alone
            mask[:, k] = ~own | kept
    pruned = set(int(s) for s in pruned_steps)
    for k, step in enumerate(step_indices.tolist()):
        if step in pruned:
            mask[:, k] = False
    return mask.to(device)  # on the device of the first-visit mask it is combined with
