"""Full tensors out of, and back into, FSDP2-sharded parameters (DTensors), for checkpoints and export.

Under FSDP2 (``fully_shard``, what accelerate's ``fsdp_version: 2`` applies) each LoRA parameter is a
DTensor holding one slice per process, and AdamW's ``exp_avg``/``exp_avg_sq`` and the EMA shadows are
DTensors of the same layout. A checkpoint must hold the same files a 1-process run writes, so:

* :func:`full` turns a DTensor into the whole tensor (an all-gather: EVERY process must call it, in the
  same order) and leaves plain tensors alone; :func:`full_state` does so for a dict, CPU float32 copies.
* :func:`like` cuts a whole tensor into the slice a DTensor ``reference`` holds on this process (no
  communication: every process has read the whole tensor from the checkpoint file).
* :func:`full_optimizer_state` is ``optimizer.state_dict()`` with whole tensors (integer parameter ids,
  exactly the 1-process layout), and :func:`shard_optimizer_state` re-slices a loaded state to the live
  (sharded) parameters after ``optimizer.load_state_dict``.

* :func:`write_weights` is flowrl's one in-place weight write, and :func:`weights_swapped` the swap built on it:
  the EMA's eval weights (:meth:`flowrl.training.ema.LoraEMA.swapped_in`), full fine-tuning's base reference
  (:meth:`flowrl.models.full_weights.FullWeights.base_swapped`) and the held-out guard's restore of its best
  point all go through them.

Without DTensors every function is the identity (or a copy), so 1-process and DDP runs take the same path.

A low module: the LoRA state of :mod:`flowrl.models.lora_io`, the EMA and the checkpoints all gather
through it, and models sit below training.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch


def is_sharded(tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


def full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a DTensor (collective: every process must call it); a plain tensor as it is."""
    return tensor.full_tensor() if is_sharded(tensor) else tensor


def full_state(state: dict[str, torch.Tensor], *, keep: bool = True) -> dict[str, torch.Tensor]:
    """Whole, detached float32 CPU copies (collective under FSDP2: every process, same key order).

    ``keep=False`` (a process that will not write them: not rank 0 of a checkpoint) takes part in the gathers and
    returns ``{}``: a full fine-tuning checkpoint's weights, EMA and AdamW state are 16 bytes a parameter, which
    every process would otherwise hold in host memory at once."""
    if not keep:
        for value in state.values():
            if is_sharded(value):
                full(value.detach())
        return {}
    return {k: full(v.detach()).to("cpu", torch.float32, copy=True).contiguous() for k, v in state.items()}


def like(value: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """``value`` (a whole tensor) laid out as ``reference``: this process's slice when it is a DTensor."""
    if not is_sharded(reference):
        return value
    from torch.distributed.tensor import distribute_tensor

    value = value.to(device=reference.device, dtype=reference.dtype)
    # src_data_rank=None: every process cuts its own slice of the tensor it already holds; no scatter.
    return distribute_tensor(value, reference.device_mesh, reference.placements, src_data_rank=None)


def full_optimizer_state(optimizer: torch.optim.Optimizer, *, keep: bool = True) -> dict:
    """``optimizer.state_dict()`` with every sharded state tensor gathered (collective under FSDP2); ``keep=False``
    gathers and returns ``{}`` (see :func:`full_state`)."""
    state = optimizer.state_dict()
    if "state" not in state:  # not a torch.optim layout (DeepSpeed's ZeRO optimizer): as it is
        return state
    if not keep:
        for entry in state["state"].values():
            for value in entry.values():
                if is_sharded(value):
                    full(value)
        return {}
    state["state"] = {index: {k: full(v).cpu() if torch.is_tensor(v) else v for k, v in entry.items()}
                      for index, entry in state["state"].items()}
    return state


@torch.no_grad()
def shard_loaded_optimizer_state(optimizer: torch.optim.Optimizer, state: dict) -> dict:
    """Before ``optimizer.load_state_dict(state)``: cut each whole state tensor of a sharded parameter into this
    process's slice, one tensor at a time. ``load_state_dict`` would otherwise move every whole tensor onto the
    parameter's GPU before :func:`shard_optimizer_state` slices it (full fine-tuning of FLUX: 95 GB of AdamW
    state at once). The same values either way; returns ``state``."""
    if "state" not in state:
        return state
    for saved, group in zip(state["param_groups"], optimizer.param_groups):
        for index, param in zip(saved["params"], group["params"]):
            entry = state["state"].get(index, {})
            if not is_sharded(param):
                continue
            for key, value in entry.items():
                if torch.is_tensor(value) and not is_sharded(value) and value.shape == param.shape:
                    entry[key] = like(value, param)
    return state


@torch.no_grad()
def shard_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """After ``optimizer.load_state_dict(whole state)``: lay each state tensor out as its parameter is.

    ``Optimizer.load_state_dict`` moves a state tensor to its parameter's device and dtype but cannot
    shard it; a parameter-shaped state (``exp_avg``) of a DTensor parameter becomes its slice here.
    Scalars (``step``) stay as they are."""
    for group in optimizer.param_groups:
        for param in group["params"]:
            if not is_sharded(param):
                continue
            entry = optimizer.state.get(param, {})
            for key, value in entry.items():
                if torch.is_tensor(value) and not is_sharded(value) and value.shape == param.shape:
                    entry[key] = like(value, param)


@torch.no_grad()
def write_weights(params: Sequence[torch.nn.Parameter], values: Sequence[torch.Tensor], *, exchange: bool,
                  kept: Sequence[torch.Tensor | None] | None = None,
                  one_at_a_time: bool = False) -> list[torch.Tensor | None]:
    """Write ``values`` into the parameters in place, through ``.data``: autograd's saved weights see the new values,
    and under FSDP2 the copy lands in the storage the all-gather reads (rebinding ``data`` would not).

    ``exchange``: the values take the parameters' old values in return, so a second call with the same lists undoes
    the first bit for bit (a swap); otherwise the values are left as they are (a load). Under FSDP2 the root
    module's parameters stay gathered between a forward and its backward (plain tensors while their store is a
    shard): those get the whole value (an all-gather, the same order on every process), and their old value is
    kept aside and returned, for the call that undoes the swap to take as ``kept``.

    Plain tensors are copied in two foreach calls; DTensors (no foreach sharding rule) and ``one_at_a_time`` (full
    weights: one temporary tensor at a time, never a second copy of the model) go one tensor at a time."""
    params, values = list(params), list(values)
    if not params:
        return []
    kept = list(kept) if kept is not None else [None] * len(params)
    if not one_at_a_time and not any(is_sharded(t) for t in [*values, *(p.data for p in params)]):
        live = torch._foreach_mul([p.data for p in params], 1) if exchange else None  # copies, one launch
        torch._foreach_copy_([p.data for p in params], [v if k is None else k for v, k in zip(values, kept)])
        if exchange:
            torch._foreach_copy_(values, live)
        return [None] * len(params)
    aside: list[torch.Tensor | None] = []
    for param, value, earlier in zip(params, values, kept):
        if earlier is not None:  # undoing a swap of a gathered root parameter: its value was kept aside
            param.data.copy_(earlier)
            aside.append(None)
            continue
        live = param.data.clone() if exchange else None
        if is_sharded(value) and not is_sharded(param.data):
            param.data.copy_(full(value))
            aside.append(live)
            continue
        param.data.copy_(value)
        if exchange:
            value.copy_(live)
        aside.append(None)
    return aside


@contextlib.contextmanager
def weights_swapped(params: Sequence[torch.nn.Parameter], values: Sequence[torch.Tensor], *,
                    one_at_a_time: bool = False) -> Iterator[None]:
    """``values`` in the live parameters for the block (held by ``values`` meanwhile), both back bit for bit after
    (:func:`write_weights` twice)."""
    kept = write_weights(params, values, exchange=True, one_at_a_time=one_at_a_time)
    try:
        yield
    finally:
        write_weights(params, values, exchange=True, kept=kept, one_at_a_time=one_at_a_time)
