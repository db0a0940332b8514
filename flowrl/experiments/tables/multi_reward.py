"""The multi-reward table: strict ToyEval plus the ToyProxy preference reward, which conflicts with it (within
a group, images the proxy likes are less often right), trained together under each reward combiner
(``experiments/multi_reward.yaml``).

Columns: each reward's final held-out task mean and its change from the base, ground-truth diversity, and from
the MARBLE run the fraction of refreshes whose worst reward gradient has a negative cosine with the update,
under the weighted sum of the same gradients and under MARBLE (the paper's diagnostic).
"""

from __future__ import annotations

from pathlib import Path

from flowrl.experiments.cells import CELL_NOTE, budget_words, fmt_mean_se
from flowrl.experiments.markdown import replace_section, table_head
from flowrl.experiments.spec import Experiment
from flowrl.training.metrics import read_metrics

SECTION = "Multi-reward balancing"


# The experiment-file keys this table reads, besides every table's (flowrl.experiments.tables.COMMON_KEYS).
FILE_KEYS: frozenset[str] = frozenset()


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


def table(results: dict[str, dict[int, dict]], p: dict, command: str) -> str:
    bases = {seed: r for per_seed in results.values() for seed, r in per_seed.items()}
    prose = (f"`configs/toy/nft.yaml` with strict ToyEval and ToyProxy both at weight 1, "
             f"{budget_words(p, ' per combiner')} (one point's sampling error is about 0.02). {CELL_NOTE} The base "
             f"model scores ToyEval {fmt_mean_se(r['toyeval_base'] for r in bases.values())} and ToyProxy "
             f"{fmt_mean_se(r['proxy_base'] for r in bases.values())}.")
    lines = table_head(f"## {p['section'] or SECTION}", command, prose,
                       ["combine", "seeds", "epochs", "ToyEval", "change", "ToyProxy", "change", "gt diversity",
                        "worst cos < 0, weighted", "worst cos < 0, MARBLE"])
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


def make(exp: Experiment) -> str | None:
    results = exp.results(summary, "combiners")
    if results is None:
        return None
    text = table(results, exp.params, exp.command)
    replace_section(Path(exp.params["results"]), text, text.splitlines()[0])
    return text
