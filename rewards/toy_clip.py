"""ToyClip: a CLIP-like reward for the toy world, with a bias built in, on an embedding D²-Align can correct.

Why: CLIP-family rewards score ``cos(image embedding, text embedding)``, and every prompt's text
embedding shares components that no prompt asked for (a house style), so the reward prefers the same
look for every prompt and optimising it collapses that look. ToyClip is that in miniature, readable
by construction:

- image embedding (unit norm): the presence of each world colour and shape among the detected
  objects, and the background's one-hot, ``[colours (5) | shapes (4) | backgrounds (6)]``;
- text embedding (unit norm): the prompt's requested colours and shapes, plus ``bias`` on the
  ``preferred_background`` slot, the same for every prompt (no toy prompt names a background);
- score ``cos`` in [0, 1]; ``toy_clip/background`` is the image's preferred-background indicator.

Images holding NaN/inf, or prompts without toy metadata, score NaN. It implements
``embed_images`` / ``embed_texts`` / ``score_embeddings`` (:mod:`rewards.directional`).
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np
import torch

from flowrl.toy.detect import background_index, check_images, detect_arrays, estimate_background
from flowrl.toy.world import BACKGROUNDS, COLORS, SHAPES

SLOTS = (*COLORS, *SHAPES, *(f"bg:{b}" for b in BACKGROUNDS))


class ToyClip:
    """Reward protocol: ToyClip()(images [N,3,H,W] in [0,1], prompts, metadata) -> {key: Tensor[N]}."""

    name = "toy_clip"

    def __init__(self, preferred_background: str = "black", bias: float = 1.0) -> None:
        if preferred_background not in BACKGROUNDS:
            raise ValueError(f"unknown background {preferred_background!r}; expected one of {list(BACKGROUNDS)}")
        if bias < 0:
            raise ValueError(f"bias must be >= 0, got {bias}")
        self.preferred, self.bias = SLOTS.index(f"bg:{preferred_background}"), float(bias)

    @torch.no_grad()
    def embed_images(self, images: torch.Tensor) -> torch.Tensor:
        """[N, 3, H, W] -> [N, 15] unit rows (NaN rows for images that cannot be scored)."""
        x, finite = check_images(images)  # [N, H, W, 3], [N]
        dets, _ = detect_arrays(x)
        backgrounds = background_index(estimate_background(x))  # [N]
        out = np.zeros((len(x), len(SLOTS)), np.float64)
        for i, found in enumerate(dets):
            for d in found:
                out[i, SLOTS.index(d.color)] = 1.0
                if d.shape in SHAPES:
                    out[i, SLOTS.index(d.shape)] = 1.0
            out[i, len(COLORS) + len(SHAPES) + int(backgrounds[i])] = 1.0
        out /= np.linalg.norm(out, axis=1, keepdims=True)
        out[~finite] = np.nan
        return torch.as_tensor(out, dtype=torch.float32)

    def embed_texts(self, prompts: Sequence[str], metadata: Sequence[Mapping[str, Any] | None]) -> torch.Tensor:
        """[N, 15] unit rows from each prompt's metadata ``objects``; NaN rows where it has none."""
        out = np.zeros((len(prompts), len(SLOTS)), np.float64)
        for i, meta in enumerate(metadata):
            objects = (meta or {}).get("objects")
            if not objects:
                out[i] = np.nan
                continue
            for obj in objects:
                out[i, SLOTS.index(obj["color"])] = 1.0
                out[i, SLOTS.index(obj["shape"])] = 1.0
            out[i, self.preferred] = self.bias
        out /= np.linalg.norm(out, axis=1, keepdims=True)
        return torch.as_tensor(out, dtype=torch.float32)

    def score_embeddings(self, image_embeddings: torch.Tensor, text_embeddings: torch.Tensor) -> torch.Tensor:
        """[N] cosine of unit rows."""
        return (image_embeddings * text_embeddings).sum(1)

    @torch.no_grad()
    def __call__(self, images: torch.Tensor, prompts: Sequence[str],
                 metadata: Sequence[Mapping[str, Any] | None]) -> dict[str, torch.Tensor]:
        if len(prompts) != len(images) or len(metadata) != len(images):
            raise ValueError(f"got {len(images)} images, {len(prompts)} prompts, {len(metadata)} metadata")
        image, text = self.embed_images(images), self.embed_texts(prompts, metadata)
        background = torch.where(torch.isfinite(image[:, self.preferred]), (image[:, self.preferred] > 0).float(),
                                 image[:, self.preferred])  # NaN stays NaN
        return {self.name: self.score_embeddings(image, text), f"{self.name}/background": background}
