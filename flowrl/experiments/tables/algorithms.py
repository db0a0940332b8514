"""The algorithms table: every trajectory and forward-process method on the toy world, on the same seeds,
machine and wall-clock budget (``experiments/algorithms.yaml``).

Each run trains for ``budget_s`` seconds of sampling, scoring and training time (``train.time_limit_s``),
with the held-out task-mean strict ToyEval measured before training, every ``test_every`` epochs and where
the budget runs out. Columns: epochs, rollouts, train time, best and final held-out task mean, the change from
the base, per task, ground-truth diversity, the time to reach base + ``gain`` and 0.6, the speed-up to the
reference's final level, and what each method's paper claims (``claims``).

Why the stages live here: tuning (``tune_budget_s`` > 0: one short run per learning rate in ``lr_factors``
times the config's, scored on validation prompts, the comparison then at the best rate) and the two-stage seed
plan (``top`` K: every method with the first of ``top_seeds``, then the K best and the reference with the rest)
depend on what the first runs measured.

The speed-up column: the wall-clock (and rollouts) the reference takes to first reach its own final held-out
level (mean over its seeds), divided by the time the method's curve takes to first reach that level.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from flowrl.config import Config, load_config
from flowrl.experiments.cells import fmt_mean_se
from flowrl.experiments.markdown import replace_head, replace_section, slug
from flowrl.experiments.runs import finished_seeds, gather, seed_dir
from flowrl.experiments.spec import Experiment, ExperimentError
from flowrl.training.metrics import read_metrics

TASKS = ("single_object", "counting", "two_object", "position")
# The held-out file has 6 single-object prompts, all in the comparison's test set, so the sweep scores on
# training prompts instead (the first of each task, round-robin, at the held-out seeds): never on the
# prompts the table reports, at the price of favouring a rate that fits prompts seen in training.
VALIDATION = "the first training prompts of each task (round-robin, at the held-out ODE seeds)"


# The experiment-file keys this table reads, besides every table's (flowrl.experiments.tables.COMMON_KEYS).
FILE_KEYS = frozenset({"budget_s", "claims", "gain", "images", "lr_factors", "reference", "test_prompts", "top",
                       "top_seeds", "tune_budget_s", "validation_config"})


def curve(run_dir: Path) -> list[dict]:
    """The held-out points of a run: epoch, rollouts, train wall-clock, task mean, per task, diversity; a one-line
    ExperimentError for a run never trained (``--table-only`` reads only what ran)."""
    if not (Path(run_dir) / "metrics.jsonl").is_file():
        raise ExperimentError(f"{run_dir} has no metrics.jsonl: that run was never trained; run the experiment without "
                              "--table-only (or, for the tuning runs, pass --tune-budget-s 0)")
    points = []
    for r in read_metrics(run_dir):
        if "test/toyeval/task_mean" not in r:
            continue
        points.append({"epoch": r["epoch"], "rollouts": r.get("perf/rollouts", 0), "wall": r.get("perf/train_wall_s", 0.0),
                       "mean": r["test/toyeval/task_mean"], "diversity": r.get("test/diversity/gt_mean", float("nan")),
                       **{t: r.get(f"test/toyeval/task/{t}", float("nan")) for t in TASKS}})
    return points


def first_reaching(points: list[dict], level: float) -> dict | None:
    return next((p for p in points if p["epoch"] >= 0 and p["mean"] >= level), None)


def claim(claims: dict[str, str], name: str) -> str:
    """What ``name``'s paper claims; a ``dense_*`` method takes ``dense_cosine``'s."""
    return claims.get(name, claims.get("dense_cosine", "") if name.startswith("dense") else "")


def speedups(runs: dict[str, dict[int, list[dict]]], reference: str = "grpo_full"
             ) -> tuple[float | None, dict[str, dict[str, list]]]:
    """The reference's final held-out level (mean over its seeds) and, per method and seed, how many times
    faster than the reference its curve first reaches that level, in wall-clock and in rollouts: the
    reference's mean time to the level (over its seeds that reach it) over the run's own. None where a run
    never reaches it."""
    ref_runs = runs.get(reference)
    if not ref_runs:
        return None, {}
    level = statistics.fmean(points[-1]["mean"] for points in ref_runs.values())
    hits = [h for h in (first_reaching(points, level) for points in ref_runs.values()) if h is not None]
    if not hits:
        return level, {}
    ref = {key: statistics.fmean(h[key] for h in hits) for key in ("wall", "rollouts")}
    ratios: dict[str, dict[str, list]] = {}
    for name, per_seed in runs.items():
        reached = [first_reaching(points, level) for points in per_seed.values()]
        ratios[name] = {key: [ref[key] / r[key] if r is not None and r[key] > 0 else None for r in reached]
                        for key in ("wall", "rollouts")}
    return level, ratios


def tuning_seed(p: dict) -> int:
    return (p["top_seeds"] if p["top"] else p["seeds"])[0]


def tune(exp: Experiment, seed: int) -> dict[str, dict]:
    """One ``tune_budget_s`` run per method and learning-rate factor (with ``seed``); the best by the validation
    task mean at the end of the budget. Returns {method: {"lr": chosen, "scores": {lr: final mean}, "base"}}."""
    p, out = exp.params, exp.out / "tune"
    validation = load_config(Config, p["validation_config"]).data.prompts  # every method's training prompts
    base_lr = {name: load_config(Config, exp.run(name).config, list(exp.run(name).overrides)).train.learning_rate
               for name in exp.names()}
    jobs = [(name, factor * base_lr[name]) for name in exp.names() for factor in p["lr_factors"]]
    run_name = lambda name, lr: seed_dir(out, f"{name}_lr{lr:g}", seed)  # noqa: E731
    if not exp.table_only:  # test_every past the budget: base and final points only
        exp.train([(name, seed, run_name(name, lr), [f"train.learning_rate={lr:g}", f"data.test_prompts={validation}"],
                    {"budget_s": p["tune_budget_s"], "test_every": 10**6}) for name, lr in jobs])
    if exp.dry_run:
        return {}
    chosen: dict[str, dict] = {}
    for name, lr in jobs:
        entry = chosen.setdefault(name, {"scores": {}, "base": None})
        points = curve(run_name(name, lr))
        entry["scores"][lr] = points[-1]["mean"]
        entry["base"] = points[0]["mean"] if points[0]["epoch"] < 0 else None
    for entry in chosen.values():
        entry["lr"] = max(entry["scores"], key=entry["scores"].get)
    out.mkdir(parents=True, exist_ok=True)
    (out / "chosen.json").write_text(json.dumps(chosen, indent=1))
    return chosen


def tuning_lines(chosen: dict[str, dict], p: dict) -> list[str]:
    factors = " ".join(f"{f:g}" for f in p["lr_factors"])
    lines = ["## Tuning", "",
             f"Every method got the same tuning budget: one {p['tune_budget_s']:.0f} s run (same seeds, two at a time, "
             f"one thread each) per learning rate, its config's rate times {factors}, nothing else varied. Each run "
             f"was scored at the end on {p['test_prompts']} validation prompts x {p['images']} ODE images: "
             f"{VALIDATION}; the held-out file's six single-object prompts are all in the comparison's test set, so "
             "the sweep never sees the prompts the table reports. The comparison ran each method at the rate in bold "
             f"(the sweep ran with seed {tuning_seed(p)} only).", "",
             "| method | " + " | ".join(f"lr x{f:g}" for f in p["lr_factors"]) + " |",
             "|" + "---|" * (1 + len(p["lr_factors"]))]
    base = next((entry["base"] for entry in chosen.values() if entry.get("base") is not None), None)
    if base is not None:
        lines[2] += f" The base model scores {base:.3f} on the validation prompts."
    for name, entry in chosen.items():
        cells = [f"**{score:.3f}** ({lr:.1e})" if lr == entry["lr"] else f"{score:.3f} ({lr:.1e})"
                 for lr, score in entry["scores"].items()]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines + [""]


def results_table(runs: dict[str, dict[int, list[dict]]], p: dict, command: str, chosen: dict[str, dict]) -> list[str]:
    """The comparison's markdown lines: one row per method, each cell the mean ± s.e. over its seeds."""
    reference = p.get("reference", "grpo_full")
    bases = {seed: points[0] for per_seed in runs.values() for seed, points in per_seed.items()}  # epoch -1
    base = statistics.fmean(pt["mean"] for pt in bases.values())
    level = base + p["gain"]
    final_level, ratios = speedups(runs, reference)
    counts = sorted({len(per_seed) for per_seed in runs.values()})
    lines = [
        "# Algorithms compared on the toy world", "",
        f"`{command}`", "",
        f"Every method trained for {p['budget_s']:.0f} s of sampling, scoring and training time on the same machine "
        f"(2 CPU cores, {p['parallel']} runs at a time, one torch thread each), from the same base model, once per "
        f"seed (column `seeds`; each seed draws its own rollouts and held-out images). Each cell is the mean over "
        f"seeds ± its standard error (sample std / sqrt(n)) and (n); {'/'.join(map(str, counts))} seed(s) per "
        f"method. Held-out task-mean strict ToyEval on {p['test_prompts']} prompts x {p['images']} ODE images (base "
        f"{fmt_mean_se(pt['mean'] for pt in bases.values())}; the sampling error of one point is about 0.02). The only "
        "setting that differs between GRPO "
        + ("rows is the method's own and its tuned learning rate (below); NFT and AWM share the main job's "
           "other settings." if chosen else "rows is the method's own, at its config's learning rate; NFT and AWM "
           "share the main job's settings. No method was tuned beyond that."), "",
    ]
    if final_level is not None:
        lines += [f"`speed-up to GRPO's final`: {reference}'s final held-out level ({final_level:.3f}, mean over its "
                  f"seeds) is the target; each cell is {reference}'s mean wall-clock (rollouts) to first reach it "
                  "divided by the method's, per seed that reaches it (k/n: k of n seeds did), so a paper's speed "
                  "claim reproduces where this reaches its factor. `paper's claim` quotes the paper.", ""]
    if p["top"]:
        lines += [f"Two stages: every method ran with seed {p['top_seeds'][0]}, then the {p['top']} best by final "
                  f"held-out task mean (and {reference}, the speed-up reference) with seeds "
                  + ",".join(map(str, p["top_seeds"][1:])) + ".", ""]
    header = ["method", "seeds", "epochs", "rollouts", "train s", "best (at s)", "final", "change", *TASKS,
              "gt diversity", f"s to {level:.3f}", "s to 0.60", "speed-up to GRPO's final, wall-clock (x)",
              "speed-up to GRPO's final, rollouts (x)", "paper's claim"]
    lines += [
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
        "| base | " + ",".join(map(str, bases)) + " | 0 | 0 | 0 | | " + fmt_mean_se(pt["mean"] for pt in bases.values())
        + " | | " + " | ".join(fmt_mean_se((pt[t] for pt in bases.values()), ".2f") for t in TASKS)
        + f" | {fmt_mean_se(pt['diversity'] for pt in bases.values())} | | | | | |",
    ]
    for name, per_seed in runs.items():
        lasts = [points[-1] for points in per_seed.values()]
        bests = [max(points[1:], key=lambda pt: pt["mean"], default=points[-1]) for points in per_seed.values()]
        reach = [[(lambda r: r["wall"] if r else None)(first_reaching(points, threshold))
                  for points in per_seed.values()] for threshold in (level, 0.6)]
        if name in ratios:
            speed = [fmt_mean_se(ratios[name][key], ".2f", missing="not reached") for key in ("wall", "rollouts")]
        else:
            speed = ["n/a"] * 2
        cells = [name, ",".join(map(str, per_seed)), fmt_mean_se((pt["epoch"] + 1 for pt in lasts), ".0f"),
                 fmt_mean_se((pt["rollouts"] for pt in lasts), ".0f"), fmt_mean_se((pt["wall"] for pt in lasts), ".0f"),
                 f"{fmt_mean_se(pt['mean'] for pt in bests)} at {statistics.fmean(pt['wall'] for pt in bests):.0f}",
                 fmt_mean_se(pt["mean"] for pt in lasts),
                 fmt_mean_se((pt["mean"] - bases[seed]["mean"] for seed, pt in zip(per_seed, lasts)), "+.3f"),
                 *(fmt_mean_se((pt[t] for pt in lasts), ".2f") for t in TASKS),
                 fmt_mean_se(pt["diversity"] for pt in lasts),
                 *(fmt_mean_se(r, ".0f", missing="never") for r in reach), *speed, claim(p.get("claims", {}), name)]
        lines.append("| " + " | ".join(cells) + " |")
    if final_level is None:
        lines += ["", f"{reference} is not in this comparison, so no speed-up over it can be stated."]
    elif not ratios:
        lines += ["", f"{reference} never reached its own final level after its first point, so no speed-up over "
                  "it can be stated as a ratio."]
    if chosen:
        lines += [""] + tuning_lines(chosen, p)
    return lines


def plot_curves(runs: dict[str, dict[int, list[dict]]], path: Path) -> None:
    """Held-out task mean against training wall-clock: one colour per method, one line per seed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    colours = plt.get_cmap("tab20").colors
    for i, (name, per_seed) in enumerate(runs.items()):
        for j, points in enumerate(per_seed.values()):
            ax.plot([pt["wall"] for pt in points], [pt["mean"] for pt in points], marker="o", ms=3,
                    label=name if j == 0 else None, color=colours[i % len(colours)], lw=2.2 if name == "nft" else 1.2)
    base = statistics.fmean(points[0]["mean"] for per_seed in runs.values() for points in per_seed.values())
    ax.axhline(base, color="grey", lw=0.8, ls="--")
    ax.set_xlabel("training wall-clock (s, one thread)")
    ax.set_ylabel("held-out task-mean strict ToyEval")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def top_methods(out: Path, names: list[str], seed: int, k: int, reference: str = "grpo_full") -> list[str]:
    """The ``k`` methods with the best final held-out task mean at ``seed`` (plus the reference)."""
    finals = {name: curve(seed_dir(out, name, seed))[-1]["mean"] for name in names
              if finished_seeds(out, name, [seed])}
    best = sorted(finals, key=finals.get, reverse=True)[:k]
    return [name for name in names if name in best or (name == reference and name in finals)]


def make(exp: Experiment) -> str | None:
    p, names = exp.params, exp.names()
    chosen = tune(exp, tuning_seed(p)) if p["tune_budget_s"] > 0 else {}
    lr = lambda name: [f"train.learning_rate={chosen[name]['lr']:g}"] if chosen else []  # noqa: E731
    seeds = p["top_seeds"] if p["top"] else exp.seeds
    plan = {name: seeds if not p["top"] else seeds[:1] for name in names}
    train = lambda stage: exp.train([(name, seed, seed_dir(exp.out, name, seed), lr(name), {})  # noqa: E731
                                     for name in names for seed in stage(name)])
    if not exp.table_only:
        train(lambda name: plan[name])
    if p["top"]:
        if exp.dry_run:
            print(f"then the {p['top']} best by final held-out task mean with seeds "
                  + ",".join(map(str, seeds[1:])))
            return None
        for name in top_methods(exp.out, names, seeds[0], p["top"], p.get("reference", "grpo_full")):
            plan[name] = seeds
        if not exp.table_only:
            train(lambda name: plan[name][1:])
    if exp.dry_run:
        return None
    runs = gather(exp.out, plan, curve)
    if not runs:
        raise SystemExit(f"{exp.path}: no finished run under {exp.out} for these methods and seeds")
    lines = results_table(runs, p, exp.command, chosen)
    results = Path(p["results"])
    if p["section"]:  # a rerun of some methods: its own section, the main table and its reading kept
        plot = results.parent / f"results_curves_{slug(p['section'])}.png"
        lines[0] = f"## {p['section']}"
        lines += ["", f"Curves: `{plot}`.", ""]
        replace_section(results, "\n".join(lines) + "\n", lines[0])
    else:
        plot = results.parent / "results_curves.png"
        replace_head(results, "\n".join(lines) + "\n")
    plot_curves(runs, plot)
    return "\n".join(lines)
