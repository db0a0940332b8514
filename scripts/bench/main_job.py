"""The main job's figures: `flowrl train` (a toy config, the README's default unless given) on several seeds,
each timed as a whole process, with its held-out change read from the run's report.json.

Prints one row per seed and the mean over seeds:

    seed | wall-clock | held-out task mean before -> after (change, paired s.e.) | per task change | diversity change

and, last, the targets of the toy world's main job: every seed's task-mean gain, the least of them, and the
largest change in ground-truth diversity. Wall-clock includes model loading and the end-of-run report;
set-up (the venv) is not included.

    python scripts/bench/main_job.py                                   # the main job, seeds 0 1 2
    python scripts/bench/main_job.py --seeds 0 --config configs/toy/grpo.yaml train.epochs=180
    python scripts/bench/main_job.py --model runs/models/base          # any base: model.path=...

Runs go to runs/bench_main_job/<config>-s<seed>[-tag]; a seed whose run already has a report.json is read,
not rerun, so an interrupted benchmark resumes.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from flowrl.cli import DEFAULT_CONFIG

KEY = "eval/toyeval/task_mean"
TASKS = ("single_object", "counting", "two_object", "position")


def run_seed(config: str, seed: int, run_dir: Path, overrides: list[str]) -> tuple[dict, float | None]:
    """(report.json's results, seconds) of one seed's run; seconds None when the report was already there."""
    report = run_dir / "report.json"
    if report.is_file():
        return json.loads(report.read_text()), None
    command = [sys.executable, "-m", "flowrl", "train", config, f"seed={seed}", f"run_dir={run_dir}",
               "log.progress=false", *overrides]
    if any(run_dir.glob("checkpoints/step_*")):  # a run cut short: continue it rather than refuse
        command.append("train.resume=latest")
    elif run_dir.exists():  # cut short before its first checkpoint: nothing to resume, start it again
        shutil.rmtree(run_dir)
    start = time.perf_counter()
    subprocess.run(command, check=True)
    return json.loads(report.read_text()), time.perf_counter() - start


def change(results: dict, key: str) -> tuple[float, float, float, float]:
    """(before, after, change, paired standard errors) of one key."""
    before, after = results["before"][key], results["after"][key]
    paired = results.get("paired", {}).get(key, {})
    return before, after, after - before, paired.get("standard_errors", float("nan"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("overrides", nargs="*", help="a.b=value overrides for every seed's run")
    parser.add_argument("--config", default=DEFAULT_CONFIG)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--model", help="model.path of every run (a base other than the config's)")
    parser.add_argument("--tag", default="", help="suffix of the run directories, to keep variants apart")
    args = parser.parse_args()
    overrides = list(args.overrides) + ([f"model.path={args.model}"] if args.model else [])
    root = Path("runs/bench_main_job")
    rows, gains, diversity = [], [], []
    for seed in args.seeds:
        name = f"{Path(args.config).stem}-s{seed}" + (f"-{args.tag}" if args.tag else "")
        results, seconds = run_seed(args.config, seed, root / name, overrides)
        before, after, gain, errors = change(results, KEY)
        per_task = ", ".join(f"{t} {change(results, f'eval/toyeval/task/{t}')[2]:+.3f}" for t in TASKS
                             if f"eval/toyeval/task/{t}" in results["before"])
        div = results["after"].get("diversity/gt_mean", float("nan")) - results["before"].get("diversity/gt_mean",
                                                                                                float("nan"))
        clock = "(read)" if seconds is None else f"{seconds / 60:.1f} min"
        rows.append(f"seed {seed} | {clock} | {before:.3f} -> {after:.3f} ({gain:+.3f}, {errors:.1f} paired s.e.) | "
                    f"{per_task} | diversity {div:+.3f}")
        gains.append(gain)
        diversity.append(div)
    print("\n".join(rows))
    spread = statistics.stdev(gains) / len(gains) ** 0.5 if len(gains) > 1 else float("nan")
    print(f"held-out task-mean change over {len(gains)} seeds: {statistics.mean(gains):+.3f} ± {spread:.3f} (s.e.); "
          f"least {min(gains):+.3f}; largest diversity change {max(diversity, key=abs):+.3f}")


if __name__ == "__main__":
    main()
