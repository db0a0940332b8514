"""GenEval-style scoring by task: per-task means, the overall score as the mean over tasks, task-stratified
prompt subsets, and the unbiased pass@k estimator.

GenEval reports each task (single object, counting, two objects, position, ...) and an overall score that
is the mean of the task scores, so a task with many prompts does not dominate it. Prompts name their task
in ``metadata["task"]``; without that key every function here reduces to the plain, untasked version.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from flowrl.data.prompts import PromptSet, round_robin


def by_task(scores: dict[str, torch.Tensor], tasks: Sequence[str | None]) -> dict[str, float]:
    """``{k/task/<task>: mean over that task's rows, k/task_mean: mean of those}`` for every score key ``k``.

    NaN-aware: NaN rows are skipped in a task's mean, an all-NaN task in the mean over tasks. Rows whose
    task is None are left out. Tasks keep their order of first appearance."""
    names = list(dict.fromkeys(t for t in tasks if t is not None))
    masks = {t: torch.tensor([task == t for task in tasks]) for t in names}
    out: dict[str, float] = {}
    for key, values in scores.items():
        values = values.detach().float().cpu()
        if values.shape[0] != len(tasks):
            raise ValueError(f"{key}: {values.shape[0]} scores but {len(tasks)} tasks")
        per_task = {t: float(torch.nanmean(values[mask])) for t, mask in masks.items()}
        out.update({f"{key}/task/{t}": v for t, v in per_task.items()})
        finite = [v for v in per_task.values() if not math.isnan(v)]
        out[f"{key}/task_mean"] = sum(finite) / len(finite) if finite else math.nan
    return out


def paired_task_mean_gain(before: torch.Tensor, after: torch.Tensor, tasks: Sequence[str | None]) -> dict[str, float]:
    """Change of the task-mean score between two scorings of the same images' prompts and seeds, with its
    standard error from the paired per-image differences: ``{gain, standard_error, standard_errors}``.

    With T tasks, n_t finite pairs and difference variance s_t^2 in task t, the gain is the mean over tasks
    of the per-task mean differences and its s.e. is ``sqrt(sum_t s_t^2 / n_t) / T``. Pairing removes the
    prompt-and-seed variance that two independent samples would carry (common random numbers)."""
    difference = (after.detach().float().cpu() - before.detach().float().cpu())  # [N]
    gains, variances = [], []
    for task in dict.fromkeys(t for t in tasks if t is not None):
        rows = difference[torch.tensor([t == task for t in tasks])]
        rows = rows[torch.isfinite(rows)]
        if len(rows):
            gains.append(float(rows.mean()))
            variances.append(float(rows.var(unbiased=True)) / len(rows) if len(rows) > 1 else 0.0)
    if not gains:
        return {"gain": math.nan, "standard_error": math.nan, "standard_errors": math.nan}
    gain, error = sum(gains) / len(gains), math.sqrt(sum(variances)) / len(gains)
    return {"gain": gain, "standard_error": error, "standard_errors": gain / error if error > 0 else math.nan}


def task_of(metadata: dict | None, key: str = "task") -> str | None:
    """A row's task: ``metadata[key]``; for ``task``, GenEval's records (tag, include) name it ``tag``."""
    metadata = metadata or {}
    if key == "task" and key not in metadata and "include" in metadata and isinstance(metadata.get("tag"), str):
        return metadata["tag"]
    return metadata.get(key)


def row_tasks(metadata: Sequence[dict | None], key: str = "task") -> list[str | None] | None:
    """The task of each row, or None when no row has one (then nothing is split by task)."""
    tasks = [task_of(m, key) for m in metadata]
    return tasks if any(t is not None for t in tasks) else None


def stratified_prefix(prompts: PromptSet, n: int, key: str = "task") -> PromptSet:
    """Up to ``n`` prompts taken round-robin over each row's task (:func:`task_of`: tasks in order of first
    appearance, each task's prompts in file order), so every task gets an equal share until it runs out.
    Without the key this is the plain prefix ``prompts[:n]``."""
    index = round_robin([task_of(meta, key) for meta in prompts.metadata])
    return prompts.subset(index[:max(n, 0)])


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one prompt with ``c`` right among ``n`` samples: the chance that a random
    ``k``-subset holds a right one, ``1 - C(n-c, k) / C(n, k)`` (Chen et al. 2021)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"need 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)
