"""The end-of-run report: did the adapter improve the rewards, and what did it cost in diversity?

Written into the run directory after training:
- ``reward_curve.png``: every ``reward/*_mean`` of ``metrics.jsonl`` against epoch;
- ``before.png`` / ``after.png``: the same held-out prompts and seeds rendered with the adapter off
  (the base model) and on (EMA weights when kept), one grid row per prompt;
- ``report.json`` / ``report.md``: mean rewards before and after on those images (with task metadata
  also per task and as the mean over tasks, GenEval's overall score) and, when asked, the toy world's
  ground-truth diversity of each prompt's group (exact mode collapse).

Before and after share prompts, seeds and the deterministic ODE sampler, so their difference is
the adapter's effect, not sampling noise.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from flowrl.data import PromptSet
from flowrl.eval_tasks import by_task, paired_task_mean_gain, row_tasks
from flowrl.rewards_api import score
from flowrl.sampling import StepPlan, rollout, root_seeds
from flowrl.training.ema import ema_weights
from flowrl.training.metrics import read_metrics


def render(policy, prompts: PromptSet, *, images_per_prompt: int, num_steps: int, guidance: float, seed: int,
           batch_prompts: int = 8, first_prompt: int = 0, with_latents: bool = False):
    """ODE samples ``[P * n, 3, H, W]`` of ``prompts``, in chunks of prompts; row-seeded, so reproducible.

    Prompt ``i`` takes the seeds of global rows ``(first_prompt + i) * n ...``, so a subset of a suite
    renders the same images as the whole. ``with_latents`` also returns the clean latents ``[P * n, C, h, w]``."""
    images, latents = [], []
    for start in range(0, len(prompts), batch_prompts):
        chunk = prompts.prompts[start:start + batch_prompts]
        with policy.local_forward():
            traj = rollout(policy, chunk, group_size=images_per_prompt, num_steps=num_steps, guidance_scale=guidance,
                           noise_level=0.0, plan=StepPlan(num_steps, sde_start=num_steps - 1, sde_size=1),
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


def plot_reward_curve(run_dir: Path) -> Path | None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not (run_dir / "metrics.jsonl").is_file():  # a report of an adapter outside a run has no curve
        return None
    records = read_metrics(run_dir)
    keys = sorted({k for r in records for k in r if k.startswith("reward/") and k.endswith("_mean")})
    if not records or not keys:
        return None
    figure, axis = plt.subplots(figsize=(6, 3.5))
    for key in keys:
        points = [(r["epoch"], r[key]) for r in records if r.get(key) is not None]
        axis.plot([p[0] for p in points], [p[1] for p in points], label=key.removeprefix("reward/"))
    axis.set_xlabel("epoch")
    axis.set_ylabel("mean reward")
    axis.legend(fontsize=7)
    figure.tight_layout()
    out = run_dir / "reward_curve.png"
    figure.savefig(out, dpi=120)
    plt.close(figure)
    return out


def write_report(run_dir: str | Path, *, policy, ema, rewards, prompts: PromptSet, images_per_prompt: int,
                 num_steps: int, guidance: float, seed: int, diversity: str = "none", save: bool = True) -> dict:
    """Render before/after, score them, plot the curve; every rank renders, ``save`` writes."""
    from torchvision.utils import save_image

    run_dir = Path(run_dir)
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
    if save:
        grid_rows = min(len(prompts), 8) * images_per_prompt
        save_image(before[:grid_rows], run_dir / "before.png", nrow=images_per_prompt, padding=2)
        save_image(after[:grid_rows], run_dir / "after.png", nrow=images_per_prompt, padding=2)
        plot_reward_curve(run_dir)
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
            f"{num_steps} steps, same seeds before and after.{by_task_note}\n\n" + "\n".join(lines) + paired_note
            + "\n\n"
            "![before](before.png) ![after](after.png)\n\n![reward curve](reward_curve.png)\n")
    return results
