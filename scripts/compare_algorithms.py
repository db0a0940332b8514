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

It writes ``docs/results.md`` (the tables and this command; a ``## Reading the table`` section already
there is kept) and ``docs/results_curves.png`` (held-out task mean against training wall-clock).

    python scripts/compare_algorithms.py    # tune (120 s per rate), then every method 240 s, two at a time
    python scripts/compare_algorithms.py --methods nft grpo_full --budget-s 60 --tune-budget-s 0
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from flowrl.config.loader import load_config  # noqa: E402
from flowrl.config.schema import Config  # noqa: E402
from flowrl.training.metrics import read_metrics  # noqa: E402

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


def base_learning_rate(name: str) -> float:
    config, overrides = METHODS[name]
    return load_config(Config, config, overrides).train.learning_rate


# The held-out file has 6 single-object prompts, all in the comparison's test set, so the sweep scores on
# training prompts instead (the first of each task, round-robin, at the held-out seeds): never on the
# prompts the table reports, at the price of favouring a rate that fits prompts seen in training.
VALIDATION = "the first training prompts of each task (round-robin, at the held-out ODE seeds)"


def run_method(name: str, run_dir: Path, budget_s: float, test_every: int, args, extra: list[str]) -> Path:
    """Train method ``name`` of :data:`METHODS` (see :func:`run_config`)."""
    config, overrides = METHODS[name]
    return run_config(config, [*overrides, *extra], run_dir, budget_s, test_every, args)


def run_config(config: str, overrides: list[str], run_dir: Path, budget_s: float, test_every: int, args) -> Path:
    """Train ``config`` with ``overrides`` for ``budget_s`` in a subprocess (one torch thread), held-out
    points every ``test_every`` epochs at ``args.test_prompts`` x ``args.images``; its log goes next to
    its run directory. A run that finished (its ``lora`` export exists) is kept, so a rerun picks up
    where an interrupted comparison stopped; an unfinished one starts again."""
    if (run_dir / "lora").is_dir():
        return run_dir
    shutil.rmtree(run_dir, ignore_errors=True)
    command = [sys.executable, "-m", "flowrl", "train", config, f"run_dir={run_dir}", "train.epochs=100000",
               f"train.time_limit_s={budget_s}", f"log.test_every={test_every}",
               f"log.test_prompts={args.test_prompts}", f"log.eval_images_per_prompt={args.images}",
               "log.report_prompts=0", "log.eval_every=0", "log.progress=false", "train.checkpoint_every=0",
               *overrides]
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    start = time.perf_counter()
    with open(f"{run_dir}.log", "w") as log:
        subprocess.run(command, check=True, stdout=log, stderr=subprocess.STDOUT, env=env)
    print(f"{run_dir.name}: done in {time.perf_counter() - start:.0f} s", flush=True)
    return run_dir


def tune(args) -> dict[str, dict]:
    """One ``--tune-budget-s`` run per method and learning-rate factor; the best by the validation task mean
    at the end of the budget. Returns {method: {"lr": chosen, "scores": {lr: final validation mean}}}."""
    out = Path(args.out) / "tune"
    validation = load_config(Config, GRPO).data.prompts  # every method's training prompts (see VALIDATION)
    jobs = [(name, factor * base_learning_rate(name)) for name in args.methods for factor in args.lr_factors]
    extra = lambda lr: [f"train.learning_rate={lr:g}", f"data.test_prompts={validation}"]  # noqa: E731
    run_name = lambda name, lr: out / f"{name}_lr{lr:g}"  # noqa: E731
    if not args.table_only:
        with ThreadPoolExecutor(args.parallel) as pool:  # test_every past the budget: base and final points only
            list(pool.map(lambda job: run_method(job[0], run_name(*job), args.tune_budget_s, 10**6, args,
                                                 extra(job[1])), jobs))
    chosen: dict[str, dict] = {}
    for name, lr in jobs:
        entry = chosen.setdefault(name, {"scores": {}})
        entry["scores"][lr] = curve(run_name(name, lr))[-1]["mean"]
    for entry in chosen.values():
        entry["lr"] = max(entry["scores"], key=entry["scores"].get)
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


def entry_base(chosen: dict[str, dict], args) -> float | None:
    """The base model's validation task mean (every tuning run's epoch -1 point)."""
    name = next(iter(chosen), None)
    if name is None:
        return None
    lr = next(iter(chosen[name]["scores"]))
    points = curve(Path(args.out) / "tune" / f"{name}_lr{lr:g}")
    return points[0]["mean"] if points and points[0]["epoch"] < 0 else None


def tuning_lines(chosen: dict[str, dict], args) -> list[str]:
    factors = " ".join(f"{f:g}" for f in args.lr_factors)
    lines = ["## Tuning", "",
             f"Every method got the same tuning budget: one {args.tune_budget_s:.0f} s run (same seeds, two at a time, one "
             f"thread each) per learning rate, its config's rate times {factors}, nothing else varied. Each run was "
             f"scored at the end on {args.test_prompts} validation prompts x {args.images} ODE images: {VALIDATION}; "
             "the held-out file's six single-object prompts are all in the comparison's test set, so the sweep "
             "never sees the prompts the table reports. The comparison ran each method at the rate in bold.", "",
             "| method | " + " | ".join(f"lr x{f:g}" for f in args.lr_factors) + " |",
             "|" + "---|" * (1 + len(args.lr_factors))]
    base = entry_base(chosen, args)
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
    path.write_text(new)


def write_results(curves: dict[str, list[dict]], args, command: str, chosen: dict[str, dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    base = next(iter(curves.values()))[0]["mean"]
    level = base + args.gain
    reference = first_reaching(curves.get("grpo_full", []), level)
    lines = [
        "# Algorithms compared on the toy world", "",
        f"`{command}`", "",
        f"Every method trained for {args.budget_s:.0f} s of sampling, scoring and training time on the same machine "
        f"(2 CPU cores, {args.parallel} runs at a time, one torch thread each), from the same base model and seeds. "
        f"Held-out task-mean strict ToyEval on {args.test_prompts} prompts x {args.images} ODE images (base "
        f"{base:.3f}; the sampling error of one point is about 0.02). The only setting that differs between GRPO "
        + ("rows is the method's own and its tuned learning rate (below); NFT and AWM share the main job's "
           "other settings." if chosen else "rows is the method's own, at its config's learning rate; NFT and AWM "
           "share the main job's settings. No method was tuned beyond that."), "",
        f"| method | epochs | rollouts | train s | best (at s) | final | change | "
        + " | ".join(TASKS) + f" | gt diversity | s to {level:.3f} | s to 0.60 |",
        "|" + "---|" * (10 + len(TASKS)),
    ]
    first = next(iter(curves.values()))[0]  # every run's epoch -1: the same base model and seeds
    lines.append("| base | 0 | 0 | 0 | | " + f"{base:.3f} | | " + " | ".join(f"{first[t]:.2f}" for t in TASKS)
                 + f" | {first['diversity']:.3f} | | |")
    for name, points in curves.items():
        last = points[-1]
        best = max(points[1:], key=lambda p: p["mean"], default=last)
        reach = [first_reaching(points, threshold) for threshold in (level, 0.6)]
        cells = [name, str(last["epoch"] + 1), str(last["rollouts"]), f"{last['wall']:.0f}",
                 f"{best['mean']:.3f} ({best['wall']:.0f})", f"{last['mean']:.3f}", f"{last['mean'] - base:+.3f}",
                 *(f"{last[t]:.2f}" for t in TASKS), f"{last['diversity']:.3f}",
                 *(f"{r['wall']:.0f}" if r else "never" for r in reach)]
        lines.append("| " + " | ".join(cells) + " |")
    if reference is None:
        lines += ["", f"Full-SDE GRPO never reached {level:.3f} within the budget, so no speed-up over it "
                  "can be stated as a ratio."]
    if chosen:
        lines += [""] + tuning_lines(chosen, args)
    results = Path("docs/results.md")
    results.parent.mkdir(exist_ok=True)
    plot = Path("docs/results_curves.png")
    if args.section:  # a rerun of some methods: its own section, the main table and its reading kept
        lines[0] = f"## {args.section}"
        plot = Path(f"docs/results_curves_{re.sub(r'[^a-z0-9]+', '_', args.section.lower()).strip('_')}.png")
        lines += ["", f"Curves: `{plot}`.", ""]
        replace_section(results, "\n".join(lines) + "\n", lines[0])
    else:
        kept = results.read_text().partition("\n## Reading the table")[1:] if results.exists() else ()
        results.write_text("\n".join(lines) + "\n" + "".join(kept))
    fig, ax = plt.subplots(figsize=(8, 5))
    colours = plt.get_cmap("tab20").colors  # 20 distinct colours: one per method
    for i, (name, points) in enumerate(curves.items()):
        ax.plot([p["wall"] for p in points], [p["mean"] for p in points], marker="o", ms=3, label=name,
                color=colours[i % len(colours)], lw=2.2 if name == "nft" else 1.2)
    ax.axhline(base, color="grey", lw=0.8, ls="--")
    ax.set_xlabel("training wall-clock (s, one thread)")
    ax.set_ylabel("held-out task-mean strict ToyEval")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(plot, dpi=120)
    print("\n".join(lines))


def add_run_arguments(parser: argparse.ArgumentParser, *, out: str, test_prompts: int = 32) -> None:
    """The budget, held-out and output options every toy comparison script shares."""
    parser.add_argument("--budget-s", type=float, default=240.0, help="training time per run (s)")
    parser.add_argument("--test-every", type=int, default=4, help="epochs between held-out points")
    parser.add_argument("--test-prompts", type=int, default=test_prompts)
    parser.add_argument("--images", type=int, default=8, help="ODE images per held-out prompt")
    parser.add_argument("--parallel", type=int, default=2, help="runs at a time, one torch thread each")
    parser.add_argument("--out", default=out)
    parser.add_argument("--table-only", action="store_true", help="rebuild the tables and plots from --out")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--methods", nargs="*", default=list(METHODS), choices=list(METHODS))
    add_run_arguments(parser, out="runs/compare", test_prompts=48)
    parser.add_argument("--gain", type=float, default=0.02,
                        help="report the time to reach the base task mean plus this (and to 0.6)")
    parser.add_argument("--tune-budget-s", type=float, default=120.0, help="per tuning run; 0: no tuning")
    parser.add_argument("--lr-factors", type=float, nargs="+", default=[0.3, 1.0, 3.0])
    parser.add_argument("--section", default=None,
                        help="write the table as this '## ' section of docs/results.md (replacing a section of that "
                             "title, else appended) instead of replacing the main table: for reruns of some methods")
    args = parser.parse_args()
    command = "python scripts/compare_algorithms.py " + shlex.join(sys.argv[1:])
    chosen = tune(args) if args.tune_budget_s > 0 else {}
    lr = lambda name: [f"train.learning_rate={chosen[name]['lr']:g}"] if chosen else []  # noqa: E731
    if not args.table_only:
        with ThreadPoolExecutor(args.parallel) as pool:
            list(pool.map(lambda name: run_method(name, Path(args.out) / name, args.budget_s, args.test_every, args,
                                                  lr(name)), args.methods))
    write_results({name: curve(Path(args.out) / name) for name in args.methods}, args, command.strip(), chosen)


if __name__ == "__main__":
    main()
