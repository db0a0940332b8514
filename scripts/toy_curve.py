"""The toy world's headline number: held-out ToyEval against wall-clock and number of rollouts.

Runs a toy config's recipe (the main job's ``configs/toy/nft.yaml`` unless another is given, e.g. grpo.yaml) with a
held-out evaluation before training and every ``--test-every`` epochs, then prints the curve:

    epoch | rollouts | train wall-clock (s) | held-out ToyEval strict | task-mean strict | partial | diversity
          | strict per task (single_object, counting, two_object, position)

"strict" is the mean over images; "task-mean" is GenEval's overall score, the mean over tasks of each
task's mean (the held-out prompts are an equal share per task). Wall-clock counts sampling, scoring and
training only, not the held-out evaluations.

    python scripts/toy_curve.py                          # the README's main job, measured
    python scripts/toy_curve.py --test-every 10 configs/toy/grpo.yaml train.epochs=20   # options first
"""

from __future__ import annotations

import argparse

from flowrl.cli import DEFAULT_CONFIG
from flowrl.config import Config, load_config
from flowrl.commands.train import recipe_train
from flowrl.training.metrics import read_metrics


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config", nargs="?", default=DEFAULT_CONFIG)
    parser.add_argument("overrides", nargs="*")
    parser.add_argument("--test-every", type=int, default=5)
    parser.add_argument("--run-dir", default="runs/toy_curve")
    args = parser.parse_args()
    cfg = load_config(Config, args.config, [f"run_dir={args.run_dir}", f"log.test_every={args.test_every}",
                                            *args.overrides])
    recipe_train(cfg.recipe)(cfg)
    records = [r for r in read_metrics(cfg.run_dir) if "test/toyeval" in r]
    prefix = "test/toyeval/task/"
    tasks = list(dict.fromkeys(k.removeprefix(prefix) for r in records for k in r if k.startswith(prefix)))
    nan = float("nan")
    print(f"\n{'epoch':>5} | {'rollouts':>8} | {'wall s':>7} | {'strict':>6} | {'task-mean':>9} | {'partial':>7} | "
          f"{'diversity':>9}" + "".join(f" | {t:>13}" for t in tasks))
    for record in records:
        print(f"{record['epoch']:>5} | {record['perf/rollouts']:>8} | {record['perf/train_wall_s']:>7.1f} | "
              f"{record['test/toyeval']:>6.3f} | {record.get('test/toyeval/task_mean', nan):>9.3f} | "
              f"{record.get('test/toyeval/partial', nan):>7.3f} | {record.get('test/diversity/gt_mean', nan):>9.3f}"
              + "".join(f" | {record.get(prefix + t, nan):>13.3f}" for t in tasks))


if __name__ == "__main__":
    main()
