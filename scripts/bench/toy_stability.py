"""Stability of the shipped toy configs: each run at its own length and at three times it, one seed each.

A recipe that is only good when stopped at exactly its default length is not a recipe: a user who gives the
main job more time must not get a worse model. For every ``configs/toy/*.yaml`` (or the configs named) this
trains ``train.epochs = E`` and ``3 E`` with the config's own settings otherwise, and prints

    config | epochs | held-out task mean before -> after (change, paired s.e.) | diversity change

with "ok" where the 3x run ends no lower than the base on held-out prompts. Runs go to
runs/bench_stability/<config>-<1x|3x> and a run with a report is read, not rerun (the table resumes).

    python scripts/bench/toy_stability.py                              # every toy config (hours on 2 cores)
    python scripts/bench/toy_stability.py configs/toy/nft.yaml configs/toy/grpo.yaml
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from main_job import KEY, change, run_seed  # noqa: E402  (a sibling script, not a package)


def epochs_of(config: Path) -> int:
    """``train.epochs`` of a config, following its ``base:`` chain."""
    data = yaml.safe_load(config.read_text()) or {}
    epochs = (data.get("train") or {}).get("epochs")
    if epochs is None and data.get("base"):
        return epochs_of(config.parent / data["base"])
    return int(epochs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("configs", nargs="*", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    configs = args.configs or sorted(Path("configs/toy").glob("*.yaml"))
    print("| config | epochs | held-out task mean | change | paired s.e. | diversity change | 3x no lower |")
    print("|---|---|---|---|---|---|---|")
    for config in configs:
        epochs = epochs_of(config)
        for scale in (1, 3):
            run_dir = Path("runs/bench_stability") / f"{config.stem}-{scale}x"
            results, _ = run_seed(str(config), args.seed, run_dir,
                                  [f"train.epochs={scale * epochs}", "log.report_prompts=64"])
            before, after, gain, errors = change(results, KEY)
            div = results["after"].get("diversity/gt_mean", float("nan")) - results["before"].get(
                "diversity/gt_mean", float("nan"))
            verdict = ("yes" if after >= before else "NO") if scale == 3 else ""
            print(f"| {config.stem} | {scale * epochs} | {before:.3f} -> {after:.3f} | {gain:+.3f} | {errors:.1f} | "
                  f"{div:+.3f} | {verdict} |", flush=True)


if __name__ == "__main__":
    main()
