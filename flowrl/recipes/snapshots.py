"""The adapter snapshots a recipe keeps besides its EMA, as run extras (:class:`flowrl.recipes.run.Run`): GARDO's
adaptive KL reference and HRF's phase anchor. Each holds an :class:`~flowrl.training.ema.AdapterSnapshot` (a copy
of the live LoRA weights) that it retakes when it moves; checkpoints save it by name through :meth:`snapshots`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from flowrl.training.ema import AdapterSnapshot, ema_weights

if TYPE_CHECKING:
    from flowrl.recipes.run import Run
    from flowrl.training.stats import StatsAccumulator


class PhaseAnchor:
    """HRF: the adapter at the start of the current phase, and the pull ``anchor_weight * ||theta - theta_phase||^2``
    toward it. No trainer state: the snapshot (``anchor.safetensors``) is all of it."""

    def __init__(self, snapshot: AdapterSnapshot, *, weight: float, phase_length: int):
        self.snapshot, self.weight, self.phase_length = snapshot, weight, phase_length

    def snapshots(self) -> dict[str, AdapterSnapshot]:
        return {"anchor": self.snapshot}

    def begin_epoch(self, run: Run, epoch: int) -> dict[str, float]:
        """At the start of every ``hrf.phase_epochs``-th epoch the anchor moves to the current adapter; returns the
        distance from it at the start of this epoch, to log."""
        if epoch > 0 and epoch % self.phase_length == 0:
            self.snapshot.take()
        shadows = self.snapshot.model.shadow_params
        distance = sum(float(((p.detach() - a) ** 2).sum()) for p, a in zip(run.params, shadows))
        return {"hrf/anchor_distance": distance ** 0.5}

    def before_step(self, run: Run) -> None:
        """Add the gradient of the pull to the accumulated one, at its loss scale under fp16 (accelerate's GradScaler
        scales the backward's gradients and unscales them in the clip that follows)."""
        scaler = getattr(run.accelerator, "scaler", None)
        scale = 1.0 if scaler is None else float(scaler.get_scale())
        for param, anchor in zip(run.params, self.snapshot.model.shadow_params):
            if param.grad is not None:
                param.grad.add_(param.detach() - anchor, alpha=2 * self.weight * scale)


class MovingReference:
    """A KL or DPO reference that moves: the base model (adapter off) until the first move, then the adapter snapshot
    taken at the last one. Its trainer state is the number of moves; its snapshot is saved as ``<file>.safetensors``.
    A subclass decides when to :meth:`move` (in its ``after_update``)."""

    def __init__(self, snapshot: AdapterSnapshot, *, file: str):
        self.snapshot, self.file = snapshot, file
        self.moves = 0  # 0: the reference is still the base model

    def snapshots(self) -> dict[str, AdapterSnapshot]:
        return {self.file: self.snapshot}

    def state_dict(self) -> int:
        return self.moves

    def load_state_dict(self, state: int) -> None:
        self.moves = int(state)

    def kl_weights(self, policy):
        """The reference's weights as a context: the base model (adapter off), or the snapshot after a move."""
        return ema_weights(self.snapshot) if self.moves else policy.reference()

    def move(self) -> None:
        """The reference becomes the adapter as it is now (after an update, before the checkpoint, so a resumed run
        has the same reference)."""
        self.snapshot.take()
        self.moves += 1


class GardoReference(MovingReference):
    """GARDO's adaptive KL reference (``reference_resets`` in the trainer state, ``reference.safetensors``)."""

    def __init__(self, snapshot: AdapterSnapshot, *, reset_every: int | None, reset_kl: float | None):
        super().__init__(snapshot, file="reference")
        self.reset_every, self.reset_kl = reset_every, reset_kl

    def after_update(self, run: Run, epoch: int, traj, stats: StatsAccumulator) -> dict[str, float]:
        """After epoch ``epoch``'s update: move the reference to the current adapter when ``gardo.reset_every``
        epochs have passed or the epoch's mean KL exceeds ``gardo.reset_kl``. Returns the metric to log."""
        kl = stats.reduce(run.accelerator).get("loss/kl", 0.0)
        if (self.reset_every is not None and (epoch + 1) % self.reset_every == 0) or (
                self.reset_kl is not None and kl > self.reset_kl):
            self.move()
        return {"gardo/reference_resets": float(self.moves)}
