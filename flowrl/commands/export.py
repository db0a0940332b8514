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

A full fine-tuning checkpoint (``model.trainable=full``, ``weights.safetensors``) gives ``OUT/transformer/``, the
trained transformer as a diffusers folder (``from_pretrained``), and with ``--svd-rank R`` also the LoRA files of
``W_trained - W_base`` truncated to rank R by SVD (ComfyUI and other LoRA loaders), the relative reconstruction
error printed as a per-layer mean and max.

A run trained with ``model.preference`` (ParetoSlider) also gets ``preference_embedding.safetensors`` (keys
``preference.*``, the rewards in its metadata), which ``flowrl.models.preference.load_preference`` installs; the
merged transformer of ``--merge`` holds the LoRA only.
"""

from __future__ import annotations

from pathlib import Path

import torch
import yaml

from flowrl.models.lora_io import COMFYUI_WEIGHT_NAME, DIFFUSERS_WEIGHT_NAME, KOHYA_WEIGHT_NAME  # noqa: F401

PIPELINE_CLASSES = {"sd3": "StableDiffusion3Pipeline", "flux": "FluxPipeline"}


def export_lora(checkpoint: str | Path, out: str | Path, *, format: str = "all", ema: bool = False,
                merge: bool = False, force: bool = False, svd_rank: int | None = None) -> list[Path]:
    """Export the LoRA of ``checkpoint`` (a checkpoint dir, or a run dir: its latest); returns written paths.
    A full fine-tuning checkpoint gives ``OUT/transformer`` and, with ``svd_rank``, a LoRA extracted by SVD."""
    from flowrl.models.lora_io import write_lora_files
    from flowrl.training.checkpoint import is_full_checkpoint, read_checkpoint_lora, resolve_checkpoint

    try:
        path = resolve_checkpoint(checkpoint)
    except FileNotFoundError:
        raise FileNotFoundError(f"{checkpoint} holds no adapter to export: no checkpoint with lora.safetensors "
                                "or weights.safetensors (give a run dir with checkpoints/ or a checkpoint dir)") from None
    run_config, config_text = _run_config(path)
    if svd_rank is not None and svd_rank < 1:
        raise ValueError(f"--svd-rank must be >= 1, got {svd_rank}")
    if is_full_checkpoint(path):
        if format != "all" and svd_rank is None:
            raise ValueError(f"{path} holds fully fine-tuned weights, which export as a transformer folder; --format "
                             f"{format} writes a LoRA file: add --svd-rank R to extract one, or leave out --format")
        return export_full(path, out, run_config, config_text, format=format, ema=ema, force=force, svd_rank=svd_rank)
    if svd_rank is not None:
        raise ValueError(f"--svd-rank extracts a LoRA from full weights, and {path} holds a LoRA already: "
                         "export it without --svd-rank")
    model = run_config.get("model", {})
    family = model.get("family", "sd3")
    from flowrl.core.safe_io import check_safetensors

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


def export_full(path: Path, out: str | Path, run_config: dict, config_text: str, *, format: str = "all",
                ema: bool = False, force: bool = False, svd_rank: int | None = None) -> list[Path]:
    """A full fine-tuning checkpoint: ``OUT/transformer`` (the base model with the trained tensors, a diffusers
    folder in the model's dtype) and, with ``svd_rank``, the LoRA of ``W_trained - W_base`` by truncated SVD
    (:mod:`flowrl.models.svd_lora`) in the ``format`` files, its reconstruction error printed. The base model is
    rebuilt from the checkpoint's ``config.yaml``, without ``lora.init_from``: the LoRA holds the whole change from
    the model users load."""
    from flowrl.config import ModelConfig, from_dict
    from flowrl.models import build_policy
    from flowrl.models.full_weights import make_full_trainable, save_transformer
    from flowrl.models.lora_io import write_lora_files
    from flowrl.core.safe_io import check_safetensors
    from flowrl.training.checkpoint import read_checkpoint_lora, weights_file

    check_safetensors(path / "ema.safetensors" if ema and (path / "ema.safetensors").is_file() else weights_file(path),
                      "checkpoint file")
    trained, _ = read_checkpoint_lora(path, ema=ema)
    out = Path(out)
    if (out / "transformer").exists() and not force:
        raise ValueError(f"{out / 'transformer'} already exists; pass --force to overwrite")
    model = from_dict(ModelConfig, run_config.get("model", {}), prefix="model")
    policy = build_policy(model.family, model.path, dtype=model.dtype, seed=int(run_config.get("seed", 0)))
    paths = []
    if svd_rank is not None:  # before anything is written: a rank it refuses leaves no files
        from flowrl.models.svd_lora import extract_lora

        state, lora_config, report = extract_lora(policy.transformer, trained, svd_rank)
    try:
        out.mkdir(parents=True, exist_ok=True)
        if svd_rank is not None:
            paths += write_lora_files(out, state, lora_config, family=model.family, base_model=model.path,
                                      config_text=config_text, format=format, force=force)
            print(f"flowrl export-lora: {report.summary()}")
        make_full_trainable(policy, model.trainable_modules)  # records the model's dtype, the export's
        named = dict(policy.transformer.named_parameters())
        with torch.no_grad():
            for name, value in trained.items():
                named[name].data = value.to(named[name].device)
        paths.append(save_transformer(policy, out / "transformer"))
    except OSError as error:  # not writable, a file in the way, a full disk
        raise ValueError(f"cannot write the export to {out}: {error.strerror or error}"
                         f"{f' ({error.filename})' if error.filename else ''}; choose a writable directory") from None
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
                       force=getattr(args, "force", False), svd_rank=getattr(args, "svd_rank", None))
