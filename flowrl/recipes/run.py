"""The state of one training run: :class:`Run` holds everything an online RL loop keeps across epochs (policy,
optimizer, EMA and the other adapter copies, rewards, prompt splits, logger, guard and counters).

Why a module of its own: :mod:`flowrl.recipes.common` builds a ``Run`` and :mod:`flowrl.recipes.snapshots`
moves its adapter copies; both read this one definition, so neither imports the other.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from accelerate import Accelerator

from flowrl.algorithms.marble import MarbleBalancer
from flowrl.config import Config
from flowrl.data import PromptSet
from flowrl.recipes.guard import DiversityGuard
from flowrl.sampling.split_schedule import BetaSplitScheduler
from flowrl.training.ema import LoraEMA
from flowrl.training.faults import FaultCounter
from flowrl.training.metrics import MetricsLogger


@dataclass
class Run:
    """Everything an online RL loop holds across epochs, built the same way for every recipe."""

    cfg: Config
    accelerator: Accelerator
    run_dir: Path
    policy: object
    params: list[torch.nn.Parameter]
    optimizer: torch.optim.Optimizer
    ema: LoraEMA | None
    rewards: list
    weights: dict[str, float]
    train_prompts: PromptSet
    test_prompts: PromptSet
    eval_prompts: PromptSet
    test_set: PromptSet
    logger: MetricsLogger
    guidance: float
    start_epoch: int
    counters: dict[str, float] = field(default_factory=dict)
    marble: MarbleBalancer | None = None  # train.combine=marble: the per-reward advantage weights in force
    reference: LoraEMA | None = None  # GARDO's adaptive reference: the adapter snapshot at the last reset
    reference_resets: int = 0  # 0: the reference is still the base model (adapter off)
    anchor: LoraEMA | None = None  # HRF: the adapter at the start of the current phase
    guard: DiversityGuard | None = None  # guard.enabled: the diversity guard (flowrl/recipes/guard.py)
    scheduler: torch.optim.lr_scheduler.LRScheduler | None = None  # train.lr_scheduler, one step per optimizer step
    faults: FaultCounter | None = None  # skipped non-finite steps and unscorable epochs (flowrl/training/faults.py)
    split_scheduler: BetaSplitScheduler | None = None  # sampling.tree.schedule=beta: TMPO's adaptive split steps
    eval_ema: LoraEMA | None = None  # nft.eval_ema_decay: the EMA eval and export use; ``ema`` is then the old policy
    adapters: dict[str, LoraEMA] = field(default_factory=dict)  # further copies a recipe names (CRD: its sampler)

    @property
    def fault_counter(self) -> FaultCounter:
        if self.faults is None:
            t = self.cfg.train
            self.faults = FaultCounter(max_skipped_steps=t.max_skipped_steps, max_nan_epochs=t.max_nan_epochs)
        return self.faults

    @property
    def snapshots(self) -> dict[str, LoraEMA]:
        """The adapter copies that checkpoints save and resume restores."""
        best = self.guard.best if self.guard is not None and self.guard.best.tensors else None
        return named_snapshots(self.reference, self.anchor, best, self.ema, self.eval_ema, self.adapters)

    @property
    def exported_ema(self) -> LoraEMA | None:
        """The weights eval, the report, the export and checkpoints' ema.safetensors hold: the eval EMA where one is
        kept, else ``ema``."""
        return exported(self.ema, self.eval_ema)

    @property
    def eval_guidance(self) -> float:
        """The guidance of eval grids, held-out scores and the report: log.eval_guidance_scale, else training's."""
        scale = self.cfg.log.eval_guidance_scale
        return self.guidance if scale is None else scale

    @property
    def beta(self) -> float:
        """The KL beta in force: train.beta, or what the diversity guard raised it to."""
        return self.cfg.train.beta if self.guard is None else self.guard.beta

    @property
    def guard_stopped(self) -> bool:
        """Whether the diversity guard (guard.policy=stop) ended the run."""
        return self.guard is not None and self.guard.stopped


def named_snapshots(reference, anchor, guard_best, ema, eval_ema, adapters: dict) -> dict[str, LoraEMA]:
    """{name: adapter copy} that checkpoints save beside ema.safetensors; ``ema`` is one of them, as "old", where
    an eval EMA takes ema.safetensors (recipe nft)."""
    old = ema if eval_ema is not None else None
    return {name: s for name, s in (("reference", reference), ("anchor", anchor), ("guard_best", guard_best),
                                    ("old", old), *adapters.items()) if s is not None}


def exported(ema: LoraEMA | None, eval_ema: LoraEMA | None) -> LoraEMA | None:
    """The EMA that eval and export use, and checkpoints save as ema.safetensors: the eval EMA where kept."""
    return eval_ema if eval_ema is not None else ema
