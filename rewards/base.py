"""Plumbing every model-backed reward shares: chunked batching and NaN for images that cannot be scored.

Reward models run on their own device (a GPU when there is one, whatever the policy uses,
:mod:`flowrl.core.devices`) and see the images in chunks of ``batch_size`` so a large rollout batch never
exceeds their memory.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from flowrl.rewards_api import IMAGE_TOLERANCE, check_batch


def chunked(score_chunk: Callable[[torch.Tensor, Sequence[str], Sequence[dict]], dict[str, torch.Tensor]],
            images: torch.Tensor, prompts: Sequence[str], metadata: Sequence[dict], batch_size: int,
            ) -> dict[str, torch.Tensor]:
    """Call ``score_chunk`` on consecutive chunks of at most ``batch_size`` rows; concatenate on CPU."""
    parts: list[dict[str, torch.Tensor]] = []
    for start in range(0, images.shape[0], batch_size):
        stop = start + batch_size
        parts.append(score_chunk(images[start:stop], list(prompts[start:stop]), list(metadata[start:stop])))
    return {key: torch.cat([p[key].detach().float().cpu() for p in parts]) for key in parts[0]}


def score_finite(images: torch.Tensor, fn: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """fn(images) -> [N]; rows holding NaN/inf are fed as zeros and scored NaN (could not score).

    One pass over the pixels gives each row's min and max: NaN/inf rows show up as non-finite
    extremes, and the finite rows must lie in [0,1] (same slack as check_images) or ValueError.
    """
    lo, hi = images.flatten(1).aminmax(dim=1)  # [N], [N]; NaN propagates, inf shows as +-inf
    finite = torch.isfinite(lo) & torch.isfinite(hi)
    if bool(finite.any()):
        low, high = torch.stack([lo[finite].min(), hi[finite].max()]).tolist()
        if low < -IMAGE_TOLERANCE or high > 1 + IMAGE_TOLERANCE:
            raise ValueError(f"image values must lie in [0,1], got [{low:.4g}, {high:.4g}]")
    if not bool(finite.all()):
        images = torch.nan_to_num(images, nan=0.0, posinf=1.0, neginf=0.0)
    out = fn(images)
    return torch.where(finite.to(out.device), out, torch.full_like(out, float("nan")))


def score_per_image(name: str, fn: Callable[[torch.Tensor], torch.Tensor], images: torch.Tensor,
                    prompts: Sequence[str], metadata: Sequence[dict | None],
                    batch_size: int) -> dict[str, torch.Tensor]:
    """``{name: fn(images) [N]}`` for a reward that scores each image alone (it reads no prompt): the batch
    checked, scored in chunks of ``batch_size``, NaN for rows holding NaN/inf."""
    check_batch(images, prompts, metadata)
    return chunked(lambda x, p, m: {name: score_finite(x, fn)}, images, prompts, metadata, batch_size)
