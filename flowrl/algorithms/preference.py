"""ParetoSlider's training signal: S preferences w per prompt group, drawn from the reference's mixture, and the
advantage ``sum_k w_k z_k`` of each reward's z-score within its (prompt, preference) subgroup.

Reference: github.com/Shelley-Golan/ParetoSlider at e56e5024a3e996944119ef7cb910d314900b3fc1 (T2I/), the
training script ``scripts/train_pareto_nft_sd3.py`` with its main configs ``config/nft.py`` (``_sd3_style_config``:
``num_pref_per_prompt = 3``, ``loss_mode = "per_objective"``, 24 images per prompt).

**The draw** (:func:`draw_preferences`; the script's ``_sample_structured_preference``, lines 273-307). For two
rewards: a one-hot corner with probability 0.1 (either corner alike), else Dirichlet(1, 1). For three or more: a
vertex (one-hot) with probability 0.5, an edge (two distinct rewards, Dirichlet(1, 1) between them, zeros
elsewhere) with 0.35, the interior (Dirichlet(1, ..., 1)) with 0.15. A prompt group of ``group_size`` rows is
split into ``S = model.preference.per_prompt`` subgroups of ``group_size / S`` consecutive rows, each with its own
w (``build_preferences_with_subgroups``, lines 310-376: 3 preferences for 24 images, subgroups of 8). Subgroup s of
group g draws from numpy's generator seeded by (run seed, a stream tag, g, s): group ids are unique over the run
(the recipes number groups by epoch, rollout batch and process), so a resumed run or one on more processes draws
the same w for the same subgroup, with no state to checkpoint.

**The advantage** (:func:`preference_advantages`; ``flow_grpo/stat_tracking.py``,
``PerPromptAndPreferenceStatTracker.update_from_reward_vectors_gdpo``, lines 187-256, keyed by
``f"{prompt}__pref{slot}"`` in the script, lines 1246-1265). Each trained reward is z-scored within its
(prompt, preference) subgroup, ``z = (r - mean) / (std + 1e-4)`` with the population std of the subgroup, and the
row's advantage is ``sum_k w_k z_k``, w the row's preference (a reward outside the slider keeps its configured
weight). There is no batch normalisation after the sum: the reference's main configs train with
``loss_mode: per_objective``, which returns the per-reward advantages unnormalised (stat_tracking.py lines 239-242)
and weights the per-reward losses by w (``flow_grpo/scalarization.py``, ``linear``; the script, lines 1497-1512).

**Per-objective losses and weighted advantages.** flowrl weights advantages, not losses; where the loss is affine in
the advantage the two are the same:

- recipe nft, loss nft (the reference's own loss): the loss is ``r L+ + (1 - r) L-`` with
  ``r = (1 + clip(A / c, -1, 1)) / 2``, c = ``train.advantage_clip``. Summed over rewards with weights summing to 1
  it is the loss at ``r = sum_k w_k r_k``; and a population z-score over n rows is at most ``sqrt(n - 1)`` in size,
  so for subgroups of up to ``c**2 + 1`` rows (26 at c = 5; the reference's are 8) no clip binds and
  ``sum_k w_k r_k`` is the r of ``A = sum_k w_k z_k``, whose size is at most ``max_k |z_k| <= c``. Identical.
  Loss awm (advantage times a flow-matching error) is linear in A: identical as well.
- recipe grpo, loss grpo-clip: ``max(-A rho, -A clip(rho, 1 - eps, 1 + eps))`` is not linear in A. While rho is
  inside the clip range both forms are ``-rho sum_k w_k z_k`` (value and gradient: the first inner step of every
  epoch, where rho = 1, is exact). Outside it they differ only for rows whose rewards pull opposite ways: per
  objective, the reward whose own term is still unclipped keeps its gradient; with the weighted advantage only the
  sign of the sum decides. flowrl keeps the weighted advantage there (one advantage per row through every loss and
  credit of recipe grpo) and this is the difference from a per-objective clipped loss.

Still different from the reference: (1) the reference assigns a prompt's repeats to slots by their order of
occurrence within each process's sampling batch (``occ % num_pref_per_prompt``), so with repeats spread over
processes its subgroups are only about ``group_size / S`` rows each; flowrl's are exactly that many, consecutive.
(2) The seeds: the reference hashes (prompt, epoch, slot); flowrl uses the run-wide group id, so a prompt drawn
twice in an epoch gets fresh w. (3) ``train.advantage`` (grpo or mean) and ``train.std_scope`` do not apply: the
per-reward z-score within the subgroup is the method, as in the reference. (4) A row with a NaN reward gets
advantage 0 and stays out of every statistic (flowrl's rule; the reference has no NaN rewards).
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from flowrl.algorithms.advantages import grpo_advantages

PREFERENCE_STREAM = 0x5A11DE  # keeps the draws apart from every other use of (seed, group id)
CORNER_PROBABILITY = 0.1  # two rewards: a one-hot corner, else Dirichlet(1, 1)
VERTEX_PROBABILITY, EDGE_PROBABILITY = 0.5, 0.35  # three or more: vertex, edge, else (0.15) the interior
EPS = 1e-4  # the z-score's std offset (the reference's)


def draw_preference(rng: np.random.Generator, num_rewards: int) -> np.ndarray:
    """``[K]`` float64: one preference from the reference's mixture (see the module docstring), drawn from ``rng``."""
    w = np.zeros(num_rewards)
    if num_rewards == 2:
        if rng.random() < CORNER_PROBABILITY:
            w[rng.integers(0, 2)] = 1.0
            return w
        return rng.dirichlet([1.0, 1.0])
    roll = rng.random()
    if roll < VERTEX_PROBABILITY:
        w[rng.integers(0, num_rewards)] = 1.0
    elif roll < VERTEX_PROBABILITY + EDGE_PROBABILITY:
        pair = rng.choice(num_rewards, size=2, replace=False)
        w[pair] = rng.dirichlet([1.0, 1.0])
    else:
        w = rng.dirichlet(np.ones(num_rewards))
    return w


def draw_preferences(seed: int, group_ids: torch.Tensor, num_rewards: int,
                     subgroups: torch.Tensor | None = None) -> torch.Tensor:
    """``[G] -> [G, K]`` float32: the w of subgroup ``subgroups[i]`` (None: 0) of group ``group_ids[i]``, from
    ``default_rng([seed, PREFERENCE_STREAM, group, subgroup])``."""
    subgroups = torch.zeros_like(group_ids) if subgroups is None else subgroups
    rows = [draw_preference(np.random.default_rng([int(seed), PREFERENCE_STREAM, int(g), int(s)]), num_rewards)
            for g, s in zip(group_ids.tolist(), subgroups.tolist())]
    return torch.tensor(np.array(rows).reshape(-1, num_rewards), dtype=torch.float32)


def subgroup_ids(group_ids: torch.Tensor, subgroups: torch.Tensor, per_group: int) -> torch.Tensor:
    """``[N]`` ids of the (prompt, preference) subgroups: ``group * per_group + subgroup``, unique over the run."""
    return group_ids.long() * per_group + subgroups.long()


def row_weights(preferences: torch.Tensor, names: list[str], weights: dict[str, float]) -> dict[str, torch.Tensor]:
    """``{name: [N]}``: the configured ``weights`` with each of ``names`` replaced by its column of
    ``preferences`` ``[N, K]`` (the other rewards keep their fixed weight: 0 logs them, non-zero adds them)."""
    n = preferences.shape[0]
    out = {name: torch.full((n,), float(w)) for name, w in weights.items()}
    out.update({name: preferences[:, k] for k, name in enumerate(names)})
    return out


def preference_advantages(rewards: dict[str, torch.Tensor], weights: dict[str, torch.Tensor | float],
                          group_ids: torch.Tensor, estimator: Callable | None = None
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """ParetoSlider's scalarisation (the ``preference`` combiner): ``A_i = sum_k w_ik z_ik``, ``z_k`` reward k's
    z-score within the row's subgroup (``group_ids`` are the (prompt, preference) subgroup ids here: the recipes pass
    :func:`subgroup_ids`), w per row (:func:`row_weights`; floats broadcast). No batch normalisation follows (the
    reference's per-objective form). ``estimator`` is not used: the per-reward subgroup z-score is the method.
    Returns (advantages [N], combined [N] = ``sum_k w_ik r_ik``, what the run logs). A row with any NaN reward gets
    advantage 0 and stays out of every statistic."""
    trained = [name for name in weights if torch.is_tensor(weights[name]) or weights[name] != 0]  # not logged-only
    row_weight = {name: torch.as_tensor(weights[name], dtype=torch.float64) for name in trained}
    combined = sum(row_weight[name].float() * rewards[name].float() for name in trained)  # [N]
    finite = torch.isfinite(combined)
    nan = torch.full_like(combined, float("nan"))
    advantages = sum(row_weight[name] * grpo_advantages(torch.where(finite, rewards[name].float(), nan), group_ids,
                                                        std_scope="group", eps=EPS).double() for name in trained)
    return torch.where(finite, advantages, torch.zeros_like(advantages)).float(), combined
