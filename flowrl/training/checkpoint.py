"""Atomic checkpoints and exact resume.

Layout (one directory per checkpoint, under ``RUN_DIR/checkpoints/``)::

    step_000012/
        lora.safetensors     raw LoRA tensors (``lora_state_dict`` keys, float32),
                             metadata {"lora_config": <json of lora_config_dict>}
        weights.safetensors  instead of lora.safetensors with model.trainable=full: the trained transformer
                             tensors only (parameter names, float32), metadata {"lora_config": <FullWeights.config>}
        ema.safetensors      EMA tensors, same keys (only when an EMA is kept),
                             metadata {"ema_state": <json of LoraEMA.state_dict()>}
        optimizer.pt         optimizer.state_dict()
        scaler.pt            GradScaler.state_dict() (only with fp16 loss scaling)
        rng_rank{r}.pt       torch CPU/CUDA, python ``random`` and numpy RNG of process r
        trainer_state.json   {"step", "world_size", ...the caller's trainer_state}
        config.yaml          the resolved run config
    latest                   text file: the name of the newest complete checkpoint

Why this shape: a run killed at any moment (pre-emption, OOM, Ctrl-C) must resume bit-exactly or
not at all. Everything is written into ``.tmp_step_000012`` and renamed to ``step_000012`` only
once complete (a rename within one directory is atomic), then ``latest`` is replaced atomically;
so a visible checkpoint is always complete and ``latest`` never names a half-written one. A save whose
writer fails (a full disk shows up as OSError, as torch's ``RuntimeError: [enforce fail at inline_container.cc]``
or as safetensors' error alike) removes its ``.tmp_*`` directory and raises
:class:`~flowrl.training.faults.TrainingAborted`, one line naming the space a checkpoint needs and the checkpoint
to resume from; stale ``.tmp_*`` directories of a killed save are removed by the next save. Loading uses safetensors
and ``torch.load(weights_only=True)`` only, so a checkpoint cannot execute code (RNG states are
stored as tensors and lists of ints for that reason).

Multi-process: every rank writes its own RNG file, rank 0 everything else; ranks meet at
``barrier`` (e.g. ``accelerator.wait_for_everyone``). The run directory must be shared by all
ranks (one filesystem), as it is for single-node training. Under FSDP2 the LoRA, EMA and optimizer
states are sharded DTensors: every rank gathers them (:mod:`flowrl.core.sharded`) before rank 0
writes, so the files are those of a 1-process run, and loading slices them back onto each rank.
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import shutil
from collections.abc import Mapping
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from flowrl.core.sharded import full_optimizer_state, shard_loaded_optimizer_state, shard_optimizer_state
from flowrl.training.faults import checkpoint_write_failed

logger = logging.getLogger(__name__)

CHECKPOINTS = "checkpoints"
LATEST = "latest"
_NAME = re.compile(r"^step_(\d+)$")
WEIGHT_FILES = ("lora.safetensors", "weights.safetensors")  # a LoRA run's, a full fine-tuning run's trained tensors


def checkpoint_name(step: int) -> str:
    return f"step_{step:06d}"


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    """Complete (visible) checkpoints of a run, oldest first by step number."""
    root = Path(run_dir) / CHECKPOINTS
    found = [p for p in root.iterdir() if p.is_dir() and _NAME.match(p.name)] if root.is_dir() else []
    return sorted(found, key=lambda p: int(_NAME.match(p.name).group(1)))


def is_checkpoint(path: Path) -> bool:
    return path.is_dir() and weights_file(path) is not None and (path / "trainer_state.json").is_file()


def weights_file(path: Path) -> Path | None:
    """The checkpoint's trained tensors: ``lora.safetensors`` (LoRA) or ``weights.safetensors`` (full weights)."""
    return next((Path(path) / n for n in WEIGHT_FILES if (Path(path) / n).is_file()), None)


# --- save ------------------------------------------------------------------------------------------
def save_checkpoint(run_dir: str | Path, step: int, *, lora_state: dict[str, torch.Tensor], lora_config: dict,
                    optimizer, ema=None, scaler=None, trainer_state: dict | None = None, config: Any = None,
                    rank: int = 0, world_size: int = 1, barrier: Callable[[], None] | None = None,
                    keep_last: int | None = 3, snapshots: dict | None = None,
                    weights_name: str = "lora.safetensors") -> Path:
    """Write ``RUN_DIR/checkpoints/step_{step:06d}`` atomically; every rank must call this.

    ``snapshots``: {name: :class:`~flowrl.training.ema.LoraEMA`} copies of the adapter a recipe keeps (GARDO's
    adaptive KL reference, HRF's phase anchor), each saved like the EMA as ``<name>.safetensors``. ``weights_name``:
    the file of ``lora_state`` (``weights.safetensors`` for the tensors of full fine-tuning).

    Returns the final checkpoint path (on every rank). ``keep_last`` complete checkpoints are kept
    (None keeps all); the one just written and the one ``latest`` names are never pruned. Any failure to write
    raises :class:`~flowrl.training.faults.TrainingAborted` with ``latest`` untouched (see the module docstring).
    """
    barrier = barrier or (lambda: None)
    root = Path(run_dir) / CHECKPOINTS
    name = checkpoint_name(step)
    tmp, final = root / f".tmp_{name}", root / name
    # Every rank gathers (FSDP2: the optimizer and EMA states are sharded DTensors; an all-gather each),
    # so rank 0 writes the files a 1-process run writes. Plain tensors pass through unchanged.
    optimizer_state = full_optimizer_state(optimizer, keep=rank == 0)  # only rank 0 keeps what it writes
    averaged = {name: (a.state_tensors(keep=rank == 0), a.state_dict())
                for name, a in (("ema", ema), *(snapshots or {}).items()) if a is not None}
    writing = partial(_stop_on_write_failure, root, name, tmp, rank=rank, state=(lora_state, optimizer_state, averaged))
    if rank == 0:
        with writing():
            root.mkdir(parents=True, exist_ok=True)
            for stale in root.glob(".tmp_*"):  # left by a save that was killed
                if stale.is_dir():
                    shutil.rmtree(stale, ignore_errors=True)
            tmp.mkdir()
    barrier()  # the tmp dir exists (and is clean) before any rank writes into it
    with writing():
        torch.save(rng_state(), tmp / f"rng_rank{rank}.pt")
        if rank == 0:
            _write_payload(tmp, step, lora_state=lora_state, lora_config=lora_config, optimizer_state=optimizer_state,
                           averaged=averaged, scaler=scaler,
                           trainer_state={"step": step, "world_size": world_size, **(trainer_state or {})},
                           config=config, weights_name=weights_name)
    barrier()  # every rank's RNG file is in place
    if rank == 0:
        with writing():
            _sync_dir_tree(tmp)
            _publish(tmp, final)
            _write_atomic(root / LATEST, name + "\n")
        if keep_last is not None:
            _prune(root, keep=keep_last, protect={name})
    barrier()  # nobody returns before the checkpoint is visible
    return final


@contextmanager
def _stop_on_write_failure(root: Path, name: str, tmp: Path, *, rank: int, state):
    """Turn any failure of the writer into a one-line TrainingAborted, after rank 0 removed the half-written ``tmp``.

    Any: a full disk is an OSError from ``open``/``write``, a ``RuntimeError`` from torch's zip writer, a
    ``SafetensorError`` from safetensors. KeyboardInterrupt and SystemExit are not Exceptions and pass through.
    ``state``: what is being written, the space estimate when no complete checkpoint exists yet."""
    try:
        yield
    except Exception as error:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        try:
            intact = resolve_checkpoint(root.parent)
        except OSError:  # FileNotFoundError: no complete checkpoint yet
            intact = None
        needed = _files_size(intact) if intact is not None else _state_size(state)
        raise checkpoint_write_failed(root, name, error, needed=needed, intact=intact) from error


def _files_size(directory: Path) -> int:
    return sum(f.stat().st_size for f in directory.iterdir() if f.is_file())


def _state_size(state) -> int:
    """Bytes of the tensors in nested dicts/lists/tuples (a checkpoint's payload, less its small JSON and RNG)."""
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    if isinstance(state, dict):
        return sum(_state_size(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(_state_size(v) for v in state)
    return 0


def _write_payload(tmp: Path, step: int, *, lora_state, lora_config, optimizer_state, averaged, scaler,
                   trainer_state, config, weights_name: str = "lora.safetensors") -> None:
    """Rank 0's files. Each is complete before the next starts, so a crash leaves only the tmp dir.

    ``averaged``: {name: (tensors, JSON state)} of the EMA and snapshots, already gathered."""
    save_file(_cpu_float(lora_state), str(tmp / weights_name),
              metadata={"format": "pt", "lora_config": json.dumps(lora_config)})
    for name, (tensors, state) in averaged.items():
        save_file(tensors, str(tmp / f"{name}.safetensors"), metadata={"format": "pt", "ema_state": json.dumps(state)})
    torch.save(optimizer_state, tmp / "optimizer.pt")
    if scaler is not None:
        torch.save(scaler.state_dict(), tmp / "scaler.pt")
    (tmp / "trainer_state.json").write_text(json.dumps(trainer_state, indent=2) + "\n")
    if config is not None:
        from flowrl.config import save_config

        save_config(config, tmp / "config.yaml")  # dataclass or plain dict alike


def _cpu_float(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().to("cpu", torch.float32).contiguous() for k, v in state.items()}


def _publish(tmp: Path, final: Path) -> None:
    """Rename the finished tmp dir into place (re-saving a step replaces the old directory)."""
    if final.exists():
        old = final.with_name(f".tmp_replaced_{final.name}")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with open(tmp, "w") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)  # a full disk: no stray pointer file, ``path`` keeps its old text
        raise


def _sync_dir_tree(directory: Path) -> None:
    """fsync the files so the rename cannot reach disk before their contents (power loss)."""
    for path in directory.iterdir():
        with open(path, "rb") as handle:
            os.fsync(handle.fileno())


def _prune(root: Path, *, keep: int, protect: set[str]) -> None:
    pointer = root / LATEST
    if pointer.is_file():
        protect = protect | {pointer.read_text().strip()}
    complete = list_checkpoints(root.parent)
    for path in complete[: max(len(complete) - keep, 0)]:
        if path.name not in protect:
            shutil.rmtree(path, ignore_errors=True)


# --- RNG -------------------------------------------------------------------------------------------
def rng_state() -> dict:
    """All RNG states of this process as tensors / ints / floats, loadable with ``weights_only=True``."""
    version, words, gauss = random.getstate()
    state = {"torch": torch.get_rng_state(), "python": {"version": version, "state": list(words), "gauss": gauss},
             "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []}
    try:
        import numpy as np
    except ImportError:
        return state
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state["numpy"] = {"kind": kind, "keys": torch.from_numpy(keys.astype("int64")), "pos": int(pos),
                      "has_gauss": int(has_gauss), "cached": float(cached)}
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    py = state["python"]
    random.setstate((py["version"], tuple(py["state"]), py["gauss"]))
    cuda = state.get("cuda") or []
    if cuda and torch.cuda.is_available():
        n = min(len(cuda), torch.cuda.device_count())
        if n != len(cuda):
            logger.warning("checkpoint holds CUDA RNG states of %d devices, restoring %d", len(cuda), n)
        for index in range(n):
            torch.cuda.set_rng_state(cuda[index], index)
    if "numpy" in state:
        import numpy as np

        s = state["numpy"]
        np.random.set_state((s["kind"], s["keys"].numpy().astype("uint32"), s["pos"], s["has_gauss"], s["cached"]))


# --- load ------------------------------------------------------------------------------------------
def resolve_checkpoint(path_or_run_dir: str | Path, resume: str | Path = "latest") -> Path:
    """The checkpoint directory to load.

    ``resume="latest"``: ``path_or_run_dir`` itself if it is a checkpoint, else the run's newest
    complete checkpoint (the ``latest`` pointer; if that is missing or stale, the highest step).
    Any other ``resume`` is a checkpoint path (or a name under ``RUN_DIR/checkpoints``).
    """
    base = Path(path_or_run_dir)
    if str(resume) != "latest":
        for candidate in (Path(resume), base / CHECKPOINTS / str(resume)):
            if is_checkpoint(candidate):
                return candidate
        raise FileNotFoundError(f"checkpoint not found: {resume} (expected a directory with lora.safetensors or "
                                "weights.safetensors and trainer_state.json, or resume=latest)")
    if is_checkpoint(base):
        return base
    root = base / CHECKPOINTS
    pointer = root / LATEST
    if pointer.is_file() and is_checkpoint(root / pointer.read_text().strip()):
        return root / pointer.read_text().strip()
    complete = [p for p in list_checkpoints(base) if is_checkpoint(p)]
    if complete:
        return complete[-1]
    raise FileNotFoundError(f"no checkpoint to resume in {root} (start without resume=...)")


def load_checkpoint(path_or_run_dir: str | Path, *, resume: str | Path = "latest", optimizer=None, ema=None,
                    scaler=None, rank: int = 0, map_location="cpu",
                    snapshots: dict | None = None) -> tuple[dict[str, torch.Tensor], dict]:
    """Restore optimizer / EMA / adapter snapshots / scaler / this rank's RNG in place; return (LoRA
    tensors, trainer state).

    The LoRA tensors have ``lora_state_dict`` keys, ready for peft's ``set_peft_model_state_dict`` (a full
    fine-tuning checkpoint's, parameter names).
    A checkpoint saved without EMA seeds a given ``ema`` from the raw LoRA weights.
    """
    path = resolve_checkpoint(path_or_run_dir, resume)
    file = weights_file(path)
    # Full weights are read one tensor at a time as they are loaded (16 bytes a parameter with the EMA otherwise
    # sit whole in every process's host memory); a LoRA is small and returned as a plain dict.
    lora_state = (SafetensorsTensors(file) if file.name == WEIGHT_FILES[1]
                  else load_file(str(file), device=str(map_location)))
    trainer_state = json.loads((path / "trainer_state.json").read_text())
    if optimizer is not None:
        # mmap: the file's pages are shared by the processes of a node; each cuts its slices one tensor at a time
        state = torch.load(path / "optimizer.pt", map_location=map_location, weights_only=True, mmap=True)
        optimizer.load_state_dict(shard_loaded_optimizer_state(optimizer, state))
        shard_optimizer_state(optimizer)  # FSDP2: whole state tensors -> this rank's slices (else a no-op)
    if ema is not None:
        if (path / "ema.safetensors").is_file():
            ema.load_state_tensors(SafetensorsTensors(path / "ema.safetensors"))
            ema.load_state_dict(json.loads(_metadata(path / "ema.safetensors").get("ema_state", "{}")))
        else:
            logger.warning("%s has no EMA weights; the EMA restarts from the checkpoint's LoRA", path)
            ema.load_state_tensors(lora_state)
    for name, snapshot in (snapshots or {}).items():
        if (path / f"{name}.safetensors").is_file():
            snapshot.load_state_tensors(SafetensorsTensors(path / f"{name}.safetensors"))
    if scaler is not None and (path / "scaler.pt").is_file():
        scaler.load_state_dict(torch.load(path / "scaler.pt", map_location="cpu", weights_only=True))
    rng_file = path / f"rng_rank{rank}.pt"
    if rng_file.is_file():
        set_rng_state(torch.load(rng_file, map_location="cpu", weights_only=True))
    else:  # resumed on more processes than saved: exactness is impossible anyway
        logger.warning("%s has no RNG state for rank %d; this rank keeps its current RNG", path, rank)
    return lora_state, trainer_state


class SafetensorsTensors(Mapping):
    """The tensors of a safetensors file as a read-only mapping that reads each one when it is asked for (CPU), so
    loading a checkpoint holds one tensor of it at a time rather than the whole file."""

    def __init__(self, file: Path):
        self.handle = safe_open(str(file), framework="pt")
        self.names = list(self.handle.keys())
        self.known = set(self.names)

    def __getitem__(self, key: str) -> torch.Tensor:
        if key not in self.known:
            raise KeyError(key)
        return self.handle.get_tensor(key)

    def __contains__(self, key) -> bool:
        return key in self.known

    def __iter__(self):
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)


def read_checkpoint_lora(path: Path, *, ema: bool = False) -> tuple[dict[str, torch.Tensor], dict]:
    """A checkpoint's adapter ``(state, peft config)``: its raw weights, or with ``ema`` its EMA weights (a full
    fine-tuning checkpoint: its trained tensors and ``{"trainable": "full", ...}``)."""
    from safetensors.torch import load_file

    file = Path(path) / "ema.safetensors" if ema else weights_file(path) or Path(path) / "lora.safetensors"
    if ema and not file.is_file():
        raise ValueError(f"{path} has no EMA weights (trained with train.ema=false); use its raw weights instead")
    return load_file(str(file)), read_lora_config(path)


def read_lora_config(path: Path) -> dict:
    """The peft config stored with a checkpoint's ``lora.safetensors`` (the full-training one, ``weights.safetensors``)."""
    return json.loads(_metadata(weights_file(path) or Path(path) / "lora.safetensors").get("lora_config", "{}"))


def is_full_checkpoint(path: Path) -> bool:
    """Whether the checkpoint holds full fine-tuning weights rather than a LoRA."""
    return (Path(path) / WEIGHT_FILES[1]).is_file()


def _metadata(file: Path) -> dict[str, str]:
    with safe_open(str(file), framework="pt") as handle:
        return handle.metadata() or {}

