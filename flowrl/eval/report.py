"""``report.html`` of ``flowrl eval``: metric tables with deltas against the base, a reward-diversity
trade-off plot, and side-by-side grids per prompt (prompt text above, one labelled row per checkpoint)."""

from __future__ import annotations

from pathlib import Path

import torch

from flowrl.eval import html

HEADLINE = ("diversity/cosine", "diversity/vendi", "diversity/latent_gmd", "diversity/zero_std_prompts", "toy/gt_mean",
            "toy/background", "toy/position", "toy/size", "fid/fid", "fid/kid")
LOWER_IS_BETTER = ("fid/fid", "fid/kid", "fid/kid_std", "diversity/zero_std_prompts")
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


def directions(keys) -> dict[str, bool | None]:
    return {k: (k not in LOWER_IS_BETTER) if not k.startswith("fid/n_") else None for k in keys}


def main_reward(results: dict) -> str | None:
    """The metric of the trade-off plot's y axis: the first trained reward's mean, else the first reward."""
    keys = next(iter(results["metrics"].values()), {})
    for name in results.get("trained_rewards", []):
        if f"reward/{name}" in keys:
            return f"reward/{name}"
    return next((k for k in keys if k.startswith(("reward/", "held_out/")) and "/task" not in k), None)


def tradeoff_plot(metrics: dict[str, dict[str, float]], x_key: str, y_key: str) -> bytes:
    """One labelled point per checkpoint: ``y_key`` against ``x_key``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from matplotlib.ticker import MaxNLocator

    figure, axis = plt.subplots(figsize=(5.5, 3.8))
    for k, (label, values) in enumerate(metrics.items()):
        x, y = values.get(x_key), values.get(y_key)
        if x is None or y is None:
            continue
        axis.scatter([x], [y], s=40)
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
    figure.tight_layout()
    data = html.figure_png(figure)
    plt.close(figure)
    return data


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
        tables.append((key, html.metric_table(rows, [*names, "mean over tasks"], base=base, caption=key)))
    return tables


def write_eval_report(out_dir: Path, results: dict, suite, images: dict[str, torch.Tensor], n: int, *,
                      grid_prompts: int) -> Path:
    metrics, base = results["metrics"], results["base"]
    keys = list(dict.fromkeys(k for values in metrics.values() for k in values))
    flat = [k for k in keys if "/task" not in k]
    table = lambda chosen: html.metric_table(metrics, chosen, base=base, directions=directions(chosen))
    headline = [k for k in flat if is_main_score(k) or k in HEADLINE or k.startswith("axis/")]
    sections = [("Summary", table(headline))]
    y_key = main_reward(results)
    if y_key is not None and "diversity/cosine" in flat:
        sections.append(("Trade-off", html.img(tradeoff_plot(metrics, "diversity/cosine", y_key), "trade-off plot")))
    shown = html.grid_order(results["tasks"], grid_prompts)
    grids = html.prompt_grids(suite.prompts, results["tasks"], shown,
                              lambda i: [(label, pictures[i * n:(i + 1) * n]) for label, pictures in images.items()])
    sections.append((f"Samples ({len(shown)} of {len(suite)} prompts, same seeds in every row)", grids))
    by_task = task_tables(metrics, base, results["tasks"])
    if by_task:
        sections.append(("By task (the mean over tasks is GenEval's overall score)",
                         "".join(content for _, content in by_task)))
    sections.append(("All metrics", f"<details><summary>{len(flat)} metrics</summary>{table(flat)}</details>"))
    reading = "".join(f"<li><code>{html.escape(prefix)}</code>: {html.escape(text)}</li>"
                      for prefix, text in READING.items() if any(k.startswith(prefix) for k in keys))
    notes = []
    if results.get("not_measured"):
        notes.append(f"Not measured (no model configured): {', '.join(results['not_measured'])} "
                     "(set eval.style_model / eval.identity_features).")
    if results.get("unreliable"):
        notes.append(f"Unreliable: {', '.join(results['unreliable'])} (fewer images than feature dimensions).")
    sections.append(("Reading the metrics", f"<ul>{reading}</ul>" + "".join(f"<p class='note'>{html.escape(t)}</p>"
                                                                          for t in notes)))
    intro = (f"Suite {html.escape(results['suite'])}: {len(suite)} prompts × {n} images, ODE, "
             f"{results['num_steps']} steps, guidance {results['guidance_scale']}, seed {results['seed']}; "
             f"model {html.escape(results['model']['path'])}. Δ columns: change from {html.escape(base)}; green "
             "for higher reward or diversity and lower FID/KID, red for the opposite.")
    page = html.page("flowrl eval", sections, intro=intro)
    path = Path(out_dir) / "report.html"
    path.write_text(page, encoding="utf-8")
    return path
