"""Does the diversity guard see preference mode collapse coming? GRPO on the hackable toy proxy without
KL (``configs/toy/grpo_proxy.yaml``: ToyProxy prefers a black background no prompt asks for) collapses
the ground-truth background diversity of each prompt's samples; the guard watches the in-group latent
cosine diversity of the rollouts it trains on and, with ``guard.policy=stop``, ends the run and keeps
the best reward-diversity weights.

Two runs, same seeds, one after the other:
- unguarded: ``guard.policy=warn``, which only measures and writes a line (training is bit for bit the
  unguarded run's), so its in-group diversity curve and the epoch the guard would fire are logged;
- guarded: ``guard.policy=stop`` with ``--max-drop``.
Both log the held-out ground-truth diversity (``test/diversity/gt_mean``, ``test/diversity/background``)
every ``--test-every`` epochs, and the guarded run at the epoch it stops; each run's report.json holds
the held-out diversity of the adapter it exported (the guarded run's: the best snapshot's).

Seeds (``--seeds 0,1,2``): the pair runs once per seed (override ``seed=S``, run directories
``--out/unguarded_sS`` and ``--out/stop_<max-drop>_sS``); each seed's tables are printed, then one over
seeds: mean ± standard error (sample std / sqrt(n)) (n) of the epoch the guard fired and of each exported
adapter's held-out figures.

Resume: a run is finished once its ``done.json`` exists (written after training returned, with the overrides
it ran with; see ``seeded_runs.py``) and is then only read. A run stopped part-way (Ctrl-C) is resumed
exactly with ``train.resume=latest`` when it left a checkpoint (pass e.g. ``train.checkpoint_every=5``; these
runs have no wall-clock budget, so the resumed run is the uninterrupted one), else its directory is removed
and it starts again; rerunning the same command therefore prints the same tables.

    OMP_NUM_THREADS=1 python scripts/toy_guard.py                      # 60 epochs as shipped, max_drop 0.3
    OMP_NUM_THREADS=1 python scripts/toy_guard.py --max-drop 0.2 train.epochs=30
    OMP_NUM_THREADS=1 python scripts/toy_guard.py --seeds 0,1,2 train.checkpoint_every=5
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from flowrl.commands.train import recipe_train  # noqa: E402
from flowrl.config import Config, load_config  # noqa: E402
from flowrl.training.metrics import read_metrics  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from seeded_runs import add_seed_argument, fmt_mean_se, mark_finished, prepare_run, seed_dir  # noqa: E402

CONFIG = "configs/toy/grpo_proxy.yaml"
HELD_OUT = ("test/diversity/gt_mean", "test/diversity/background", "test/toy_proxy", "test/toyeval")


def train(run_dir: Path, overrides: list[str]) -> list[dict]:
    """Train the proxy config into ``run_dir``: a finished run is only read, an interrupted one resumed from its
    checkpoint or started again (see the module docstring)."""
    arguments = ["log.report_diversity=toy", "log.progress=false", "guard.enabled=true", *overrides]
    extra = prepare_run(run_dir, arguments, exact_resume=True)
    if extra is not None:
        start = time.perf_counter()
        cfg = load_config(Config, CONFIG, [f"run_dir={run_dir}", *arguments, *extra])
        recipe_train(cfg.recipe)(cfg)
        mark_finished(run_dir, arguments, time.perf_counter() - start)
    return read_metrics(run_dir)


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("overrides", nargs="*", help="config overrides applied to both runs")
    parser.add_argument("--max-drop", type=float, default=0.3, help="guard.max_drop of the guarded run")
    parser.add_argument("--test-every", type=int, default=5, help="epochs between held-out points")
    add_seed_argument(parser)
    parser.add_argument("--out", default="runs/toy_guard")
    args = parser.parse_args()
    import torch

    torch.set_num_threads(1)
    try:
        summaries = {seed: run_seed(args, seed) for seed in args.seeds}
    except KeyboardInterrupt:
        sys.exit("interrupted: the same command again skips the finished runs and resumes or redoes the others")
    if len(summaries) > 1:
        print_over_seeds(summaries)


def run_seed(args, seed: int) -> dict:
    """Train (or read) the unguarded and the guarded run of ``seed``, print their tables; returns the figures
    the table over seeds averages."""
    common = [f"log.test_every={args.test_every}", "train.checkpoint_every=0", f"seed={seed}", *args.overrides]
    out = Path(args.out)
    guarded = f"stop_{args.max_drop:g}"
    free = train(seed_dir(out, "unguarded", seed),
                 ["guard.policy=warn", f"guard.max_drop={args.max_drop}", *common])
    stopped = train(seed_dir(out, guarded, seed), ["guard.policy=stop", f"guard.max_drop={args.max_drop}", *common])
    free_train = [r for r in free if r["epoch"] >= 0]
    stop_train = [r for r in stopped if r["epoch"] >= 0]
    fired = first_firing(stop_train)
    same = all(a.get("diversity/cosine") == b.get("diversity/cosine") for a, b in zip(free_train, stop_train))
    base = held_out_at(free, -1)
    reports = {name: json.loads((seed_dir(out, d, seed) / "report.json").read_text())
               for name, d in (("unguarded", "unguarded"), ("guarded", guarded))}
    summary = {"fired": None if fired is None else fired["epoch"], "epochs": len(free_train),
               "base": reports["unguarded"]["before"], **{name: r["after"] for name, r in reports.items()}}

    print(f"seed {seed}: {CONFIG}, {len(free_train)} epochs unguarded; guard.policy=stop "
          f"guard.max_drop={args.max_drop:g}")
    print("| run / epoch | held-out epoch | in-group diversity/cosine | proxy reward (train) | "
          + " | ".join(HELD_OUT) + " |")
    print("| --- " * (4 + len(HELD_OUT)) + "|")
    print(row("base model", {}, base))
    print(row(f"unguarded, epoch {free_train[0]['epoch']} (start)", free_train[0], held_out_at(free, 0)))
    if fired is not None:
        epoch = fired["epoch"]
        print(row(f"guard fires, epoch {epoch}", fired, held_out_at(stopped, epoch)))
        print(row(f"unguarded, epoch {epoch}", free_train[epoch], held_out_at(free, epoch)))
    end = free_train[-1]
    print(row(f"unguarded, end (epoch {end['epoch']})", end, held_out_at(free, end["epoch"])))
    if fired is None:
        print("the guard never fired")
        return summary
    best = int(stop_train[-1]["diversity/best_epoch"])
    print(f"guard fired at epoch {fired['epoch']}: diversity {fired['diversity/cosine']:.3f} vs start "
          f"{fired['diversity/start']:.3f} (drop {fired['diversity/drop']:.1%}); best epoch kept {best} "
          f"(score {stop_train[best]['diversity/score']:.3f}); guarded run identical to the unguarded one until it "
          f"stopped: {same}")
    print("| exported adapter, report | " + " | ".join(report_key(k) for k in HELD_OUT) + " |\n"
          + "| --- " * (1 + len(HELD_OUT)) + "|")
    print("| base model | " + " | ".join(fmt(summary["base"].get(report_key(k))) for k in HELD_OUT) + " |")
    print("| unguarded (final adapter) | " + " | ".join(fmt(summary["unguarded"].get(report_key(k))) for k in HELD_OUT)
          + " |")
    print(f"| guarded (epoch {best} kept) | " + " | ".join(fmt(summary["guarded"].get(report_key(k))) for k in HELD_OUT)
          + " |")
    curve = " ".join(f"{r['epoch']}:{r['diversity/cosine']:.3f}" for r in free_train[:: args.test_every])
    print(f"unguarded in-group diversity/cosine every {args.test_every} epochs: {curve}")
    return summary


def print_over_seeds(summaries: dict[int, dict]) -> None:
    """The exported adapters' held-out figures and the guard's firing epoch, mean ± s.e. over seeds."""
    runs = list(summaries.values())
    fired = [r["fired"] for r in runs]
    when = (f"fired at epoch {fmt_mean_se(fired, '.1f')} (a seed where it never fired is left out of the mean)"
            if any(epoch is not None for epoch in fired) else "never fired")
    print(f"over seeds {','.join(map(str, summaries))}: the guard {when}")
    print("| exported adapter, report | " + " | ".join(report_key(k) for k in HELD_OUT) + " |\n"
          + "| --- " * (1 + len(HELD_OUT)) + "|")
    for label, name in (("base model", "base"), ("unguarded (final adapter)", "unguarded"),
                        ("guarded (best epoch kept)", "guarded")):
        print(f"| {label} | " + " | ".join(fmt_mean_se(r[name].get(report_key(k)) for r in runs) for k in HELD_OUT)
              + " |")


if __name__ == "__main__":
    main()
