"""ParetoSlider's training signal: a preference w per prompt group, drawn from Dirichlet(1), and the reward w . r.

Each group's w is a uniform draw from the simplex (Dirichlet with all concentrations 1), from numpy's generator
seeded by (run seed, a stream tag, the group's id). Group ids are unique over the run (the recipes number groups
by epoch, rollout batch and process), so a resumed run or one on more processes draws the same w for the same
group, with no state to checkpoint. The rollout and the training forward of a group are conditioned on its w
(``TextCond.preference``), and its rows are scored by ``sum_k w_k r_k``: the ``preference`` combiner, a weighted
sum whose weights are per row.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch

PREFERENCE_STREAM = 0x5A11DE  # keeps the draws apart from every other use of (seed, group id)


def draw_preferences(seed: int, group_ids: torch.Tensor, num_rewards: int) -> torch.Tensor:
    """``[G] -> [G, K]`` float32: group g's w ~ Dirichlet(1_K) from ``default_rng([seed, PREFERENCE_STREAM, g])``."""
    rows = [np.random.default_rng([int(seed), PREFERENCE_STREAM, int(g)]).dirichlet(np.ones(num_rewards))
            for g in group_ids.tolist()]
    return torch.tensor(np.array(rows).reshape(-1, num_rewards), dtype=torch.float32)


def row_weights(preferences: torch.Tensor, names: list[str], weights: dict[str, float]) -> dict[str, torch.Tensor]:
    """``{name: [N]}``: the configured ``weights`` with each of ``names`` replaced by its column of
    ``preferences`` ``[N, K]`` (the other rewards keep their fixed weight: 0 logs them, non-zero adds them)."""
    n = preferences.shape[0]
    out = {name: torch.full((n,), float(w)) for name, w in weights.items()}
    out.update({name: preferences[:, k] for k, name in enumerate(names)})
    return out


def preference_sum(rewards: dict[str, torch.Tensor], weights: dict[str, torch.Tensor | float], group_ids: torch.Tensor,
                   estimator: Callable) -> tuple[torch.Tensor, torch.Tensor]:
    """ParetoSlider's scalarisation: ``combined[i] = sum_k w_ik r_ik`` with per-row weights (:func:`row_weights`;
    floats broadcast), then one advantage per group. w is constant within a group, so the group's baseline is
    taken at its own trade-off. NaN in any reward -> NaN."""
    trained = [name for name in weights if torch.is_tensor(weights[name]) or weights[name] != 0]  # not logged-only
    combined = sum(torch.as_tensor(weights[name], dtype=torch.float32) * rewards[name].float() for name in trained)
    return estimator(combined, group_ids), combined
