"""The diversity-guard table: does the guard see preference mode collapse coming? GRPO on the hackable toy
proxy without KL collapses the ground-truth background diversity of each prompt's samples; the guard watches
the in-group latent cosine diversity of the rollouts it trains on and, with ``guard.policy=stop``, ends the run
and keeps the best reward-diversity weights (``experiments/guard.yaml``).

Two runs per seed, one after the other: the ``unguarded`` one (``guard.policy=warn``, which only measures, so
training is bit for bit the unguarded run's) and the ``guarded`` one (``guard.policy=stop`` at ``max_drop``).
Both log held-out ground-truth diversity every ``test_every`` epochs; each run's report.json holds the
held-out figures of the adapter it exported (the guarded run's: the best snapshot's). Each seed gets its
tables, then one over seeds: the epoch the guard fired and each exported adapter's held-out figures.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from flowrl.experiments.cells import fmt_mean_se
from flowrl.experiments.markdown import replace_section
from flowrl.experiments.runs import finished_seeds, seed_dir
from flowrl.experiments.spec import Experiment
from flowrl.training.metrics import read_metrics

SECTION = "Diversity guard"
HELD_OUT = ("test/diversity/gt_mean", "test/diversity/background", "test/toy_proxy", "test/toyeval")


# The experiment-file keys this table reads, besides every table's (flowrl.experiments.tables.COMMON_KEYS).
FILE_KEYS = frozenset({"guarded", "max_drop", "test_every", "unguarded"})


def first_firing(records: list[dict]) -> dict | None:
    return next((r for r in records if r.get("diversity/guard_fired") == 1.0), None)


def held_out_at(records: list[dict], epoch: int) -> dict:
    """The held-out point at ``epoch``, else the last one before it (the base model's is epoch -1)."""
    points = [r for r in records if "test/diversity/gt_mean" in r and r["epoch"] <= epoch]
    return points[-1] if points else {}


def report_key(key: str) -> str:
    """A held-out curve key's name in report.json (test/toyeval -> eval/toyeval, diversity keys unprefixed)."""
    key = key.removeprefix("test/")
    return key if key.startswith("diversity/") else f"eval/{key}"


def fmt(value) -> str:
    return "n/a" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.3f}"


def row(label: str, record: dict, held: dict) -> str:
    return (f"| {label} | {held.get('epoch', 'n/a')} | {fmt(record.get('diversity/cosine'))} | "
            f"{fmt(record.get('reward/toy_proxy_mean'))} | " + " | ".join(fmt(held.get(k)) for k in HELD_OUT) + " |")


def adapters_header() -> list[str]:
    return ["| exported adapter, report | " + " | ".join(report_key(k) for k in HELD_OUT) + " |",
            "| --- " * (1 + len(HELD_OUT)) + "|"]


def seed_lines(free_dir: Path, stop_dir: Path, seed: int, p: dict, lines: list[str]) -> dict:
    """Append the tables of one seed's pair of runs to ``lines``; returns what the table over seeds averages."""
    free, stopped = read_metrics(free_dir), read_metrics(stop_dir)
    free_train = [r for r in free if r["epoch"] >= 0]
    stop_train = [r for r in stopped if r["epoch"] >= 0]
    fired = first_firing(stop_train)
    same = all(a.get("diversity/cosine") == b.get("diversity/cosine") for a, b in zip(free_train, stop_train))
    reports = {name: json.loads((d / "report.json").read_text()) for name, d in (("unguarded", free_dir),
                                                                                ("guarded", stop_dir))}
    summary = {"fired": None if fired is None else fired["epoch"], "epochs": len(free_train),
               "base": reports["unguarded"]["before"], **{name: r["after"] for name, r in reports.items()}}
    lines += [f"Seed {seed}: {len(free_train)} epochs unguarded; guard.policy=stop guard.max_drop={p['max_drop']:g}.",
              "", "| run / epoch | held-out epoch | in-group diversity/cosine | proxy reward (train) | "
              + " | ".join(HELD_OUT) + " |", "| --- " * (4 + len(HELD_OUT)) + "|",
              row("base model", {}, held_out_at(free, -1)),
              row(f"unguarded, epoch {free_train[0]['epoch']} (start)", free_train[0], held_out_at(free, 0))]
    if fired is not None:
        epoch = fired["epoch"]
        lines += [row(f"guard fires, epoch {epoch}", fired, held_out_at(stopped, epoch)),
                  row(f"unguarded, epoch {epoch}", free_train[epoch], held_out_at(free, epoch))]
    end = free_train[-1]
    lines += [row(f"unguarded, end (epoch {end['epoch']})", end, held_out_at(free, end["epoch"])), ""]
    if fired is None:
        lines += ["The guard never fired.", ""]
        return summary
    best = int(stop_train[-1]["diversity/best_epoch"])
    lines += [f"The guard fired at epoch {fired['epoch']}: diversity {fired['diversity/cosine']:.3f} vs start "
              f"{fired['diversity/start']:.3f} (drop {fired['diversity/drop']:.1%}); best epoch kept {best} "
              f"(score {stop_train[best]['diversity/score']:.3f}); guarded run identical to the unguarded one until "
              f"it stopped: {same}.", "", *adapters_header(),
              "| base model | " + " | ".join(fmt(summary["base"].get(report_key(k))) for k in HELD_OUT) + " |",
              "| unguarded (final adapter) | "
              + " | ".join(fmt(summary["unguarded"].get(report_key(k))) for k in HELD_OUT) + " |",
              f"| guarded (epoch {best} kept) | "
              + " | ".join(fmt(summary["guarded"].get(report_key(k))) for k in HELD_OUT) + " |", ""]
    curve = " ".join(f"{r['epoch']}:{r['diversity/cosine']:.3f}" for r in free_train[:: p["test_every"]])
    lines += [f"Unguarded in-group diversity/cosine every {p['test_every']} epochs: {curve}", ""]
    return summary


def over_seeds_lines(summaries: dict[int, dict]) -> list[str]:
    """The exported adapters' held-out figures and the guard's firing epoch, mean ± s.e. over seeds."""
    runs = list(summaries.values())
    fired = [r["fired"] for r in runs]
    when = (f"fired at epoch {fmt_mean_se(fired, '.1f')} (a seed where it never fired is left out of the mean)"
            if any(epoch is not None for epoch in fired) else "never fired")
    lines = [f"Over seeds {','.join(map(str, summaries))}: the guard {when}.", "", *adapters_header()]
    for label, name in (("base model", "base"), ("unguarded (final adapter)", "unguarded"),
                        ("guarded (best epoch kept)", "guarded")):
        lines.append(f"| {label} | " + " | ".join(fmt_mean_se(r[name].get(report_key(k)) for r in runs)
                                                  for k in HELD_OUT) + " |")
    return lines + [""]


def make(exp: Experiment) -> str | None:
    p = exp.params
    free, stop = exp.substitute(p["unguarded"]), exp.substitute(p["guarded"])
    if not exp.table_only:  # seed by seed, the unguarded run first (they run one after the other)
        exp.train([(name, seed, seed_dir(exp.out, name, seed), [], {}) for seed in exp.seeds for name in (free, stop)])
    if exp.dry_run:
        return None
    seeds = [s for s in finished_seeds(exp.out, free, exp.seeds) if s in finished_seeds(exp.out, stop, exp.seeds)]
    if not seeds:
        raise SystemExit(f"{exp.path}: no finished pair of runs under {exp.out} for these seeds")
    config = exp.run(free).config
    lines = [f"## {p['section'] or SECTION}", "", f"`{exp.command}`", "",
             f"`{config}` trained twice per seed, one run after the other: unguarded (`guard.policy=warn`, which "
             f"only measures) and guarded (`guard.policy=stop guard.max_drop={p['max_drop']:g}`); held-out "
             f"ground-truth diversity every {p['test_every']} epochs; each report is the exported adapter's.", ""]
    summaries = {seed: seed_lines(seed_dir(exp.out, free, seed), seed_dir(exp.out, stop, seed), seed, p, lines)
                 for seed in seeds}
    if len(summaries) > 1:
        lines += over_seeds_lines(summaries)
    text = "\n".join(lines)
    replace_section(Path(p["results"]), text, lines[0])
    return text
