"""Plumbing every model-backed reward shares: device placement, dtype, and chunked batching.

Reward models run on their own device (a GPU when there is one, whatever the policy uses) and see
the images in chunks of ``batch_size`` so a large rollout batch never exceeds their memory.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch


def resolve_device(device: str | torch.device | None = "auto") -> torch.device:
    """'auto' -> cuda when available, else cpu."""
    if device in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """None/'auto' -> bfloat16 on GPU, float32 on CPU; names like 'bf16' are accepted."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in (None, "auto"):
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    aliases = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
    resolved = getattr(torch, aliases.get(dtype, dtype), None)
    if not isinstance(resolved, torch.dtype):
        raise ValueError(f"unknown dtype {dtype!r}; use float32, bfloat16 or float16")
    return resolved


def chunked(score_chunk: Callable[[torch.Tensor, Sequence[str], Sequence[dict]], dict[str, torch.Tensor]],
            images: torch.Tensor, prompts: Sequence[str], metadata: Sequence[dict], batch_size: int,
            ) -> dict[str, torch.Tensor]:
    """Call ``score_chunk`` on consecutive chunks of at most ``batch_size`` rows; concatenate on CPU."""
    parts: list[dict[str, torch.Tensor]] = []
    for start in range(0, images.shape[0], batch_size):
        stop = start + batch_size
        parts.append(score_chunk(images[start:stop], list(prompts[start:stop]), list(metadata[start:stop])))
    return {key: torch.cat([p[key].detach().float().cpu() for p in parts]) for key in parts[0]}
