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

It replaces the ``## Multi-reward balancing`` section of ``docs/results.md`` (the rest is kept).

    python scripts/compare_multi_reward.py                      # 4 combiners, 240 s each
    python scripts/compare_multi_reward.py --combiners weighted marble --budget-s 60
"""

from __future__ import annotations

import argparse
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from compare_algorithms import NFT, add_run_arguments, replace_section, run_config  # noqa: E402
from flowrl.training.metrics import read_metrics  # noqa: E402

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


def table(results: dict[str, dict], args, command: str) -> str:
    first = next(iter(results.values()))
    lines = [SECTION, "", f"`{command}`", "",
             f"`configs/toy/nft.yaml` with strict ToyEval and ToyProxy both at weight 1, {args.budget_s:.0f} s of "
             f"training time per combiner (2 CPU cores, {args.parallel} runs at a time, one thread each), the same "
             f"seeds; held-out task means on {args.test_prompts} prompts x {args.images} ODE images (one point's "
             "sampling error is about 0.02). The base model scores ToyEval "
             f"{first['toyeval_base']:.3f} and ToyProxy {first['proxy_base']:.3f}.", "",
             "| combine | epochs | ToyEval | change | ToyProxy | change | gt diversity | worst cos < 0, weighted | "
             "worst cos < 0, MARBLE |", "|" + "---|" * 9]
    for name, r in results.items():
        fractions = (f"{r['negative_weighted']:.2f} | {r['negative_marble']:.2f}" if name == "marble" else " | ")
        lines.append(f"| {name} | {r['epochs']} | {r['toyeval']:.3f} | {r['toyeval'] - r['toyeval_base']:+.3f} | "
                     f"{r['proxy']:.3f} | {r['proxy'] - r['proxy_base']:+.3f} | {r['diversity']:.3f} | {fractions} |")
    lines += ["", "The cosine columns are measured in the MARBLE run, at each refresh, on the same per-reward "
              "gradients: how often the update would move the worst-served reward's loss the wrong way under "
              "the configured weighted sum, and under MARBLE's direction.", ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--combiners", nargs="*", default=list(COMBINERS), choices=list(COMBINERS))
    add_run_arguments(parser, out="runs/compare_multi_reward")
    args = parser.parse_args()
    command = ("python scripts/compare_multi_reward.py " + " ".join(sys.argv[1:])).strip()
    if not args.table_only:
        with ThreadPoolExecutor(args.parallel) as pool:
            list(pool.map(lambda name: run_config(NFT, overrides(name), Path(args.out) / name, args.budget_s,
                                                  args.test_every, args), args.combiners))
    text = table({name: summary(Path(args.out) / name) for name in args.combiners}, args, command)
    replace_section(Path("docs/results.md"), text, SECTION)
    print(text)


if __name__ == "__main__":
    main()
