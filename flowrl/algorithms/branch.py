"""BranchGRPO's tree advantages: per-depth z-scores of the mean leaf reward under each tree edge.

Reference: ``Fredreic1849/BranchGRPO``, ``fastvideo/train_branchgrpo_flux.py`` at commit 19fbb9fc
(``compute_node_rewards_from_leaves``, ``compute_hierarchical_advantages_by_depth`` and the tree branch of
``train_one_step_tree``, the path its shipped script ``scripts/finetune/finetune_flux_branchgrpo_8gpus.sh``
runs: no ``--use_group``, no ``--tree_prob_weighted``). There:

1. a leaf's reward is its image's reward; an inner node's is the plain mean of the rewards of all the
   leaves below it;
2. within each tree (one per prompt), the nodes of each depth (one level per denoising step) are
   z-scored against each other: ``(r - mean) / (std + 1e-8)`` with the unbiased std; a depth holding a
   single node, or whose rewards have std < 1e-6, gets 0 everywhere. The leaves are the deepest level,
   so they are normalised by the same rule, within their tree;
3. the transition from a node to its child trains on the child's advantage, clipped to +-5
   (``adv_clip_max``), each tree edge once.

In flowrl a node at depth ``k + 1`` is an edge of stored column ``k`` (the rows sharing an edge id are the
leaves below it) and a tree is the set of rows descending from one root row (``Trajectory.parent``).

What the z-score is taken of: the recipe passes the rows' advantages from the configured estimator and
reward combiner instead of raw rewards. Every estimator is a positive affine map of the reward within a
group, and a tree lies inside one group, so with one reward (or a weighted sum) the z-scores are the
reference's up to the estimator's eps (a relative 1e-8); it also lets GDPO's per-reward normalisation act
before the tree backup. Deliberate differences: the ``std < 1e-6`` "flat depth" test then acts on that
scale rather than the raw reward's; and a leaf that could not be scored (NaN) is left out of the means and
statistics (the reference has no such leaf).
"""

from __future__ import annotations

import torch


def tree_roots(parent: torch.Tensor) -> torch.Tensor:
    """[N] long: the root row of each row's tree, following ``parent`` [N] (-1 at a root) upwards."""
    parent = parent.detach().cpu().long()
    root = torch.arange(parent.numel())
    while True:
        up = parent[root]
        climbed = torch.where(up >= 0, up, root)
        if torch.equal(climbed, root):
            return root
        root = climbed


def depth_standardised_advantages(leaf_values: torch.Tensor, edge_ids: torch.Tensor, tree_ids: torch.Tensor, *,
                                  eps: float = 1e-8, min_std: float = 1e-6) -> torch.Tensor:
    """[N, K] float32 BranchGRPO edge advantages from ``leaf_values`` [N] (NaN: unscored, left out).

    Per stored column ``k`` and per tree (``tree_ids`` [N], equal id: same tree), each edge (``edge_ids``
    [N, K]) gets the mean value of its finite leaves, and the edges of the tree are z-scored with the unbiased
    std plus ``eps``; a tree with fewer than two scored edges in the column, or a std under ``min_std``, gives
    0. Every row carrying an edge gets that edge's advantage.
    """
    values = leaf_values.detach().cpu().double()
    finite = torch.isfinite(values)
    values = torch.where(finite, values, torch.zeros_like(values))
    _, tree = torch.unique(tree_ids.detach().cpu(), return_inverse=True)  # [N] trees numbered 0..T-1
    num_trees = int(tree.max()) + 1
    out = torch.zeros(edge_ids.shape, dtype=torch.float64)
    for k in range(edge_ids.shape[1]):
        _, edge = torch.unique(edge_ids[:, k].detach().cpu(), return_inverse=True)  # [N] edges numbered 0..E-1
        num_edges = int(edge.max()) + 1
        scored = torch.zeros(num_edges, dtype=torch.float64).index_add_(0, edge, finite.double())  # [E]
        node = torch.zeros(num_edges, dtype=torch.float64).index_add_(0, edge, values) / scored.clamp(min=1)
        has_value = scored > 0
        edge_tree = torch.zeros(num_edges, dtype=torch.long).scatter_(0, edge, tree)  # [E] an edge lies in one tree
        count = torch.zeros(num_trees, dtype=torch.float64).index_add_(0, edge_tree, has_value.double())  # [T]
        mean = torch.zeros(num_trees, dtype=torch.float64).index_add_(
            0, edge_tree, torch.where(has_value, node, 0.0)) / count.clamp(min=1)
        deviation = torch.where(has_value, node - mean[edge_tree], 0.0)  # [E]
        std = (torch.zeros(num_trees, dtype=torch.float64).index_add_(0, edge_tree, deviation**2)
               / (count - 1).clamp(min=1)).sqrt()  # [T] unbiased, as torch.std
        flat = (count < 2) | (std < min_std)  # [T] one node at this depth, or all alike: no signal
        z = torch.where(flat[edge_tree] | ~has_value, 0.0, deviation / (std[edge_tree] + eps))  # [E]
        out[:, k] = z[edge]
    return out.float()


def branch_advantages(row_advantages: torch.Tensor, scored: torch.Tensor, edge_ids: torch.Tensor,
                      parent: torch.Tensor, *, clip: float) -> torch.Tensor:
    """[N, K] the edge advantages GRPO trains tree rollouts on by default (``sampling.tree.backup``):
    :func:`depth_standardised_advantages` of the rows' unclipped advantages [N] (``scored`` [N] bool: rows
    with a finite reward), per tree of ``parent`` [N], then clipped to +-``clip`` as BranchGRPO clips them."""
    leaves = torch.where(scored.cpu(), row_advantages.detach().cpu().double(), float("nan"))
    return depth_standardised_advantages(leaves, edge_ids, tree_roots(parent)).clamp(-clip, clip)
