"""``flowrl export-lora CHECKPOINT OUT``: a checkpoint's LoRA as files other tools load at the trained scale.

Every file has the LoRA scale folded into lora_B (see ``flowrl.models.lora_io``), so diffusers, ComfyUI and
kohya-style loaders all apply the trained update at strength 1.0, and its header records the base model,
rank, alpha, targets, flowrl version and config hash.

- ``--format all`` (default): ``pytorch_lora_weights.safetensors`` (diffusers ``pipe.load_lora_weights(OUT)``,
  ComfyUI, flowrl), ``pytorch_lora_weights_kohya.safetensors`` (native ``lora_unet_`` names: kohya-style
  loaders, ComfyUI) and ``README.md`` saying which to use where. ``RUN_DIR/lora`` holds the same set.
- ``--format diffusers`` / ``kohya``: that one file. ``--format comfyui``: kept for old scripts; the diffusers
  file under ``pytorch_lora_weights_comfyui.safetensors`` (it used to add ``.alpha`` tensors, which broke
  diffusers' SD3 loader; ComfyUI reads the folded file at the right scale without them).
- ``--ema``: the EMA weights instead of the raw ones (the checkpoint must hold them).
- ``--merge``: additionally ``OUT/transformer/``, the base transformer with the LoRA fused in and
  the peft layers removed, loadable with plain ``<Transformer class>.from_pretrained``. The base
  model is rebuilt from the checkpoint's ``config.yaml`` (``model`` section and ``seed``).
- ``--force``: overwrite files already in ``OUT``; without it an existing output is a one-line error.

A run trained with ``model.preference`` (ParetoSlider) also gets ``preference_embedding.safetensors`` (keys
``preference.*``, the rewards in its metadata), which ``flowrl.models.preference.load_preference`` installs; the
merged transformer of ``--merge`` holds the LoRA only.
"""

from __future__ import annotations

from pathlib import Path

import yaml

from flowrl.models.lora_io import COMFYUI_WEIGHT_NAME, DIFFUSERS_WEIGHT_NAME, KOHYA_WEIGHT_NAME  # noqa: F401

PIPELINE_CLASSES = {"sd3": "StableDiffusion3Pipeline", "flux": "FluxPipeline"}


def export_lora(checkpoint: str | Path, out: str | Path, *, format: str = "all", ema: bool = False,
                merge: bool = False, force: bool = False) -> list[Path]:
    """Export the LoRA of ``checkpoint`` (a checkpoint dir, or a run dir: its latest); returns written paths."""
    from flowrl.models.lora_io import write_lora_files
    from flowrl.training.checkpoint import read_checkpoint_lora, resolve_checkpoint

    try:
        path = resolve_checkpoint(checkpoint)
    except FileNotFoundError:
        raise FileNotFoundError(f"{checkpoint} holds no adapter to export: no checkpoint with lora.safetensors "
                                "(give a run dir with checkpoints/ or a checkpoint dir)") from None
    run_config, config_text = _run_config(path)
    model = run_config.get("model", {})
    family = model.get("family", "sd3")
    from flowrl.safe_io import check_safetensors

    weights = path / ("ema.safetensors" if ema else "lora.safetensors")
    if weights.is_file():  # a missing EMA file gets read_checkpoint_lora's own message
        check_safetensors(weights, "checkpoint file")
    state, lora_config = read_checkpoint_lora(path, ema=ema)
    from flowrl.models.preference import checkpoint_preference

    slider = checkpoint_preference(state, family, model.get("preference") or {})  # ParetoSlider's embedding, if any
    if merge and format == "kohya":
        raise ValueError("--merge reads the diffusers file back; use --format all or diffusers with --merge")
    out = Path(out)
    if merge and (out / "transformer").exists() and not force:
        raise ValueError(f"{out / 'transformer'} already exists; pass --force to overwrite")
    try:
        out.mkdir(parents=True, exist_ok=True)
        paths = write_lora_files(out, state, lora_config, family=family, base_model=model.get("path"),
                                 config_text=config_text, format=format, force=force,
                                 preference=slider[1] if slider else None)
    except OSError as error:  # not writable, a file in the way, a full disk
        raise ValueError(f"cannot write the export to {out}: {error.strerror or error}"
                         f"{f' ({error.filename})' if error.filename else ''}; choose a writable directory") from None
    if merge:
        paths.append(_merged_transformer(run_config, paths[0], out / "transformer"))
    return paths


def _run_config(path: Path) -> tuple[dict, str]:
    file = path / "config.yaml"
    if not file.is_file():
        raise FileNotFoundError(f"{path} has no config.yaml; cannot tell the model family")
    text = file.read_text()
    return yaml.safe_load(text) or {}, text


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
    return export_lora(args.checkpoint, args.out, format=args.format, ema=args.ema, merge=args.merge,
                       force=getattr(args, "force", False))
