"""Multi-reward balancing on the toy world: strict ToyEval plus the ToyProxy preference reward, which
conflicts with it (within a group, images the proxy likes are less often right: a correlation of
about -0.15 on the base model's samples), trained together under each reward combiner.

Every run is ``configs/toy/nft.yaml`` (the recipe that learns on the toy world) with both rewards at
weight 1 and one ``train.combine``, on the same seeds and the same ``--budget-s`` of sampling, scoring
and training time, two at a time with one torch thread each. The table reports each reward's final
held-out value (task mean over ``--test-prompts`` prompts x ``--images`` ODE images), the change from
the base model, ground-truth diversity, and from the MARBLE run the fraction of refreshes whose worst
reward gradient has a negative cosine with the update, under the weighted sum of the same gradients and
under MARBLE (the paper's diagnostic).

It replaces the ``## Multi-reward balancing`` section of ``--results`` (default ``docs/results.md``; the
rest is kept).

Seeds (``--seeds 0,1,2``): every combiner runs once per seed (override ``seed=S``, run directory
``--out/<combiner>_sS``); each cell is the mean over seeds ± the standard error (sample std / sqrt(n)) and
(n), the changes taken per seed from that seed's base point.

Resume: a run is finished once its ``done.json`` exists (written after the training process exited cleanly,
see ``seeded_runs.py``); a rerun, e.g. after Ctrl-C, skips finished runs and starts the others again from
scratch, their directories removed first (no mid-run checkpoints: a wall-clock budget does not resume
exactly). ``--table-only`` rebuilds the table from ``--out``.

    python scripts/compare_multi_reward.py                      # 4 combiners, 240 s each
    python scripts/compare_multi_reward.py --combiners weighted marble --budget-s 60 --seeds 0,1,2
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from compare_algorithms import NFT, add_run_arguments, replace_section, run_all, run_config  # noqa: E402
from flowrl.training.metrics import read_metrics  # noqa: E402
from seeded_runs import CELL_NOTE, fmt_mean_se, gather, seed_dir  # noqa: E402

REWARDS = "rewards=[{name: toyeval}, {name: toy_proxy, weight: 1.0}]"
COMBINERS = ("weighted", "gdpo", "correlation", "marble")
SECTION = "## Multi-reward balancing"


def overrides(combine: str) -> list[str]:
    extra = ["train.marble.refresh_every=2"] if combine == "marble" else []  # one refresh per epoch (2 steps)
    return [REWARDS, f"train.combine={combine}", *extra]


def summary(run_dir: Path) -> dict:
    records = read_metrics(run_dir)
    tests = [r for r in records if "test/toyeval/task_mean" in r]
    base, last = tests[0], tests[-1]

    def mean_of(key: str) -> float:
        values = [r[key] for r in records if key in r]
        return sum(values) / len(values) if values else float("nan")

    return {"epochs": last["epoch"] + 1, "toyeval": last["test/toyeval/task_mean"],
            "toyeval_base": base["test/toyeval/task_mean"], "proxy": last["test/toy_proxy/task_mean"],
            "proxy_base": base["test/toy_proxy/task_mean"],
            "diversity": last.get("test/diversity/gt_mean", float("nan")),
            "negative_weighted": mean_of("marble/worst_cos_negative_weighted"),
            "negative_marble": mean_of("marble/worst_cos_negative_marble")}


def table(results: dict[str, dict[int, dict]], args, command: str) -> str:
    bases = {seed: r for per_seed in results.values() for seed, r in per_seed.items()}
    lines = [SECTION, "", f"`{command}`", "",
             f"`configs/toy/nft.yaml` with strict ToyEval and ToyProxy both at weight 1, {args.budget_s:.0f} s of "
             f"training time per combiner (2 CPU cores, {args.parallel} runs at a time, one thread each), once per "
             f"seed (column `seeds`); held-out task means on {args.test_prompts} prompts x {args.images} ODE images "
             f"(one point's sampling error is about 0.02). {CELL_NOTE} The base model scores ToyEval "
             f"{fmt_mean_se(r['toyeval_base'] for r in bases.values())} and ToyProxy "
             f"{fmt_mean_se(r['proxy_base'] for r in bases.values())}.", "",
             "| combine | seeds | epochs | ToyEval | change | ToyProxy | change | gt diversity | "
             "worst cos < 0, weighted | worst cos < 0, MARBLE |", "|" + "---|" * 10]
    for name, per_seed in results.items():
        runs = list(per_seed.values())
        cell = lambda key, spec=".3f": fmt_mean_se((r[key] for r in runs), spec)  # noqa: E731
        change = lambda key: fmt_mean_se((r[key] - r[f"{key}_base"] for r in runs), "+.3f")  # noqa: E731
        fractions = (f"{cell('negative_weighted', '.2f')} | {cell('negative_marble', '.2f')}"
                     if name == "marble" else " | ")
        lines.append(f"| {name} | {','.join(map(str, per_seed))} | {cell('epochs', '.0f')} | {cell('toyeval')} | "
                     f"{change('toyeval')} | {cell('proxy')} | {change('proxy')} | {cell('diversity')} | {fractions} |")
    lines += ["", "The cosine columns are measured in the MARBLE run, at each refresh, on the same per-reward "
              "gradients: how often the update would move the worst-served reward's loss the wrong way under "
              "the configured weighted sum, and under MARBLE's direction.", ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--combiners", nargs="*", default=list(COMBINERS), choices=list(COMBINERS))
    add_run_arguments(parser, out="runs/compare_multi_reward")
    args = parser.parse_args()
    out = Path(args.out)
    command = ("python scripts/compare_multi_reward.py " + " ".join(sys.argv[1:])).strip()
    if not args.table_only:
        run_all([(name, seed) for name in args.combiners for seed in args.seeds],
                lambda name, seed: run_config(NFT, overrides(name), seed_dir(out, name, seed), args.budget_s,
                                              args.test_every, args, seed=seed), args.parallel)
    results = gather(out, {name: args.seeds for name in args.combiners}, summary)
    if not results:
        sys.exit(f"compare_multi_reward: no finished run under {out} for these combiners and seeds")
    text = table(results, args, command)
    replace_section(Path(args.results), text, SECTION)
    print(text)


if __name__ == "__main__":
    main()
