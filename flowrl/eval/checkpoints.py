"""What ``flowrl eval --checkpoint SPEC`` evaluates, and putting it into the policy.

A SPEC is ``[LABEL=]WHAT[:ema]`` where WHAT is ``base`` (the model without adapter), a LoRA file
(``.safetensors`` in diffusers, ComfyUI or checkpoint format), a peft adapter directory, an exported
directory (``pytorch_lora_weights.safetensors``), a checkpoint directory, or a run directory (its final
``lora/`` export when there is one, else its latest checkpoint). ``:ema`` takes a checkpoint's EMA
weights instead of the raw ones. A LoRA that was trained on another model is refused with one line
before anything is generated: by the run's recorded model when there is one, and by tensor shapes.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch
import yaml


@dataclass(frozen=True)
class EvalCheckpoint:
    label: str
    path: Path | None = None  # a LoRA file, adapter dir or checkpoint dir; None for the base model
    ema: bool = False  # the checkpoint's EMA weights

    @property
    def is_base(self) -> bool:
        return self.path is None


def parse_checkpoint(spec: str) -> EvalCheckpoint:
    """``[LABEL=]WHAT[:ema]`` -> an :class:`EvalCheckpoint` (see the module docstring)."""
    from flowrl.training.checkpoint import is_checkpoint, resolve_checkpoint

    label, what = (spec.split("=", 1) if "=" in spec and not os.path.exists(spec) else (None, spec))
    ema = what.endswith(":ema") and not os.path.exists(what)
    what = what.removesuffix(":ema") if ema else what
    if what == "base":
        if ema:
            raise ValueError("base:ema has no meaning: the base model has no EMA weights")
        return EvalCheckpoint(label or "base")
    path = Path(what)
    if not path.exists():
        raise FileNotFoundError(f"checkpoint not found: {what} (give base, a LoRA .safetensors file, an adapter or "
                                "export directory, a checkpoint directory or a run directory; append :ema for EMA)")
    if path.is_dir() and not is_checkpoint(path):
        if ema or not _is_adapter_dir(path):
            final = path / "lora"
            try:
                path = final if not ema and _is_adapter_dir(final) else resolve_checkpoint(path)
            except FileNotFoundError:
                raise FileNotFoundError(f"{what} holds no adapter to evaluate: no LoRA file, no lora/ export and no "
                                        "checkpoint; give a run directory, a checkpoint or export directory, a LoRA "
                                        ".safetensors file, or base") from None
    if ema and not (path.is_dir() and (path / "ema.safetensors").is_file()):
        raise ValueError(f"{what} has no EMA weights (trained with train.ema=false): drop :ema")
    if path.name == "lora":  # RUN_DIR/lora: the run's final export
        default = path.parent.name
    elif is_checkpoint(path):  # RUN_DIR/checkpoints/step_000040
        default = f"{path.parent.parent.name}@{path.name}"
    else:
        default = path.stem
    return EvalCheckpoint(label or default + ("-ema" if ema else ""), path, ema)


def _is_adapter_dir(path: Path) -> bool:
    from flowrl.models.lora_io import DIFFUSERS_WEIGHT_NAME

    return path.is_dir() and ((path / DIFFUSERS_WEIGHT_NAME).is_file() or (path / "adapter_config.json").is_file())


def unique_labels(checkpoints: list[EvalCheckpoint]) -> list[EvalCheckpoint]:
    """Append -2, -3, ... to repeated labels, so each checkpoint has its own image folder."""
    seen: dict[str, int] = {}
    out = []
    for checkpoint in checkpoints:
        count = seen[checkpoint.label] = seen.get(checkpoint.label, 0) + 1
        out.append(checkpoint if count == 1 else EvalCheckpoint(f"{checkpoint.label}-{count}", checkpoint.path,
                                                                checkpoint.ema))
    return out


def read_adapter(checkpoint: EvalCheckpoint) -> tuple[dict[str, torch.Tensor], dict]:
    """The adapter's LoRA ``(state, peft config)`` with keys relative to the transformer (a preference embedding:
    :func:`read_slider`)."""
    from flowrl.models.lora_io import read_lora
    from flowrl.models.preference import split_preference
    from flowrl.training.checkpoint import is_checkpoint, is_full_checkpoint, read_checkpoint_lora

    if is_checkpoint(checkpoint.path):
        if is_full_checkpoint(checkpoint.path):
            raise ValueError(f"{checkpoint.path} holds full fine-tuning weights (model.trainable=full), which flowrl "
                             "eval does not load yet: export them (flowrl export-lora RUN OUT --svd-rank 64) and "
                             "evaluate the LoRA, or load RUN_DIR/transformer with diffusers")
        state, config = read_checkpoint_lora(checkpoint.path, ema=checkpoint.ema)
        return split_preference(state)[0], config
    return read_lora(checkpoint.path)


def read_slider(checkpoint: EvalCheckpoint) -> tuple[dict[str, torch.Tensor], dict[str, str]] | None:
    """The checkpoint's ParetoSlider preference embedding ``(tensors, header)``, or None where it has none: from a
    checkpoint's adapter state (described by its run's ``model.preference``) or an export's own file."""
    from flowrl.models.preference import checkpoint_preference, preference_file, read_preference
    from flowrl.training.checkpoint import is_checkpoint, read_checkpoint_lora

    if checkpoint.is_base:
        return None
    if is_checkpoint(checkpoint.path):
        model = recorded_model(checkpoint) or {}
        state, _ = read_checkpoint_lora(checkpoint.path, ema=checkpoint.ema)
        return checkpoint_preference(state, model.get("family", "sd3"), model.get("preference") or {})
    return read_preference(checkpoint.path) if preference_file(checkpoint.path) is not None else None


def recorded_model(checkpoint: EvalCheckpoint) -> dict | None:
    """The ``model`` section of the run config saved beside a checkpoint or run export, if any."""
    path = checkpoint.path
    for directory in (path, path.parent, path.parent.parent, path.parent.parent.parent):
        file = directory / "config.yaml"
        if file.is_file():
            return (yaml.safe_load(file.read_text()) or {}).get("model")
    return None


def check_same_model(checkpoint: EvalCheckpoint, family: str, model_path: str) -> None:
    """Refuse a checkpoint whose run trained another model family or base model."""
    model = recorded_model(checkpoint)
    if model is None:
        return
    trained = (model.get("family", "sd3"), str(model.get("path", "tiny")))
    if trained[0] != family or os.path.normpath(trained[1]) != os.path.normpath(model_path):
        raise ValueError(f"checkpoint {checkpoint.path} was trained on {trained[0]} model {trained[1]!r}, but this "
                         f"config evaluates {family} model {model_path!r}: set model.family/model.path to match")


def check_fits(transformer, checkpoint: EvalCheckpoint, state: dict[str, torch.Tensor]) -> None:
    """Refuse a LoRA whose tensors name modules the transformer lacks or have shapes its layers don't take.

    Needs no adapter on the transformer: ``lora_A`` must take the layer's input size, ``lora_B`` give its
    output size."""
    for key, tensor in state.items():
        name, _, part = key.rpartition(".lora_")
        try:
            module = transformer.get_submodule(name)
        except AttributeError:
            module = None
        weight = getattr(getattr(module, "base_layer", module), "weight", None)
        if weight is None or weight.dim() < 2 or tensor.dim() < 2:
            problem = "has no module for"
        elif part.startswith("A") and tensor.shape[1] != weight.shape[1]:
            problem = f"takes inputs of size {weight.shape[1]} at"
        elif part.startswith("B") and tensor.shape[0] != weight.shape[0]:
            problem = f"gives outputs of size {weight.shape[0]} at"
        else:
            continue
        raise ValueError(f"LoRA {checkpoint.path} does not fit this model: the model {problem} {key!r} "
                         f"(the LoRA has shape {tuple(tensor.shape)}); was it trained on another model?")


def load_adapter(policy, checkpoint: EvalCheckpoint) -> None:
    """Attach (or overwrite) the policy's LoRA with the checkpoint's weights, after checking they fit."""
    from peft.utils import set_peft_model_state_dict

    state, config = read_adapter(checkpoint)
    if not policy.has_lora:
        policy.add_lora(rank=int(config["r"]), alpha=float(config["lora_alpha"]),
                        target_modules=list(config["target_modules"]))
    from flowrl.models.lora_io import lora_state_dict

    from flowrl.models.preference import split_preference

    expected = split_preference(lora_state_dict(policy.transformer))[0]
    unknown = [k for k in state if k not in expected]
    mismatched = [k for k in state if k in expected and expected[k].shape != state[k].shape]
    if unknown or mismatched:
        key = (unknown or mismatched)[0]
        what = "has no module for" if unknown else f"expects shape {tuple(expected[key].shape)} for"
        raise ValueError(f"LoRA {checkpoint.path} does not fit this model: the model {what} {key!r} "
                         f"({len(unknown) + len(mismatched)} of {len(state)} tensors); was it trained on another model?")
    set_peft_model_state_dict(policy.transformer, state)
    from flowrl.models.preference import install_preference, remove_preference

    slider = read_slider(checkpoint)  # a slider model's embedding; none: an earlier checkpoint's comes off
    if slider is not None:
        install_preference(policy, *slider)
    else:
        remove_preference(policy)


def trained_reward_states(specs: list[EvalCheckpoint]) -> tuple[dict[str, dict], Path | None]:
    """The state of each reward that trained during a run (Adv-GRPO's discriminator), as its checkpoint saved it:
    ``({reward name: state}, the checkpoint it came from)``, or ``({}, None)``.

    A trained reward built from the config alone is its untrained head, whose scores mean nothing; the run's own
    reward is in the ``reward_updates`` entry of a checkpoint's trainer state. The last checkpoint listed that holds
    one gives it (a run directory or its ``lora/`` export: that run's latest checkpoint), so every checkpoint
    evaluated, the base too, is scored by one and the same head."""
    import json

    from flowrl.training.checkpoint import is_checkpoint, resolve_checkpoint

    for checkpoint in reversed(specs):
        if checkpoint.is_base:
            continue
        if is_checkpoint(checkpoint.path):
            path = checkpoint.path
        elif checkpoint.path.name == "lora":  # RUN_DIR/lora: the run's latest checkpoint
            try:
                path = resolve_checkpoint(checkpoint.path.parent)
            except FileNotFoundError:
                continue
        else:  # a LoRA file or adapter directory holds no trainer state
            continue
        states = json.loads((path / "trainer_state.json").read_text()).get("reward_updates")
        if states:
            return states, path
    return {}, None
