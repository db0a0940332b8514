"""The learning-rate schedule: diffusers' schedulers, stepped once per optimizer step.

``train.lr_scheduler`` names one of diffusers' (``diffusers.optimization.get_scheduler``) and
``train.lr_warmup_steps`` its linear warm-up from 0; cosine and linear decay to 0 at the run's last
optimizer step. The scheduler's state goes into each checkpoint's trainer state, so a resumed run
continues the same sequence.
"""

from __future__ import annotations

import warnings

import torch


def build_lr_scheduler(optimizer: torch.optim.Optimizer, name: str, *, warmup_steps: int,
                       total_steps: int) -> torch.optim.lr_scheduler.LRScheduler:
    """Optimizer step s (0-based) then runs at ``lr * factor(s)``: constant 1; with warm-up s / warmup_steps
    while s < warmup_steps; cosine and linear fall from 1 after the warm-up to 0 at ``total_steps``."""
    from diffusers.optimization import get_scheduler

    scheduler = get_scheduler(name, optimizer, num_warmup_steps=warmup_steps, num_training_steps=total_steps)
    if any(torch.is_tensor(group["lr"]) for group in optimizer.param_groups):
        # torchao's AdamW8bit keeps each group's lr as a tensor (its compiled step reads it without recompiling),
        # which torch's scheduler fills in place; the scheduler's own numbers are kept as plain floats, so the
        # trainer state stays JSON and a resumed run computes the same lr as the uninterrupted one.
        assert isinstance(scheduler, torch.optim.lr_scheduler.LambdaLR), type(scheduler)  # every diffusers schedule
        scheduler.__class__ = FloatStateLambdaLR
        scheduler.base_lrs = [float(lr) for lr in scheduler.base_lrs]
    return scheduler


def skip_scheduled_step(scheduler: torch.optim.lr_scheduler.LRScheduler) -> None:
    """Advance the schedule past an optimizer step that did not happen (a non-finite gradient, or nothing left to
    train), so the schedule stays a function of the step index. torch warns when a schedule steps before its
    optimizer ever has, which is exactly this case on a run's first step: that one warning is silenced here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler\.step\(\)` before")
        scheduler.step()


class FloatStateLambdaLR(torch.optim.lr_scheduler.LambdaLR):
    """A LambdaLR whose state lists (``base_lrs``, ``_last_lr``) are saved as floats where the optimizer's lr is a
    tensor."""

    def state_dict(self) -> dict:
        return {key: [float(v) if torch.is_tensor(v) else v for v in value] if isinstance(value, list) else value
                for key, value in super().state_dict().items()}
