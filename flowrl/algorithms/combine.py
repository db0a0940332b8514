"""Reward combiners: several rewards -> one advantage per row.

One signature for every combiner, registered by name:
``fn(rewards: {name: [N]}, weights: {name: w}, group_ids [N], estimator) -> (advantages [N], combined [N])``
where ``estimator(rewards [N], group_ids [N]) -> [N]`` is a configured advantage estimator.
Combiners receive per-reward signals (not a pre-summed scalar) so that methods that normalise or
balance each reward separately (GDPO, MARBLE) fit behind the same seam. ``combined`` is always the
weighted sum of the raw rewards (NaN where any is NaN): what the run logs and masks by.

- ``weighted``: early scalarisation, one advantage of ``sum_k w_k r_k``.
- ``gdpo`` (GDPO): each reward z-scored within its group on its own, so a reward with a wide spread
  cannot drown a narrow one; the weighted sum of those is normalised over the batch.
- ``marble``: the weighted sum of the per-reward advantages (:func:`reward_advantages`) at the
  configured weights. The recipes replace those weights by MARBLE's gradient balancing
  (:mod:`flowrl.algorithms.marble`); this is the step-0 value and what the look-ahead credit uses.

Rewards with weight 0 are scored and logged only: no combiner trains on them.
"""

from __future__ import annotations

from typing import Callable

import torch

from flowrl.algorithms.advantages import grpo_advantages


def weighted_sum(rewards: dict[str, torch.Tensor], weights: dict[str, float], group_ids: torch.Tensor,
                 estimator: Callable) -> tuple[torch.Tensor, torch.Tensor]:
    """Early scalarisation: sum_k w_k r_k, then one advantage estimate. NaN in any reward -> NaN."""
    combined = combined_reward(rewards, weights)
    return estimator(combined, group_ids), combined


def trained_weights(rewards: dict[str, torch.Tensor], weights: dict[str, float]) -> dict[str, float]:
    """The nonzero weights, after checking that every weighted reward has a signal and vice versa."""
    missing, unweighted = sorted(set(weights) - set(rewards)), sorted(set(rewards) - set(weights))
    if missing or unweighted:
        raise ValueError(f"reward weights do not match the rewards: weights for {missing or 'none'} have no "
                         f"reward signal, rewards {unweighted or 'none'} have no weight; give every reward in "
                         "`rewards:` its own `weight:`")
    nonzero = {name: w for name, w in weights.items() if w != 0}
    if not nonzero:
        raise ValueError("every reward weight is 0: give at least one reward a nonzero `weight:`")
    return nonzero


def reward_advantages(rewards: dict[str, torch.Tensor], weights: dict[str, float], group_ids: torch.Tensor,
                      estimator: Callable) -> dict[str, torch.Tensor]:
    """{name: [N]} each weighted reward's own group advantage (``estimator``), NaN rows 0; one per
    gradient MARBLE balances."""
    return {name: estimator(rewards[name].float(), group_ids) for name in trained_weights(rewards, weights)}


def combined_reward(rewards: dict[str, torch.Tensor], weights: dict[str, float]) -> torch.Tensor:
    """[N] sum_k w_k r_k over every reward, NaN where any reward is NaN."""
    return sum(weights[name] * rewards[name].float() for name in weights)


def gdpo(rewards: dict[str, torch.Tensor], weights: dict[str, float], group_ids: torch.Tensor,
         estimator: Callable, eps: float = 1e-4) -> tuple[torch.Tensor, torch.Tensor]:
    """GDPO: ``A = z_batch(sum_k w_k z_group(r_k))``, ``z_group`` each reward's group z-score (its own group
    std, whatever ``estimator`` is: the per-reward decoupling is the method) and ``z_batch`` the z-score
    over the batch's finite rows. A row with any NaN reward gets advantage 0 and stays out of every statistic."""
    nonzero = trained_weights(rewards, weights)
    combined = combined_reward(rewards, weights)
    finite = torch.isfinite(combined)
    nan = torch.full_like(combined, float("nan"))  # a row left out is left out of every reward's group
    summed = sum(w * grpo_advantages(torch.where(finite, rewards[name].float(), nan), group_ids, std_scope="group",
                                     eps=eps).double() for name, w in nonzero.items())  # [N]
    values = summed[finite]
    mean = values.mean() if values.numel() else summed.new_zeros(())
    std = values.std(unbiased=False) if values.numel() else summed.new_zeros(())
    advantages = torch.where(finite, (summed - mean) / (std + eps), torch.zeros_like(summed))
    return advantages.float(), combined


def marble_initial(rewards: dict[str, torch.Tensor], weights: dict[str, float], group_ids: torch.Tensor,
                   estimator: Callable) -> tuple[torch.Tensor, torch.Tensor]:
    """MARBLE before any gradient is measured: sum_k w_k A_k of the per-reward advantages."""
    per_reward = reward_advantages(rewards, weights, group_ids, estimator)
    advantages = sum(weights[name] * per_reward[name] for name in per_reward)
    return advantages, combined_reward(rewards, weights)


COMBINERS: dict[str, Callable] = {"weighted": weighted_sum, "gdpo": gdpo, "marble": marble_initial}
