"""ToyProxy: a deliberately hackable "preference" reward for the toy world.

Why: human-preference / aesthetic reward models reward a narrow look, and
optimising them collapses everything the prompt leaves open.  ToyProxy is
that failure in miniature: it prefers saturated, centred, large objects on
one particular background, judged from pixels only (it never checks the
prompt).  Optimising it alone should drive the free attributes (background,
position, size) to a single mode, which `flowrl.toy.diversity` then measures.

Score in [0, 1], the weighted mean of four sub-scores, each in [0, 1]:
  toy_proxy/saturation  mean HSV saturation of foreground pixels
  toy_proxy/centre      1 - distance(foreground centroid, image centre) / (sqrt(2)/2)
  toy_proxy/size        foreground area fraction / TARGET_AREA, capped at 1
  toy_proxy/background  exp(-|border colour - preferred|^2 / (2 * 0.25^2))
Foreground is a soft mask of how far a pixel's colour is from the border
(background) colour.  Images holding NaN/inf score NaN.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np
import torch

from flowrl.toy.detect import check_images, estimate_background
from flowrl.toy.world import BACKGROUNDS

TARGET_AREA = 0.5  # area fraction at which the size term saturates (never reached by the world)
FG_LO, FG_HI = 0.10, 0.30  # colour distance from background: 0 -> 1 foreground ramp
BG_SIGMA = 0.25


class ToyProxy:
    """Reward protocol: ToyProxy()(images [N,3,H,W] in [0,1], prompts, metadata) -> {key: Tensor[N]}."""

    name = "toy_proxy"

    def __init__(self, preferred_background: str = "black",
                 weights: Mapping[str, float] | None = None) -> None:
        if preferred_background not in BACKGROUNDS:
            raise ValueError(f"unknown background {preferred_background!r}; expected one of {list(BACKGROUNDS)}")
        self.preferred = np.array(BACKGROUNDS[preferred_background], np.float32) / 255.0  # [3]
        self.weights = dict(weights or {"saturation": 0.25, "centre": 0.25, "size": 0.25, "background": 0.25})
        unknown = set(self.weights) - {"saturation", "centre", "size", "background"}
        if unknown:
            raise ValueError(f"unknown weight keys {sorted(unknown)}")
        total = sum(self.weights.values())
        if total <= 0:
            raise ValueError("weights must sum to a positive number")
        self.weights = {k: v / total for k, v in self.weights.items()}

    @torch.no_grad()
    def __call__(self, images: torch.Tensor, prompts: Sequence[str],
                 metadata: Sequence[Mapping[str, Any] | None]) -> dict[str, torch.Tensor]:
        x, finite = check_images(images)  # [N, H, W, 3], [N]
        n, h, w, _ = x.shape
        if len(prompts) != n or len(metadata) != n:
            raise ValueError(f"got {n} images, {len(prompts)} prompts, {len(metadata)} metadata")
        bg = estimate_background(x)  # [N, 3]
        dist = np.linalg.norm(x - bg[:, None, None, :], axis=-1)  # [N, H, W]
        fg = np.clip((dist - FG_LO) / (FG_HI - FG_LO), 0.0, 1.0)
        mass = fg.sum(axis=(1, 2))  # [N]
        has = mass > 1e-6
        safe = np.where(has, mass, 1.0)
        mx, mn = x.max(-1), x.min(-1)
        sat = (mx - mn) / np.maximum(mx, 1e-6)  # [N, H, W]
        saturation = np.where(has, (fg * sat).sum(axis=(1, 2)) / safe, 0.0)
        ys = (np.arange(h) + 0.5) / h
        xs = (np.arange(w) + 0.5) / w
        cy = (fg.sum(2) * ys).sum(1) / safe
        cx = (fg.sum(1) * xs).sum(1) / safe
        centre = np.where(has, 1.0 - np.hypot(cx - 0.5, cy - 0.5) / np.sqrt(0.5), 0.0)
        size = np.minimum(1.0, mass / (h * w) / TARGET_AREA)
        background = np.exp(-((bg - self.preferred) ** 2).sum(-1) / (2 * BG_SIGMA**2))
        subs = {"saturation": saturation, "centre": centre, "size": size, "background": background}
        total = sum(self.weights.get(k, 0.0) * v for k, v in subs.items())
        nan = np.where(finite, 0.0, np.nan)  # NaN for images that could not be scored
        out = {self.name: torch.as_tensor(total + nan, dtype=torch.float32)}
        for k, v in subs.items():
            out[f"{self.name}/{k}"] = torch.as_tensor(v + nan, dtype=torch.float32)  # [N]
        return out
