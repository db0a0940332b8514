"""Seeds and resume for the toy comparison scripts (compare_algorithms, compare_collapse, compare_multi_reward,
toy_guard): one run directory per method and seed, a finished run skipped on rerun, and table cells that
give the mean and standard error over seeds.

Why one module: the scripts must agree on what a finished run is (else a rerun after Ctrl-C would redo or,
worse, reuse half a run) and on how a figure over seeds reads in ``docs/results.md``.

A run is finished when its ``done.json`` exists: written by the script only after the training process
exited cleanly, holding the training arguments it ran with. A directory without it was interrupted (or
ran with other arguments) and is started again: resumed with ``train.resume=latest`` where the caller says
its runs resume exactly (no wall-clock budget) and the directory holds a checkpoint, removed otherwise.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import statistics
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TypeVar

DONE = "done.json"
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


def add_seed_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--seeds", type=parse_seeds, default=[0],
                        help="comma-separated run seeds (override seed=S, run directory NAME_sS); default 0")


def seed_dir(out: Path, name: str, seed: int) -> Path:
    return Path(out) / f"{name}_s{seed}"


def is_finished(run_dir: Path, arguments: list[str] | None = None) -> bool:
    """Whether ``run_dir`` holds a run that ended cleanly (with ``arguments``, when given)."""
    marker = Path(run_dir) / DONE
    if not marker.is_file():
        return False
    return arguments is None or json.loads(marker.read_text()).get("arguments") == arguments


def mark_finished(run_dir: Path, arguments: list[str], seconds: float) -> None:
    """Write ``done.json`` atomically (a kill mid-write leaves no marker, so the run counts as unfinished)."""
    marker = Path(run_dir) / DONE
    partial = marker.with_suffix(".tmp")
    partial.write_text(json.dumps({"arguments": arguments, "seconds": round(seconds, 1)}, indent=1))
    partial.replace(marker)


def prepare_run(run_dir: Path, arguments: list[str], *, exact_resume: bool) -> list[str] | None:
    """What to do with ``run_dir`` before training it with ``arguments``: None when it is finished (skip it);
    else the extra overrides to start it with: ``["train.resume=latest"]`` when ``exact_resume`` and an
    interrupted run left a checkpoint, else [] after removing whatever an earlier attempt left."""
    run_dir = Path(run_dir)
    if is_finished(run_dir, arguments):
        return None
    if not run_dir.exists():
        return []
    if is_finished(run_dir):
        print(f"{run_dir.name}: finished with other settings, run again", flush=True)
    elif exact_resume and any((run_dir / "checkpoints").glob("*/trainer_state.json")):
        print(f"{run_dir.name}: interrupted, resuming from its last checkpoint", flush=True)
        return ["train.resume=latest"]
    else:
        print(f"{run_dir.name}: interrupted, starting again", flush=True)
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


CELL_NOTE = ("Each cell: mean over seeds ± standard error (sample std / sqrt(n)) (n); a change is taken from the "
             "same seed's base point.")
"""How a table of per-seed runs reads, said once for every comparison script."""


def mean_se(values: Iterable[float | None]) -> tuple[float, float, int]:
    """(mean, standard error = sample std / sqrt(n), n) of the values that are numbers (None and NaN are
    left out); the error is NaN below two values, the mean NaN with none."""
    xs = [float(v) for v in values if v is not None and not math.isnan(v)]
    if not xs:
        return math.nan, math.nan, 0
    se = statistics.stdev(xs) / math.sqrt(len(xs)) if len(xs) > 1 else math.nan
    return statistics.fmean(xs), se, len(xs)


def fmt_mean_se(values: Iterable[float | None], spec: str = ".3f", *, missing: str = "n/a") -> str:
    """A table cell over seeds: ``"0.412 ± 0.018 (3)"``, ``"0.412 (1)"`` with one seed. Values that are None or
    NaN (a threshold never reached) are left out of the mean and the count reads ``(2/3)``; with none, ``missing``.
    ``spec`` is a format spec such as ``".3f"``, ``"+.3f"`` or ``".0f"``."""
    values = list(values)
    mean, se, n = mean_se(values)
    if n == 0:
        return missing
    count = f"({n})" if n == len(values) else f"({n}/{len(values)})"
    if n == 1:
        return f"{mean:{spec}} {count}"
    return f"{mean:{spec}} ± {se:{spec.replace('+', '')}} {count}"
