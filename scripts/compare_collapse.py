"""Preference mode collapse on the toy world, and what each defence buys: every method optimises
ToyClip, the CLIP-like proxy whose text embedding carries a black-background bias for every prompt
(``rewards/toy_clip.py``), with strict ToyEval scored alongside at weight 0 (held out from training,
so it catches hacking).

Methods (``configs/toy/grpo_clip.yaml``, no KL, unless noted): plain GRPO; GRPO with KL (beta 0.04);
GARDO (KL gated to the 10% most uncertain samples against ToyEval, the reference reset every 10 epochs,
positive advantages scaled by latent nearest-neighbour distance); D²-Align (ToyClip with its shared
direction, fitted first on base-model samples by ``scripts/d2align_fit.py``, removed); HRF (a sliding
3-step SDE window, one phase per position, weights anchored to the phase start); TMPO (Softmax
Trajectory Balance); CRD (the forward-process recipe with Centered Reward Distillation). Same seeds and
``--budget-s`` of training time each, two at a time, one thread each.

The table gives each method's final held-out proxy reward (the raw ToyClip score, also for D²-Align),
strict ToyEval, ground-truth diversity and background diversity, each with its change from the base;
``results_collapse.png`` beside ``--results`` plots the reward-diversity trade-off. It replaces the
``## Preference mode collapse`` section of ``--results`` (default ``docs/results.md``).

Seeds (``--seeds 0,1,2``): every method runs once per seed (override ``seed=S``, run directory
``--out/<method>_sS``); each cell is the mean over seeds ± the standard error (sample std / sqrt(n)) and (n),
the changes taken per seed from that seed's base point.

Resume: a run is finished once its ``done.json`` exists (written after the training process exited cleanly,
see ``seeded_runs.py``); a rerun, e.g. after Ctrl-C, skips finished runs and starts the others again from
scratch, their directories removed first (no mid-run checkpoints: a wall-clock budget does not resume
exactly). The fitted D²-Align direction is kept once written. ``--table-only`` rebuilds the table from ``--out``.

    python scripts/compare_collapse.py                          # 7 methods, 240 s each
    python scripts/compare_collapse.py --methods grpo d2align --budget-s 60 --seeds 0,1,2
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from compare_algorithms import add_run_arguments, replace_section, run_all, run_config  # noqa: E402
from flowrl.training.metrics import read_metrics  # noqa: E402
from seeded_runs import CELL_NOTE, fmt_mean_se, gather, seed_dir  # noqa: E402

CONFIG = "configs/toy/grpo_clip.yaml"
DIRECTION = "directions/toy_clip.safetensors"  # under --out
METHODS: dict[str, list[str]] = {
    "grpo": [],
    "grpo_kl": ["train.beta=0.04"],
    "gardo": ["train.beta=0.04", "gardo.kl_fraction=0.1", "gardo.reset_every=10", "gardo.diversity=true"],
    "d2align": [],  # rewards set in overrides(), with the fitted direction
    "hrf": ["sampling.window.size=3", "sampling.window.mode=sliding", "sampling.window.shift_every=4",
            "hrf.anchor_weight=10.0"],
    "tmpo": ["train.loss=tmpo"],
    "crd": ["recipe=nft", "nft.loss=crd", "sampling.group_size=16", "train.micro_batch_size=64",
            "train.inner_epochs=2", "train.advantage_clip=5.0", "train.std_scope=group", "nft.timesteps_per_sample=2",
            "train.optimizer_steps_per_epoch=1"],  # nft.yaml's loop, CRD's own decays and loss scale
}
SECTION = "## Preference mode collapse"


def overrides(name: str, out: Path) -> list[str]:
    if name == "d2align":
        return [f"rewards=[{{name: d2align, kwargs: {{reward: toy_clip, direction: {out / DIRECTION}}}}}, "
                "{name: toyeval, weight: 0.0}]"]
    return METHODS[name]


def summary(run_dir: Path) -> dict:
    tests = [r for r in read_metrics(run_dir) if "test/toyeval/task_mean" in r]
    raw = "test/toy_clip_d2/raw/task_mean"  # D²-Align trains the corrected score; the table reports the raw one
    proxy = raw if raw in tests[-1] else "test/toy_clip/task_mean"
    point = lambda r: {"proxy": r[proxy], "toyeval": r["test/toyeval/task_mean"],  # noqa: E731
                       "diversity": r["test/diversity/gt_mean"], "background": r["test/diversity/background"]}
    return {"epochs": tests[-1]["epoch"] + 1, "base": point(tests[0]), "final": point(tests[-1])}


KEYS = ("proxy", "toyeval", "diversity", "background")


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
    ax.set_ylabel("ToyClip proxy reward (held-out)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def table(results: dict[str, dict[int, dict]], args, command: str, plot_path: Path) -> str:
    bases = {seed: r["base"] for per_seed in results.values() for seed, r in per_seed.items()}
    base = {k: fmt_mean_se(b[k] for b in bases.values()) for k in KEYS}
    lines = [SECTION, "", f"`{command}`", "",
             f"Every method optimised ToyClip (`{CONFIG}`, strict ToyEval logged at weight 0) for "
             f"{args.budget_s:.0f} s of training time (2 CPU cores, {args.parallel} runs at a time, one thread each), "
             f"once per seed (column `seeds`); held-out task means on {args.test_prompts} prompts x {args.images} ODE "
             f"images. {CELL_NOTE} Base: proxy {base['proxy']}, ToyEval {base['toyeval']}, diversity "
             f"{base['diversity']}, background diversity {base['background']}. Plot: `{plot_path}`.", "",
             "| method | seeds | epochs | proxy | change | ToyEval | change | gt diversity | change | background | "
             "change |", "|" + "---|" * 11]
    for name, per_seed in results.items():
        cells = [f"{fmt_mean_se(r['final'][k] for r in per_seed.values())} | "
                 + fmt_mean_se((r["final"][k] - r["base"][k] for r in per_seed.values()), "+.3f") for k in KEYS]
        lines.append(f"| {name} | {','.join(map(str, per_seed))} | "
                     f"{fmt_mean_se((r['epochs'] for r in per_seed.values()), '.0f')} | " + " | ".join(cells) + " |")
    return "\n".join(lines + [""])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--methods", nargs="*", default=list(METHODS), choices=list(METHODS))
    add_run_arguments(parser, out="runs/compare_collapse")
    args = parser.parse_args()
    out = Path(args.out)
    command = ("python scripts/compare_collapse.py " + " ".join(sys.argv[1:])).strip()
    if not args.table_only:
        if "d2align" in args.methods and not (out / DIRECTION).is_file():
            subprocess.run([sys.executable, "scripts/d2align_fit.py", CONFIG, "--reward", "toy_clip", "--out",
                            str(out / DIRECTION)], check=True)
        run_all([(name, seed) for name in args.methods for seed in args.seeds],
                lambda name, seed: run_config(CONFIG, overrides(name, out), seed_dir(out, name, seed), args.budget_s,
                                              args.test_every, args, seed=seed), args.parallel)
    results = gather(out, {name: args.seeds for name in args.methods}, summary)
    if not results:
        sys.exit(f"compare_collapse: no finished run under {out} for these methods and seeds")
    plot_path = Path(args.results).parent / "results_collapse.png"
    plot_path.parent.mkdir(parents=True, exist_ok=True)
    plot(results, plot_path)
    text = table(results, args, command, plot_path)
    replace_section(Path(args.results), text, SECTION)
    print(text)


if __name__ == "__main__":
    main()
