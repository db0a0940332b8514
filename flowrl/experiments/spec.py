"""An experiment file, ``experiments/<table>.yaml``, read into an :class:`Experiment`: what to train (config
files and overrides per run), on which seeds and budget, and which table to write from the run directories.

Why data: a table is reproducible only when the runs behind it are written down; the Python left is how each
kind of table reads its runs (:mod:`flowrl.experiments.tables`).

The file's keys:

- ``table``: the table kind (a module of :mod:`flowrl.experiments.tables`).
- ``runs``: ``{name: {config: FILE, overrides: [...]}}``, one run directory ``OUT/<name>_s<seed>`` per seed.
- ``settings``: overrides every run gets after its config file (then ``seed=S``, the run's own overrides and
  the command line's); ``${key}`` is replaced by the experiment's value of ``key`` (``${budget_s}``...).
- ``seeds``, ``parallel`` (runs at a time, one torch thread each), ``out``, ``results`` (the markdown file),
  ``section`` (a ``## `` section of it; none: the file's main table), ``resume`` (``restart`` for runs with a
  wall-clock budget, ``exact`` for runs that resume from a checkpoint bit for bit), ``methods`` (the runs to
  train, default all), ``prepare`` (``[{creates: FILE, command: [...]}]``: made once, before the runs).
- ``extends``: another experiment file (relative to this one) whose keys this one overrides.
- anything else (``budget_s``, ``test_every``, ``top``...) is a parameter the settings and the table read.
"""

from __future__ import annotations

import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from string import Template
from typing import Any

import yaml

from flowrl.experiments.runs import STATE_LINES, gather, run_all, run_state, seed_dir, train

FLOATS = ("budget_s", "tune_budget_s", "gain", "max_drop")
"""Parameters kept as floats (so ``train.time_limit_s=330.0`` reads the same from the file and from a flag)."""
DEFAULTS: dict[str, Any] = {"seeds": [0], "parallel": 1, "resume": "restart", "results": "docs/results.md",
                            "section": None, "methods": None, "settings": [], "prepare": []}


class ExperimentError(ValueError):
    """An experiment file or flag that cannot be run: one line says why."""


@dataclass(frozen=True)
class Run:
    config: str
    overrides: tuple[str, ...] = ()


@dataclass
class Experiment:
    """One experiment: its runs and parameters, and how to train them (listing them instead when ``dry_run``)."""

    path: Path
    table: str
    runs: dict[str, Run]
    params: dict[str, Any]
    overrides: list[str] = field(default_factory=list)
    command: str = ""
    dry_run: bool = False
    table_only: bool = False

    @property
    def out(self) -> Path:
        return Path(self.params["out"])

    @property
    def seeds(self) -> list[int]:
        return list(self.params["seeds"])

    def names(self) -> list[str]:
        """The runs to train (``methods``, default every run), their names' ``${key}`` filled in."""
        wanted = self.params["methods"] or list(self.runs)
        return [self.substitute(name) for name in wanted]

    def run(self, name: str) -> Run:
        by_name = {self.substitute(key): run for key, run in self.runs.items()}
        return by_name[name]

    def substitute(self, text: str, **values: Any) -> str:
        """``text`` with ``${key}`` replaced by the parameter ``key`` (or ``values[key]``)."""
        scalars = {k: v for k, v in {**self.params, **values}.items() if isinstance(v, (str, int, float, Path))}
        try:
            return Template(text).substitute({k: str(v) for k, v in scalars.items()})
        except KeyError as missing:
            raise ExperimentError(f"{self.path}: {text!r} names {missing}, which the experiment does not set") from None
        except ValueError as bad:
            raise ExperimentError(f"{self.path}: {text!r}: {bad}") from None

    def arguments(self, name: str, seed: int, extra: list[str] = (), **values: Any) -> list[str]:
        """The training arguments of run ``name`` at ``seed``: its config file, the settings (``values`` replacing
        parameters, e.g. a tuning budget), ``seed=S``, its overrides, ``extra`` and the command line's overrides."""
        run = self.run(name)
        fill = lambda text: self.substitute(text, seed=seed, out=self.out, **values)  # noqa: E731
        return [run.config, *(fill(s) for s in self.params["settings"]), f"seed={seed}",
                *(fill(o) for o in run.overrides), *extra, *self.overrides]

    def train(self, jobs: list[tuple[str, int, Path, list[str], dict]]) -> None:
        """Train every job ``(name, seed, run_dir, extra, values)``; a finished run is kept. With ``dry_run``,
        print what each job would do and the command instead."""
        exact = self.params["resume"] == "exact"
        if self.dry_run:
            for name, seed, run_dir, extra, values in jobs:
                arguments = self.arguments(name, seed, extra, **values)
                state = run_state(run_dir, arguments, exact_resume=exact)
                print(f"{run_dir}: {STATE_LINES[state]}\n    python -m flowrl train "
                      + shlex.join([arguments[0], f"run_dir={run_dir}", *arguments[1:]]), flush=True)
            return
        run_all(jobs, lambda name, seed, run_dir, extra, values: train(
            run_dir, self.arguments(name, seed, extra, **values), exact_resume=exact), self.params["parallel"])

    def train_seeds(self, plan: dict[str, list[int]]) -> None:
        """Train each run of ``plan`` ({name: seeds}) into ``OUT/<name>_s<seed>``."""
        self.train([(name, seed, seed_dir(self.out, name, seed), [], {}) for name, seeds in plan.items()
                    for seed in seeds])

    def results(self, read, what: str = "runs") -> dict[str, dict[int, Any]] | None:
        """Train every run of every seed that is not finished (none with --table-only), then {name: {seed:
        read(run directory)}} over the finished ones; None on --dry-run, which only lists them."""
        plan = {name: self.seeds for name in self.names()}
        if not self.table_only:
            self.prepare()
            self.train_seeds(plan)
        if self.dry_run:
            return None
        found = gather(self.out, plan, read)
        if not found:
            raise SystemExit(f"{self.path}: no finished run under {self.out} for these {what} and seeds")
        return found

    def prepare(self) -> None:
        """Make each ``prepare`` file that is not there yet (e.g. a fitted reward direction), in order."""
        for step in self.params["prepare"]:
            creates = Path(self.substitute(step["creates"], out=self.out))
            command = [self.substitute(part, out=self.out) for part in step["command"]]
            if creates.is_file():
                continue
            if self.dry_run:
                print(f"{creates}: to make\n    {shlex.join(command)}", flush=True)
                continue
            command = [sys.executable if part == "python" else part for part in command]
            creates.parent.mkdir(parents=True, exist_ok=True)  # the experiment's own folder may not exist yet
            if subprocess.run(command).returncode != 0:
                raise ExperimentError(f"preparing {creates} failed: {shlex.join(command)}")


def read_file(path: Path, seen: tuple[Path, ...] = ()) -> dict[str, Any]:
    """The experiment file's keys, over those of the file it ``extends``."""
    path = Path(path)
    if path in seen:
        raise ExperimentError(f"{path}: 'extends' loops back to itself")
    try:
        data = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise ExperimentError(f"no experiment file {path}") from None
    except yaml.YAMLError as error:
        raise ExperimentError(f"{path} is not valid YAML: {str(error).splitlines()[0]}") from None
    if not isinstance(data, dict):
        raise ExperimentError(f"{path} must hold a mapping of keys (table, runs, seeds...)")
    parent = data.pop("extends", None)
    return {**read_file(path.parent / parent, (*seen, path)), **data} if parent else data


def load_experiment(path: Path | str) -> Experiment:
    """Read and check an experiment file (see the module docstring for its keys)."""
    path = Path(path)
    data = {**DEFAULTS, **read_file(path)}
    table, runs = data.pop("table", None), data.pop("runs", None)
    if not isinstance(table, str):
        raise ExperimentError(f"{path}: 'table' must name the table kind")
    if not isinstance(runs, dict) or not runs:
        raise ExperimentError(f"{path}: 'runs' must map run names to {{config: FILE, overrides: [...]}}")
    parsed = {}
    for name, run in runs.items():
        if not isinstance(run, dict) or not isinstance(run.get("config"), str) or set(run) - {"config", "overrides"}:
            raise ExperimentError(f"{path}: run {name!r} must be {{config: FILE, overrides: [...]}}")
        overrides = run.get("overrides") or []
        if not isinstance(overrides, list) or not all(isinstance(o, str) for o in overrides):
            raise ExperimentError(f"{path}: run {name!r}: overrides must be a list of strings")
        if "${" not in run["config"] and not Path(run["config"]).is_file():  # not "training exited with status 2"
            raise ExperimentError(f"{path}: run {name!r}: config file {run['config']} not found (paths are from the "
                                  "repository root)")
        parsed[str(name)] = Run(run["config"], tuple(overrides))
    if "out" not in data:
        raise ExperimentError(f"{path}: 'out' must name the directory of its runs")
    if data["resume"] not in ("restart", "exact"):
        raise ExperimentError(f"{path}: 'resume' must be restart or exact (got {data['resume']!r})")
    for key in FLOATS:
        if isinstance(data.get(key), int):
            data[key] = float(data[key])
    experiment = Experiment(path, table, parsed, data)
    check_methods(experiment)
    return experiment


def check_methods(experiment: Experiment) -> None:
    """Every name in ``methods`` must be a run of the experiment."""
    unknown = [m for m in experiment.params["methods"] or [] if m not in experiment.runs]
    if unknown:
        raise ExperimentError(f"{experiment.path}: no run named {', '.join(unknown)} "
                              f"(runs: {', '.join(experiment.runs)})")
