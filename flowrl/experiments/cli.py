"""The runner's command line: ``python -m flowrl.experiments EXPERIMENT.yaml [options] [overrides]``.

It trains the experiment's runs that are not finished yet (a rerun after Ctrl-C skips the finished ones and
resumes or redoes the others), then writes its table into ``--results`` and prints it. A flag replaces the
experiment file's value of the same name (``--budget-s 60`` sets ``budget_s``); the overrides after the file
go to every run (``train.checkpoint_every=5``).

    python -m flowrl.experiments experiments/algorithms.yaml --seeds 0,1,2
    python -m flowrl.experiments experiments/algorithms.yaml --top 4 --top-seeds 0,1,2
    python -m flowrl.experiments experiments/collapse.yaml --methods grpo d2align --budget-s 60
    python -m flowrl.experiments experiments/guard.yaml --max-drop 0.2 train.epochs=30
    python -m flowrl.experiments experiments/multi_reward.yaml --dry-run     # what would run, and how
"""

from __future__ import annotations

import argparse
import shlex
import sys
from collections.abc import Sequence

from flowrl.experiments.runs import parse_seeds
from flowrl.experiments.spec import ExperimentError, check_methods, load_experiment
from flowrl.experiments.tables import TABLES, check_keys

ANY = ("seeds", "methods", "parallel", "out", "results", "section")
"""Parameters every experiment has; any other flag must name a key its file sets."""


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m flowrl.experiments", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("experiment", help="an experiment file, e.g. experiments/algorithms.yaml")
    p.add_argument("overrides", nargs="*", help="config overrides a.b=value for every run")
    p.add_argument("--seeds", type=parse_seeds, help="comma-separated run seeds (run directory NAME_sS)")
    p.add_argument("--methods", "--combiners", nargs="+",
                   help="the runs to train and tabulate, space- or comma-separated (default: all)")
    p.add_argument("--budget-s", "--budget", type=float, dest="budget_s", help="training time per run (s)")
    p.add_argument("--test-every", type=int, help="epochs between held-out points")
    p.add_argument("--test-prompts", type=int, help="held-out prompts")
    p.add_argument("--images", type=int, help="ODE images per held-out prompt")
    p.add_argument("--parallel", type=int, help="runs at a time, one torch thread each")
    p.add_argument("--out", help="the directory of the run directories")
    p.add_argument("--results", help="the markdown file the table goes into (plots beside it)")
    p.add_argument("--section", help="write the table as this '## ' section of --results")
    p.add_argument("--top", type=int, help="two stages: every run with the first of --top-seeds, then the K best")
    p.add_argument("--top-seeds", type=parse_seeds, help="the seeds of --top")
    p.add_argument("--gain", type=float, help="report the time to reach the base task mean plus this")
    p.add_argument("--tune-budget-s", type=float, help="per tuning run (s); 0: no tuning")
    p.add_argument("--lr-factors", type=float, nargs="+", help="learning-rate factors of the tuning sweep")
    p.add_argument("--max-drop", type=float, help="guard.max_drop of the guarded run")
    p.add_argument("--table-only", action="store_true", help="rebuild the table from --out, training nothing")
    p.add_argument("--dry-run", action="store_true", help="list each run's state and command, train nothing")
    return p


def checked_overrides(overrides: Sequence[str]) -> list[str]:
    """The overrides for every run, each ``a.b=value``; anything else is one line before a run starts (a stray
    token would otherwise reach every run's command line and fail each one, e.g. ``--seeds 0 1`` passes ``1``)."""
    for token in overrides:
        key, sep, _ = token.partition("=")
        if not sep or not key.strip():
            hint = " (several seeds are one comma-separated flag: --seeds 0,1,2)" if token.strip().isdigit() else ""
            raise ExperimentError(f"{token!r} is not an override; overrides are a.b=value{hint}")
    return list(overrides)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser().parse_intermixed_args(argv)
    if args.methods:  # "--methods a b" or "--methods a,b", as --seeds takes 0,1,2
        args.methods = [name for item in args.methods for name in item.split(",") if name]
    try:
        experiment = load_experiment(args.experiment)
        flags = {k: v for k, v in vars(args).items()
                 if v is not None and k not in ("experiment", "overrides", "table_only", "dry_run")}
        for key, value in flags.items():
            if key not in ANY and key not in experiment.params:
                raise ExperimentError(f"{args.experiment}: --{key.replace('_', '-')} does not apply to this experiment")
        if (args.top or 0) < 0:
            raise ExperimentError("--top must be >= 0")
        experiment.params.update(flags)
        check_methods(experiment)
        if experiment.table not in TABLES:
            raise ExperimentError(f"{args.experiment}: unknown table {experiment.table!r} "
                                  f"(one of {', '.join(TABLES)})")
        check_keys(experiment)
        experiment.overrides = checked_overrides(args.overrides)
        experiment.dry_run, experiment.table_only = args.dry_run, args.table_only
        experiment.command = "python -m flowrl.experiments " + shlex.join(argv)
        text = TABLES[experiment.table](experiment)
    except ExperimentError as error:
        print(f"flowrl.experiments: {error}", file=sys.stderr)
        return 2
    if text:
        print(text)
    return 0
