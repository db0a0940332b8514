"""Fault containment: what a run does when a step, an epoch's rewards or a checkpoint write goes wrong.

- A non-finite gradient (a NaN/inf loss gives one too): the optimizer step is skipped, its gradients zeroed, so
  the weights stay finite; ``train.max_skipped_steps`` such steps in a row stop the run.
- An epoch in which every trained reward is NaN (nothing could be scored) trains on nothing: one warning line
  names the reward, and ``train.max_nan_epochs`` such epochs in a row stop the run.
- A checkpoint write that fails (a full disk; whatever the writer raises: OSError, torch's RuntimeError, safetensors'
  error): the half-written directory is removed, the previous checkpoint stays the latest one, and the run stops
  with the free space the next checkpoint needs.

Every stop is a :class:`TrainingAborted`, one line saying what happened and what to do; it is raised before
the epoch's checkpoint, so the last checkpoint on disk is the last good state (resume with train.resume=latest).
"""

from __future__ import annotations

import math
import shutil
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch


class TrainingAborted(RuntimeError):
    """The run stopped itself to contain a fault; the message is one line, the last checkpoint is intact."""


def grad_norm(params: Iterable[torch.nn.Parameter]) -> torch.Tensor:
    """The total L2 norm of the gradients (NaN/inf if any entry is); 0 when there are none."""
    grads = [p.grad.detach() for p in params if p.grad is not None]
    if not grads:
        return torch.zeros(())
    norms = [g.full_tensor().norm() if hasattr(g, "full_tensor") else g.norm() for g in grads]  # DTensor: global
    return torch.stack([n.float().cpu() for n in norms]).norm()


class FaultCounter:
    """Skipped steps (in a row and in all) and unscorable epochs in a row; raises TrainingAborted at the limit."""

    def __init__(self, *, max_skipped_steps: int, max_nan_epochs: int) -> None:
        self.max_skipped_steps, self.max_nan_epochs = max_skipped_steps, max_nan_epochs
        self.skipped_in_a_row = self.skipped_total = self.nan_epochs_in_a_row = 0

    def step(self, norm: float, *, step_label: str = "") -> bool:
        """Record one optimizer step's gradient norm; True if the step must be skipped."""
        if math.isfinite(norm):
            self.skipped_in_a_row = 0
            return False
        self.skipped_in_a_row += 1
        self.skipped_total += 1
        if self.skipped_in_a_row >= self.max_skipped_steps:
            raise TrainingAborted(
                f"{self.skipped_in_a_row} optimizer steps in a row had a non-finite gradient or loss ({norm}) and "
                f"were skipped (train.max_skipped_steps={self.max_skipped_steps}); the last checkpoint is intact: "
                "lower train.learning_rate or raise train.max_grad_norm's clipping, check the rewards for inf, and "
                "resume with train.resume=latest")
        return True

    def epoch(self, rewards: Mapping[str, torch.Tensor], trained: Iterable[str], *, epoch: int,
              idle: str | None = None) -> str | None:
        """Record one epoch's gathered rewards; returns a warning line when every trained reward is NaN, or when the
        update had nothing to train on (``idle``: why, e.g. online DPO found no preference pair). Either counts
        toward ``train.max_nan_epochs`` in a row."""
        trained = [k for k in trained if k in rewards]
        dead = [k for k in trained if not bool(torch.isfinite(rewards[k]).any())]
        unscored = bool(trained) and len(dead) == len(trained)
        if not unscored and idle is None:
            self.nan_epochs_in_a_row = 0
            return None
        self.nan_epochs_in_a_row += 1
        if unscored:
            what = f"reward {', '.join(repr(k) for k in dead)} scored every image NaN (could not score)"
            fix = ": fix the reward (is its server up? see the warnings above) and resume with train.resume=latest"
        else:  # the rewards scored, but the update had nothing to train on
            what, fix = idle, ""
        if self.nan_epochs_in_a_row >= self.max_nan_epochs:
            raise TrainingAborted(
                f"{what} for {self.nan_epochs_in_a_row} epochs in a row through epoch {epoch} "
                f"(train.max_nan_epochs={self.max_nan_epochs}), so nothing trained; the last checkpoint is intact{fix}")
        return (f"flowrl train: warning: epoch {epoch}: {what}, so this epoch trains on nothing; the run stops after "
                f"{self.max_nan_epochs} such epochs in a row")

    def metrics(self) -> dict[str, float]:
        return {"faults/skipped_steps": float(self.skipped_total),
                "faults/nan_reward_epochs": float(self.nan_epochs_in_a_row)}

    def state_dict(self) -> dict[str, int]:
        """The counts, saved in each checkpoint's trainer state: a resumed run goes on counting where it stopped
        (a NaN epoch before a restart and one after are two in a row)."""
        return {"skipped_in_a_row": self.skipped_in_a_row, "skipped_total": self.skipped_total,
                "nan_epochs_in_a_row": self.nan_epochs_in_a_row}

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        for key in ("skipped_in_a_row", "skipped_total", "nan_epochs_in_a_row"):
            setattr(self, key, int(state.get(key, 0)))


def checkpoint_write_failed(root: Path, name: str, error: Exception, *, needed: int,
                            intact: Path | None) -> TrainingAborted:
    """The stop after writing checkpoint ``name`` under ``root`` failed (its half-written directory already removed):
    what failed, about how much free space a checkpoint needs (``needed`` bytes) against what is free now, and
    ``intact``, the complete checkpoint a resume starts from (None: there is none yet)."""
    if isinstance(error, OSError) and error.strerror:
        reason = error.strerror + (f" ({error.filename})" if error.filename else "")
    else:  # torch's serializer on a full disk: RuntimeError "[enforce fail at inline_container.cc:...] ..."
        lines = [line.strip() for line in str(error).splitlines() if line.strip()]
        reason = f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__
    where = root
    while not where.exists() and where != where.parent:  # the checkpoints folder may not exist yet
        where = where.parent
    try:
        free = f"{_size(shutil.disk_usage(where).free)} is free now"
    except OSError:
        free = "the free space is unknown"
    space = f"a checkpoint needs about {_size(needed)} free and {free}"
    if intact is None:
        return TrainingAborted(f"could not write checkpoint {name} under {root}: {reason}; {space}; no earlier "
                               "checkpoint exists: free disk space and start the run again")
    return TrainingAborted(f"could not write checkpoint {name} under {root}: {reason}; {space}; the last checkpoint, "
                           f"{intact}, is intact: free disk space (or lower train.keep_checkpoints) and resume from it "
                           "with train.resume=latest")


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"
