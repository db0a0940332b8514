"""The state of one training run: :class:`Run` holds what every online RL loop keeps across epochs (policy,
optimizer, EMA, rewards, prompt splits, logger, counters) and a dict of named *extras*, the stateful pieces a
feature adds (MARBLE's balancer, GARDO's reference, HRF's anchor, the diversity guard, the LR and split
schedulers, the fault counter, a recipe's adapter copies).

Why extras and not one slot per feature: checkpoints, resume and the end of each epoch handle every extra the
same way, through the small protocol below, so adding a regulariser means writing its class and its builder;
the scaffold, the checkpoint code and the other recipe stay as they are. Every method is optional:

- ``state_dict()`` / ``load_state_dict(state)``: JSON-safe state, saved in ``trainer_state.json`` under the
  extra's name (a ``None`` state saves nothing) and loaded from there on resume;
- ``snapshots()``: ``{name: adapter copy}`` (an :class:`~flowrl.training.ema.AdapterSnapshot` or
  :class:`~flowrl.training.ema.LoraEMA`) saved beside ``ema.safetensors`` as ``<name>.safetensors``; part of the
  training state, which the held-out guard's rollback restores with the weights (:meth:`Run.adapter_copies`),
  unless the extra sets ``keeps_records = True`` (its copies record a past best point: the guards' best weights);
- ``begin_epoch(run, epoch)`` -> metrics, at the start of each epoch (:meth:`Run.begin_epoch`);
- ``before_step(run)``: on the accumulated gradients, before each optimizer step;
- ``after_scoring(run, epoch, traj, combined)`` -> metrics, once the epoch's rollouts ``traj`` are scored and
  their combined rewards ``combined`` [N_all] gathered, before the update (:meth:`Run.after_scoring`: the
  diversity guard measures them and may raise the KL beta the update uses);
- ``after_update(run, epoch, traj, stats)`` -> metrics, after the epoch's policy update and before its checkpoint,
  with its rollouts and the update's statistics (:meth:`Run.after_update`: the trainable rewards learn from the
  rollouts, GARDO's reference moves to the adapter);
- ``updates_policy(epoch)`` -> bool: whether the policy trains on epoch ``epoch`` (:meth:`Run.updates_policy`:
  the trainable rewards' schedule, Adv-GRPO's epochs that train only its discriminator); the recipe skips the
  policy's update where any extra says False;
- ``shape_rows(run, traj, groups)`` -> :class:`RowShaping`: a scale on each row's positive advantage and the rows
  the KL acts on, from the epoch's scored rollouts (:meth:`Run.shape_rows`: GARDO's diversity weights and KL gate);
- ``kl_weights(policy)``: the KL reference's weights as a context, where an extra moves them (:attr:`Run.kl_reference`:
  GARDO's resets);
- ``metrics()``: logged at the end of each epoch;
- ``end_epoch(run, epoch, metrics, held_out)`` -> metrics, at the end of each epoch (and at the base model's
  held-out point, epoch -1) with the epoch's metrics and, at a held-out point, the per-image held-out scores
  ``{key: [P * n]}`` (else None); before the checkpoint, so what it changes is saved;
- ``balance(params, step, per_reward, backward, stats)``: takes over an optimizer step's gradient from each reward's
  own advantages ``per_reward`` (MARBLE's gradient balancing; :meth:`Run.backward`);
- ``kl_beta``: the live KL beta, in place of ``train.beta``; ``kl_scale``: a factor on the KL beta in force;
  ``stopped``: the extra ended the run;
- ``finish(run)``: before the final export and report.

:func:`flowrl.recipes.start.start_run` builds a ``Run`` and :mod:`flowrl.recipes.snapshots` defines extras; both read this
one definition, so neither imports the other.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Callable, NamedTuple

import torch
from accelerate import Accelerator

from flowrl.config import Config
from flowrl.data.prompts import PromptSet
from flowrl.training.ema import LoraEMA
from flowrl.training.faults import FaultCounter
from flowrl.training.metrics import MetricsLogger
from flowrl.training.row_shards import RowShards


class RowShaping(NamedTuple):
    """How an extra shapes one epoch's rows (:meth:`Run.shape_rows`); None fields change nothing."""

    positive_scale: torch.Tensor | None = None  # [N] factor on each row's positive advantage (GARDO's distances)
    kl_rows: torch.Tensor | None = None  # [N] bool: the rows the KL acts on (GARDO's gate); None: every row
    metrics: dict[str, float] = {}


@dataclass
class Run:
    """Everything an online RL loop holds across epochs, built the same way for every recipe."""

    cfg: Config
    accelerator: Accelerator
    run_dir: Path
    policy: object
    params: list[torch.nn.Parameter]
    optimizer: torch.optim.Optimizer
    ema: LoraEMA | None  # the EMA the recipe steps (recipe nft: the old adapter)
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
    extras: dict[str, Any] = field(default_factory=dict)  # name -> stateful extra (see the module docstring)
    exported_ema: LoraEMA | None = None  # what eval, the report, the export and ema.safetensors hold (None: ema)
    # Which rows this process holds and how every row is gathered once (context groups hold one shard); None: one
    # shard per process, the accelerator's own answers.
    shards: RowShards | None = None

    def __post_init__(self):
        if self.exported_ema is None:
            self.exported_ema = self.ema
        if self.shards is None:
            self.shards = RowShards(self.accelerator)

    # --- the extras, as the checkpoint and the loop see them ----------------------------------------------------
    @property
    def snapshots(self) -> dict[str, LoraEMA]:
        """The adapter copies that checkpoints save and resume restores, by file name."""
        return {name: copy for extra in self.extras.values() if hasattr(extra, "snapshots")
                for name, copy in extra.snapshots().items()}

    def adapter_copies(self) -> dict[str, LoraEMA]:
        """Every adapter copy of the training state, by name, each once: the exported EMA ("ema"), the EMA the recipe
        steps where it is another one ("old": recipe nft's old adapter), and every extra's snapshots (CRD's sampler,
        GARDO's reference, HRF's anchor) except an extra's that keeps records of a past point (``keeps_records``).
        What the held-out guard's best point copies and its rollback puts back."""
        copies: dict[str, LoraEMA] = {}
        if self.exported_ema is not None:
            copies["ema"] = self.exported_ema
        if self.ema is not None and self.ema is not self.exported_ema:
            copies["old"] = self.ema
        for extra in self.extras.values():
            if hasattr(extra, "snapshots") and not getattr(extra, "keeps_records", False):
                copies.update({name: copy for name, copy in extra.snapshots().items()
                               if all(copy is not kept for kept in copies.values())})
        return copies

    def trainer_state(self) -> dict[str, Any]:
        """The extras' JSON states by name, for the checkpoint's trainer state."""
        states = {name: extra.state_dict() for name, extra in self.extras.items() if hasattr(extra, "state_dict")}
        return {name: state for name, state in states.items() if state is not None}

    def load_trainer_state(self, state: dict[str, Any]) -> None:
        """Restore each extra whose name the resumed trainer state holds."""
        for name, extra in self.extras.items():
            if name in state and hasattr(extra, "load_state_dict"):
                extra.load_state_dict(state[name])

    def hook(self, name: str) -> list:
        """The extras' bound methods called ``name``, in the extras' order."""
        return [getattr(extra, name) for extra in self.extras.values() if hasattr(extra, name)]

    def metrics_of(self, name: str, *args) -> dict[str, float]:
        """Every extra's ``name(run, *args)`` called in the extras' order, their metrics merged."""
        metrics: dict[str, float] = {}
        for method in self.hook(name):
            metrics.update(method(self, *args))
        return metrics

    def begin_epoch(self, epoch: int) -> dict[str, float]:
        """Each extra's start-of-epoch work (HRF: a new phase re-anchors the weights); returns their metrics."""
        return self.metrics_of("begin_epoch", epoch)

    def after_scoring(self, epoch: int, traj, combined: torch.Tensor) -> dict[str, float]:
        """Each extra's work on the epoch's scored rollouts ``traj`` and combined rewards ``combined`` [N_all]
        (the diversity guard), before the update; returns their metrics."""
        return self.metrics_of("after_scoring", epoch, traj, combined)

    def after_update(self, epoch: int, traj, stats) -> dict[str, float]:
        """Each extra's work after the epoch's policy update, on its rollouts ``traj`` and the update's ``stats``
        (trainable rewards, GARDO's reference); returns their metrics."""
        return self.metrics_of("after_update", epoch, traj, stats)

    def updates_policy(self, epoch: int) -> bool:
        """Whether the policy trains on epoch ``epoch``: unless an extra's schedule keeps the epoch for itself
        (Adv-GRPO's discriminator epochs); True where no extra has a say."""
        return all(method(epoch) for method in self.hook("updates_policy"))

    def shape_rows(self, traj, groups) -> RowShaping:
        """The shaping of this epoch's rows by the extra that shapes them (GARDO), from its scored rollouts ``traj``
        and their gathered group advantages ``groups``; no shaping where none does."""
        shapers = self.hook("shape_rows")
        return shapers[0](self, traj, groups) if shapers else RowShaping()

    @property
    def kl_reference(self) -> Callable | None:
        """The KL reference's weights as a context where an extra moves them (GARDO's resets); None: the base model
        (the policy's own ``reference()``)."""
        references = self.hook("kl_weights")
        return partial(references[0], self.policy) if references else None

    @property
    def balances_rewards(self) -> bool:
        """Whether an extra balances the rewards' gradients (MARBLE): the recipe then hands each reward's own
        advantages to :meth:`backward`."""
        return bool(self.hook("balance"))

    def backward(self, step: int, advantages: torch.Tensor, per_reward: dict[str, torch.Tensor] | None, backward,
                 stats) -> None:
        """Optimizer step ``step``'s gradient: ``backward(advantages, stats)``, or, where an extra balances the
        rewards (:attr:`balances_rewards`), that extra's from each reward's own advantages ``per_reward``."""
        if per_reward is None:
            backward(advantages, stats)
            return
        self.hook("balance")[0](self.params, step, per_reward, backward, stats)

    @property
    def stopped(self) -> bool:
        """Whether an extra (a guard with policy stop) ended the run."""
        return any(getattr(extra, "stopped", False) for extra in self.extras.values())

    @property
    def beta(self) -> float:
        """The KL beta in force: train.beta, or what an extra (the diversity guard) moved it to, times every
        extra's ``kl_scale`` (the held-out guard's rollbacks)."""
        beta = next((extra.kl_beta for extra in self.extras.values() if hasattr(extra, "kl_beta")),
                    self.cfg.train.beta)
        return math.prod([beta, *(extra.kl_scale for extra in self.extras.values() if hasattr(extra, "kl_scale"))])

    def end_epoch(self, epoch: int, metrics: dict[str, float],
                  held_out: dict[str, torch.Tensor] | None) -> dict[str, float]:
        """Each extra's work on the epoch's metrics and held-out scores (the held-out guard); returns its metrics."""
        return self.metrics_of("end_epoch", epoch, metrics, held_out)

    # --- convenience accessors ------------------------------------------------------------------------------
    @property
    def faults(self) -> FaultCounter:
        """Skipped non-finite steps and unscorable epochs (flowrl/training/faults.py); every run keeps one."""
        return self.extras["faults"]

    @property
    def eval_ema(self) -> LoraEMA | None:
        """The separate eval/export EMA (recipe nft), or None where the EMA is exported itself."""
        return self.exported_ema if self.exported_ema is not self.ema else None

    @property
    def eval_guidance(self) -> float:
        """The guidance of eval grids, held-out scores and the report: log.eval_guidance_scale, else training's."""
        scale = self.cfg.log.eval_guidance_scale
        return self.guidance if scale is None else scale


class AdapterCopies:
    """An extra that only carries named adapter copies for checkpoints (recipe nft: its old adapter where an eval
    EMA takes ``ema.safetensors``, CRD's sampler)."""

    def __init__(self, copies: dict[str, LoraEMA]):
        self.copies = copies

    def snapshots(self) -> dict[str, LoraEMA]:
        return dict(self.copies)
