"""An exponential moving average of the trainable LoRA weights, for eval grids and export.

RL fine-tuning is noisy from one optimizer step to the next; evaluating and exporting an EMA of
the adapter gives smoother, usually better images. The averaging itself is diffusers'
:class:`~diffusers.training_utils.EMAModel` (same decay schedule as the diffusers training
scripts); this wrapper adds what a checkpoint needs: the EMA tensors keyed by parameter NAME.

Key choice: :meth:`LoraEMA.state_tensors` uses the keys of
:func:`flowrl.models.lora_io.lora_state_dict`, i.e. the transformer's parameter names with peft's
adapter-name infix removed (``blocks.0.attn.to_q.lora_A.default.weight`` ->
``blocks.0.attn.to_q.lora_A.weight``). So ``ema.safetensors`` and ``lora.safetensors`` of a
checkpoint share keys, and the EMA tensors can be exported or loaded exactly like the raw LoRA.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Sequence

import torch


def peft_key(name: str, adapter: str = "default") -> str:
    """Parameter name -> ``lora_state_dict`` key: drop the ``.<adapter>`` infix after ``lora_A/B``."""
    for part in ("lora_A", "lora_B", "lora_magnitude_vector"):
        name = name.replace(f".{part}.{adapter}.", f".{part}.")
        if name.endswith(f".{part}.{adapter}"):
            name = name[: -len(f".{adapter}")]
    return name


class LoraEMA:
    """EMA of named trainable parameters; call :meth:`step` after every optimizer step.

    ``decay`` is the per-step decay. ``update_after_step`` steps copy the weights instead of
    averaging them (diffusers' semantics: the EMA starts from the weights after that step).
    ``power=None`` keeps the decay constant; a float (e.g. 2/3) enables diffusers' warmup
    ``1 - (1 + step) ** -power``, capped at ``decay``, so early steps average over fewer updates.
    """

    def __init__(self, named_parameters: Sequence[tuple[str, torch.nn.Parameter]], decay: float = 0.9,
                 update_after_step: int = 0, power: float | None = None, adapter: str = "default"):
        from diffusers.training_utils import EMAModel

        named_parameters = list(named_parameters)
        if not named_parameters:
            raise ValueError("LoraEMA needs at least one trainable parameter (attach a LoRA first)")
        self.names = [peft_key(n, adapter) for n, _ in named_parameters]
        if len(set(self.names)) != len(self.names):
            raise ValueError("LoraEMA: parameter names collide after removing the adapter name")
        self.parameters = [p for _, p in named_parameters]
        warmup, decay = power is not None, float(decay)
        self.decay = decay  # the decay scheduled_step averages at (step's pinned one may overwrite the model's)
        # Without warmup, min_decay=decay pins diffusers' default (1+s)/(10+s) ramp to a constant decay.
        self.model = EMAModel(self.parameters, decay=decay, min_decay=0.0 if warmup else decay,
                              update_after_step=update_after_step, use_ema_warmup=warmup,
                              power=power if warmup else 2 / 3, foreach=True)

    @property
    def optimization_step(self) -> int:
        return self.model.optimization_step

    def step(self, decay: float | None = None) -> None:
        """Fold the current weights into the average (after ``optimizer.step()``).

        ``decay`` pins this step's decay from the second call on (a schedule the caller computes; the
        first call copies, diffusers' rule; :meth:`blend` applies it on every call); None uses the decay
        the EMA was built with."""
        if decay is not None:
            self.model.decay = self.model.min_decay = float(decay)
        self.model.step(self.parameters)

    def scheduled_step(self, step: int, *, start: int = 1, every: int = 1, warmup: str = "none") -> None:
        """The update after optimizer step ``step`` (1: the first) on a schedule: through step ``start``
        the EMA copies the live weights; from then on every ``every``-th step folds them in at the built
        decay, or with ``warmup="flow_grpo"`` at Flow-GRPO's ramp ``min(decay, (1 + k) / (10 + k))``, k the
        steps since ``start`` (its ``EMAModuleWrapper.get_current_decay``). start=1, every=1, warmup none
        is :meth:`step`'s (diffusers') rule; start=0 averages from the initial weights, as Flow-GRPO does."""
        since = step - start
        if since > 0 and since % every:
            return
        decay = 0.0 if since <= 0 else self.decay
        if since > 0 and warmup == "flow_grpo":
            decay = min(decay, (1 + since) / (10 + since))
        self.blend(decay)

    def blend(self, decay: float) -> None:
        """``shadow = decay * shadow + (1 - decay) * weights``, exactly this decay on every call, the first
        included (where :meth:`step` copies, diffusers' rule): the update of an adapter snapshot that follows
        the trained one on a schedule of its own (:func:`decay_schedule`)."""
        self.model.get_decay = lambda _: decay  # noqa: E731  diffusers' own update, at this decay
        try:
            self.model.step(self.parameters)
        finally:
            del self.model.get_decay

    # --- tensors, by name -------------------------------------------------------------
    def state_tensors(self, *, keep: bool = True) -> dict[str, torch.Tensor]:
        """EMA weights as float32 CPU tensors, keyed like ``lora_state_dict`` (safetensors-ready).

        Under FSDP2 the shadows are DTensors laid out as their (sharded) parameters; they are gathered
        whole here, so every process must call this; ``keep=False`` gathers and returns ``{}`` (a process that
        writes nothing)."""
        from flowrl.core.sharded import full_state

        return full_state(dict(zip(self.names, self.model.shadow_params)), keep=keep)

    @torch.no_grad()
    def load_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        """Inverse of :meth:`state_tensors`; every tracked name must be present with its shape."""
        from flowrl.core.sharded import like

        missing = [n for n in self.names if n not in tensors]
        if missing:
            raise ValueError(f"EMA state lacks {len(missing)} tensor(s), e.g. {missing[0]!r}")
        for name, shadow in zip(self.names, self.model.shadow_params):
            value = tensors[name]
            if value.shape != shadow.shape:
                raise ValueError(f"EMA tensor {name!r} has shape {tuple(value.shape)}, expected {tuple(shadow.shape)}")
            shadow.copy_(like(value.to(device=shadow.device, dtype=shadow.dtype), shadow))  # FSDP2: this rank's slice

    # --- counters and hyper-parameters (JSON-safe) --------------------------------------
    def state_dict(self) -> dict:
        """Step counter and schedule, without tensors (those go through :meth:`state_tensors`)."""
        state = dict(self.model.state_dict())
        state.pop("shadow_params")
        return state

    def load_state_dict(self, state: dict) -> None:
        self.model.load_state_dict({k: v for k, v in state.items() if k != "shadow_params"})

    # --- eval with EMA weights ------------------------------------------------------------
    @contextlib.contextmanager
    def swapped_in(self) -> Iterator[None]:
        """Temporarily put the EMA weights into the live parameters; the trained ones come back after, bit for bit.
        The live weights wait in the shadows' storage meanwhile (:func:`flowrl.core.sharded.weights_swapped`: no
        host copy, since recipe nft swaps the old adapter in for every micro-batch)."""
        from flowrl.core.sharded import weights_swapped

        with weights_swapped(self.parameters, self.model.shadow_params):
            yield


class AdapterSnapshot(LoraEMA):
    """A copy of the trainable LoRA weights taken at one moment: GARDO's KL reference, HRF's phase anchor, the
    diversity guard's best weights. One class for all of them, so a checkpoint saves and restores each by name
    (``<name>.safetensors``) and each lives as the parameters do (device, dtype, FSDP2 slice), ready to swap in.

    ``taken``: whether it holds weights yet; one built with ``taken=False`` (the guard's best, before any
    measurement) is skipped by checkpoints until :meth:`take` or a load fills it."""

    def __init__(self, named_parameters: Sequence[tuple[str, torch.nn.Parameter]], *, taken: bool = True,
                 adapter: str = "default"):
        super().__init__(named_parameters, decay=0.0, adapter=adapter)
        self.taken = taken

    def take(self) -> None:
        """Copy the live weights (decay 0: the average becomes them)."""
        self.step(0.0)
        self.taken = True

    def load_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        super().load_state_tensors(tensors)
        self.taken = True


# DiffusionNFT's old-policy schedules by their ``decay_type`` number (scripts/train_nft_sd3.py, ``return_decay``),
# as ``(start_step, start_value, slope, end_value)``: 0 keeps no memory (the old adapter is the trained one as
# it ended the last epoch), 1 is its default ramp, 2 its OCR config's, which holds 0 for 75 steps.
NFT_DECAY_TYPES: dict[int, tuple[float, float, float, float]] = {
    0: (0, 0.0, 0.0, 0.0),
    1: (0, 0.0, 0.001, 0.5),
    2: (75, 0.0, 0.0075, 0.999),
}


def decay_schedule(step: int, schedule: int | Sequence[float]) -> float:
    """The decay of an adapter snapshot after ``step`` optimizer steps (the count after the epoch's last one).

    ``schedule`` is a :data:`NFT_DECAY_TYPES` number or ``[start_step, start_value, slope, end_value]``:
    ``start_value`` before ``start_step``, then ``min(start_value + slope * (step - start_step), end_value)``
    (Flow-Factory's ``compute_decay`` format, of which DiffusionNFT's types are the ``start_value = 0`` cases)."""
    start_step, start_value, slope, end_value = (NFT_DECAY_TYPES[schedule] if isinstance(schedule, int)
                                                 else schedule)
    if step < start_step:
        return float(start_value)
    return float(min(start_value + (step - start_step) * slope, end_value))


def ema_weights(ema: LoraEMA | None) -> contextlib.AbstractContextManager:
    """The EMA weights swapped in for the block when an EMA is kept; the live weights otherwise."""
    return ema.swapped_in() if ema is not None else contextlib.nullcontext()
