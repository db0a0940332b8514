"""The learning-rate schedule: diffusers' schedulers, stepped once per optimizer step.

``train.lr_scheduler`` names one of diffusers' (``diffusers.optimization.get_scheduler``) and
``train.lr_warmup_steps`` its linear warm-up from 0; cosine and linear decay to 0 at the run's last
optimizer step. The scheduler's state goes into each checkpoint's trainer state, so a resumed run
continues the same sequence.
"""

from __future__ import annotations

import torch


def build_lr_scheduler(optimizer: torch.optim.Optimizer, name: str, *, warmup_steps: int,
                       total_steps: int) -> torch.optim.lr_scheduler.LRScheduler:
    """Optimizer step s (0-based) then runs at ``lr * factor(s)``: constant 1; with warm-up s / warmup_steps
    while s < warmup_steps; cosine and linear fall from 1 after the warm-up to 0 at ``total_steps``."""
    from diffusers.optimization import get_scheduler

    return get_scheduler(name, optimizer, num_warmup_steps=warmup_steps, num_training_steps=total_steps)
