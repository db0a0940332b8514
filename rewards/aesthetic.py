"""LAION's "improved aesthetic predictor": a small MLP on OpenAI CLIP ViT-L/14 image embeddings.

Why this reward: it is the aesthetic score of DDPO / Flow-GRPO and of LAION-Aesthetics, so
numbers are comparable with published runs. The predictor is a regression head trained on
AVA / SAC / LAION-Logos ratings (1-10 scale) of the *L2-normalised* CLIP embedding; it ignores
the prompt.

The head must load the released state dict unchanged, so `AestheticMLP` keeps the original layout
(an nn.Sequential named `layers`: Linear, Dropout, Linear, Dropout, Linear, Dropout, Linear,
Linear -> keys layers.{0,2,4,6,7}). The original has no activation functions between the linear
layers, so it is an affine map of the embedding; the dropouts do nothing in eval mode.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch
from torch import nn

from flowrl.models.clip import load_open_clip, load_state_dict, resolve_file
from flowrl.rewards_api import check_batch
from rewards.base import chunked, score_finite

WEIGHTS_HINT = "sac+logos+ava1-l14-linearMSE.pth from LAION's improved-aesthetic-predictor"


class AestheticMLP(nn.Module):
    """dim -> 1024 -> 128 -> 64 -> 16 -> 1, with the original dropouts (0.2, 0.2, 0.1)."""

    def __init__(self, dim: int = 768) -> None:
        super().__init__()
        self.layers = nn.Sequential(
            nn.Linear(dim, 1024), nn.Dropout(0.2),
            nn.Linear(1024, 128), nn.Dropout(0.2),
            nn.Linear(128, 64), nn.Dropout(0.1),
            nn.Linear(64, 16),
            nn.Linear(16, 1),
        )

    def forward(self, emb: torch.Tensor) -> torch.Tensor:  # [N, dim] -> [N, 1]
        return self.layers(emb)


def load_aesthetic_mlp(weights: str) -> AestheticMLP:
    """Build the head from a .safetensors / .pth state dict (or "hf:owner/repo/file")."""
    state = load_state_dict(resolve_file(weights, "weights"))
    first = state.get("layers.0.weight")
    if first is None or first.ndim != 2:
        raise ValueError(f"weights={weights!r} is not an aesthetic-predictor state dict "
                         f"(no layers.0.weight; keys: {sorted(state)[:6]})")
    mlp = AestheticMLP(first.shape[1])
    mlp.load_state_dict(state, strict=True)
    return mlp.float().eval().requires_grad_(False)


class Aesthetic:
    """Predicted aesthetic rating (about 1-10; generated images mostly score 4-7).

    weights: the head's state dict (required). clip_pretrained: an open_clip tag ("openai") or a
    checkpoint file of OpenAI's ViT-L/14 in open_clip format. QuickGELU is on by default because
    OpenAI's CLIP uses it. The CLIP runs in `dtype`; the head always runs in float32, as the
    original does. `model=` injects an already-built open_clip model (tests).
    """

    name = "aesthetic"

    def __init__(self, weights: str | None = None, clip_arch: str = "ViT-L-14",
                 clip_pretrained: str = "openai", quick_gelu: bool = True, device: Any = "auto",
                 dtype: Any = None, batch_size: int = 64, model: torch.nn.Module | None = None) -> None:
        if not weights:
            raise ValueError(f"aesthetic needs weights=<path to {WEIGHTS_HINT}> (.pth or .safetensors)")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        mlp = load_aesthetic_mlp(weights)  # before the CLIP: a missing file fails fast
        self.backbone = load_open_clip(clip_arch, clip_pretrained, device=device, dtype=dtype,
                                       quick_gelu=quick_gelu, model=model, kwarg="clip_pretrained")
        dim = getattr(self.backbone.model.visual, "output_dim", None)
        if dim is not None and dim != mlp.layers[0].in_features:
            raise ValueError(f"aesthetic: the head takes {mlp.layers[0].in_features}-d embeddings but "
                             f"{clip_arch} gives {dim}-d")
        self.mlp = mlp.to(self.backbone.device)
        self.batch_size = int(batch_size)

    def _score_chunk(self, images: torch.Tensor, prompts: Sequence[str],
                     metadata: Sequence[Any]) -> dict[str, torch.Tensor]:
        rate = lambda x: self.mlp(self.backbone.embed_images(x)).squeeze(-1)  # [n, D] -> [n]
        return {self.name: score_finite(images, rate)}

    @torch.no_grad()
    def __call__(self, images: torch.Tensor, prompts: Sequence[str],
                 metadata: Sequence[Mapping[str, Any] | None]) -> dict[str, torch.Tensor]:
        if check_batch(images, prompts, metadata) == 0:
            return {self.name: torch.empty(0)}
        return chunked(self._score_chunk, images, prompts, metadata, self.batch_size)
