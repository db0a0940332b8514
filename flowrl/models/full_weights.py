"""Full fine-tuning (``model.trainable: full``): the transformer's own weights are trained, all of them or those of
the modules ``model.trainable_modules`` names, and the reference model is the frozen base they started from.

Why the reference is a copy of the trained tensors only, kept as they are laid out: with LoRA the base model is the
live weights with the adapter switched off, free of charge; with full training the base has to be kept. A frozen
deep copy of the whole transformer would hold every tensor on every GPU (FLUX.1-dev in bf16: 24 GB a GPU, sharded
or not); offloading the base to CPU memory moves it over PCIe for every reference forward. :class:`FullWeights`
keeps a float32 copy of the *trained* tensors only, in the parameters' own layout: under FSDP2 each process holds
its slice (FLUX.1-dev on 8 GPUs: 6 GB), and partial training keeps only the matched modules. A reference forward
swaps the copy in and the live weights out in place, one tensor at a time (no second copy of the model exists
at any moment), and swaps back after: the values come back bit for bit.

The trained tensors are float32 master weights (a bf16 model computes under autocast, as LoRA's float32 adapter
does); the copy is taken after ``accelerator.prepare`` (:meth:`FullWeights.take_base`), so it is sharded as the
parameters are, and before a checkpoint is loaded, so it is the base and not the resumed weights.
"""

from __future__ import annotations

import contextlib
import re
from typing import Iterator, Sequence

import torch

FULL_WEIGHT_NAME = "weights.safetensors"
"""A full-training checkpoint's trained tensors (the LoRA checkpoint's ``lora.safetensors``)."""


def module_name(parameter_name: str) -> str:
    """``transformer_blocks.0.attn.to_q.weight`` -> ``transformer_blocks.0.attn.to_q``."""
    return parameter_name.rpartition(".")[0]


def matched_parameters(transformer: torch.nn.Module, patterns: Sequence[str]) -> list[str]:
    """Names of the parameters whose module name matches any of ``patterns`` (``re.search``); all of them when
    ``patterns`` is empty. A pattern that matches nothing is a one-line ValueError (a typo would train nothing)."""
    names = [n for n, _ in transformer.named_parameters()]
    if not patterns:
        return names
    compiled = [re.compile(p) for p in patterns]
    for pattern in compiled:
        if not any(pattern.search(module_name(n)) for n in names):
            example = module_name(names[0]) if names else "(no parameters)"
            raise ValueError(f"model.trainable_modules: {pattern.pattern!r} matches no module of the transformer "
                             f"(module names look like {example!r})")
    return [n for n in names if any(p.search(module_name(n)) for p in compiled)]


class FullWeights:
    """The trained transformer tensors of a full fine-tuning run and the frozen base they started from."""

    def __init__(self, transformer: torch.nn.Module, names: Sequence[str], patterns: Sequence[str] = ()):
        self.transformer = transformer
        self.names = list(names)  # the trained parameters, in named_parameters() order
        self.patterns = list(patterns)
        self.dtype = next(transformer.parameters()).dtype  # the model's own dtype, that of an export
        self.base: list[torch.Tensor] | None = None  # float32 copies laid out as the parameters; None: not taken

    def parameters(self) -> list[torch.nn.Parameter]:
        """The live trained parameters (looked up by name: FSDP2 replaces the parameter objects)."""
        named = dict(self.transformer.named_parameters())
        return [named[n] for n in self.names]

    def config(self) -> dict:
        """What a checkpoint records instead of a LoRA config."""
        return {"trainable": "full", "trainable_modules": self.patterns, "tensors": len(self.names)}

    @torch.no_grad()
    def take_base(self) -> None:
        """Copy the trained tensors as they are now (the base) into the reference; call after the parameters are
        laid out (``accelerator.prepare``: FSDP2 shards) and before a checkpoint is loaded or a forward runs."""
        self.base = [p.detach().clone() for p in self.parameters()]

    @contextlib.contextmanager
    def base_swapped(self) -> Iterator[None]:
        """The base weights in the live parameters for the block, the trained ones back after, bit for bit
        (:func:`flowrl.core.sharded.weights_swapped`, one tensor at a time: never a second copy of the model)."""
        if self.base is None:  # not taken yet: the live weights still are the base
            yield
            return
        from flowrl.core.sharded import weights_swapped

        # What the modules hold now: under FSDP2 a shard, or the gathered tensor of a root parameter.
        with weights_swapped(self.parameters(), self.base, one_at_a_time=True):
            torch.clear_autocast_cache()  # autocast caches a float32 weight's bf16 cast: never reuse the other's
            try:
                yield
            finally:
                torch.clear_autocast_cache()


def make_full_trainable(policy, patterns: Sequence[str] = ()) -> FullWeights:
    """Freeze everything but the matched transformer parameters (all with no ``patterns``), which become float32
    master weights; ``policy.full_weights`` then holds them and the base reference (:meth:`policy.reference`)."""
    transformer = policy.transformer
    names = matched_parameters(transformer, patterns)
    transformer.requires_grad_(False)
    policy.vae.requires_grad_(False)
    for encoder in policy.text_encoders():
        encoder.requires_grad_(False)
    policy.full_weights = FullWeights(transformer, names, patterns)  # records the model's dtype before the cast
    named = dict(transformer.named_parameters())
    for name in names:
        named[name].data = named[name].data.float()
        named[name].requires_grad_(True)
    return policy.full_weights


def merge_lora(policy) -> None:
    """Fuse an attached LoRA into the base weights and remove its layers (``lora.init_from`` with full training:
    continue from the adapter's model with every weight trainable)."""
    policy.transformer.fuse_lora()  # W += (alpha / r) * B @ A, per adapted module
    policy.transformer.unload_lora()
    policy.has_lora = False


def trained_state(policy, *, keep: bool = True) -> dict[str, torch.Tensor]:
    """Whole float32 CPU copies of the trained tensors, keyed by parameter name (collective under FSDP2; ``keep=False``
    takes part in the gathers and returns ``{}``)."""
    from flowrl.core.sharded import full_state

    return full_state(dict(policy.named_trainable_parameters()), keep=keep)


@torch.no_grad()
def load_trained_state(policy, state: dict[str, torch.Tensor]) -> None:
    """Put a :func:`trained_state` back into the live parameters (this process's slice under FSDP2)."""
    from flowrl.core.sharded import like

    live = dict(policy.named_trainable_parameters())
    missing, extra = sorted(set(live) - set(state)), sorted(set(state) - set(live))
    if missing or extra:
        raise ValueError(f"full weights do not fit this model: {len(missing)} trained tensors missing, {len(extra)} "
                         f"extra (e.g. {(missing or extra)[0]!r})")
    for name, param in live.items():
        param.data.copy_(like(state[name].to(device=param.device, dtype=param.dtype), param))


def save_transformer(policy, out_dir, *, write: bool = True):
    """The live transformer as a diffusers model folder (``config.json`` and ``diffusion_pytorch_model*.safetensors``,
    sharded at 10 GB with an index, as ``save_pretrained`` writes them) in the model's own dtype, which plain
    ``<Transformer class>.from_pretrained`` loads. Every tensor is gathered whole, one at a time (collective under
    FSDP2: every process calls this); only ``write`` ones write. Returns ``out_dir``."""
    from pathlib import Path

    from huggingface_hub import save_torch_state_dict

    from flowrl.core.safe_io import shared_mode
    from flowrl.core.sharded import full

    dtype = policy.full_weights.dtype if policy.full_weights is not None else policy.dtype
    state = {}
    for name, tensor in policy.transformer.state_dict().items():
        whole = full(tensor.detach())
        if write:
            state[name] = whole.to("cpu", dtype if whole.is_floating_point() else whole.dtype, copy=True).contiguous()
    out_dir = Path(out_dir)
    if write:
        out_dir.mkdir(parents=True, exist_ok=True)
        policy.transformer.save_config(out_dir)
        save_torch_state_dict(state, out_dir, filename_pattern="diffusion_pytorch_model{suffix}.safetensors",
                              max_shard_size="10GB")
        shared_mode(out_dir)
    return out_dir
