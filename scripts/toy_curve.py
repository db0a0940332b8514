"""The toy world's headline number: held-out ToyEval against wall-clock and number of rollouts.

Runs a toy config's recipe (``configs/toy/grpo.yaml`` unless another config is given, e.g. nft.yaml) with a
held-out evaluation before training and every ``--test-every`` epochs, then prints the curve:

    epoch | rollouts | train wall-clock (s) | held-out ToyEval strict | partial | diversity

Wall-clock counts sampling, scoring and training only, not the held-out evaluations.

    python scripts/toy_curve.py                          # the README's main job, measured
    python scripts/toy_curve.py configs/toy/grpo.yaml train.epochs=20 --test-every 2
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from flowrl.config import Config, load_config  # noqa: E402
from flowrl.commands.train import recipe_train  # noqa: E402
from flowrl.training.metrics import read_metrics  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config", nargs="?", default="configs/toy/grpo.yaml")
    parser.add_argument("overrides", nargs="*")
    parser.add_argument("--test-every", type=int, default=5)
    parser.add_argument("--run-dir", default="runs/toy_curve")
    args = parser.parse_args()
    cfg = load_config(Config, args.config, [f"run_dir={args.run_dir}", f"log.test_every={args.test_every}",
                                            *args.overrides])
    recipe_train(cfg.recipe)(cfg)
    print(f"\n{'epoch':>5} | {'rollouts':>8} | {'wall s':>7} | {'strict':>6} | {'partial':>7} | {'diversity':>9}")
    for record in read_metrics(cfg.run_dir):
        if "test/toyeval" not in record:
            continue
        print(f"{record['epoch']:>5} | {record['perf/rollouts']:>8} | {record['perf/train_wall_s']:>7.1f} | "
              f"{record['test/toyeval']:>6.3f} | {record.get('test/toyeval/partial', float('nan')):>7.3f} | "
              f"{record.get('test/diversity/gt_mean', float('nan')):>9.3f}")


if __name__ == "__main__":
    main()
