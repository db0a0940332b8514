"""Run directories of an experiment: one per run and seed, a finished run skipped on rerun, an interrupted one
resumed or started again, training ``parallel`` runs at a time in subprocesses.

Why one module: every experiment must agree on what a finished run is (else a rerun after Ctrl-C would redo
or, worse, reuse half a run).

A run is finished when its ``done.json`` exists: written only after the training process exited cleanly,
holding the training arguments it ran with and a digest of the config they resolved to (the file, its ``base:``
chain and the overrides), so a run whose config file was edited since is trained again, not tabulated with its
old settings (the weights a config names are not digested). A directory without it was interrupted (or ran with other
arguments) and is started again: resumed with ``train.resume=latest`` where the experiment says its runs
resume exactly (``resume: exact``: no wall-clock budget) and the directory holds a checkpoint, removed
otherwise (``resume: restart``: a wall-clock budget resumed from a checkpoint would not be the uninterrupted
run's). Tables are built from the run directories alone, so a rerun's tables are the uninterrupted ones.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path
from typing import TypeVar

DONE = "done.json"
RESUME = "train.resume=latest"
T = TypeVar("T")


def parse_seeds(text: str) -> list[int]:
    """``"0,1,2"`` -> [0, 1, 2]: distinct integers, in the order given (an argparse ``type``)."""
    try:
        seeds = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"seeds must be comma-separated integers, e.g. 0,1,2 (got {text!r})") from None
    if not seeds or len(set(seeds)) != len(seeds):
        raise argparse.ArgumentTypeError(f"seeds must be distinct and at least one, e.g. 0,1,2 (got {text!r})")
    return seeds


def seed_dir(out: Path, name: str, seed: int) -> Path:
    return Path(out) / f"{name}_s{seed}"


def settings_digest(arguments: list[str]) -> str | None:
    """A digest of the config ``arguments`` (the config file, then its overrides) resolve to, its ``run_dir``
    left out; None where they do not load (the training run says why in its own log)."""
    from flowrl.config import Config, load_config, to_dict

    if not arguments:
        return None
    try:
        data = to_dict(load_config(Config, arguments[0], arguments[1:]))
    except (ValueError, OSError):
        return None
    data.pop("run_dir", None)
    return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()[:16]


def is_finished(run_dir: Path, arguments: list[str] | None = None) -> bool:
    """Whether ``run_dir`` holds a run that ended cleanly (with ``arguments``, when given, and the config they
    resolve to now, where its ``done.json`` recorded one)."""
    marker = Path(run_dir) / DONE
    if not marker.is_file():
        return False
    if arguments is None:
        return True
    done = json.loads(marker.read_text())  # a marker from before digests, or of a config that did not load: None
    return done.get("arguments") == arguments and done.get("settings") in (None, settings_digest(arguments))


def mark_finished(run_dir: Path, arguments: list[str], seconds: float) -> None:
    """Write ``done.json`` atomically (a kill mid-write leaves no marker, so the run counts as unfinished)."""
    marker = Path(run_dir) / DONE
    partial = marker.with_suffix(".tmp")
    partial.write_text(json.dumps({"arguments": arguments, "settings": settings_digest(arguments),
                                   "seconds": round(seconds, 1)}, indent=1))
    partial.replace(marker)


def run_state(run_dir: Path, arguments: list[str], *, exact_resume: bool) -> str:
    """What a rerun does with ``run_dir``: ``"finished"`` (skip), ``"new"`` (no directory yet), ``"stale"``
    (finished with other arguments: start again), ``"resume"`` (interrupted, resumed from its last checkpoint)
    or ``"restart"`` (interrupted: start again)."""
    run_dir = Path(run_dir)
    if is_finished(run_dir, arguments):
        return "finished"
    if not run_dir.exists():
        return "new"
    if is_finished(run_dir):
        return "stale"
    if exact_resume and any((run_dir / "checkpoints").glob("*/trainer_state.json")):
        return "resume"
    return "restart"


STATE_LINES = {"finished": "finished", "new": "to run", "stale": "finished with other settings, run again",
               "resume": "interrupted, resuming from its last checkpoint", "restart": "interrupted, starting again"}


def prepare_run(run_dir: Path, arguments: list[str], *, exact_resume: bool) -> list[str] | None:
    """What to do with ``run_dir`` before training it with ``arguments``: None when it is finished (skip it);
    else the extra overrides to start it with: ``["train.resume=latest"]`` when ``exact_resume`` and an
    interrupted run left a checkpoint, else [] after removing whatever an earlier attempt left."""
    state = run_state(run_dir, arguments, exact_resume=exact_resume)
    if state == "finished":
        return None
    if state == "new":
        return []
    print(f"{Path(run_dir).name}: {STATE_LINES[state]}", flush=True)
    if state == "resume":
        return [RESUME]
    shutil.rmtree(run_dir)
    return []


def finished_seeds(out: Path, name: str, seeds: Iterable[int]) -> list[int]:
    """The seeds of ``seeds`` whose run of ``name`` under ``out`` is finished."""
    return [s for s in seeds if is_finished(seed_dir(out, name, s))]


def gather(out: Path, plan: dict[str, list[int]], read: Callable[[Path], T]) -> dict[str, dict[int, T]]:
    """{name: {seed: read(run directory)}} over the finished runs of ``plan`` ({name: seeds}), with a line for
    each planned run that is not finished (a name with none is left out)."""
    found: dict[str, dict[int, T]] = {}
    for name, seeds in plan.items():
        done = finished_seeds(out, name, seeds)
        if len(done) < len(seeds):
            print(f"{name}: no finished run for seed(s) " + ",".join(str(s) for s in seeds if s not in done)
                  + f" under {out}", flush=True)
        if done:
            found[name] = {seed: read(seed_dir(out, name, seed)) for seed in done}
    return found


class RunFailed(RuntimeError):
    """A training subprocess exited with an error (its log says why)."""


def train(run_dir: Path, arguments: list[str], *, exact_resume: bool) -> Path:
    """``python -m flowrl train *arguments run_dir=RUN_DIR`` in a subprocess with one torch thread, its log in
    ``RUN_DIR.log``; a finished run (same arguments) is kept, any other directory resumed or removed first
    (:func:`prepare_run`). ``arguments`` is the config file and its overrides, as ``done.json`` records them
    (not the run directory: it moves with ``--out``)."""
    run_dir = Path(run_dir)
    extra = prepare_run(run_dir, arguments, exact_resume=exact_resume)
    if extra is None:
        return run_dir
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    config, *overrides = arguments
    start = time.perf_counter()
    with open(f"{run_dir}.log", "a" if extra else "w") as log:
        code = subprocess.run([sys.executable, "-m", "flowrl", "train", config, f"run_dir={run_dir}", *overrides,
                               *extra], stdout=log, stderr=subprocess.STDOUT, env=env).returncode
    if code != 0:
        raise RunFailed(f"{run_dir.name}: training exited with status {code}, see {run_dir}.log")
    mark_finished(run_dir, arguments, time.perf_counter() - start)
    print(f"{run_dir.name}: done in {time.perf_counter() - start:.0f} s", flush=True)
    return run_dir


def run_all(jobs: Sequence[tuple], run: Callable[..., object], parallel: int) -> None:
    """``run(*job)`` for every job, ``parallel`` at a time. A failed run ends the runner with one line once the
    other runs have ended (finished runs are kept for the rerun); Ctrl-C starts no further run."""
    pool = ThreadPoolExecutor(max(1, parallel))
    futures = [pool.submit(run, *job) for job in jobs]
    try:
        wait(futures)
    except KeyboardInterrupt:  # the runs under way got the same SIGINT and end unmarked; start no other
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C while they end changes nothing
        pool.shutdown(wait=False, cancel_futures=True)
        sys.exit("interrupted: the same command again skips the finished runs and resumes or redoes the others")
    pool.shutdown()
    failed = [str(f.exception()) for f in futures if isinstance(f.exception(), RunFailed)]
    for f in futures:
        if not isinstance(f.exception(), RunFailed):
            f.result()  # anything else is a bug: its traceback
    if failed:
        sys.exit("\n".join(failed))
