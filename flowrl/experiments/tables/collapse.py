"""The preference-collapse table: every method optimises a hackable proxy reward (the experiment's ``proxy``:
``toy_clip``, the CLIP-like proxy whose text embedding carries a black-background bias for every prompt, or
``toy_proxy``), with strict ToyEval scored alongside at weight 0 (held out from training, so it catches hacking)
(``experiments/collapse.yaml``; ``experiments/artifact.yaml`` compares the proxy with and without the fitted
artifact reward beside it).

Columns: the first held-out point at which background diversity is half the base's or less (the collapse; seeds
where it never came are left out of the mean, and the count says how many reached it), then each method's final
held-out proxy reward (the raw proxy score, also for D²-Align), strict ToyEval, ground-truth diversity and
background diversity, each with its change from the base; ``results_collapse.png`` beside the results file plots
the reward-diversity trade-off.
"""

from __future__ import annotations

import statistics
from pathlib import Path

from flowrl.experiments.cells import CELL_NOTE, budget_words, fmt_mean_se
from flowrl.experiments.markdown import replace_section, table_head
from flowrl.experiments.spec import Experiment
from flowrl.training.metrics import read_metrics

SECTION = "Preference mode collapse"
KEYS = ("proxy", "toyeval", "diversity", "background")


# The experiment-file keys this table reads, besides every table's (flowrl.experiments.tables.COMMON_KEYS).
FILE_KEYS = frozenset({"plot", "proxy"})


def summary(run_dir: Path, proxy_reward: str = "toy_clip") -> dict:
    tests = [r for r in read_metrics(run_dir) if "test/toyeval/task_mean" in r]
    raw = f"test/{proxy_reward}_d2/raw/task_mean"  # D²-Align trains the corrected score; the table reports the raw one
    proxy = raw if raw in tests[-1] else f"test/{proxy_reward}/task_mean"
    point = lambda r: {"proxy": r[proxy], "toyeval": r["test/toyeval/task_mean"],  # noqa: E731
                       "diversity": r["test/diversity/gt_mean"], "background": r["test/diversity/background"]}
    base = point(tests[0])
    halved = next((r["epoch"] + 1 for r in tests[1:] if r["test/diversity/background"] <= base["background"] / 2),
                  None)  # epochs trained when held-out background diversity first stood at half the base's
    return {"epochs": tests[-1]["epoch"] + 1, "halved": halved, "base": base, "final": point(tests[-1])}


def plot(results: dict[str, dict[int, dict]], path: Path) -> None:
    """Each method's final proxy reward against ground-truth diversity: the mean over seeds, its standard error
    as error bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def point(runs: list[dict], key: str) -> tuple[float, float]:
        values = [r[key] for r in runs]
        se = statistics.stdev(values) / len(values) ** 0.5 if len(values) > 1 else 0.0
        return statistics.fmean(values), se

    fig, ax = plt.subplots(figsize=(6, 4.5))
    bases = {seed: r["base"] for per_seed in results.values() for seed, r in per_seed.items()}
    (x, _), (y, _) = point(list(bases.values()), "diversity"), point(list(bases.values()), "proxy")
    ax.scatter([x], [y], color="black", marker="*", s=120, label="base", zorder=3)
    colours = plt.get_cmap("tab10").colors
    for i, (name, per_seed) in enumerate(results.items()):
        finals = [r["final"] for r in per_seed.values()]
        (x, xe), (y, ye) = point(finals, "diversity"), point(finals, "proxy")
        ax.errorbar([x], [y], xerr=[xe], yerr=[ye], color=colours[i % 10], fmt="o", ms=6, label=name)
        ax.annotate(name, (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
    ax.set_xlabel("ground-truth diversity (held-out, higher keeps more)")
    ax.set_ylabel("proxy reward (held-out)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def table(results: dict[str, dict[int, dict]], p: dict, command: str, config: str, plot_path: Path) -> str:
    bases = {seed: r["base"] for per_seed in results.values() for seed, r in per_seed.items()}
    base = {k: fmt_mean_se(b[k] for b in bases.values()) for k in KEYS}
    prose = (f"Every method optimised `{p.get('proxy', 'toy_clip')}` (`{config}`, strict ToyEval logged at weight 0) "
             f"for {budget_words(p)}. {CELL_NOTE} Base: proxy {base['proxy']}, ToyEval {base['toyeval']}, diversity "
             f"{base['diversity']}, background diversity {base['background']}. Plot: `{plot_path}`.")
    lines = table_head(f"## {p['section'] or SECTION}", command, prose,
                       ["method", "seeds", "epochs", "background halved at epoch", "proxy", "change", "ToyEval",
                        "change", "gt diversity", "change", "background", "change"])
    for name, per_seed in results.items():
        cells = [f"{fmt_mean_se(r['final'][k] for r in per_seed.values())} | "
                 + fmt_mean_se((r["final"][k] - r["base"][k] for r in per_seed.values()), "+.3f") for k in KEYS]
        lines.append(f"| {name} | {','.join(map(str, per_seed))} | "
                     f"{fmt_mean_se((r['epochs'] for r in per_seed.values()), '.0f')} | "
                     f"{fmt_mean_se((r['halved'] for r in per_seed.values()), '.0f', missing='never')} | "
                     + " | ".join(cells) + " |")
    return "\n".join(lines + [""])


def make(exp: Experiment) -> str | None:
    proxy = exp.params.get("proxy", "toy_clip")
    results = exp.results(lambda run_dir: summary(run_dir, proxy), "methods")  # runs `prepare` first
    if results is None:
        return None
    plot_path = Path(exp.params["results"]).parent / exp.params.get("plot", "results_collapse.png")
    plot_path.parent.mkdir(parents=True, exist_ok=True)
    plot(results, plot_path)
    config = exp.run(next(iter(results))).config
    text = table(results, exp.params, exp.command, config, plot_path)
    replace_section(Path(exp.params["results"]), text, text.splitlines()[0])
    return text
