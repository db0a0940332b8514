"""The reports of flowrl: ``report.html`` of ``flowrl eval`` and the end-of-run report of ``flowrl train``.

``flowrl eval`` (:func:`write_eval_report`): metric tables with deltas against the base, a reward-diversity
trade-off plot, and side-by-side grids per prompt (prompt text above, one labelled row per checkpoint).

The end of a run (:func:`write_report`): did the adapter improve the rewards, and what did it cost in
diversity? Written into the run directory after training:
- ``report.html``: the page to open, in the layout of ``flowrl eval``: first the headline table (the main
  score's task mean and each task: before, after, change, paired standard error) and the toy world's
  ground-truth diversity, then the training curve, one labelled grid per held-out prompt (the prompt
  above, a row of base images and a row of trained images on the same seeds), and the sub-scores and
  other metrics folded away (without the rows that are NaN on both sides, sub-scores a task lacks);
- ``reward_curve.png``: the trained reward per epoch (raw and moving average) with the held-out score on
  the same axes, the other rewards and sub-scores (moving averages) in a second panel, and the held-out
  score against wall-clock minutes in a third when ``metrics.jsonl`` times its epochs;
- ``before.png`` / ``after.png``: the same grids as plain images, one row per prompt;
- ``report.md``: report.html's tables, in the same order, with links to the images;
- ``report.json``: mean rewards before and after on those images (with task metadata also per task and as
  the mean over tasks, GenEval's overall score, each with its paired change) and, when asked, the toy
  world's ground-truth diversity of each prompt's group (exact mode collapse), and the one-line summary
  ``flowrl train`` prints at the end (the main score's change overall and per task, and diversity's).

Both pages are made of the pieces of :mod:`flowrl.eval.html` and share what is here: tables whose deltas
are coloured by each metric's direction, the samples section, the "All metrics" section, and matplotlib
figures as PNG. The numbers come from elsewhere: :mod:`flowrl.eval.runner` for ``flowrl eval``,
:func:`flowrl.eval.held_out.before_after` for the end of a run (same prompts, seeds and deterministic ODE
sampler before and after, so their difference is the adapter's effect, not sampling noise).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Callable, Sequence

import torch

from flowrl.data.prompts import PromptSet
from flowrl.eval import html
from flowrl.eval.held_out import before_after
from flowrl.core.media import stills
from flowrl.training.metrics import read_metrics

LOWER_IS_BETTER = ("fid/fid", "fid/kid", "fid/kid_std", "diversity/zero_std_prompts")


# --- shared by both reports --------------------------------------------------------------------------------
def higher_is_better(key: str) -> bool | None:
    """A metric's direction, which colours its deltas; None for a count (``fid/n_images``), left uncoloured."""
    return (key not in LOWER_IS_BETTER) if not key.startswith("fid/n_") else None


def table(columns: dict[str, dict[str, float]], keys: Sequence[str], base: str, caption: str = "",
          errors: dict | None = None) -> str:
    """Rows ``keys``, one column per model (``columns[label][key]``) beside its change from ``base`` (and, from
    ``errors[label][key]``, that change's paired standard error)."""
    return html.metric_table(columns, keys, base=base, directions={k: higher_is_better(k) for k in keys},
                             caption=caption, errors=errors)


def all_metrics(content: str, count: int, heading: str = "All metrics") -> tuple[str, str]:
    """The last section of both pages: the table of ``count`` metrics, folded away."""
    return heading, f"<details><summary>{count} metrics</summary>{content}</details>"


def samples(prompts: PromptSet, tasks: list, count: int, rows: Callable[[int], list], what: str) -> tuple[str, str]:
    """The samples section: ``count`` prompts (an equal share per task) as labelled grids, ``rows(i)`` giving
    prompt i's ``(label, images)`` rows; ``what`` ends the heading."""
    shown = html.grid_order(tasks, count)
    return (f"Samples ({len(shown)} of {len(prompts)} {what})",
            html.prompt_grids(prompts.prompts, tasks, shown, rows))


def write_page(path: Path, title: str, sections: Sequence[tuple[str, str]], intro: str) -> Path:
    path.write_text(html.page(title, sections, intro=intro), encoding="utf-8")
    return path


def pyplot():
    """matplotlib's pyplot on the Agg backend: files only, so a cluster node without a display can plot."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def png(figure, **savefig) -> bytes:
    """The figure, laid out tight, as PNG bytes; the figure is closed."""
    figure.tight_layout()
    data = html.figure_png(figure, **savefig)
    pyplot().close(figure)
    return data


def labelled_grid(images: torch.Tensor, prompts: Sequence[str], per_prompt: int, title: str,
                  min_tile: int = 96) -> bytes:
    """PNG bytes of ``images`` [P * per_prompt, 3, H, W] in [0, 1] (videos as film strips), one row per prompt with
    the prompt written on its left and ``title`` above: a mosaic of 32 px tiles says nothing to a reader. Tiles
    smaller than ``min_tile`` px are enlarged by whole factors with nearest-neighbour sampling, so pixels stay
    pixels."""
    strips = stills(images).clamp(0, 1)  # [N, 3, H, W]
    rows = len(strips) // per_prompt
    height, width = strips.shape[-2:]
    scale = max(1, math.ceil(min_tile / min(height, width)))
    plt = pyplot()
    figure, axes = plt.subplots(rows, per_prompt, squeeze=False,
                                figsize=(1.6 + per_prompt * scale * width / 100, 0.4 + rows * scale * height / 100))
    for row in range(rows):
        for k in range(per_prompt):
            axis = axes[row][k]
            tile = strips[row * per_prompt + k].permute(1, 2, 0).float().numpy()
            axis.imshow(tile, interpolation="nearest")
            axis.set_xticks([])
            axis.set_yticks([])
        axes[row][0].set_ylabel(prompts[row], rotation=0, ha="right", va="center", fontsize=8)
    figure.suptitle(title, fontsize=10)
    return png(figure)


# --- flowrl eval -------------------------------------------------------------------------------------------
HEADLINE = ("diversity/cosine", "diversity/vendi", "diversity/latent_gmd", "diversity/zero_std_prompts", "toy/gt_mean",
            "toy/background", "toy/position", "toy/size", "fid/fid", "fid/kid")
READING = {
    "reward/": "mean of a trained reward (higher is better)",
    "held_out/": "mean of a reward not trained on: a fall while the trained reward rises is reward hacking",
    "diversity/cosine": "mean pairwise cosine distance of a prompt's images, in [0, 2] (higher: more diverse)",
    "diversity/vendi": "Vendi score of a prompt's images: their effective number, in [1, images per prompt]",
    "diversity/latent_gmd": "mean pairwise RMS distance of a prompt's clean latents (higher: more diverse)",
    "diversity/zero_std_prompts": "share of prompts whose images all score alike on the trained reward",
    "axis/": "per-axis spread of what the prompt leaves free (layout, tonal, style, identity; higher: more diverse)",
    "toy/": "the toy world's exact normalised entropy / coverage of free attributes, in [0, 1]",
    "fid/": "FID and KID against the reference images (lower: closer)",
}


def main_reward(results: dict) -> str | None:
    """The metric of the trade-off plot's y axis: the first trained reward's mean, else the first reward."""
    keys = next(iter(results["metrics"].values()), {})
    for name in results.get("trained_rewards", []):
        if f"reward/{name}" in keys:
            return f"reward/{name}"
    return next((k for k in keys if k.startswith(("reward/", "held_out/")) and "/task" not in k), None)


def tradeoff_plot(metrics: dict[str, dict[str, float]], x_key: str, y_key: str,
                  errors: dict[str, dict[str, dict[str, float]]] | None = None) -> bytes:
    """One labelled point per checkpoint: ``y_key`` against ``x_key``, with a bar of +-1 paired standard error of
    ``y_key``'s change from the base where ``errors[label][y_key]`` gives one."""
    plt = pyplot()
    from matplotlib.ticker import MaxNLocator

    figure, axis = plt.subplots(figsize=(5.5, 3.8))
    for k, (label, values) in enumerate(metrics.items()):
        x, y = values.get(x_key), values.get(y_key)
        if x is None or y is None:
            continue
        axis.scatter([x], [y], s=40)
        pair = (errors or {}).get(label, {}).get(y_key)
        if pair and math.isfinite(pair["standard_error"]):
            axis.errorbar([x], [y], yerr=[pair["standard_error"]], fmt="none", capsize=3, linewidth=1)
        # alternate label offsets, so checkpoints that land close together stay readable
        axis.annotate(label, (x, y), textcoords="offset points", xytext=(6, 8 - 14 * (k % 2)), fontsize=8)
    axis.xaxis.set_major_locator(MaxNLocator(4))
    axis.yaxis.set_major_locator(MaxNLocator(5))
    axis.ticklabel_format(useOffset=False)
    axis.margins(0.2)
    axis.set_xlabel(f"{x_key} (more diverse →)")
    axis.set_ylabel(y_key)
    axis.set_title("reward-diversity trade-off", fontsize=10)
    axis.grid(alpha=0.3)
    return png(figure)


def is_main_score(key: str) -> bool:
    """``reward/<name>`` or ``held_out/<name>``, not a sub-score (``held_out/toyeval/color``) or a task split."""
    prefix, _, name = key.partition("/")
    return prefix in ("reward", "held_out") and "/" not in name


def task_tables(metrics: dict[str, dict[str, float]], base: str, tasks: list) -> list[tuple[str, str]]:
    """One table per main reward: rows are the tasks and their mean, columns the checkpoints."""
    names = [t for t in dict.fromkeys(tasks) if t is not None]
    if not names:
        return []
    tables = []
    for key in [k for k in next(iter(metrics.values())) if is_main_score(k)]:
        rows = {label: {**{t: values.get(f"{key}/task/{t}") for t in names}, "mean over tasks":
                        values.get(f"{key}/task_mean")} for label, values in metrics.items()}
        tables.append((key, table(rows, [*names, "mean over tasks"], base, caption=key)))
    return tables


def write_eval_report(out_dir: Path, results: dict, suite: PromptSet, images: dict[str, torch.Tensor], n: int, *,
                      grid_prompts: int) -> Path:
    """``OUT/report.html`` of ``flowrl eval`` from its ``results.json`` and each checkpoint's images."""
    metrics, base = results["metrics"], results["base"]
    keys = list(dict.fromkeys(k for values in metrics.values() for k in values))
    flat = [k for k in keys if "/task" not in k]
    headline = [k for k in flat if is_main_score(k) or k in HEADLINE or k.startswith("axis/")]
    paired = results.get("paired", {})
    sections = [("Summary", table(metrics, headline, base, errors=paired))]
    y_key = main_reward(results)
    if y_key is not None and "diversity/cosine" in flat:
        sections.append(("Trade-off", html.img(tradeoff_plot(metrics, "diversity/cosine", y_key, paired),
                                               "trade-off plot")))
    sections.append(samples(suite, results["tasks"], grid_prompts,
                            lambda i: [(label, pictures[i * n:(i + 1) * n]) for label, pictures in images.items()],
                            "prompts, same seeds in every row"))
    by_task = task_tables(metrics, base, results["tasks"])
    if by_task:
        sections.append(("By task (the mean over tasks is GenEval's overall score)",
                         "".join(content for _, content in by_task)))
    sections.append(all_metrics(table(metrics, flat, base), len(flat)))
    reading = "".join(f"<li><code>{html.escape(prefix)}</code>: {html.escape(text)}</li>"
                      for prefix, text in READING.items() if any(k.startswith(prefix) for k in keys))
    notes = []
    if results.get("not_measured"):
        notes.append(f"Not measured (no model configured): {', '.join(results['not_measured'])} "
                     "(set eval.style_model / eval.identity_features).")
    for name, source in results.get("trained_reward_states", {}).items():
        notes.append(f"{name} trains during a run: scored for every checkpoint by the state saved in {source}."
                     if source else f"{name} trains during a run and no checkpoint evaluated holds its state: "
                     "left out (evaluate a checkpoint directory, or a run directory with checkpoints).")
    if results.get("unreliable"):
        notes.append(f"Unreliable: {', '.join(results['unreliable'])} (fewer images than feature dimensions).")
    sections.append(("Reading the metrics", f"<ul>{reading}</ul>" + "".join(f"<p class='note'>{html.escape(t)}</p>"
                                                                          for t in notes)))
    intro = (f"Suite {html.escape(results['suite'])}: {len(suite)} prompts × {n} images, ODE, "
             f"{results['num_steps']} steps, guidance {results['guidance_scale']}, seed {results['seed']}; "
             f"model {html.escape(results['model']['path'])}. Δ columns: change from {html.escape(base)}; green "
             "for higher reward or diversity and lower FID/KID, red for the opposite; a reward's change carries its "
             "paired standard error (every checkpoint renders each prompt on the same seeds), and the trade-off "
             "plot's bars are +-1 of it.")
    return write_page(Path(out_dir) / "report.html", "flowrl eval", sections, intro)


# --- the end of a run --------------------------------------------------------------------------------------
GRID_IMAGES = 8  # images per grid row in report.html (all are scored)


def moving_average(values: list[float], window: int) -> list[float]:
    """Trailing mean over the last ``window`` values (fewer at the start)."""
    out, total = [], 0.0
    for k, value in enumerate(values):
        total += value - (values[k - window] if k >= window else 0.0)
        out.append(total / min(k + 1, window))
    return out


def curve_keys(records: list[dict], trained: list[str]) -> tuple[str, str | None, list[str]]:
    """(trained reward key, its held-out key, the other reward series) of ``metrics.jsonl``."""
    keys = {k for r in records for k in r}
    main = f"reward/{trained[0]}_mean" if len(trained) == 1 and f"reward/{trained[0]}_mean" in keys else \
        "reward/combined_mean"
    held_out = None
    for name in trained[:1]:
        held_out = next((k for k in (f"test/{name}/task_mean", f"test/{name}") if k in keys), None)
    others = sorted(k for k in keys if k.startswith("reward/") and k.endswith("_mean") and k != main
                    and k != "reward/combined_mean")
    return main, held_out, others


def wall_clock(records: list[dict]) -> dict[int, float]:
    """``{epoch: minutes of training by its end}`` (epoch -1, before training: 0): ``perf/train_wall_s``
    (sampling, scoring and updates, summed by the run and kept across a resume), else the running sum of
    ``perf/epoch_s``; empty when the records time nothing."""
    records = sorted((r for r in records if isinstance(r.get("epoch"), int)), key=lambda r: r["epoch"])
    if any(r.get("perf/train_wall_s") is not None for r in records):
        return {r["epoch"]: r["perf/train_wall_s"] / 60 for r in records if r.get("perf/train_wall_s") is not None}
    if all(r.get("perf/epoch_s") is None for r in records):
        return {}
    total, out = 0.0, {}
    for r in records:
        total += r.get("perf/epoch_s") or 0.0
        out[r["epoch"]] = total / 60
    return out


def plot_reward_curve(run_dir: Path, trained: list[str] | None = None) -> Path | None:
    """``reward_curve.png``: trained reward (raw, moving average) and held-out score by epoch, other series
    below, and with timed records the held-out score against wall-clock minutes: the axis on which runs of
    different costs per epoch (group size, sampler, steps) compare."""
    if not (run_dir / "metrics.jsonl").is_file():  # a report of an adapter outside a run has no curve
        return None
    records = [r for r in read_metrics(run_dir) if r.get("epoch", -1) is not None]
    if not records:
        return None
    main, held_out, others = curve_keys(records, trained or [])
    series = lambda key: [(r["epoch"], r[key]) for r in records if r.get(key) is not None]
    points = [p for p in series(main) if p[0] >= 0]
    if not points:
        return None
    clock = wall_clock(records)
    timed = [(clock[e], value) for e, value in series(held_out) if e in clock] if held_out else []
    panels = 3 if timed else 2
    figure = pyplot().figure(figsize=(7.5, 3 * panels))
    grid = figure.add_gridspec(panels, 1, height_ratios=[3, 2, 2][:panels])
    top = figure.add_subplot(grid[0])
    bottom = figure.add_subplot(grid[1], sharex=top)
    window = max(1, min(10, len(points) // 5))
    epochs, values = [p[0] for p in points], [p[1] for p in points]
    name = main.removeprefix("reward/").removesuffix("_mean")
    top.plot(epochs, values, color="tab:blue", alpha=0.3, linewidth=1, label=f"{name} (training rollouts)")
    top.plot(epochs, moving_average(values, window), color="tab:blue", linewidth=2,
             label=f"{name}, moving average of {window}")
    if held_out is not None:
        test = series(held_out)
        top.plot([p[0] + 1 for p in test], [p[1] for p in test], "o-", color="tab:orange", linewidth=2,
                 label=f"{held_out.removeprefix('test/')} (held-out prompts, ODE, EMA)")
    top.set_ylabel("reward")
    top.grid(alpha=0.3)
    top.legend(fontsize=8, loc="best", framealpha=0.8)
    top.set_title("trained reward", fontsize=10)
    top.tick_params(labelbottom=False)
    colours = pyplot().get_cmap("tab20")  # 20 colours, then a second line style: no two legend lines alike
    for index, key in enumerate(others):
        line = series(key)
        if line:
            bottom.plot([p[0] for p in line], moving_average([p[1] for p in line], window), linewidth=1.2,
                        color=colours(index % 20), linestyle="-" if index < 20 else "--",
                        label=key.removeprefix("reward/").removesuffix("_mean"))
    bottom.set_xlabel("epoch (held-out points: after that many epochs)" if held_out is not None else "epoch")
    bottom.set_ylabel("moving average")
    bottom.set_title("other rewards and sub-scores", fontsize=10)
    bottom.grid(alpha=0.3)
    if others:
        bottom.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5), frameon=False)
    if timed:
        plot_wall_clock(figure.add_subplot(grid[2]), timed, held_out.removeprefix("test/"))
    out = run_dir / "reward_curve.png"
    out.write_bytes(png(figure, bbox_inches="tight"))
    return out


def plot_wall_clock(axis, points: list[tuple[float, float]], label: str) -> None:
    """The held-out score ``label`` at each ``(minutes, score)`` point."""
    axis.plot([p[0] for p in points], [p[1] for p in points], "o-", color="tab:orange", linewidth=2)
    axis.set_xlabel("wall-clock minutes of training (sampling, scoring, updates)")
    axis.set_ylabel("held-out score")
    axis.set_title(f"held-out {label} vs wall-clock minutes", fontsize=10)
    axis.grid(alpha=0.3)


DIVERSITY = ("diversity/gt_mean", "diversity/background", "diversity/position", "diversity/size")
COLUMNS = ("before", "after", "change", "paired s.e.")
READING_CHANGE = ("Change: after minus before, with the paired standard errors it spans; paired s.e.: its standard "
                  "error from the per-image differences on the same prompts and seeds (for the task mean, from "
                  "the per-task means' differences).")


def main_score(results: dict, trained: Sequence[str]) -> str | None:
    """The reward the report leads with: the first trained one, else the first one scored; None if unscored."""
    names = [k.removeprefix("eval/") for k in results["before"] if k.startswith("eval/") and k.count("/") == 1]
    name = trained[0] if trained else next(iter(names), None)
    return name if name in names else None


def headline_keys(results: dict, name: str) -> dict[str, str]:
    """``{row: key}`` of reward ``name``'s headline: the task mean (GenEval's overall score) and each task, or
    without task metadata its plain mean."""
    before, prefix = results["before"], f"eval/{name}/task/"
    if f"eval/{name}/task_mean" not in before:
        return {name: f"eval/{name}"}
    tasks = {k.removeprefix(prefix): k for k in before if k.startswith(prefix)}
    return {"task mean": f"eval/{name}/task_mean", **tasks}


def measured(results: dict, key: str) -> bool:
    """Whether ``key`` has a number on either side: a sub-score that does not apply to a task is NaN on both."""
    return not all(math.isnan(results[side].get(key, math.nan)) for side in ("before", "after"))


def report_tables(results: dict, trained: Sequence[str]) -> list[tuple[str, dict[str, str]]]:
    """``(title, {row: key})`` of the run report's tables, in order: the main score by task (did the run help,
    and where), the toy world's ground-truth diversity (what it cost), then every other metric (sub-scores,
    other rewards, plain means), which both pages fold away. Rows unmeasured on both sides are left out."""
    name = main_score(results, trained)
    headline = headline_keys(results, name) if name else {}
    diversity = {k.removeprefix("diversity/"): k for k in DIVERSITY if k in results["before"]}
    shown = {*headline.values(), *diversity.values()}
    tables = [(f"{name}, held-out", headline), ("diversity (ground truth)", diversity),
              ("metric", {k: k for k in results["before"] if k not in shown})]
    return [(title, {row: k for row, k in rows.items() if measured(results, k)}) for title, rows in tables]


def table_cells(results: dict, rows: dict[str, str], change: Callable[[str, float, float], str]
                ) -> tuple[list[str], list[list[str]]]:
    """The header and the cells of one before / after table of both pages: per row its two values,
    ``change(key, after, before)`` with the paired standard errors it spans, and the paired s.e.; that last
    column only when a row has one."""
    paired = results.get("paired", {})
    columns = list(COLUMNS if any(k in paired for k in rows.values()) else COLUMNS[:3])
    body = []
    for row, key in rows.items():
        before, after, pair = results["before"][key], results["after"][key], paired.get(key, {})
        errors = pair.get("standard_errors", math.nan)
        cells = [row, html.number(before), html.number(after),
                 change(key, after, before) + ("" if math.isnan(errors) else f" ({errors:.1f} s.e.)"),
                 html.number(pair["standard_error"]) if pair else ""]
        body.append(cells[:len(columns) + 1])
    return columns, body


def html_table(results: dict, title: str, rows: dict[str, str]) -> str:
    """:func:`table_cells` as an HTML table, each change coloured by its metric's direction."""
    coloured = lambda key, after, before: html.delta(after, before, higher_is_better(key))
    columns, body = table_cells(results, rows, coloured)
    head = "".join(f"<th>{html.escape(c)}</th>" for c in [title, *columns])
    cells = "".join(f"<tr><td>{html.escape(row)}</td>" + "".join(f"<td>{c}</td>" for c in values) + "</tr>"
                    for row, *values in body)
    return f"<table><tr>{head}</tr>{cells}</table>"


def markdown_table(results: dict, title: str, rows: dict[str, str]) -> str:
    """:func:`table_cells` as a markdown table."""
    plain = lambda key, after, before: "" if math.isnan(after - before) else f"{after - before:+.4f}"
    columns, body = table_cells(results, rows, plain)
    return "\n".join(f"| {' | '.join(line)} |" for line in [[title, *columns], ["---"] * (len(columns) + 1), *body])


def shift(results: dict, key: str, unit: str = " s.e.") -> str:
    """``0.250 -> 0.350 (+0.100, 2.5 s.e.)``: a key's change, with its paired standard errors when known."""
    before, after = results["before"][key], results["after"][key]
    errors = results.get("paired", {}).get(key, {}).get("standard_errors", math.nan)
    detail = "" if math.isnan(errors) else f", {errors:.1f}{unit}"
    return f"{before:.3f} -> {after:.3f} ({after - before:+.3f}{detail})"


def summary_line(results: dict, trained: list[str], report: Path) -> str:
    """``toyeval held-out task mean 0.135 -> 0.152 (+0.017, 2.2 paired s.e.); single_object 0.200 -> 0.250
    (+0.050, 1.9 s.e.), counting ...; diversity 0.886 -> 0.873 (-0.013); report: PATH``, one line: the main
    score's change overall and per task, and what it cost in diversity."""
    parts, name = [], main_score(results, trained)
    if name is not None:
        (_, mean), *tasks = headline_keys(results, name).items()
        what = "held-out task mean" if mean.endswith("task_mean") else "held-out"
        parts.append(f"{name} {what} {shift(results, mean, ' paired s.e.')}")
        by_task = [f"{task} {shift(results, key)}" for task, key in tasks if measured(results, key)]
        parts += [", ".join(by_task)] if by_task else []
    if "diversity/gt_mean" in results["before"]:
        parts.append(f"diversity {shift(results, 'diversity/gt_mean')}")
    return "; ".join(parts + [f"report: {report}"])


def html_report(run_dir: Path, results: dict, prompts: PromptSet, before: torch.Tensor, after: torch.Tensor,
                images_per_prompt: int, curve: Path | None, grid_prompts: int = 12, trained: Sequence[str] = ()
                ) -> Path:
    """``report.html`` in the layout of ``flowrl eval``: the headline tables, curve, labelled grids per prompt,
    the other metrics folded."""
    n = images_per_prompt
    *shown, (_, rest) = report_tables(results, trained)
    sections = [("Before and after", "".join(html_table(results, title, rows) for title, rows in shown if rows)
                 + f"<p class='note'>{html.escape(READING_CHANGE)}</p>")]
    if curve is not None:
        sections.append(("Training curve", html.img(curve.read_bytes(), "reward curve")))
    k = min(n, GRID_IMAGES)  # a row of 24 images would shrink each to a few pixels
    sections.append(samples(prompts, [m.get("task") for m in prompts.metadata], grid_prompts,
                            lambda i: [("base", before[i * n:i * n + k]), ("trained", after[i * n:i * n + k])],
                            f"held-out prompts, {k} of {n} images each, same seeds in both rows"))
    sections.append(all_metrics(html_table(results, "metric", rest), len(rest), "Sub-scores and other metrics"))
    intro = (f"{len(prompts)} held-out prompts × {n} images, ODE, the same seeds before (base model) and after "
             "(trained adapter, EMA weights when kept).")
    return write_page(run_dir / "report.html", f"flowrl run report: {run_dir.name}", sections, intro)


def markdown_report(results: dict, num_steps: int, trained: Sequence[str] = ()) -> str:
    """``report.md``: the headline tables, how they were measured, the other metrics folded, links to the images."""
    *shown, (_, rest) = report_tables(results, trained)
    tables = "".join(markdown_table(results, title, rows) + "\n\n" for title, rows in shown if rows)
    by_task_note = "" if "prompts_per_task" not in results else (
        " Prompts per task: " + ", ".join(f"{t} {c}" for t, c in results["prompts_per_task"].items())
        + "; the task mean (`<key>/task_mean`) is the mean over tasks of the per-task means (GenEval's overall "
        "score).")
    folded = "" if not rest else (f"<details><summary>{len(rest)} more metrics: sub-scores, other rewards"
                                  f"</summary>\n\n{markdown_table(results, 'metric', rest)}\n\n</details>\n\n")
    return (f"# Run report\n\n{tables}{results['prompts']} held-out prompts x {results['images_per_prompt']} images, "
            f"ODE, {num_steps} steps, same seeds before and after.{by_task_note} {READING_CHANGE} The full report: "
            f"report.html.\n\n{folded}![before](before.png) ![after](after.png)\n\n![reward curve](reward_curve.png)\n")


def write_report(run_dir: str | Path, *, policy, ema, rewards, prompts: PromptSet, images_per_prompt: int,
                 num_steps: int, guidance: float, seed: int, diversity: str = "none", save: bool = True,
                 trained: list[str] | None = None) -> dict:
    """The end-of-run report: render before/after, score them, plot the curve; every rank renders, ``save`` writes.

    ``trained``: the reward keys training optimised (nonzero weight), the curve's and summary's main score."""
    run_dir, trained = Path(run_dir), list(trained or [])
    results, before, after = before_after(policy, ema, rewards, prompts, images_per_prompt=images_per_prompt,
                                          num_steps=num_steps, guidance=guidance, seed=seed, diversity=diversity)
    results["summary"] = summary_line(results, trained, run_dir / "report.html")
    if save:
        rows = min(len(prompts), 8)
        for name, images, when in (("before.png", before, "before training"), ("after.png", after, "after training")):
            (run_dir / name).write_bytes(labelled_grid(images[:rows * images_per_prompt], prompts.prompts[:rows],
                                                       images_per_prompt, f"{when}: one row per held-out prompt"))
        curve = plot_reward_curve(run_dir, trained)
        html_report(run_dir, results, prompts, before, after, images_per_prompt, curve, trained=trained)
        (run_dir / "report.json").write_text(json.dumps(results, indent=2) + "\n")
        (run_dir / "report.md").write_text(markdown_report(results, num_steps, trained))
    return results
