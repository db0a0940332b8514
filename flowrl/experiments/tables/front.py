"""The Pareto-front table (ParetoSlider): one preference-conditioned model against models trained at fixed reward
weights, each scored on held-out prompts at the same weights (``experiments/pareto_front.yaml``).

Why its own kind: the other tables read each run's training log, but a slider model has one point per weight, so
its front only exists after training: every slider run is evaluated once per weight of ``points`` with ``flowrl
eval --preference w1,1-w1``, and every fixed-weight run once, at the weights it was trained on (read from its saved
config: ``w1 = weight of rewards[0] / (sum of both weights)``). All evaluations use the experiment's ``eval_config``
(the slider's config: the same rewards, both scored as trained ones), ``eval_suite`` (held-out prompts),
``eval_images`` images per prompt and the eval seeds, so every point is scored on the same images' seeds.

Parameters: ``slider`` (the slider run's name; every other run is a fixed-weight one), ``points`` (the w1 values),
``rewards`` (the two reward names, w1 weighing the first), ``eval_config``, ``eval_suite``, ``eval_images``, and
optionally ``figure`` (the plot's file name beside the results file; ``results_front.png`` by default).
Columns: per w1, each reward's held-out task mean for the slider and for the fixed model of that weight; the plot
puts both fronts in the plane of the two rewards.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import yaml

from flowrl.experiments.cells import CELL_NOTE, fmt_mean_se, mean_se
from flowrl.experiments.markdown import replace_section, table_head
from flowrl.experiments.spec import Experiment, ExperimentError

SECTION = "ParetoSlider: one slider model against fixed-weight models"


# The experiment-file keys this table reads, besides every table's (flowrl.experiments.tables.COMMON_KEYS).
FILE_KEYS = frozenset({"compute", "eval_config", "eval_images", "eval_suite", "figure", "points", "rewards", "slider"})


def trained_w1(run_dir: Path, rewards: list[str]) -> float:
    """The first reward's share of the two weights a fixed-weight run trained with (its saved config)."""
    config = yaml.safe_load((Path(run_dir) / "config.yaml").read_text()) or {}
    weights = {r.get("key") or r["name"]: float(r.get("weight", 1.0)) for r in config.get("rewards", [])}
    total = weights.get(rewards[0], 0.0) + weights.get(rewards[1], 0.0)
    return weights.get(rewards[0], 0.0) / total if total else float("nan")


def evaluate(p: dict, run_dir: Path, out: Path, w1: float | None) -> dict[str, float]:
    """``flowrl eval`` of ``run_dir``'s adapter (at ``w1, 1 - w1`` when given: a slider) into ``out``; returns
    {reward: held-out task mean}. A finished evaluation (its results.json) is read, not redone."""
    results = out / "results.json"
    if not results.is_file():
        command = [sys.executable, "-m", "flowrl", "eval", p["eval_config"], "--checkpoint", f"run={run_dir}",
                   "--out", str(out), f"eval.suite={p['eval_suite']}", f"eval.images_per_prompt={p['eval_images']}",
                   "eval.toy_diversity=false"]
        if w1 is not None:
            command.append(f"--preference={w1!r},{1 - w1!r}")
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
        out.parent.mkdir(parents=True, exist_ok=True)
        with open(f"{out}.log", "w") as log:
            if subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, env=env).returncode != 0:
                raise ExperimentError(f"evaluating {run_dir} failed, see {out}.log")
    metrics = json.loads(results.read_text())["metrics"]["run"]

    def score(name: str) -> float:
        for key in (f"reward/{name}/task_mean", f"held_out/{name}/task_mean", f"reward/{name}", f"held_out/{name}"):
            if key in metrics:
                return float(metrics[key])
        return float("nan")

    return {name: score(name) for name in p["rewards"]}


def is_slider_run(run_dir: Path, slider: str) -> bool:
    """Whether ``run_dir`` (``NAME_sSEED``) is a seed of the run named ``slider``: the whole name, so a slider
    ``slider`` does not claim ``slider_14_s0``."""
    return Path(run_dir).name.rsplit("_s", 1)[0] == slider


def reader(p: dict):
    """``read(run_dir) -> {w1: {reward: score}}``: every point of a slider run, the one point of a fixed run."""
    def read(run_dir: Path) -> dict[float, dict[str, float]]:
        if is_slider_run(run_dir, p["slider"]):
            return {float(w1): evaluate(p, run_dir, Path(run_dir) / "front" / f"w{float(w1):.2f}", float(w1))
                    for w1 in p["points"]}
        w1 = trained_w1(run_dir, p["rewards"])
        return {w1: evaluate(p, run_dir, Path(run_dir) / "front" / "fixed", None)}
    return read


def fronts(results: dict[str, dict[int, dict]], p: dict) -> dict[str, dict[float, dict[int, dict[str, float]]]]:
    """{"slider" | "fixed": {w1: {seed: {reward: score}}}}."""
    out: dict[str, dict[float, dict[int, dict[str, float]]]] = {"slider": {}, "fixed": {}}
    for name, per_seed in results.items():
        kind = "slider" if name == p["slider"] else "fixed"
        for seed, points in per_seed.items():
            for w1, scores in points.items():
                out[kind].setdefault(round(w1, 4), {})[seed] = scores
    return out


def table(found: dict, p: dict, command: str) -> str:
    a, b = p["rewards"]
    prose = (f"One `{p['slider']}` model, trained with w drawn per prompt group, against one model per fixed "
             f"weight ({p['compute']}); every point scored on the held-out prompts of "
             f"`{p['eval_suite']}` x {p['eval_images']} ODE images with `flowrl eval` (the slider at "
             f"`--preference w1,1-w1`). w1 weighs {a}, 1 - w1 weighs {b}. {CELL_NOTE}")
    lines = table_head(f"## {p['section'] or SECTION}", command, prose,
                       ["w1", f"{a}, slider", f"{a}, fixed", f"{b}, slider", f"{b}, fixed"])
    for w1 in sorted({*found["slider"], *found["fixed"]}):
        cell = lambda kind, name: fmt_mean_se(s[name] for s in found[kind].get(w1, {}).values())  # noqa: E731
        lines.append(f"| {w1:.2f} | {cell('slider', a)} | {cell('fixed', a)} | {cell('slider', b)} | "
                     f"{cell('fixed', b)} |")
    return "\n".join(lines + [""])


def plot(found: dict, p: dict, path: Path) -> None:
    """Both fronts in the (reward a, reward b) plane: seed means with standard errors, points joined by w1."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    a, b = p["rewards"]
    fig, ax = plt.subplots(figsize=(6, 5))
    for kind, style in (("slider", "o-"), ("fixed", "s--")):
        points = sorted(found[kind].items())
        xs = [mean_se(s[a] for s in seeds.values()) for _, seeds in points]
        ys = [mean_se(s[b] for s in seeds.values()) for _, seeds in points]
        ax.errorbar([x[0] for x in xs], [y[0] for y in ys], xerr=[x[1] for x in xs], yerr=[y[1] for y in ys],
                    fmt=style, capsize=3, label=f"{kind} ({len(points)} weights)")
        for (w1, _), x, y in zip(points, xs, ys):
            ax.annotate(f"{w1:.2f}", (x[0], y[0]), textcoords="offset points", xytext=(4, 4), fontsize=7)
    ax.set_xlabel(f"{a} (held-out task mean)")
    ax.set_ylabel(f"{b} (held-out task mean)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def make(exp: Experiment) -> str | None:
    p = {**exp.params, "eval_suite": exp.substitute(str(exp.params.get("eval_suite", "")), out=exp.out)}
    missing = [k for k in ("slider", "points", "rewards", "eval_config", "eval_suite", "eval_images", "compute")
               if k not in p]
    if missing or p.get("slider") not in exp.runs or len(p.get("rewards") or []) != 2:
        raise ExperimentError(f"{exp.path}: a front table needs {', '.join(missing) or 'slider'} (slider: one of its "
                              "runs; rewards: two names)")
    results = exp.results(reader(p), "slider and fixed-weight runs")
    if results is None:
        print(f"then: flowrl eval of each {p['slider']} run at w1 in {p['points']} (--preference w1,1-w1), and of "
              f"each fixed-weight run once, on {p['eval_suite']} x {p['eval_images']} images", flush=True)
        return None
    found = fronts(results, p)
    text = table(found, p, exp.command)
    results_file = Path(p["results"])
    image = results_file.parent / p.get("figure", "results_front.png")
    plot(found, p, image)
    text = text + f"\nFronts: `{image}`.\n"
    replace_section(results_file, text, text.splitlines()[0])
    return text
