"""Rewards for image editing (FLUX.1 Kontext): scores that compare the output with its source image.

The scorer (``flowrl.rewards_api.with_source_pixels``) puts each row's source into its metadata as
``source_pixels``, a float tensor [3, H, W] in [0, 1] at the output's size, next to the path under
``source_image``. A row without one could not be scored: NaN, never zero.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

import torch


class EditPreservation:
    """How much of the source survives the edit: 1 - mean |output - source| over pixels and channels, in [0, 1].

    1 is an unchanged source; alone it rewards doing nothing, so combine it with a reward for the edit
    itself (an instruction-following score, or brightness in the smoke run): the pair trades the edit
    against keeping everything else."""

    name = "edit_preservation"

    @torch.no_grad()
    def __call__(self, images: torch.Tensor, prompts: Sequence[str],
                 metadata: Sequence[Mapping[str, Any] | None]) -> dict[str, torch.Tensor]:
        scores = torch.full((images.shape[0],), math.nan, dtype=torch.float32, device=images.device)  # [N]
        rows = [i for i, m in enumerate(metadata) if m and m.get("source_pixels") is not None]
        if rows:
            source = torch.stack([torch.as_tensor(metadata[i]["source_pixels"]) for i in rows])  # [R, 3, H, W]
            output = images[rows].float()
            if source.shape != output.shape:
                raise ValueError(f"source_pixels have shape {tuple(source.shape[1:])}, the images "
                                 f"{tuple(output.shape[1:])}")
            scores[rows] = 1 - (output - source.to(output)).abs().mean((1, 2, 3))
        return {self.name: scores}
