"""What recipe grpo trains on one epoch's rollouts (``train.loss``): every stored transition on its own step's
advantage (any per-transition policy loss of :data:`flowrl.algorithms.losses.POLICY_LOSSES`), TMPO's whole tree
paths (:class:`~flowrl.recipes.tmpo_paths.TmpoPaths`) or SDPO's pairs of rows that share their initial noise
(:class:`~flowrl.recipes.sdpo.SdpoPairs`).

An objective is built per epoch from the rollouts, the trained stored steps and their noise levels, the rows'
combined rewards R [N] (NaN: unscored), and the per-step advantages and mask [N, K] the credit rule gave. It
tells the rollout what to keep (``store_means``, ``pairs_share_noise``, ``own_split_noise``), splits the
epoch's rows into optimizer steps (``chunks``) and accumulates each step's gradient (``backward``).
"""

from __future__ import annotations

import numpy as np
import torch

from flowrl.recipes.sdpo import SdpoPairs
from flowrl.recipes.tmpo_paths import TmpoPaths
from flowrl.training.stats import StatsAccumulator


class TransitionObjective:
    """A per-transition policy loss: the loss of each stored transition on its step's advantage, the recipe's
    transition update (:func:`flowrl.algorithms.transition.transition_loss`), tree edges backed up by
    ``sampling.tree.backup``."""

    own_split_noise = False  # tree splits draw BranchGRPO's scaled split noise
    store_means = False  # the rollout's step means are not needed (ratio_norm grpo_guard asks for them itself)
    backs_up_edges = True  # tree edges train on sampling.tree.backup's advantages
    pairs_share_noise = False  # rows draw their own initial noise (SDPO's pairs share theirs)
    trains_last_step = False  # a full-SDE rollout's last, near-clean step is not trained (Flow-GRPO)

    def __init__(self, run, traj, columns: list[int], noise_levels: list[float], rewards: torch.Tensor,
                 advantages: torch.Tensor | None = None, mask: torch.Tensor | None = None):
        pass  # everything it needs is the recipe's per-transition update

    def chunks(self, order: np.ndarray, count: int) -> list[np.ndarray]:
        """Rows of the epoch in ``count`` chunks, one optimizer step each."""
        return np.array_split(order, count)

    def backward(self, chunk: torch.Tensor, stats: StatsAccumulator, *, on_policy: bool, transitions) -> None:
        """Accumulate one chunk's gradient: ``transitions()``, the recipe's per-transition update."""
        transitions()

    def advantage_size(self, combined_advantages: torch.Tensor, clip: float) -> float:
        """The epoch's ``advantages/abs_mean``: the mean clipped row advantage."""
        return float(combined_advantages.clamp(-clip, clip).abs().mean())


# train.loss names with an objective of their own; every other (registered per-transition) loss trains transitions.
OBJECTIVES = {"tmpo": TmpoPaths, "sdpo": SdpoPairs}


def objective_of(loss: str) -> type:
    """The objective that trains ``train.loss``."""
    return OBJECTIVES.get(loss, TransitionObjective)
