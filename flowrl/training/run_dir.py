"""One run per run directory: a new run never writes into another run's files.

A run directory holds one run's config, metrics, checkpoints, grids, adapter and report. Starting a second run in
it without ``train.resume`` used to truncate the first run's ``metrics.jsonl`` and mix both runs' checkpoints under
one ``latest``. Here a fresh start into a directory that already holds a run is refused in one line; with
``train.overwrite=true`` the old run is moved aside whole (``RUN.old-<timestamp>``), never deleted. A run that
stopped before its first checkpoint (a reward that raised, a dead server) is not a run to protect: the same command
run again starts afresh, and the failed attempt's config and log move aside to ``RUN.failed-<timestamp>`` for
diagnosis. A directory that cannot be created or written to is one line naming the path and the reason, checked
before any model loads.
"""

from __future__ import annotations

import errno
import os
import tempfile
import time
from pathlib import Path

RUN_MARKERS = ("config.yaml", "metrics.jsonl", "checkpoints")  # what a started run leaves first


class RunDirError(ValueError):
    """The run directory cannot take this run; the message is one line that says what to do."""


def held_run(run_dir: str | Path) -> list[str]:
    """The marks of a run already in ``run_dir`` (its config, metrics, checkpoints); empty for none."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return []
    found = []
    for name in RUN_MARKERS:
        path = run_dir / name
        if path.is_file() or (path.is_dir() and any(path.iterdir())):
            found.append(name)
    return found


def has_checkpoint(run_dir: str | Path) -> bool:
    """Whether the run in ``run_dir`` wrote a complete checkpoint (``checkpoints/latest`` names one)."""
    return (Path(run_dir) / "checkpoints" / "latest").is_file()


def check_run_dir(run_dir: str | Path, *, resume: bool, overwrite: bool) -> None:
    """Refuse, before anything loads, a run directory that cannot be written or that holds another run.

    ``resume``: the run continues the one in ``run_dir``, so finding it is expected. ``overwrite``: an old run
    there is to be moved aside by :func:`claim_run_dir` when the run starts."""
    run_dir = Path(run_dir)
    check_writable(run_dir)
    marks = held_run(run_dir)
    if marks and not resume and not overwrite and has_checkpoint(run_dir):
        raise RunDirError(
            f"run_dir {run_dir} already holds a run ({', '.join(marks)}); continue it with train.resume=latest, "
            f"start a fresh one with run_dir=<another directory>, or move the old one aside with "
            f"train.overwrite=true")


def claim_run_dir(run_dir: str | Path, *, overwrite: bool, resume: bool = False) -> Path | None:
    """Make ``run_dir`` this run's (call on the main process when the run starts, after everything loaded).

    With ``overwrite`` an old run there is renamed to ``RUN.old-<YYYYmmdd-HHMMSS>`` (a numbered suffix if taken); a
    fresh start over an attempt that never checkpointed renames it to ``RUN.failed-<YYYYmmdd-HHMMSS>``. Returns where
    it went, or None when there was nothing to move."""
    run_dir = Path(run_dir)
    moved = None
    failed = not resume and not overwrite and not has_checkpoint(run_dir)
    if (overwrite or failed) and held_run(run_dir):
        stamp = time.strftime("%Y%m%d-%H%M%S")
        kind = "failed" if failed else "old"
        moved = run_dir.with_name(f"{run_dir.name}.{kind}-{stamp}")
        n = 1
        while moved.exists():
            n += 1
            moved = run_dir.with_name(f"{run_dir.name}.{kind}-{stamp}-{n}")
        try:
            os.replace(run_dir, moved)
        except OSError as error:
            raise RunDirError(f"cannot move the old run in {run_dir} aside to {moved}: {_reason(error)}") from None
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise RunDirError(_unusable(run_dir, error)) from None
    return moved


def check_writable(run_dir: Path) -> None:
    """``run_dir`` is a writable directory, or can be created as one; RunDirError naming path and reason if not.

    Nothing is created: a missing directory is probed through its nearest existing parent, so a run refused later
    (a bad model path) leaves no directory behind."""
    probe = run_dir
    while not probe.exists():
        if probe.is_symlink():  # a dangling link: mkdir would fail on it
            raise RunDirError(f"run_dir {run_dir} cannot be used: {probe} is a broken symbolic link")
        if probe.parent == probe:
            break
        probe = probe.parent
    if not probe.is_dir():
        where = "run_dir" if probe == run_dir else f"its parent {probe}"
        raise RunDirError(f"run_dir {run_dir} cannot be used: {where} is a file, not a directory; choose another "
                          f"run_dir or move the file")
    try:
        with tempfile.TemporaryFile(dir=probe):
            pass
    except OSError as error:
        raise RunDirError(_unusable(run_dir, error, probe)) from None


def _unusable(run_dir: Path, error: OSError, probe: Path | None = None) -> str:
    where = "" if probe in (None, run_dir) else f" (in {probe})"
    return (f"run_dir {run_dir} cannot be written{where}: {_reason(error)}; choose a writable run_dir or fix the "
            f"permissions")


def _reason(error: OSError) -> str:
    if error.errno == errno.EROFS:
        return "read-only file system"
    return error.strerror or str(error) or type(error).__name__
