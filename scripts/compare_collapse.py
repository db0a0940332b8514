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
``docs/results_collapse.png`` plots the reward-diversity trade-off. It replaces the ``## Preference mode
collapse`` section of ``docs/results.md``.

    python scripts/compare_collapse.py                          # 7 methods, 240 s each
    python scripts/compare_collapse.py --methods grpo d2align --budget-s 60
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from compare_algorithms import add_run_arguments, replace_section, run_config  # noqa: E402
from flowrl.training.metrics import read_metrics  # noqa: E402

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


def plot(results: dict[str, dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4.5))
    base = next(iter(results.values()))["base"]
    ax.scatter([base["diversity"]], [base["proxy"]], color="black", marker="*", s=120, label="base", zorder=3)
    colours = plt.get_cmap("tab10").colors
    for i, (name, r) in enumerate(results.items()):
        ax.scatter([r["final"]["diversity"]], [r["final"]["proxy"]], color=colours[i % 10], s=50, label=name)
        ax.annotate(name, (r["final"]["diversity"], r["final"]["proxy"]), fontsize=7, xytext=(3, 3),
                    textcoords="offset points")
    ax.set_xlabel("ground-truth diversity (held-out, higher keeps more)")
    ax.set_ylabel("ToyClip proxy reward (held-out)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def table(results: dict[str, dict], args, command: str) -> str:
    base = next(iter(results.values()))["base"]
    lines = [SECTION, "", f"`{command}`", "",
             f"Every method optimised ToyClip (`{CONFIG}`, strict ToyEval logged at weight 0) for "
             f"{args.budget_s:.0f} s of training time (2 CPU cores, {args.parallel} runs at a time, one thread each), "
             f"the same seeds; held-out task means on {args.test_prompts} prompts x {args.images} ODE images. Base: "
             f"proxy {base['proxy']:.3f}, ToyEval {base['toyeval']:.3f}, diversity {base['diversity']:.3f}, "
             f"background diversity {base['background']:.3f}. Plot: `docs/results_collapse.png`.", "",
             "| method | epochs | proxy | change | ToyEval | change | gt diversity | change | background | change |",
             "|" + "---|" * 10]
    for name, r in results.items():
        f = r["final"]
        cells = [f"{f[k]:.3f} | {f[k] - base[k]:+.3f}" for k in ("proxy", "toyeval", "diversity", "background")]
        lines.append(f"| {name} | {r['epochs']} | " + " | ".join(cells) + " |")
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
        with ThreadPoolExecutor(args.parallel) as pool:
            list(pool.map(lambda name: run_config(CONFIG, overrides(name, out), out / name, args.budget_s,
                                                  args.test_every, args), args.methods))
    results = {name: summary(out / name) for name in args.methods}
    plot(results, Path("docs/results_collapse.png"))
    text = table(results, args, command)
    replace_section(Path("docs/results.md"), text, SECTION)
    print(text)


if __name__ == "__main__":
    main()
