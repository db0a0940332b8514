"""``flowrl export-lora CHECKPOINT OUT``: a checkpoint's LoRA as files other tools load.

- ``--format diffusers`` (default): ``OUT/pytorch_lora_weights.safetensors``, written by the
  family's pipeline class (``StableDiffusion3Pipeline`` / ``FluxPipeline``), so
  ``pipe.load_lora_weights(OUT)`` works and the peft config (rank, alpha) rides in the metadata.
- ``--format comfyui``: ``OUT/pytorch_lora_weights_comfyui.safetensors``, the same tensors plus
  one ``<module>.alpha`` per adapted module (ComfyUI ignores metadata and scales by alpha / rank).
- ``--ema``: the EMA weights instead of the raw ones (the checkpoint must hold them).
- ``--merge``: additionally ``OUT/transformer/``, the base transformer with the LoRA fused in and
  the peft layers removed, loadable with plain ``<Transformer class>.from_pretrained``. The base
  model is rebuilt from the checkpoint's ``config.yaml`` (``model`` section and ``seed``).
"""

from __future__ import annotations

from pathlib import Path

import yaml

COMFYUI_WEIGHT_NAME = "pytorch_lora_weights_comfyui.safetensors"
PIPELINE_CLASSES = {"sd3": "StableDiffusion3Pipeline", "flux": "FluxPipeline"}


def export_lora(checkpoint: str | Path, out: str | Path, *, format: str = "diffusers", ema: bool = False,
                merge: bool = False) -> list[Path]:
    """Export the LoRA of ``checkpoint`` (a checkpoint dir, or a run dir: its latest); returns written paths."""
    from flowrl.models.lora_io import save_comfyui_lora, save_diffusers_lora
    from flowrl.training.checkpoint import read_checkpoint_lora, resolve_checkpoint

    if format not in ("diffusers", "comfyui"):
        raise ValueError(f"unknown export format {format!r}; use diffusers or comfyui")
    path = resolve_checkpoint(checkpoint)
    run_config = _run_config(path)
    family = run_config.get("model", {}).get("family", "sd3")
    state, lora_config = read_checkpoint_lora(path, ema=ema)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    if format == "diffusers":
        import diffusers

        written = save_diffusers_lora(getattr(diffusers, PIPELINE_CLASSES[family]), out, state, lora_config)
    else:
        written = save_comfyui_lora(out / COMFYUI_WEIGHT_NAME, state, alpha=float(lora_config["lora_alpha"]))
    paths = [written]
    if merge:
        paths.append(_merged_transformer(run_config, written, out / "transformer"))
    return paths


def _run_config(path: Path) -> dict:
    file = path / "config.yaml"
    if not file.is_file():
        raise FileNotFoundError(f"{path} has no config.yaml; cannot tell the model family")
    return yaml.safe_load(file.read_text()) or {}


def _merged_transformer(run_config: dict, lora_file: Path, out_dir: Path) -> Path:
    """Base transformer + fused LoRA, saved without peft layers (read back through ``lora_file``)."""
    from flowrl.config import ModelConfig, from_dict
    from flowrl.models import build_policy
    from flowrl.models.lora_io import load_lora_into

    model = from_dict(ModelConfig, run_config.get("model", {}), prefix="model")
    policy = build_policy(model.family, model.path, dtype=model.dtype, seed=int(run_config.get("seed", 0)))
    load_lora_into(policy, lora_file)  # also proves the exported file loads into the base model
    transformer = policy.transformer
    transformer.fuse_lora()  # W += (alpha / r) * B @ A, per adapted module
    transformer.unload_lora()  # swap each peft layer for its (now merged) base layer
    transformer.save_pretrained(out_dir, safe_serialization=True)
    return out_dir


def run_export(args) -> list[Path]:
    return export_lora(args.checkpoint, args.out, format=args.format, ema=args.ema, merge=args.merge)
