"""Stability of the shipped toy configs: each run for three times its epochs, one seed, read at 1x, 2x and 3x.

A recipe that is only good when stopped at exactly its default length is not a recipe: a user who gives the
main job more time must not get a worse model. The learning rate is constant in every toy config, so a run of
3E epochs passes through the E-epoch run's state; one run per config therefore gives both rows. For every
``configs/toy/*.yaml`` (or the configs named) this trains ``train.epochs = 3E`` with the config's own settings
otherwise and its held-out curve every E epochs (the config's own ``log.test_every`` where that divides E), and
prints

    config | E | held-out curve at 0 / E / 2E / 3E | 3x report: before -> after (change, paired s.e.) | diversity | ok

The curve is the run's ``test/toyeval/task_mean`` (32 held-out prompts, ODE, fixed seeds); the report is the
end-of-run comparison on 64 held-out prompts; "yes" where the 3x report ends no lower than the base. Runs go
to runs/bench_stability/<config>-3x; a run with a report is read, not rerun, and a cut-short run resumes.

    python scripts/bench/toy_stability.py                              # every toy config (hours on 2 cores)
    python scripts/bench/toy_stability.py configs/toy/nft.yaml configs/toy/grpo.yaml
    python scripts/bench/toy_stability.py configs/toy/grpo.yaml --tag lr1e-3 --override train.learning_rate=1e-3
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from main_job import KEY, change, run_seed  # noqa: E402  (a sibling script, not a package)

from flowrl.config import Config, load_config  # noqa: E402
from flowrl.training.metrics import read_metrics  # noqa: E402

CURVE = "test/toyeval/task_mean"


def curve_at(run_dir: Path, epochs: list[int]) -> list[float]:
    """The held-out curve's value after each of ``epochs`` epochs (epoch -1 is the base); nan where unscored."""
    points = {r["epoch"]: r[CURVE] for r in read_metrics(run_dir) if CURVE in r}
    return [points.get(e - 1, float("nan")) for e in epochs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("configs", nargs="*", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tag", default="", help="suffix of the run directories, to keep variants apart")
    parser.add_argument("--override", action="append", default=[], help="a.b=value for every run (repeatable)")
    args = parser.parse_args()
    configs = args.configs or sorted(Path("configs/toy").glob("*.yaml"))
    print("| config | E | held-out curve at 0 / E / 2E / 3E | 3x report | change | paired s.e. | diversity change "
          "| 3x no lower |")
    print("|---|---|---|---|---|---|---|---|")
    for config in configs:
        cfg = load_config(Config, config)  # the base: chain resolved, as flowrl train reads it
        epochs, own = cfg.train.epochs, cfg.log.test_every
        test_every = own if own and epochs % own == 0 else epochs
        run_dir = Path("runs/bench_stability") / (f"{config.stem}-3x" + (f"-{args.tag}" if args.tag else ""))
        results, _ = run_seed(str(config), args.seed, run_dir,
                              [f"train.epochs={3 * epochs}", f"log.test_every={test_every}", "log.report_prompts=64",
                               *args.override])
        before, after, gain, errors = change(results, KEY)
        div = results["after"].get("diversity/gt_mean", float("nan")) - results["before"].get(
            "diversity/gt_mean", float("nan"))
        curve = " / ".join(f"{v:.3f}" for v in curve_at(run_dir, [0, epochs, 2 * epochs, 3 * epochs]))
        print(f"| {config.stem}{' ' + args.tag if args.tag else ''} | {epochs} | {curve} | {before:.3f} -> "
              f"{after:.3f} | {gain:+.3f} | {errors:.1f} | {div:+.3f} | {'yes' if after >= before else 'NO'} |",
              flush=True)


if __name__ == "__main__":
    main()
