"""The end-of-run report: did the adapter improve the rewards, and what did it cost in diversity?

Written into the run directory after training:
- ``report.html``: the page to open, in the layout of ``flowrl eval`` (:mod:`flowrl.eval.html`): the before /
  after table with deltas and paired standard errors, the training curve, and one labelled grid per
  held-out prompt (the prompt above, a row of base images and a row of trained images on the same seeds);
- ``reward_curve.png``: the trained reward per epoch (raw and moving average) with the held-out score on
  the same axes, and the other rewards and sub-scores (moving averages) in a second panel;
- ``before.png`` / ``after.png``: the same grids as plain images, one row per prompt;
- ``report.json`` / ``report.md``: mean rewards before and after on those images (with task metadata
  also per task and as the mean over tasks, GenEval's overall score) and, when asked, the toy world's
  ground-truth diversity of each prompt's group (exact mode collapse), and the one-line summary
  ``flowrl train`` prints at the end.

Before and after share prompts, seeds and the deterministic ODE sampler, so their difference is
the adapter's effect, not sampling noise.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from flowrl.data import PromptSet
from flowrl.eval_tasks import by_task, paired_task_mean_gain, row_tasks
from flowrl.media import stills
from flowrl.rewards_api import score
from flowrl.sampling import StepPlan, rollout, root_seeds
from flowrl.training.ema import ema_weights
from flowrl.training.metrics import read_metrics


def render(policy, prompts: PromptSet, *, images_per_prompt: int, num_steps: int, guidance: float, seed: int,
           batch_prompts: int = 8, first_prompt: int = 0, with_latents: bool = False):
    """ODE samples ``[P * n, 3, H, W]`` (video ``[P * n, T, 3, H, W]``) of ``prompts``, in chunks of prompts;
    row-seeded, so reproducible. Each prompt's metadata reaches the policy (an editing family's source image).

    Prompt ``i`` takes the seeds of global rows ``(first_prompt + i) * n ...``, so a subset of a suite
    renders the same images as the whole. ``with_latents`` also returns the clean latents ``[P * n, C, h, w]``."""
    images, latents = [], []
    for start in range(0, len(prompts), batch_prompts):
        chunk = prompts.prompts[start:start + batch_prompts]
        metadata = prompts.metadata[start:start + batch_prompts]
        with policy.local_forward():
            traj = rollout(policy, chunk, group_size=images_per_prompt, num_steps=num_steps, guidance_scale=guidance,
                           noise_level=0.0, plan=StepPlan(num_steps, sde_start=num_steps - 1, sde_size=1),
                           metadata=metadata,
                           seeds=root_seeds(seed, (first_prompt + start) * images_per_prompt,
                                            len(chunk) * images_per_prompt))
        images.append(traj.images)
        latents.append(traj.final_latents.float().cpu())
    return (torch.cat(images), torch.cat(latents)) if with_latents else torch.cat(images)


def evaluate(images: torch.Tensor, prompts: PromptSet, images_per_prompt: int, rewards, diversity: str) -> dict:
    """Mean of every reward key (NaN-aware); with task metadata, each key's per-task means and their mean
    (``eval/<key>/task/<task>``, ``eval/<key>/task_mean``); for ``diversity="toy"``, ground-truth diversity."""
    return evaluate_rows(images, prompts, images_per_prompt, rewards, diversity)[0]


def evaluate_rows(images: torch.Tensor, prompts: PromptSet, images_per_prompt: int, rewards,
                  diversity: str) -> tuple[dict, dict[str, torch.Tensor]]:
    """:func:`evaluate`'s summary and the per-image scores ``{key: [P * n]}`` behind it."""
    row_prompts = [p for p in prompts.prompts for _ in range(images_per_prompt)]
    row_metadata = [m for m in prompts.metadata for _ in range(images_per_prompt)]
    scores = score(rewards, images, row_prompts, row_metadata, on_error="nan")
    out = {f"eval/{k}": float(torch.nanmean(v)) for k, v in scores.items()}
    tasks = row_tasks(row_metadata)
    if tasks is not None:  # GenEval's convention: per-task means and their mean, eval/<key>/task_mean
        out.update({f"eval/{k}": v for k, v in by_task(scores, tasks).items()})
    if diversity == "toy":
        from flowrl.toy.diversity import diversity as toy_diversity

        groups = torch.arange(len(prompts)).repeat_interleave(images_per_prompt)
        out.update({k: float(v) for k, v in toy_diversity(images, groups).items()})
    return out, scores


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


def plot_reward_curve(run_dir: Path, trained: list[str] | None = None) -> Path | None:
    """``reward_curve.png``: trained reward (raw, moving average) and held-out score; other series below."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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
    window = max(1, min(10, len(points) // 5))
    figure, (top, bottom) = plt.subplots(2, 1, figsize=(7.5, 6), sharex=True,
                                         gridspec_kw={"height_ratios": [3, 2]})
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
    for key in others:
        line = series(key)
        if line:
            bottom.plot([p[0] for p in line], moving_average([p[1] for p in line], window), linewidth=1.2,
                        label=key.removeprefix("reward/").removesuffix("_mean"))
    bottom.set_xlabel("epoch (held-out points: after that many epochs)")
    bottom.set_ylabel("moving average")
    bottom.set_title("other rewards and sub-scores", fontsize=10)
    bottom.grid(alpha=0.3)
    if others:
        bottom.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5), frameon=False)
    figure.tight_layout()
    out = run_dir / "reward_curve.png"
    figure.savefig(out, dpi=110, bbox_inches="tight")
    plt.close(figure)
    return out


def summary_line(results: dict, trained: list[str], report: Path) -> str:
    """``toyeval (held-out task mean) 0.354 -> 0.376 (+0.022, 2.1 paired s.e.); ...; report: PATH``."""
    before, after, paired = results["before"], results["after"], results.get("paired", {})
    parts = []
    for name in trained[:1] or [k.removeprefix("eval/") for k in before if k.count("/") == 1][:1]:
        key = next((k for k in (f"eval/{name}/task_mean", f"eval/{name}") if k in before), None)
        if key is None:
            continue
        errors = paired.get(key, {}).get("standard_errors", math.nan)
        detail = "" if math.isnan(errors) else f", {errors:.1f} paired s.e."
        what = "held-out task mean" if key.endswith("task_mean") else "held-out"
        parts.append(f"{name} ({what}) {before[key]:.3f} -> {after[key]:.3f} ({after[key] - before[key]:+.3f}{detail})")
    if "diversity/gt_mean" in before:
        parts.append(f"diversity {before['diversity/gt_mean']:.3f} -> {after['diversity/gt_mean']:.3f}")
    return "; ".join(parts + [f"report: {report}"])


def is_headline(key: str) -> bool:
    """A reward's main score (``eval/<name>``), its mean over tasks, or the toy world's diversity."""
    parts = key.split("/")
    if parts[0] == "diversity":
        return parts[1] in ("gt_mean", "background", "position", "size")
    return parts[0] == "eval" and (len(parts) == 2 or len(parts) == 3 and parts[2] == "task_mean")


def html_report(run_dir: Path, results: dict, prompts: PromptSet, before: torch.Tensor, after: torch.Tensor,
                images_per_prompt: int, curve: Path | None, grid_prompts: int = 12) -> Path:
    """``report.html`` in the layout of ``flowrl eval``: table, curve, labelled grids per prompt."""
    from flowrl.eval import html

    n, columns = images_per_prompt, {"base": results["before"], "trained": results["after"]}
    keys = list(results["before"])
    headline = [k for k in keys if is_headline(k)]
    paired = "".join(f"<li><code>{html.escape(k)}</code>: {v['gain']:+.4f} ({v['standard_errors']:.1f} paired "
                     "standard errors)</li>" for k, v in results.get("paired", {}).items() if k in headline)
    sections = [("Before and after", html.metric_table(columns, headline, base="base")
                 + (f"<p class='note'>Change of each task-mean score with its paired standard error:</p><ul>{paired}"
                    "</ul>" if paired else ""))]
    if curve is not None:
        sections.append(("Training curve", html.img(curve.read_bytes(), "reward curve")))
    tasks = [m.get("task") for m in prompts.metadata]
    shown = html.grid_order(tasks, grid_prompts)
    k = min(n, GRID_IMAGES)  # a row of 24 images would shrink each to a few pixels
    grids = html.prompt_grids(prompts.prompts, tasks, shown,
                              lambda i: [("base", before[i * n:i * n + k]), ("trained", after[i * n:i * n + k])])
    sections.append((f"Samples ({len(shown)} of {len(prompts)} held-out prompts, {k} of {n} images each, same seeds "
                     "in both rows)", grids))
    sections.append(("All metrics", f"<details><summary>{len(keys)} metrics</summary>"
                                    f"{html.metric_table(columns, keys, base='base')}</details>"))
    intro = (f"{len(prompts)} held-out prompts × {n} images, ODE, the same seeds before (base model) and after "
             "(trained adapter, EMA weights when kept). Δ: change from base.")
    path = run_dir / "report.html"
    path.write_text(html.page(f"flowrl run report: {run_dir.name}", sections, intro=intro), encoding="utf-8")
    return path


def write_report(run_dir: str | Path, *, policy, ema, rewards, prompts: PromptSet, images_per_prompt: int,
                 num_steps: int, guidance: float, seed: int, diversity: str = "none", save: bool = True,
                 trained: list[str] | None = None) -> dict:
    """Render before/after, score them, plot the curve; every rank renders, ``save`` writes.

    ``trained``: the reward keys training optimised (nonzero weight), the curve's and summary's main score."""
    from torchvision.utils import save_image

    run_dir, trained = Path(run_dir), list(trained or [])
    kwargs = dict(images_per_prompt=images_per_prompt, num_steps=num_steps, guidance=guidance, seed=seed)
    with policy.reference():
        before = render(policy, prompts, **kwargs)
    with ema_weights(ema):
        after = render(policy, prompts, **kwargs)
    (summary_before, scores_before), (summary_after, scores_after) = (
        evaluate_rows(images, prompts, images_per_prompt, rewards, diversity) for images in (before, after))
    results = {"before": summary_before, "after": summary_after,
               "prompts": len(prompts), "images_per_prompt": images_per_prompt}
    tasks = row_tasks(prompts.metadata)
    if tasks is not None:
        results["prompts_per_task"] = {t: tasks.count(t) for t in dict.fromkeys(tasks) if t is not None}
        # Same prompts and seeds before and after: the change of each task-mean score, with its paired s.e.
        row_task = [t for t in tasks for _ in range(images_per_prompt)]
        results["paired"] = {f"eval/{k}/task_mean": paired_task_mean_gain(scores_before[k], scores_after[k], row_task)
                             for k in scores_before}
    results["summary"] = summary_line(results, trained, run_dir / "report.html")
    if save:
        grid_rows = min(len(prompts), 8) * images_per_prompt
        save_image(stills(before[:grid_rows]), run_dir / "before.png", nrow=images_per_prompt, padding=2)
        save_image(stills(after[:grid_rows]), run_dir / "after.png", nrow=images_per_prompt, padding=2)
        curve = plot_reward_curve(run_dir, trained)
        html_report(run_dir, results, prompts, before, after, images_per_prompt, curve)
        (run_dir / "report.json").write_text(json.dumps(results, indent=2) + "\n")
        lines = ["| metric | before | after |", "| --- | --- | --- |"]
        for key in results["before"]:
            lines.append(f"| {key} | {results['before'][key]:.4f} | {results['after'][key]:.4f} |")
        by_task_note = "" if "prompts_per_task" not in results else (
            " Prompts per task: " + ", ".join(f"{t} {c}" for t, c in results["prompts_per_task"].items())
            + "; `<key>/task_mean` is the mean over tasks of the per-task means (GenEval's overall score).")
        paired = [f"- {key}: {v['gain']:+.4f} ({v['standard_errors']:.1f} paired standard errors)"
                  for key, v in results.get("paired", {}).items()]
        paired_note = "" if not paired else "\n\nChange of each task-mean score, after minus before:\n" + "\n".join(paired)
        (run_dir / "report.md").write_text(
            f"# Run report\n\n{len(prompts)} held-out prompts x {images_per_prompt} images, ODE, "
            f"{num_steps} steps, same seeds before and after.{by_task_note} The full report: report.html.\n\n"
            + "\n".join(lines) + paired_note + "\n\n"
            "![before](before.png) ![after](after.png)\n\n![reward curve](reward_curve.png)\n")
    return results
