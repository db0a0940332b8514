"""Simple rewards that need no model weights: enough to train and test the whole loop on a CPU.

Brightness and ColorTarget are smooth pixel statistics (easy, fast-moving targets for smoke runs);
the JPEG pair are DDPO's compressibility tasks. Each follows the Reward protocol of
`flowrl.rewards_api`: images [N,3,H,W] float in [0,1] -> {name: float32 [N], ...}.
Images holding NaN/inf score NaN (could not score), never zero.
"""

from __future__ import annotations

import io
import math
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Mapping, Sequence

import numpy as np
import torch
from PIL import Image

LUMA = (0.299, 0.587, 0.114)  # ITU-R BT.601 weights for R, G, B


class Brightness:
    """Mean luminance 0.299R + 0.587G + 0.114B, in [0, 1].

    saturation=True adds "brightness/saturation", the mean HSV saturation (max-min)/max, so a run
    can watch whether brightness is bought by washing colours out to white.
    """

    name = "brightness"

    def __init__(self, saturation: bool = False) -> None:
        self.saturation = saturation

    @torch.no_grad()
    def __call__(self, images: torch.Tensor, prompts: Sequence[str],
                 metadata: Sequence[Mapping[str, Any] | None]) -> dict[str, torch.Tensor]:
        x = images.float()  # [N, 3, H, W]
        w = torch.tensor(LUMA, dtype=x.dtype, device=x.device)
        out = {self.name: torch.einsum("nchw,c->n", x, w) / (x.shape[2] * x.shape[3])}  # [N]
        if self.saturation:
            hi, lo = x.amax(1), x.amin(1)  # [N, H, W]
            sat = torch.where(hi > 0, (hi - lo) / hi.clamp_min(1e-6), torch.zeros_like(hi))
            sat = torch.where(torch.isnan(hi), hi, sat)  # keep NaN images NaN
            out[f"{self.name}/saturation"] = sat.mean((1, 2))
        return out


class JpegCompressibility:
    """Negative JPEG size in KB (quality 95): rewards images that compress well (DDPO).

    Encoding is per image on the CPU; PIL releases the GIL while encoding, so a small thread pool
    scales across cores.
    """

    name = "jpeg_compressibility"
    sign = -1.0

    def __init__(self, quality: int = 95, num_workers: int = 4) -> None:
        if not 1 <= quality <= 100:
            raise ValueError(f"quality must be in [1, 100], got {quality}")
        self.quality, self.num_workers = quality, max(1, num_workers)

    def _kb(self, arr: np.ndarray) -> float:
        buf = io.BytesIO()
        Image.fromarray(arr).save(buf, format="JPEG", quality=self.quality)
        return buf.tell() / 1000.0

    @torch.no_grad()
    def __call__(self, images: torch.Tensor, prompts: Sequence[str],
                 metadata: Sequence[Mapping[str, Any] | None]) -> dict[str, torch.Tensor]:
        x = images.detach().to("cpu", torch.float32)  # [N, 3, H, W]
        finite = torch.isfinite(x).flatten(1).all(1)  # [N]
        u8 = (torch.nan_to_num(x).clamp(0, 1) * 255).round().to(torch.uint8)
        arrs = list(u8.permute(0, 2, 3, 1).contiguous().numpy())  # N x [H, W, 3]
        if self.num_workers > 1 and len(arrs) > 1:
            with ThreadPoolExecutor(min(self.num_workers, len(arrs))) as pool:
                sizes = list(pool.map(self._kb, arrs))
        else:
            sizes = [self._kb(a) for a in arrs]
        kb = torch.tensor(sizes, dtype=torch.float32)  # [N]
        return {self.name: torch.where(finite, self.sign * kb, torch.full_like(kb, math.nan))}


class JpegIncompressibility(JpegCompressibility):
    """Positive JPEG size in KB: rewards detail and texture (DDPO's incompressibility task)."""

    name = "jpeg_incompressibility"
    sign = 1.0


class ColorTarget:
    """1 - mean Euclidean RGB distance of pixels to `target` / sqrt(3), in [0, 1].

    A verifiable, dense toy objective: 1 exactly when every pixel is the target colour.
    """

    name = "color_target"

    def __init__(self, target: Sequence[float] = (1.0, 0.0, 0.0)) -> None:
        target = tuple(float(v) for v in target)
        if len(target) != 3 or not all(0.0 <= v <= 1.0 for v in target):
            raise ValueError(f"target must be 3 RGB values in [0, 1], got {target}")
        self.target = target

    @torch.no_grad()
    def __call__(self, images: torch.Tensor, prompts: Sequence[str],
                 metadata: Sequence[Mapping[str, Any] | None]) -> dict[str, torch.Tensor]:
        x = images.float()  # [N, 3, H, W]
        t = torch.tensor(self.target, dtype=x.dtype, device=x.device).view(1, 3, 1, 1)
        dist = (x - t).square().sum(1).sqrt()  # [N, H, W]
        return {self.name: 1.0 - dist.mean((1, 2)) / math.sqrt(3.0)}
