"""The adapter snapshots a recipe keeps besides its EMA: GARDO's adaptive KL reference and HRF's phase
anchor. Each is a :class:`~flowrl.training.ema.LoraEMA` stepped at decay 0 (a copy of the live LoRA
weights) when it moves; :class:`flowrl.recipes.run.Run` holds them and checkpoints save them by name.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from flowrl.training.ema import ema_weights

if TYPE_CHECKING:
    from flowrl.recipes.run import Run
    from flowrl.training.stats import StatsAccumulator


def anchor_pull(run: Run) -> None:
    """HRF: add the gradient of ``hrf.anchor_weight * ||theta - theta_phase||^2`` to the accumulated one."""
    weight = 2 * run.cfg.hrf.anchor_weight
    for param, anchor in zip(run.params, run.anchor.model.shadow_params):
        if param.grad is not None:
            param.grad.add_(param.detach() - anchor, alpha=weight)


def reference_weights(run: Run):
    """The KL reference as a context: the base model (adapter off), or after GARDO's first reset the
    adapter snapshot taken then."""
    return ema_weights(run.reference) if run.reference_resets else run.policy.reference()


def start_phase(run: Run, epoch: int) -> dict[str, float]:
    """HRF: at the start of every ``hrf.phase_epochs``-th epoch the parameter anchor moves to the current
    adapter; returns the distance from it at the start of this epoch, to log."""
    if run.anchor is None:
        return {}
    if epoch > 0 and epoch % run.cfg.hrf.phase_length(run.cfg.sampling) == 0:
        run.anchor.step(0.0)
    distance = sum(float(((p.detach() - a) ** 2).sum()) for p, a in zip(run.params, run.anchor.model.shadow_params))
    return {"hrf/anchor_distance": distance ** 0.5}


def maybe_reset_reference(run: Run, epoch: int, stats: StatsAccumulator) -> dict[str, float]:
    """GARDO's adaptive reference: after epoch ``epoch``, move the reference to the current adapter
    when ``gardo.reset_every`` epochs have passed or the epoch's mean KL exceeds ``gardo.reset_kl``
    (before the checkpoint, so a resumed run has the same reference). Returns the metric to log."""
    if run.reference is None:
        return {}
    g = run.cfg.gardo
    kl = stats.reduce(run.accelerator).get("loss/kl", 0.0)
    if (g.reset_every is not None and (epoch + 1) % g.reset_every == 0) or (g.reset_kl is not None and kl > g.reset_kl):
        run.reference.step(0.0)  # decay 0: the snapshot becomes the live weights
        run.reference_resets += 1
    return {"gardo/reference_resets": float(run.reference_resets)}
