"""Verifiable video rewards that need no model weights: enough to train and test a video family on a CPU.

Both take clips ``[N, T, 3, H, W]`` in [0, 1] (``takes_video = True``: the reward seam hands them the whole clip
instead of sampled frames, see ``flowrl.rewards_api``) and follow the Reward protocol otherwise: ->
``{name: float32 [N], ...}``, NaN for a clip that could not be scored (non-finite pixels, no direction named,
nothing to track), never zero.

- ``motion_direction``: the object (the toy world's shapes: whatever differs from the background) should move
  the way the prompt or ``metadata["direction"]`` says, "left", "right", "up" or "down". Score: the
  displacement of its centroid from the first to the last frame along that direction, in units of the frame's
  width (x) or height (y), so in [-1, 1]; positive when it moved the named way.
- ``temporal_consistency``: 1 minus the mean absolute pixel change between consecutive frames, in [0, 1]; 1 for
  a still clip. A flicker penalty to pair with a motion reward (which alone could be won by jumping around).
"""

from __future__ import annotations

import math
import re
from typing import Any, Mapping, Sequence

import torch

DIRECTIONS = {"right": (1.0, 0.0), "left": (-1.0, 0.0), "down": (0.0, 1.0), "up": (0.0, -1.0)}  # (x, y); y down
_DIRECTION_WORD = re.compile(r"\b(left|right|up|down|upwards|downwards|leftwards|rightwards)\b", re.IGNORECASE)


def _check_video(videos: torch.Tensor) -> torch.Tensor:
    if not isinstance(videos, torch.Tensor) or videos.ndim != 5 or videos.shape[2] != 3:
        shape = tuple(videos.shape) if isinstance(videos, torch.Tensor) else type(videos).__name__
        raise ValueError(f"video rewards take clips [N,T,3,H,W], got {shape}")
    return videos.detach().float()


def named_direction(prompt: str, metadata: Mapping[str, Any] | None) -> str | None:
    """``metadata["direction"]`` if given, else the first of left/right/up/down (or "-wards") in the prompt."""
    given = (metadata or {}).get("direction")
    if given is not None:
        given = str(given).lower()
        if given not in DIRECTIONS:
            raise ValueError(f"metadata direction must be one of {sorted(DIRECTIONS)}, got {given!r}")
        return given
    match = _DIRECTION_WORD.search(prompt)
    return match.group(1).lower().removesuffix("wards") if match else None


def centroids(frames: torch.Tensor) -> torch.Tensor:
    """Centroid ``[..., 2]`` (x, y in [0, 1], pixel centres) of what differs from each frame's background.

    ``frames`` ``[..., 3, H, W]``. The background is the per-channel median colour of the frame (the toy world's
    shapes cover a minority of it); a pixel weighs its L1 colour distance to it. NaN where nothing differs."""
    h, w = frames.shape[-2:]
    background = frames.flatten(-2).median(dim=-1).values[..., None, None]  # [..., 3, 1, 1]
    weight = (frames - background).abs().sum(dim=-3)  # [..., H, W]
    total = weight.sum(dim=(-2, -1))  # [...]
    xs = (torch.arange(w, dtype=frames.dtype, device=frames.device) + 0.5) / w  # [W]
    ys = (torch.arange(h, dtype=frames.dtype, device=frames.device) + 0.5) / h  # [H]
    cx = (weight * xs).sum(dim=(-2, -1)) / total
    cy = (weight * ys[:, None]).sum(dim=(-2, -1)) / total
    centre = torch.stack([cx, cy], dim=-1)
    return torch.where((total > 0)[..., None], centre, torch.full_like(centre, math.nan))


class MotionDirection:
    """Centroid displacement (first -> last frame) along the named direction; sub-scores dx, dy (x right, y down).

    ``direction`` fixes one direction for every prompt (else the metadata or the prompt names it)."""

    name = "motion_direction"
    takes_video = True

    def __init__(self, direction: str | None = None) -> None:
        if direction is not None and direction not in DIRECTIONS:
            raise ValueError(f"direction must be one of {sorted(DIRECTIONS)}, got {direction!r}")
        self.direction = direction

    @torch.no_grad()
    def __call__(self, images: torch.Tensor, prompts: Sequence[str],
                 metadata: Sequence[Mapping[str, Any] | None]) -> dict[str, torch.Tensor]:
        x = _check_video(images)  # [N, T, 3, H, W]
        finite = torch.isfinite(x).flatten(1).all(1)  # [N]
        ends = centroids(torch.nan_to_num(x[:, [0, -1]]))  # [N, 2 (first, last), 2 (x, y)]
        shift = ends[:, 1] - ends[:, 0]  # [N, 2]
        unit = torch.full_like(shift, math.nan)
        for i, (prompt, meta) in enumerate(zip(prompts, metadata)):
            name = self.direction or named_direction(prompt, meta)
            if name is not None:
                unit[i] = torch.tensor(DIRECTIONS[name], dtype=unit.dtype)
        nan = torch.full_like(shift[:, 0], math.nan)
        score = torch.where(finite, (shift * unit).sum(1), nan)
        return {self.name: score, f"{self.name}/dx": torch.where(finite, shift[:, 0], nan),
                f"{self.name}/dy": torch.where(finite, shift[:, 1], nan)}


class TemporalConsistency:
    """1 - mean |frame[t+1] - frame[t]| over pixels, channels and consecutive pairs; 1 for one-frame clips."""

    name = "temporal_consistency"
    takes_video = True

    @torch.no_grad()
    def __call__(self, images: torch.Tensor, prompts: Sequence[str],
                 metadata: Sequence[Mapping[str, Any] | None]) -> dict[str, torch.Tensor]:
        x = _check_video(images)  # [N, T, 3, H, W]
        if x.shape[1] < 2:
            return {self.name: torch.where(torch.isfinite(x).flatten(1).all(1), 1.0, math.nan)}
        change = (x[:, 1:] - x[:, :-1]).abs().flatten(1).mean(1)  # [N]; NaN/inf pixels give NaN
        return {self.name: torch.where(torch.isfinite(change), 1 - change, math.nan)}
