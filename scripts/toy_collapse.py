"""Preference mode collapse in miniature: GRPO on the hackable proxy vs GRPO on ToyEval with KL.

Trains ``configs/toy/grpo_proxy.yaml`` (ToyProxy, no KL) and ``configs/toy/grpo.yaml`` (ToyEval,
KL) with the same overrides, then prints, from each run's ``report.json`` (held-out prompts, the
same seeds before and after), the rewards and the toy world's ground-truth diversity of the free
attributes (background, position bin, size bin; normalised entropy per prompt group). Both
configs also score the other reward with weight 0 (logged, not trained on), so each report holds both:

    run | ToyEval strict before/after | proxy before/after | diversity before/after (change)

    python scripts/toy_collapse.py                        # both configs as shipped
    python scripts/toy_collapse.py train.epochs=20        # shorter, same overrides for both
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from flowrl.config import Config, load_config
from flowrl.commands.train import recipe_train

RUNS = {"proxy, no KL": "configs/toy/grpo_proxy.yaml", "ToyEval + KL": "configs/toy/grpo.yaml"}
DIVERSITY_KEYS = ("diversity/gt_mean", "diversity/background", "diversity/position", "diversity/size")


def run(config: str, run_dir: Path, overrides: list[str]) -> dict:
    """Train one config (reusing a finished run's report) and return its report.json."""
    report = run_dir / "report.json"
    if not report.exists():
        cfg = load_config(Config, config, [f"run_dir={run_dir}", "log.report_diversity=toy", *overrides])
        recipe_train(cfg.recipe)(cfg)
    return json.loads(report.read_text())


def fmt(report: dict, key: str) -> str:
    before, after = report["before"].get(key), report["after"].get(key)
    if before is None or after is None:
        return "n/a"
    return f"{before:.3f} -> {after:.3f} ({after - before:+.3f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("overrides", nargs="*", help="config overrides applied to both runs")
    parser.add_argument("--out", default="runs/toy_collapse")
    args = parser.parse_args()
    reports = {name: run(cfg, Path(args.out) / Path(cfg).stem, args.overrides) for name, cfg in RUNS.items()}
    for key in ("eval/toyeval", "eval/toy_proxy", *DIVERSITY_KEYS):
        print(f"{key:>22} | " + " | ".join(f"{name}: {fmt(rep, key)}" for name, rep in reports.items()))


if __name__ == "__main__":
    main()
