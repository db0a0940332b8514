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
- ``correlation`` (correlation-weighted multi-reward): GDPO with each weight scaled by the reward's
  difficulty ``(1 - mean correlation with the other rewards) / 2`` over the batch: a concept that
  fights the others (negative correlation) gains weight, one the others already carry loses it.
  With two rewards both difficulties are equal, so it is GDPO; it differs from three rewards on
  (concept sub-scores such as ``toyeval/count``, ``toyeval/color``, ``toyeval/shape``).
- ``preference`` (ParetoSlider): ``sum_k w_k z_k``, each reward's z-score within its (prompt, preference)
  subgroup weighted by the subgroup's w, so the weights are per row and ``group_ids`` are subgroup ids
  (:mod:`flowrl.algorithms.preference`); the recipes pass both when ``model.preference`` is set.
- ``marble``: the weighted sum of the per-reward advantages (:func:`reward_advantages`) at the
  configured weights. The recipes replace those weights by MARBLE's gradient balancing
  (:mod:`flowrl.algorithms.marble`); this is the step-0 value and what the look-ahead credit uses.

Rewards with weight 0 are scored and logged only: no combiner trains on them.
"""

from __future__ import annotations

from typing import Callable

import torch

from flowrl.algorithms.advantages import grpo_advantages
from flowrl.algorithms.preference import preference_advantages


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
    """[N] sum_k w_k r_k over the trained rewards, NaN where any of them is NaN. A logged-only reward (weight 0) is
    left out, not added as 0 * r: a row it could not score (NaN, inf) must not lose the rewards that train."""
    return sum(weights[name] * rewards[name].float() for name in weights if weights[name] != 0)


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
    batch = torch.zeros_like(group_ids)  # one group: the batch z-score, NaN rows 0
    return grpo_advantages(torch.where(finite, summed, nan.double()), batch, std_scope="global", eps=eps), combined


def correlation_weights(rewards: dict[str, torch.Tensor], weights: dict[str, float]) -> dict[str, float]:
    """{name: w_k * d_k * sum(w) / sum(w * d)}: the nonzero weights rescaled by difficulty
    ``d_k = (1 - c_k) / 2``, ``c_k`` the mean Pearson correlation of reward k with the other weighted
    rewards over the batch's rows where all are finite (a constant reward correlates 0). The total
    weight is kept; with one reward, or all difficulties 0, the weights are unchanged."""
    nonzero = trained_weights(rewards, weights)
    names = list(nonzero)
    if len(names) < 2:
        return nonzero
    stacked = torch.stack([rewards[n].double() for n in names])  # [K, N]
    stacked = stacked[:, torch.isfinite(stacked).all(0)]
    centred = stacked - stacked.mean(1, keepdim=True)
    norms = centred.norm(dim=1)
    unit = torch.where(norms[:, None] > 0, centred / norms.clamp(min=1e-12)[:, None], torch.zeros_like(centred))
    corr = unit @ unit.T  # [K, K], 0 rows for constant rewards
    mean_other = (corr.sum(1) - corr.diagonal()) / (len(names) - 1)
    difficulty = (1 - mean_other) / 2  # [K] in [0, 1]
    w = torch.tensor([nonzero[n] for n in names], dtype=torch.float64)
    total = float((w * difficulty).sum())
    if total == 0:
        return nonzero
    scaled = w * difficulty * float(w.sum()) / total
    return dict(zip(names, scaled.tolist()))


def correlation_weighted(rewards: dict[str, torch.Tensor], weights: dict[str, float], group_ids: torch.Tensor,
                         estimator: Callable) -> tuple[torch.Tensor, torch.Tensor]:
    """GDPO at :func:`correlation_weights`; ``combined`` stays the configured weighted sum."""
    advantages, _ = gdpo(rewards, {**weights, **correlation_weights(rewards, weights)}, group_ids, estimator)
    return advantages, combined_reward(rewards, weights)


def marble_initial(rewards: dict[str, torch.Tensor], weights: dict[str, float], group_ids: torch.Tensor,
                   estimator: Callable) -> tuple[torch.Tensor, torch.Tensor]:
    """MARBLE before any gradient is measured: sum_k w_k A_k of the per-reward advantages."""
    per_reward = reward_advantages(rewards, weights, group_ids, estimator)
    advantages = sum(weights[name] * per_reward[name] for name in per_reward)
    return advantages, combined_reward(rewards, weights)


COMBINERS: dict[str, Callable] = {"weighted": weighted_sum, "gdpo": gdpo, "correlation": correlation_weighted,
                                  "marble": marble_initial, "preference": preference_advantages}
