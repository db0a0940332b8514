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
