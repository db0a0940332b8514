"""Where a frozen model runs (a reward's scorer, a feature network): its device and its dtype, "auto" by default.

A low module: the reward plugins, the CLIP loader of :mod:`flowrl.models.clip` and the commands all place
models with it, so none of them imports another to do so.
"""

from __future__ import annotations

import torch


def resolve_device(device: str | torch.device | None = "auto") -> torch.device:
    """'auto' -> cuda when available, else cpu. A CUDA device asked for where none is visible is a one-line
    ValueError, not torch's traceback at the first tensor moved there."""
    if device in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    resolved = torch.device(device)
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {str(device)!r}: no CUDA GPU is visible here; use cpu, or auto to take a GPU "
                         "where there is one")
    return resolved


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
