"""The one container that moves between stages: the rollout fills it, the rewards are attached, and the loss
reads it; advantages are the recipe's own tensors, computed from it and never written back.

Rows are trajectories. Groups are explicit ids (never implicit reshapes), and the same key names
are used from sampler to loss. Only the stochastic (SDE) steps are stored: ``K`` below is the
number of stored steps, ``latents[:, k]`` is the input of stored step ``k`` and
``latents[:, k + 1]`` its output.

Every row records which steps it stored (``row_step_indices``) and their noise levels (``row_sigmas``):
Flow-GRPO-Fast draws its SDE window per rollout batch, so the rows of one epoch may hold different
windows and stored column ``k`` is a different step, at a different sigma, from batch to batch. Where
every row shares one window (every single rollout call, full-SDE, fixed and sliding windows),
``sigmas``, ``timesteps`` and ``step_indices`` give the shared [K+1] / [K] vectors; on mixed rows they
raise instead of answering for row 0.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

import torch


@dataclass
class Trajectory:
    latents: torch.Tensor  # [N, K+1, C, H, W] states around the stored steps (video: [N, K+1, C, F, H, W])
    log_probs: torch.Tensor  # [N, K] float32 log-density of each stored transition
    row_sigmas: torch.Tensor  # [N, K+1] float32 noise levels of each row's stored states
    row_timesteps: torch.Tensor  # [N, K] float32 model timesteps (sigma * 1000) of each row's stored steps
    row_step_indices: torch.Tensor  # [N, K] long, position of each row's stored steps in the full schedule
    final_latents: torch.Tensor  # [N, C, H, W] the clean latent x0 at the end of the rollout ([N, C, F, H, W])
    prompt_ids: torch.Tensor  # [N] long, index into ``prompts``
    group_ids: torch.Tensor  # [N] long, rows with equal id are compared against each other
    seeds: torch.Tensor  # [N] int64, per-row seed that determined its noise
    edge_ids: torch.Tensor  # [N, K] long, equal ids mark the same tree edge shared across rows
    parent: torch.Tensor  # [N] long, row this row branched from at its last branch point, or -1
    prompts: list[str]  # [P] the distinct prompts of the batch
    metadata: list[dict] = field(default_factory=list)  # [P] per-prompt metadata
    images: torch.Tensor | None = None  # [N, 3, H, W] in [0, 1], decoded final_latents (video: [N, T, 3, H, W])
    cond: Any = None  # text conditioning of ``prompts`` (policy-specific), reused by the loss
    rewards: dict[str, torch.Tensor] = field(default_factory=dict)  # {name: [N]}
    x0_preds: torch.Tensor | None = None  # [N, K+1, C, H, W] float32 x_k - sigma_k v_k at each stored state
    # (the last: x_K itself when clean, else from the next ODE step's velocity); filled only by
    # ``RolloutSettings(..., store_x0_preds=True)`` for dense_cosine credit, None otherwise to save memory.
    means: torch.Tensor | None = None  # [N, K, C, H, W] float32 mean of each stored transition under the sampling
    # policy; filled only by ``RolloutSettings(..., store_means=True)`` for GRPO-Guard's ratio, None otherwise.
    rollouts_sampled: int = 0  # rollouts of every process behind this set, dropped Pilot-Commit pilots included
    sampling_metrics: dict[str, float] = field(default_factory=dict)  # perf/* of the allocation (Pilot-Commit)

    @property
    def sigmas(self) -> torch.Tensor:
        """[K+1] noise levels of the stored states, when every row stored the same steps."""
        return _shared(self.row_sigmas, "sigmas")

    @property
    def timesteps(self) -> torch.Tensor:
        """[K] model timesteps of the stored steps, when every row stored the same steps."""
        return _shared(self.row_timesteps, "timesteps")

    @property
    def step_indices(self) -> torch.Tensor:
        """[K] schedule positions of the stored steps, when every row stored the same steps."""
        return _shared(self.row_step_indices, "step_indices")

    @property
    def shares_window(self) -> bool:
        """True when every row stored the same steps of the schedule."""
        return bool((self.row_step_indices == self.row_step_indices[:1]).all())

    @property
    def num_rows(self) -> int:
        return self.latents.shape[0]

    @property
    def num_stored_steps(self) -> int:
        return self.log_probs.shape[1]

    @property
    def row_prompts(self) -> list[str]:
        return [self.prompts[i] for i in self.prompt_ids.tolist()]

    @property
    def row_metadata(self) -> list[dict]:
        if not self.metadata:
            return [{} for _ in range(self.num_rows)]
        return [self.metadata[i] for i in self.prompt_ids.tolist()]

    def first_visit_mask(self) -> torch.Tensor:
        """[N, K] bool: True on the first row that carries each tree edge, so each edge trains once."""
        mask = torch.zeros_like(self.edge_ids, dtype=torch.bool)
        for k in range(self.edge_ids.shape[1]):
            column = self.edge_ids[:, k]
            _, inverse = torch.unique(column, return_inverse=True)
            first = torch.full((int(inverse.max()) + 1,), column.numel(), dtype=torch.long)
            first = first.scatter_reduce(0, inverse, torch.arange(column.numel()), reduce="amin")
            mask[first, k] = True
        return mask

    def to(self, device) -> "Trajectory":
        """Move every tensor field (not ``cond``) to ``device``."""
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, torch.Tensor):
                setattr(self, f.name, value.to(device))
        return self


def concat_trajectories(parts: list[Trajectory]) -> Trajectory:
    """Join rollout batches into one trajectory set; prompt, edge and parent ids are re-offset.

    Group ids are kept as they are: the caller assigns them globally unique per prompt.
    """
    from flowrl.models.base import TextCond

    if len(parts) == 1:
        return parts[0]
    prompt_offset = edge_offset = row_offset = 0
    prompt_ids, edge_ids, parents = [], [], []
    for part in parts:
        prompt_ids.append(part.prompt_ids + prompt_offset)
        edge_ids.append(part.edge_ids + edge_offset)
        parents.append(torch.where(part.parent >= 0, part.parent + row_offset, part.parent))
        prompt_offset += len(part.prompts)
        edge_offset += int(part.edge_ids.max()) + 1
        row_offset += part.num_rows
    first = parts[0]
    images = None if first.images is None else torch.cat([p.images for p in parts])
    x0_preds = None if first.x0_preds is None else torch.cat([p.x0_preds for p in parts])
    means = None if first.means is None else torch.cat([p.means for p in parts])
    return Trajectory(
        latents=torch.cat([p.latents for p in parts]),
        log_probs=torch.cat([p.log_probs for p in parts]),
        row_sigmas=torch.cat([p.row_sigmas for p in parts]),
        row_timesteps=torch.cat([p.row_timesteps for p in parts]),
        row_step_indices=torch.cat([p.row_step_indices for p in parts]),
        final_latents=torch.cat([p.final_latents for p in parts]),
        prompt_ids=torch.cat(prompt_ids),
        group_ids=torch.cat([p.group_ids for p in parts]),
        seeds=torch.cat([p.seeds for p in parts]),
        edge_ids=torch.cat(edge_ids),
        parent=torch.cat(parents),
        prompts=[prompt for p in parts for prompt in p.prompts],
        metadata=[m for p in parts for m in (p.metadata or [{} for _ in p.prompts])],
        images=images,
        cond=TextCond.cat([p.cond for p in parts]) if first.cond is not None else None,
        rewards=_concat_rewards(parts),
        x0_preds=x0_preds,
        means=means,
    )


def _concat_rewards(parts: list[Trajectory]) -> dict[str, torch.Tensor]:
    """Join per-batch reward dicts; a key missing from a batch (its reward failed) becomes NaN there."""
    keys = list(dict.fromkeys(k for p in parts for k in p.rewards))
    nan = lambda p: torch.full((p.num_rows,), float("nan"))  # noqa: E731
    return {k: torch.cat([p.rewards[k].float() if k in p.rewards else nan(p) for p in parts]) for k in keys}


def _shared(per_row: torch.Tensor, name: str) -> torch.Tensor:
    """Row 0 of ``per_row`` [N, ...] when every row equals it; else a ValueError naming the per-row field."""
    if not (per_row == per_row[:1]).all():
        raise ValueError(f"the rows of this trajectory stored different steps (an SDE window drawn per rollout "
                         f"batch): read row_{name} [N, ...] instead of the shared {name}")
    return per_row[0]
