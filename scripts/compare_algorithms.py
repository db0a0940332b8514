"""Every trajectory and forward-process method on the toy world, on the same seeds, machine and budget.

Each method is a toy config plus the overrides that turn the method on. A method named after a paper runs its
toy preset (``configs/toy/<method>.yaml``), which carries its reference's settings; the other GRPO variants
start from ``configs/toy/grpo.yaml``'s learning rate, clip, KL and batch.
Each trains for ``--budget-s`` seconds of sampling, scoring and training time (``train.time_limit_s``),
with the held-out task-mean strict ToyEval measured before training, every ``--test-every`` epochs and
where the budget runs out (``log.test_prompts`` prompts taken round-robin over tasks,
``log.eval_images_per_prompt`` ODE images each, the same seeds for every method and point). Runs go
``--parallel`` at a time, one torch thread each, so their clocks are alike.

Tuning (``--tune-budget-s`` > 0): before the comparison, every method gets the same small budget, one
short run per learning rate in ``--lr-factors`` (times its config's rate), scored on validation prompts
(training prompts: the held-out file's few single-object prompts are all in the test set); the
comparison then runs each method at its best rate. The sweep's table goes into ``docs/results.md`` with the comparison's.

Seeds (``--seeds 0,1,2``): every method runs once per seed (override ``seed=S``, run directory
``--out/<method>_sS``) and each table cell gives the mean over seeds, the standard error (sample std /
sqrt(n)) and n, e.g. ``0.412 ± 0.018 (3)``. With ``--top K --top-seeds 0,1,2`` every method first runs
with the first of those seeds, then the K best by final held-out task mean (and grpo_full, the speed-up
reference) with the others; the table's ``seeds`` column says which runs each row averages.

Beside the measured columns, ``paper's claim`` quotes what each method's paper reports (:data:`CLAIMS`) and
``speed-up to GRPO's final`` says whether a speed claim reproduces: the wall-clock (and rollouts) grpo_full
takes to first reach its own final held-out level (mean over its seeds), divided by the time the method's
curve takes to first reach that level (mean ± s.e. over the method's seeds that reach it).

Resume: a run is finished once its ``done.json`` exists (written after the training process exited
cleanly, with the arguments it ran with; see ``seeded_runs.py``). A rerun, e.g. after Ctrl-C, skips finished
runs and starts every other one again from scratch, its directory removed first: the runs keep no
mid-run checkpoints, as a wall-clock budget resumed from one would not be the uninterrupted run's. The
tables are built from the run directories alone, so the rerun's tables are the uninterrupted ones.

It writes ``--results`` (default ``docs/results.md``: the tables and this command; a ``## Reading the
table`` section already there is kept) and ``results_curves.png`` beside it (held-out task mean against
training wall-clock).

    python scripts/compare_algorithms.py    # tune (120 s per rate), then every method 240 s, two at a time
    python scripts/compare_algorithms.py --methods nft grpo_full --budget-s 60 --tune-budget-s 0 --seeds 0,1,2
    python scripts/compare_algorithms.py --top 4 --top-seeds 0,1,2    # all methods once, the best 4 thrice
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import signal
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

from flowrl.config.loader import load_config  # noqa: E402
from flowrl.config.schema import Config  # noqa: E402
from flowrl.training.metrics import read_metrics  # noqa: E402
from seeded_runs import (add_seed_argument, finished_seeds, fmt_mean_se, gather, mark_finished,  # noqa: E402
                         parse_seeds, prepare_run, seed_dir)

GRPO, NFT, AWM = "configs/toy/grpo.yaml", "configs/toy/nft.yaml", "configs/toy/awm.yaml"
WINDOW = ["sampling.window.size=3"]
# MixGRPO: the window slides once over its six starts in 60 epochs, never wrapping (MixGRPO's 300 iterations
# never do), and stays before the last two steps; no KL, as in MixGRPO's scripts.
SLIDING = WINDOW + ["sampling.window.mode=sliding", "sampling.window.start_range=[0,5]",
                    "sampling.window.shift_every=10", "train.beta=0"]
# A method named after a paper runs its toy preset, which carries its reference's settings (each file's header
# says which, and what the toy world changes); the others are toy GRPO or NFT plus the overrides naming them.
METHODS: dict[str, tuple[str, list[str]]] = {
    "grpo_full": (GRPO, []),  # Flow-GRPO: every step stochastic and trained
    "grpo_fast": ("configs/toy/grpo_fast.yaml", []),  # Flow-GRPO-Fast: a window drawn per rollout batch
    "grpo_mix": (GRPO, SLIDING),  # MixGRPO
    "grpo_mix_flash": ("configs/toy/grpo_mixgrpo_flash.yaml", []),  # MixGRPO-Flash: SLIDING + its solver
    "grpo_early": (GRPO, WINDOW + ["sampling.window.mode=fixed", "sampling.window.start_range=[0,0]"]),
    "grpo_tree": ("configs/toy/grpo_tree.yaml", []),  # BranchGRPO
    "grpo_guard": ("configs/toy/grpo_guard.yaml", []),  # GRPO-Guard
    "dense_cosine": (GRPO, ["train.credit=dense_cosine"]),
    "dense_ode": (GRPO, ["train.credit=dense_ode"]),
    "pilot_commit": (GRPO, ["sampling.pilot.candidates=16", "sampling.pilot.group_size=4"]),
    "tmpo": (GRPO, ["train.loss=tmpo", "train.beta=0", "train.std_scope=group",  # Softmax-TB on flat groups,
                    "train.learning_rate=3.3e-5"]),  # at configs/toy/tmpo.yaml's rate
    "tmpo_tree": ("configs/toy/tmpo.yaml", []),  # TMPO: 27-leaf tree, CPS at Beta-scheduled splits
    "nft": (NFT, []),
    "awm": (AWM, []),
    "crd": ("configs/toy/crd.yaml", []),  # CRD, after Flow-Factory's port
}
TASKS = ("single_object", "counting", "two_object", "position")
REFERENCE = "grpo_full"  # the speed-up column's baseline: Flow-GRPO, every step stochastic and trained
BETTER = "better than plain Flow-GRPO"
# What each method's paper claims against Flow-GRPO, quoted beside what the toy world shows (a dense_* method
# takes dense_cosine's). MixGRPO's percentages are of training time: 50% less is a 2x speed-up, 71% less 3.4x.
CLAIMS: dict[str, str] = {
    "nft": "up to 25x faster than Flow-GRPO (DiffusionNFT)",
    "awm": "up to 24x faster than Flow-GRPO (AWM)",
    "grpo_mix": "50% less training time than Flow-GRPO, i.e. 2x (MixGRPO)",
    "grpo_mix_flash": "71% less training time than Flow-GRPO, i.e. 3.4x (MixGRPO-Flash)",
    "grpo_tree": "2.4x faster than Flow-GRPO (TreeGRPO/BranchGRPO)",
    "grpo_guard": f"{BETTER} (GRPO-Guard)",
    "dense_cosine": f"{BETTER} (dense credit)",
    "tmpo": f"{BETTER} (TMPO)",
    "tmpo_tree": f"{BETTER} (TMPO)",
    "pilot_commit": f"{BETTER} (Pilot-Commit)",
}


def claim(name: str) -> str:
    return CLAIMS.get(name, CLAIMS["dense_cosine"] if name.startswith("dense") else "")


def base_learning_rate(name: str) -> float:
    config, overrides = METHODS[name]
    return load_config(Config, config, overrides).train.learning_rate


# The held-out file has 6 single-object prompts, all in the comparison's test set, so the sweep scores on
# training prompts instead (the first of each task, round-robin, at the held-out seeds): never on the
# prompts the table reports, at the price of favouring a rate that fits prompts seen in training.
VALIDATION = "the first training prompts of each task (round-robin, at the held-out ODE seeds)"


def run_method(name: str, run_dir: Path, budget_s: float, test_every: int, args, extra: list[str],
               seed: int = 0) -> Path:
    """Train method ``name`` of :data:`METHODS` (see :func:`run_config`)."""
    config, overrides = METHODS[name]
    return run_config(config, [*overrides, *extra], run_dir, budget_s, test_every, args, seed=seed)


def run_config(config: str, overrides: list[str], run_dir: Path, budget_s: float, test_every: int, args, *,
               seed: int = 0) -> Path:
    """Train ``config`` with ``overrides`` and ``seed`` for ``budget_s`` in a subprocess (one torch thread),
    held-out points every ``test_every`` epochs at ``args.test_prompts`` x ``args.images``; its log goes next
    to its run directory. A finished run (``done.json``, same arguments) is kept; any other directory there is
    removed and the run started again (see the module docstring: a budgeted run does not resume exactly)."""
    settings = ["train.epochs=100000", f"train.time_limit_s={budget_s}", f"log.test_every={test_every}",
                f"log.test_prompts={args.test_prompts}", f"log.eval_images_per_prompt={args.images}",
                "log.report_prompts=0", "log.eval_every=0", "log.progress=false", "train.checkpoint_every=0",
                f"seed={seed}", *overrides]
    arguments = [config, *settings]  # what done.json records (not the run directory: it moves with --out)
    if prepare_run(run_dir, arguments, exact_resume=False) is None:
        return run_dir
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    start = time.perf_counter()
    with open(f"{run_dir}.log", "w") as log:
        code = subprocess.run([sys.executable, "-m", "flowrl", "train", config, f"run_dir={run_dir}", *settings],
                              stdout=log, stderr=subprocess.STDOUT, env=env).returncode
    if code != 0:
        raise RunFailed(f"{run_dir.name}: training exited with status {code}, see {run_dir}.log")
    mark_finished(run_dir, arguments, time.perf_counter() - start)
    print(f"{run_dir.name}: done in {time.perf_counter() - start:.0f} s", flush=True)
    return run_dir


class RunFailed(RuntimeError):
    """A training subprocess exited with an error (its log says why)."""


def run_all(jobs, run, parallel: int) -> None:
    """``run(*job)`` for every job, ``parallel`` at a time. A failed run ends the script with one line once the
    other runs have ended (finished runs are kept for the rerun); Ctrl-C starts no further run."""
    pool = ThreadPoolExecutor(parallel)
    futures = [pool.submit(run, *job) for job in jobs]
    try:
        wait(futures)
    except KeyboardInterrupt:  # the runs under way got the same SIGINT and end unmarked; start no other
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C while they end changes nothing
        pool.shutdown(wait=False, cancel_futures=True)
        sys.exit("interrupted: the same command again skips the finished runs and redoes the others")
    pool.shutdown()
    failed = [str(f.exception()) for f in futures if isinstance(f.exception(), RunFailed)]
    for f in futures:
        if not isinstance(f.exception(), RunFailed):
            f.result()  # anything else is a bug: its traceback
    if failed:
        sys.exit("\n".join(failed))


def tune(args, seed: int) -> dict[str, dict]:
    """One ``--tune-budget-s`` run per method and learning-rate factor (with ``seed``); the best by the
    validation task mean at the end of the budget. Returns {method: {"lr": chosen, "scores": {lr: final mean}}}."""
    out = Path(args.out) / "tune"
    validation = load_config(Config, GRPO).data.prompts  # every method's training prompts (see VALIDATION)
    jobs = [(name, factor * base_learning_rate(name)) for name in args.methods for factor in args.lr_factors]
    extra = lambda lr: [f"train.learning_rate={lr:g}", f"data.test_prompts={validation}"]  # noqa: E731
    run_name = lambda name, lr: seed_dir(out, f"{name}_lr{lr:g}", seed)  # noqa: E731
    if not args.table_only:  # test_every past the budget: base and final points only
        run_all(jobs, lambda name, lr: run_method(name, run_name(name, lr), args.tune_budget_s, 10**6, args,
                                                  extra(lr), seed), args.parallel)
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


def curve(run_dir: Path) -> list[dict]:
    """The held-out points of a run: epoch, rollouts, train wall-clock, task mean, per task, diversity."""
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


def tuning_lines(chosen: dict[str, dict], args) -> list[str]:
    factors = " ".join(f"{f:g}" for f in args.lr_factors)
    lines = ["## Tuning", "",
             f"Every method got the same tuning budget: one {args.tune_budget_s:.0f} s run (same seeds, two at a time, one "
             f"thread each) per learning rate, its config's rate times {factors}, nothing else varied. Each run was "
             f"scored at the end on {args.test_prompts} validation prompts x {args.images} ODE images: {VALIDATION}; "
             "the held-out file's six single-object prompts are all in the comparison's test set, so the sweep "
             "never sees the prompts the table reports. The comparison ran each method at the rate in bold "
             f"(the sweep ran with seed {tuning_seed(args)} only).", "",
             "| method | " + " | ".join(f"lr x{f:g}" for f in args.lr_factors) + " |",
             "|" + "---|" * (1 + len(args.lr_factors))]
    base = next((entry["base"] for entry in chosen.values() if entry.get("base") is not None), None)
    if base is not None:
        lines[2] += f" The base model scores {base:.3f} on the validation prompts."
    for name, entry in chosen.items():
        cells = [f"**{score:.3f}** ({lr:.1e})" if lr == entry["lr"] else f"{score:.3f} ({lr:.1e})"
                 for lr, score in entry["scores"].items()]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines + [""]


def replace_section(path: Path, text: str, section: str) -> None:
    """``text`` in place of the section titled ``section`` (to the next ``## `` heading), or appended."""
    old = path.read_text() if path.exists() else ""
    pattern = re.compile(rf"^{re.escape(section)}\n.*?(?=^## |\Z)", re.S | re.M)
    new = pattern.sub(lambda _: text, old) if pattern.search(old) else old.rstrip("\n") + "\n\n" + text
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(new)


def speedups(runs: dict[str, dict[int, list[dict]]]) -> tuple[float | None, dict[str, dict[str, list]]]:
    """grpo_full's final held-out level (mean over its seeds) and, per method and seed, how many times faster
    than grpo_full its curve first reaches that level, in wall-clock and in rollouts: grpo_full's mean time to
    the level (over its seeds that reach it) over the run's own. None where a run never reaches it."""
    reference = runs.get(REFERENCE)
    if not reference:
        return None, {}
    level = statistics.fmean(points[-1]["mean"] for points in reference.values())
    hits = [first_reaching(points, level) for points in reference.values()]
    hits = [h for h in hits if h is not None]
    if not hits:
        return level, {}
    ref = {key: statistics.fmean(h[key] for h in hits) for key in ("wall", "rollouts")}
    ratios: dict[str, dict[str, list]] = {}
    for name, per_seed in runs.items():
        reached = [first_reaching(points, level) for points in per_seed.values()]
        ratios[name] = {key: [ref[key] / r[key] if r is not None and r[key] > 0 else None for r in reached]
                        for key in ("wall", "rollouts")}
    return level, ratios


def results_table(runs: dict[str, dict[int, list[dict]]], args, command: str, chosen: dict[str, dict]) -> list[str]:
    """The comparison's markdown lines: one row per method, each cell the mean ± s.e. over its seeds."""
    bases = {seed: points[0] for per_seed in runs.values() for seed, points in per_seed.items()}  # epoch -1
    base = statistics.fmean(p["mean"] for p in bases.values())
    level = base + args.gain
    final_level, ratios = speedups(runs)
    counts = sorted({len(per_seed) for per_seed in runs.values()})
    lines = [
        "# Algorithms compared on the toy world", "",
        f"`{command}`", "",
        f"Every method trained for {args.budget_s:.0f} s of sampling, scoring and training time on the same machine "
        f"(2 CPU cores, {args.parallel} runs at a time, one torch thread each), from the same base model, once per "
        f"seed (column `seeds`; each seed draws its own rollouts and held-out images). Each cell is the mean over "
        f"seeds ± its standard error (sample std / sqrt(n)) and (n); {'/'.join(map(str, counts))} seed(s) per "
        f"method. Held-out task-mean strict ToyEval on {args.test_prompts} prompts x {args.images} ODE images (base "
        f"{fmt_mean_se(p['mean'] for p in bases.values())}; the sampling error of one point is about 0.02). The only "
        "setting that differs between GRPO "
        + ("rows is the method's own and its tuned learning rate (below); NFT and AWM share the main job's "
           "other settings." if chosen else "rows is the method's own, at its config's learning rate; NFT and AWM "
           "share the main job's settings. No method was tuned beyond that."), "",
    ]
    if final_level is not None:
        lines += [f"`speed-up to GRPO's final`: {REFERENCE}'s final held-out level ({final_level:.3f}, mean over its "
                  f"seeds) is the target; each cell is {REFERENCE}'s mean wall-clock (rollouts) to first reach it "
                  "divided by the method's, per seed that reaches it (k/n: k of n seeds did), so a paper's speed "
                  "claim reproduces where this reaches its factor. `paper's claim` quotes the paper.", ""]
    if args.top:
        lines += [f"Two stages: every method ran with seed {args.top_seeds[0]}, then the {args.top} best by final "
                  f"held-out task mean (and {REFERENCE}, the speed-up reference) with seeds "
                  + ",".join(map(str, args.top_seeds[1:])) + ".", ""]
    header = ["method", "seeds", "epochs", "rollouts", "train s", "best (at s)", "final", "change", *TASKS,
              "gt diversity", f"s to {level:.3f}", "s to 0.60", "speed-up to GRPO's final, wall-clock (x)",
              "speed-up to GRPO's final, rollouts (x)", "paper's claim"]
    lines += [
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
        "| base | " + ",".join(map(str, bases)) + " | 0 | 0 | 0 | | " + fmt_mean_se(p["mean"] for p in bases.values())
        + " | | " + " | ".join(fmt_mean_se((p[t] for p in bases.values()), ".2f") for t in TASKS)
        + f" | {fmt_mean_se(p['diversity'] for p in bases.values())} | | | | | |",
    ]
    for name, per_seed in runs.items():
        lasts = [points[-1] for points in per_seed.values()]
        bests = [max(points[1:], key=lambda p: p["mean"], default=points[-1]) for points in per_seed.values()]
        never = "never"
        reach = [[(lambda r: r["wall"] if r else None)(first_reaching(points, threshold))
                  for points in per_seed.values()] for threshold in (level, 0.6)]
        if name in ratios:
            speed = [fmt_mean_se(ratios[name][key], ".2f", missing="not reached") for key in ("wall", "rollouts")]
        else:
            speed = ["n/a"] * 2
        cells = [name, ",".join(map(str, per_seed)), fmt_mean_se((p["epoch"] + 1 for p in lasts), ".0f"),
                 fmt_mean_se((p["rollouts"] for p in lasts), ".0f"), fmt_mean_se((p["wall"] for p in lasts), ".0f"),
                 f"{fmt_mean_se(p['mean'] for p in bests)} at {statistics.fmean(p['wall'] for p in bests):.0f}",
                 fmt_mean_se(p["mean"] for p in lasts),
                 fmt_mean_se((p["mean"] - bases[seed]["mean"] for seed, p in zip(per_seed, lasts)), "+.3f"),
                 *(fmt_mean_se((p[t] for p in lasts), ".2f") for t in TASKS),
                 fmt_mean_se(p["diversity"] for p in lasts),
                 *(fmt_mean_se(r, ".0f", missing=never) for r in reach), *speed, claim(name)]
        lines.append("| " + " | ".join(cells) + " |")
    if final_level is None:
        lines += ["", f"{REFERENCE} is not in this comparison, so no speed-up over it can be stated."]
    elif not ratios:
        lines += ["", f"{REFERENCE} never reached its own final level after its first point, so no speed-up over "
                  "it can be stated as a ratio."]
    if chosen:
        lines += [""] + tuning_lines(chosen, args)
    return lines


def write_results(runs: dict[str, dict[int, list[dict]]], args, command: str, chosen: dict[str, dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lines = results_table(runs, args, command, chosen)
    results = Path(args.results)
    plot = results.parent / "results_curves.png"
    if args.section:  # a rerun of some methods: its own section, the main table and its reading kept
        lines[0] = f"## {args.section}"
        plot = results.parent / f"results_curves_{re.sub(r'[^a-z0-9]+', '_', args.section.lower()).strip('_')}.png"
        lines += ["", f"Curves: `{plot}`.", ""]
        replace_section(results, "\n".join(lines) + "\n", lines[0])
    else:
        kept = results.read_text().partition("\n## Reading the table")[1:] if results.exists() else ()
        results.parent.mkdir(parents=True, exist_ok=True)
        results.write_text("\n".join(lines) + "\n" + "".join(kept))
    fig, ax = plt.subplots(figsize=(8, 5))
    colours = plt.get_cmap("tab20").colors  # 20 distinct colours: one per method, one line per seed
    for i, (name, per_seed) in enumerate(runs.items()):
        for j, points in enumerate(per_seed.values()):
            ax.plot([p["wall"] for p in points], [p["mean"] for p in points], marker="o", ms=3,
                    label=name if j == 0 else None, color=colours[i % len(colours)], lw=2.2 if name == "nft" else 1.2)
    base = statistics.fmean(points[0]["mean"] for per_seed in runs.values() for points in per_seed.values())
    ax.axhline(base, color="grey", lw=0.8, ls="--")
    ax.set_xlabel("training wall-clock (s, one thread)")
    ax.set_ylabel("held-out task-mean strict ToyEval")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(plot, dpi=120)
    print("\n".join(lines))


def add_run_arguments(parser: argparse.ArgumentParser, *, out: str, test_prompts: int = 32) -> None:
    """The budget, held-out, seed and output options every toy comparison script shares."""
    parser.add_argument("--budget-s", type=float, default=240.0, help="training time per run (s)")
    parser.add_argument("--test-every", type=int, default=4, help="epochs between held-out points")
    parser.add_argument("--test-prompts", type=int, default=test_prompts)
    parser.add_argument("--images", type=int, default=8, help="ODE images per held-out prompt")
    parser.add_argument("--parallel", type=int, default=2, help="runs at a time, one torch thread each")
    add_seed_argument(parser)
    parser.add_argument("--out", default=out)
    parser.add_argument("--results", default="docs/results.md",
                        help="the markdown file the tables go into (plots beside it)")
    parser.add_argument("--table-only", action="store_true", help="rebuild the tables and plots from --out")


def top_methods(out: Path, names: list[str], seed: int, k: int) -> list[str]:
    """The ``k`` methods with the best final held-out task mean at ``seed`` (plus grpo_full, the reference)."""
    finals = {name: curve(seed_dir(out, name, seed))[-1]["mean"] for name in names
              if finished_seeds(out, name, [seed])}
    best = sorted(finals, key=finals.get, reverse=True)[:k]
    return [name for name in names if name in best or (name == REFERENCE and name in finals)]


def tuning_seed(args) -> int:
    return (args.top_seeds if args.top else args.seeds)[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--methods", nargs="*", default=list(METHODS), choices=list(METHODS))
    add_run_arguments(parser, out="runs/compare", test_prompts=48)
    parser.add_argument("--top", type=int, default=0,
                        help="two stages: every method with the first of --top-seeds, then the K best with the rest")
    parser.add_argument("--top-seeds", type=parse_seeds, default=[0, 1, 2], help="the seeds of --top (default 0,1,2)")
    parser.add_argument("--gain", type=float, default=0.02,
                        help="report the time to reach the base task mean plus this (and to 0.6)")
    parser.add_argument("--tune-budget-s", type=float, default=120.0, help="per tuning run; 0: no tuning")
    parser.add_argument("--lr-factors", type=float, nargs="+", default=[0.3, 1.0, 3.0])
    parser.add_argument("--section", default=None,
                        help="write the table as this '## ' section of --results (replacing a section of that "
                             "title, else appended) instead of replacing the main table: for reruns of some methods")
    args = parser.parse_args()
    if args.top < 0:
        parser.error("--top must be >= 0")
    command = "python scripts/compare_algorithms.py " + shlex.join(sys.argv[1:])
    out = Path(args.out)
    chosen = tune(args, tuning_seed(args)) if args.tune_budget_s > 0 else {}
    lr = lambda name: [f"train.learning_rate={chosen[name]['lr']:g}"] if chosen else []  # noqa: E731
    run = lambda name, seed: run_method(name, seed_dir(out, name, seed), args.budget_s,  # noqa: E731
                                        args.test_every, args, lr(name), seed)
    seeds = args.top_seeds if args.top else args.seeds
    plan = {name: seeds if not args.top else seeds[:1] for name in args.methods}
    if not args.table_only:
        run_all([(name, seed) for name in args.methods for seed in plan[name]], run, args.parallel)
    if args.top:
        for name in top_methods(out, args.methods, seeds[0], args.top):
            plan[name] = seeds
        if not args.table_only:
            run_all([(name, seed) for name in args.methods for seed in plan[name][1:]], run, args.parallel)
    runs = gather(out, plan, curve)
    if not runs:
        sys.exit(f"compare_algorithms: no finished run under {out} for these methods and seeds")
    write_results(runs, args, command.strip(), chosen)


if __name__ == "__main__":
    main()
