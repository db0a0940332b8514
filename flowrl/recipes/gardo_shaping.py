"""GARDO as run extras of recipe grpo: the per-row shaping of each epoch's advantages and KL, and the adaptive KL
reference (``gardo.*``; the math is :mod:`flowrl.algorithms.gardo`).

- :class:`GardoShaping` (``gardo.diversity``, ``gardo.kl_fraction < 1``): each epoch, the scale on the positive
  advantages (the sample's nearest-neighbour distance in its group, in the ``gardo.features`` space) and the rows
  the KL acts on (the most uncertain fraction), through the extras' ``shape_rows`` hook;
- :class:`~flowrl.recipes.snapshots.GardoReference` (``gardo.reset_every`` / ``reset_kl``): the KL reference that
  its resets move, through the ``kl_weights`` hook.

The recipe registers both builders and names neither in its loop.
"""

from __future__ import annotations

from typing import Callable


from flowrl.algorithms.gardo import build_features, gated_rows, nearest_neighbour_distances, uncertainty
from flowrl.recipes.extras import snapshot
from flowrl.recipes.run import Run, RowShaping
from flowrl.recipes.snapshots import GardoReference


class GardoShaping:
    """GARDO's per-epoch shaping: positive advantages times each sample's nearest-neighbour distance in its group
    (``features``; None: off) and the KL on the ``kl_fraction`` most uncertain rows (1: every row), uncertainty
    being the trained reward's win-rate less the ``auxiliary`` rewards' mean win-rate."""

    def __init__(self, features: Callable | None, kl_fraction: float, auxiliary: list[str]):
        self.features, self.kl_fraction, self.auxiliary = features, kl_fraction, auxiliary

    def shape_rows(self, run: Run, traj, groups) -> RowShaping:
        """This process's rows' shaping from the epoch's rollouts ``traj`` and their gathered ``groups``
        (:class:`flowrl.recipes.rollouts.GroupAdvantages`)."""
        distances = None if self.features is None else nearest_neighbour_distances(
            self.features(traj.images, traj.final_latents), traj.group_ids)  # [N]
        gate = None
        if self.kl_fraction < 1:
            scores = uncertainty(groups.combined, {key: groups.gathered[key] for key in self.auxiliary},
                                 groups.all_groups)  # [N_all]
            gate = gated_rows(scores, self.kl_fraction)[groups.local]  # [N]
        metrics = {} if distances is None else {"gardo/nn_distance_mean": float(distances.mean())}
        if gate is not None:
            metrics["gardo/kl_gated_fraction"] = float(gate.float().mean())
        return RowShaping(positive_scale=distances, kl_rows=gate, metrics=metrics)


def gardo_shaping(run: Run) -> GardoShaping | None:
    """gardo.diversity or gardo.kl_fraction < 1: GARDO's per-row shaping (auxiliary rewards: gardo.auxiliary, else
    every reward of weight 0)."""
    g = run.cfg.gardo
    if not g.diversity and g.kl_fraction >= 1:
        return None
    return GardoShaping(features=build_features(g.features, g.feature_kwargs) if g.diversity else None,
                        kl_fraction=g.kl_fraction,
                        auxiliary=g.auxiliary or [k for k, w in run.weights.items() if w == 0])


def gardo_reference(run: Run) -> GardoReference | None:
    """gardo.reset_every / reset_kl: GARDO's adaptive KL reference."""
    g = run.cfg.gardo
    if g.reset_every is None and g.reset_kl is None:
        return None
    return GardoReference(snapshot(run), reset_every=g.reset_every, reset_kl=g.reset_kl)
