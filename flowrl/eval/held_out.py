"""Held-out prompts on fixed seeds: their ODE samples, their scores, and an adapter's paired before / after.

One job: turn a policy and prompts into images and numbers that can be compared across runs and epochs.
Training's held-out points and eval grids (:mod:`flowrl.recipes.epoch_end`), the renders of ``flowrl eval``
(:mod:`flowrl.eval.runner`) and the end-of-run report (:mod:`flowrl.eval.report`, which writes what
:func:`before_after` computes) all sample here, so they all see the same images for the same seeds.
"""

from __future__ import annotations

import torch

from flowrl.data.prompts import PromptSet
from flowrl.data.tasks import by_task, paired_task_mean_gain, row_tasks
from flowrl.rewards_api import score
from flowrl.sampling import RolloutSettings, StepPlan, rollout, root_seeds
from flowrl.training.ema import ema_weights


def render(policy, prompts: PromptSet, *, images_per_prompt: int, num_steps: int, guidance: float, seed: int,
           batch_prompts: int = 8, first_prompt: int = 0, with_latents: bool = False, self_guidance=None):
    """ODE samples ``[P * n, 3, H, W]`` (video ``[P * n, T, 3, H, W]``) of ``prompts``, in chunks of prompts;
    row-seeded, so reproducible. Each prompt's metadata reaches the policy (an editing family's source image).

    Prompt ``i`` takes the seeds of global rows ``(first_prompt + i) * n ...``, so a subset of a suite
    renders the same images as the whole. ``with_latents`` also returns the clean latents ``[P * n, C, h, w]``.
    ``self_guidance`` (:class:`flowrl.sampling.self_guidance.SelfGuidance`) disperses each prompt's images."""
    settings = RolloutSettings(num_steps=num_steps, guidance_scale=guidance, noise_level=0.0,
                               plan=StepPlan(num_steps, sde_start=num_steps - 1, sde_size=1),
                               self_guidance=self_guidance)  # the ODE: one noise-free stored step at the end
    images, latents = [], []
    for start in range(0, len(prompts), batch_prompts):
        chunk = prompts.prompts[start:start + batch_prompts]
        metadata = prompts.metadata[start:start + batch_prompts]
        with policy.local_forward():
            traj = rollout(policy, chunk, settings, group_size=images_per_prompt, metadata=metadata,
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
    """:func:`evaluate`'s summary and the per-image scores ``{key: [P * n]}`` behind it. A group-wise reward scores
    each prompt's ``n`` images as one group."""
    row_prompts = [p for p in prompts.prompts for _ in range(images_per_prompt)]
    row_metadata = [m for m in prompts.metadata for _ in range(images_per_prompt)]
    groups = torch.arange(len(prompts)).repeat_interleave(images_per_prompt)  # [P * n]
    scores = score(rewards, images, row_prompts, row_metadata, groups=groups, on_error="nan")
    out = {f"eval/{k}": float(torch.nanmean(v)) for k, v in scores.items()}
    tasks = row_tasks(row_metadata)
    if tasks is not None:  # GenEval's convention: per-task means and their mean, eval/<key>/task_mean
        out.update({f"eval/{k}": v for k, v in by_task(scores, tasks).items()})
    if diversity == "toy":
        from flowrl.toy.diversity import diversity as toy_diversity

        out.update({k: float(v) for k, v in toy_diversity(images, groups).items()})
    return out, scores


def before_after(policy, ema, rewards, prompts: PromptSet, *, images_per_prompt: int, num_steps: int,
                 guidance: float, seed: int, diversity: str = "none") -> tuple[dict, torch.Tensor, torch.Tensor]:
    """The base model (``policy.reference()``) and the trained adapter (EMA weights when kept) on the same
    prompts and seeds, scored alike: ``(results, before [P * n, ...], after [P * n, ...])``.

    ``results`` holds both sides' :func:`evaluate` and, with task metadata, the prompts per task and
    :func:`paired_changes` (each score's change as the task mean and per task, with its paired standard error):
    the same prompts and seeds on both sides make the difference the adapter's effect, not sampling noise."""
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
        results["paired"] = paired_changes(scores_before, scores_after,
                                           [t for t in tasks for _ in range(images_per_prompt)])
    return results, before, after


def paired_changes(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor],
                   row_task: list[str | None]) -> dict[str, dict[str, float]]:
    """``{eval/<key>/task_mean: change, eval/<key>/task/<task>: change}`` for every score key, each change
    :func:`~flowrl.data.tasks.paired_task_mean_gain`'s ``{gain, standard_error, standard_errors}`` of the
    per-image differences ``after - before`` (``[P * n]``, one task per row).

    A task's own change is the task-mean change of its rows alone (the others' task set to None): the mean
    difference over its prompts x images and ``s / sqrt(n)``, so a task's gain reads on the same scale as
    the task mean's, and a gain that only one task carries shows where the adapter helped."""
    names = [t for t in dict.fromkeys(row_task) if t is not None]
    alone = {t: [task if task == t else None for task in row_task] for t in names}
    out = {}
    for key in before:
        out[f"eval/{key}/task_mean"] = paired_task_mean_gain(before[key], after[key], row_task)
        out.update({f"eval/{key}/task/{t}": paired_task_mean_gain(before[key], after[key], alone[t]) for t in names})
    return out
