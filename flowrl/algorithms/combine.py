"""Reward combiners: several rewards -> one advantage per row.

One signature for every combiner, registered by name:
``fn(rewards: {name: [N]}, weights: {name: w}, group_ids [N], estimator) -> (advantages [N], combined [N])``
where ``estimator(rewards [N], group_ids [N]) -> [N]`` is a configured advantage estimator.
Combiners receive per-reward signals (not a pre-summed scalar) so that methods that normalise or
balance each reward separately (GDPO, MARBLE) fit behind the same seam.
"""

from __future__ import annotations

from typing import Callable

import torch


def weighted_sum(rewards: dict[str, torch.Tensor], weights: dict[str, float], group_ids: torch.Tensor,
                 estimator: Callable) -> tuple[torch.Tensor, torch.Tensor]:
    """Early scalarisation: sum_k w_k r_k, then one advantage estimate. NaN in any reward -> NaN."""
    combined = sum(weights[name] * rewards[name].float() for name in weights)
    return estimator(combined, group_ids), combined


COMBINERS: dict[str, Callable] = {"weighted": weighted_sum}
