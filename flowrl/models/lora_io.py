"""LoRA weights in and out: diffusers format, ComfyUI format, peft directories, merged weights.

- diffusers: ``pytorch_lora_weights.safetensors`` with ``transformer.``-prefixed peft keys
  (``lora_A``/``lora_B``) and the adapter config (rank, alpha, targets) in the safetensors
  metadata, written by the pipeline's own ``save_lora_weights``.
- ComfyUI ignores that metadata and scales by ``alpha / rank`` from per-module ``.alpha`` tensors;
  without them it would apply the update at scale 1. We write the same tensors plus those alphas.
- peft directories (``adapter_config.json`` + ``adapter_model.safetensors``) load as well.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

DIFFUSERS_WEIGHT_NAME = "pytorch_lora_weights.safetensors"


def lora_state_dict(transformer) -> dict[str, torch.Tensor]:
    """A copy of the adapter's tensors, keys relative to the transformer (``blocks.0.attn.to_q.lora_A.weight``).

    Always a copy: float32 CPU parameters would otherwise be returned as themselves, and a caller that
    reads the state inside ``ema_weights(...)`` would see it revert to the raw weights on leaving."""
    from peft.utils import get_peft_model_state_dict

    return {k: v.detach().to("cpu", torch.float32, copy=True).contiguous()
            for k, v in get_peft_model_state_dict(transformer).items()}


def lora_config_dict(transformer) -> dict:
    """JSON-safe peft config of the active adapter (rank, alpha, target modules, ...)."""
    config = transformer.peft_config["default"].to_dict()
    return json.loads(json.dumps(config, default=lambda v: sorted(v) if isinstance(v, set) else str(v)))


def save_diffusers_lora(pipeline_class, out_dir: str | Path, state: dict[str, torch.Tensor], config: dict) -> Path:
    """Write ``out_dir/pytorch_lora_weights.safetensors`` through diffusers' own saver."""
    pipeline_class.save_lora_weights(out_dir, transformer_lora_layers=state, transformer_lora_adapter_metadata=config,
                                     safe_serialization=True)
    return Path(out_dir) / DIFFUSERS_WEIGHT_NAME


def save_comfyui_lora(out_file: str | Path, state: dict[str, torch.Tensor], *, alpha: float) -> Path:
    """diffusers-style keys plus one ``<module>.alpha`` scalar per adapted module."""
    tensors = {f"transformer.{k}": v for k, v in state.items()}
    for key in state:
        if key.endswith(".lora_A.weight"):
            tensors[f"transformer.{key[: -len('.lora_A.weight')]}.alpha"] = torch.tensor(float(alpha))
    save_file(tensors, str(out_file), metadata={"format": "pt"})
    return Path(out_file)


def read_lora(path: str | Path) -> tuple[dict[str, torch.Tensor], dict]:
    """Read any supported LoRA -> (state relative to the transformer, {"r", "lora_alpha", "target_modules"})."""
    path = Path(path)
    if path.is_dir():
        if (path / DIFFUSERS_WEIGHT_NAME).is_file():
            return read_lora(path / DIFFUSERS_WEIGHT_NAME)
        if (path / "adapter_config.json").is_file() and (path / "adapter_model.safetensors").is_file():
            config = json.loads((path / "adapter_config.json").read_text())
            raw = load_file(str(path / "adapter_model.safetensors"))
            state = {k.removeprefix("base_model.model."): v for k, v in raw.items()}
            return _plain_keys(state), config
        raise FileNotFoundError(f"no LoRA in {path}: expected {DIFFUSERS_WEIGHT_NAME} or a peft adapter directory")
    if not path.is_file():
        raise FileNotFoundError(f"LoRA file not found: {path}")
    if path.suffix != ".safetensors":
        raise ValueError(f"unsupported LoRA file {path}: use .safetensors")
    with safe_open(str(path), framework="pt") as handle:
        header = handle.metadata() or {}
    raw = load_file(str(path))
    alphas = {k[: -len(".alpha")]: float(v) for k, v in raw.items() if k.endswith(".alpha")}
    state = _plain_keys({k.removeprefix("transformer."): v for k, v in raw.items() if not k.endswith(".alpha")})
    flat = json.loads(header.get("lora_adapter_metadata") or "{}")  # diffusers: {"transformer.r": 32, ...}
    config = {k.removeprefix("transformer."): v for k, v in flat.items() if k.startswith("transformer.")}
    rank = next(v.shape[0] for k, v in state.items() if k.endswith("lora_A.weight"))
    config.setdefault("r", rank)
    config.setdefault("lora_alpha", next(iter(alphas.values()), float(rank)))
    config.setdefault("target_modules", sorted({k.rsplit(".lora_", 1)[0] for k in state}))
    return state, config


def _plain_keys(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Drop peft's adapter-name infix (``lora_A.default.weight`` -> ``lora_A.weight``)."""
    return {k.replace(".lora_A.default.", ".lora_A.").replace(".lora_B.default.", ".lora_B."): v for k, v in state.items()}


def load_lora_into(policy, path: str | Path) -> None:
    """Load a LoRA into ``policy``; attaches an adapter shaped like the file's if none is attached."""
    from peft.utils import set_peft_model_state_dict

    state, config = read_lora(path)
    if not policy.has_lora:
        policy.add_lora(rank=int(config["r"]), alpha=float(config["lora_alpha"]),
                        target_modules=list(config["target_modules"]))
    result = set_peft_model_state_dict(policy.transformer, state)
    unexpected = getattr(result, "unexpected_keys", None) or []
    if unexpected:
        raise ValueError(f"LoRA {path} does not fit this model: unexpected key {unexpected[0]!r}")
    for param in policy.trainable_parameters():
        param.data = param.data.float()
