"""Reading files a user hands flowrl (LoRAs, checkpoints to resume or export) with one-line errors.

A truncated or corrupt file surfaces from safetensors as ``SafetensorError: incomplete metadata`` and from
``torch.load`` as ``OSError: [Errno 22]``, deep in a traceback. These helpers check a file before the run
uses it and name the file, what is wrong and what to do. Nothing here unpickles: safetensors and
``torch.load(weights_only=True)`` only, so a file cannot run code.
"""

from __future__ import annotations

import json
import zipfile
from pathlib import Path


def check_safetensors(path: str | Path, what: str = "safetensors file") -> None:
    """Open ``path``'s header (safetensors checks it covers the whole file); ValueError if it is not readable."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as handle:
            handle.keys()
    except Exception as error:  # SafetensorError (truncated, garbage) is a bare Exception subclass
        raise ValueError(f"{what} {path} is not a readable safetensors file (truncated or corrupt: "
                         f"{str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__})") \
            from None


def check_torch_file(path: str | Path, what: str = "file", *, load: bool = False) -> None:
    """A ``torch.save`` file: a complete zip archive (``load``: also loads it with ``weights_only=True``)."""
    try:
        with zipfile.ZipFile(path) as archive:
            bad = archive.testzip()  # reads every member and checks its CRC
        if bad is not None:
            raise ValueError(f"member {bad} fails its checksum")
        if load:
            import torch

            torch.load(path, map_location="cpu", weights_only=True)
    except (zipfile.BadZipFile, OSError, ValueError, RuntimeError, EOFError) as error:
        raise ValueError(f"{what} {path} is truncated or corrupt ({type(error).__name__}: "
                         f"{str(error).strip().splitlines()[0] if str(error).strip() else 'unreadable'})") from None


def check_checkpoint(path: str | Path) -> dict:
    """Every file of a checkpoint directory readable -> its trainer state; a one-line ValueError naming the
    first bad file and the fix (resume from an earlier checkpoint) otherwise."""
    path = Path(path)
    fix = "; resume from an earlier checkpoint (train.resume=RUN_DIR/checkpoints/step_...) or delete this one"
    try:
        state_file = path / "trainer_state.json"
        try:
            state = json.loads(state_file.read_text(encoding="utf-8"))
        except (ValueError, UnicodeDecodeError) as error:
            reason = "it is empty" if not state_file.read_bytes().strip() else f"invalid JSON ({error})"
            raise ValueError(f"checkpoint file {state_file} is unreadable: {reason}") from None
        if not isinstance(state, dict) or not isinstance(state.get("epoch", state.get("step")), int):
            raise ValueError(f"checkpoint file {state_file} must be a JSON object with an integer 'epoch'")
        for file in sorted(path.glob("*.safetensors")):
            check_safetensors(file, "checkpoint file")
        for file in sorted(path.glob("*.pt")):
            check_torch_file(file, "checkpoint file", load=file.name.startswith("rng_"))  # RNG files are small
    except ValueError as error:
        raise ValueError(f"{error}{fix}") from None
    return state


# What must be the same for a checkpoint to continue a run: (dotted config key, what it is called in the message).
RESUME_IDENTITY = (("model.family", "model family"), ("model.path", "base model"), ("lora.rank", "LoRA rank"),
                   ("lora.alpha", "LoRA alpha"), ("lora.target_modules", "LoRA target modules"))
# Keys whose state the checkpoint holds in a form only the same setting can load (the optimizer's moments).
RESUME_STATE = (("train.optimizer", "optimizer"),)


def check_checkpoint_matches(path: str | Path, config: dict) -> None:
    """The checkpoint at ``path`` was trained with this run's base model, family and LoRA shape (its saved
    ``config.yaml`` against ``config``, a plain dict of the run's config); a one-line ValueError naming what differs
    otherwise, before anything is loaded into torch. A checkpoint saved without its config passes (the shapes are
    checked again when the adapter loads, by :func:`check_checkpoint_shapes`)."""
    import yaml

    saved_file = Path(path) / "config.yaml"
    if not saved_file.is_file():
        return
    try:
        saved = yaml.safe_load(saved_file.read_text(encoding="utf-8")) or {}
    except (yaml.YAMLError, UnicodeDecodeError) as error:
        raise ValueError(f"checkpoint file {saved_file} is unreadable ({type(error).__name__}); resume from an "
                         "earlier checkpoint") from None
    differ = [f"{label} {_dotted(saved, key)!r} there, {_dotted(config, key)!r} here ({key})"
              for key, label in RESUME_IDENTITY if _dotted(saved, key) != _dotted(config, key)]
    if differ:
        raise ValueError(f"checkpoint {path} belongs to another run: {'; '.join(differ)}; resume with the config it "
                         "was trained with, or start a fresh run in another run_dir")
    for key, label in RESUME_STATE:
        if _dotted(saved, key) is not None and _dotted(saved, key) != _dotted(config, key):
            raise ValueError(f"checkpoint {path} holds the state of {label} {_dotted(saved, key)!r}, and this run asks "
                             f"for {_dotted(config, key)!r} ({key}): resume with {key}={_dotted(saved, key)}, or start "
                             "a fresh run in another run_dir")


def check_checkpoint_shapes(path: str | Path, shapes: dict[str, tuple[int, ...]], trained: str = "lora") -> None:
    """The checkpoint's adapter tensors are exactly the run's trainable ones, ``shapes`` {peft key: full shape};
    read from the safetensors header only. A one-line ValueError naming the first difference otherwise. ``trained``:
    the run's ``model.trainable`` (lora: ``lora.safetensors``; full: ``weights.safetensors``)."""
    from safetensors import safe_open

    names = ("lora.safetensors", "weights.safetensors")  # a LoRA run's, a full fine-tuning run's (model.trainable)
    file = next((Path(path) / n for n in names if (Path(path) / n).is_file()), Path(path) / names[0])
    if file.name != ("weights.safetensors" if trained == "full" else "lora.safetensors"):
        raise ValueError(f"checkpoint {path} holds {'a LoRA' if file.name == names[0] else 'full weights'}, and this "
                         f"run trains {'full weights' if trained == 'full' else 'a LoRA'}: set model.trainable as in "
                         "that run, or start a fresh run (lora.init_from fuses a LoRA into full training)")
    with safe_open(str(file), framework="pt") as handle:
        saved = {key: tuple(handle.get_slice(key).get_shape()) for key in handle.keys()}
    missing, extra = sorted(set(shapes) - set(saved)), sorted(set(saved) - set(shapes))
    resized = sorted(k for k in set(shapes) & set(saved) if tuple(shapes[k]) != saved[k])
    if not (missing or extra or resized):
        return
    parts = []
    if resized:
        k = resized[0]
        parts.append(f"{len(resized)} tensors differ in shape, e.g. {k}: {list(saved[k])} there, {list(shapes[k])} "
                     "here")
    if missing:
        parts.append(f"{len(missing)} of this run's adapter tensors are missing from it, e.g. {missing[0]}")
    if extra:
        parts.append(f"it holds {len(extra)} tensors this run does not train, e.g. {extra[0]}")
    what = "; ".join(parts)
    raise ValueError(f"checkpoint {path} does not fit this run's model: {what}; it was trained on another model, "
                     "family or LoRA: resume with that config, or start a fresh run in another run_dir")


def _dotted(tree: dict, key: str):
    for part in key.split("."):
        tree = tree.get(part) if isinstance(tree, dict) else None
    return tree


def shared_mode(*paths: str | Path) -> None:
    """Give exported files (and every file in an exported folder) the mode the umask allows, as ``open`` would:
    safetensors writes through a private temporary file, so its files are 0600 whatever the umask, and a ComfyUI or
    diffusers server running as another user could not read an exported LoRA."""
    import os

    umask = os.umask(0)
    os.umask(umask)
    for path in map(Path, paths):
        for file in ([path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]):
            file.chmod(0o666 & ~umask)
