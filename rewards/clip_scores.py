"""Prompt-image agreement rewards built on a CLIP: CLIPScore, PickScore and HPSv2.

All three are "cosine between the image embedding and the prompt embedding", differing in the
CLIP (and its fine-tuning) and in the scale:

  clipscore  2.5 * max(cos, 0)            Hessel et al. 2021, openai/clip-vit-large-patch14
  pickscore  scale * exp(logit_scale) * cos   Kirstain et al. 2023, CLIP-H fine-tuned on Pick-a-Pic
  hpsv2      cos                          Wu et al. 2023, open_clip ViT-H-14 fine-tuned on HPD v2

``pickscore_rank`` is a group-wise reward on PickScore: each image's rank within its group, over the group size.

Loading and preprocessing live in `flowrl.models.clip`; images are scored in chunks of
`batch_size` (`rewards.base.chunked`), each distinct prompt is embedded once per chunk, and images
holding NaN/inf score NaN. Scores are float32 on CPU whatever `dtype` the model runs in.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

import torch

from flowrl.models.clip import ClipBackbone, load_hf_clip, load_open_clip
from flowrl.rewards_api import check_batch
from rewards.base import chunked, score_finite


class _ClipSimilarity:
    """Shared __call__: validate, chunk, cosine per (image, own prompt), then `_scores`."""

    name = "clip_similarity"

    def __init__(self, backbone: ClipBackbone, batch_size: int) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if backbone.tokenizer is None:
            raise ValueError(f"{self.name}: an injected model needs tokenizer= as well")
        self.backbone, self.batch_size = backbone, int(batch_size)

    def _scores(self, cos: torch.Tensor) -> dict[str, torch.Tensor]:  # [N] -> {key: [N]}
        raise NotImplementedError

    def embed_images(self, images: torch.Tensor) -> torch.Tensor:
        """[N, D] unit image embeddings, in chunks: the space D²-Align corrects in (rewards.directional)."""
        return torch.cat([self.backbone.embed_images(chunk).cpu() for chunk in images.split(self.batch_size)])

    def _score_chunk(self, images: torch.Tensor, prompts: Sequence[str],
                     metadata: Sequence[Any]) -> dict[str, torch.Tensor]:
        return self._scores(score_finite(images, lambda x: self.backbone.cosine(x, prompts)))

    @torch.no_grad()
    def __call__(self, images: torch.Tensor, prompts: Sequence[str],
                 metadata: Sequence[Mapping[str, Any] | None]) -> dict[str, torch.Tensor]:
        if check_batch(images, prompts, metadata) == 0:
            return self._scores(torch.empty(0))
        return chunked(self._score_chunk, images, prompts, metadata, self.batch_size)


class ClipScore(_ClipSimilarity):
    """CLIPScore (Hessel et al. 2021): `weight * max(cos, 0)`, weight 2.5, in [0, 2.5].

    The clipped, rescaled form is the published metric (the 2.5 stretches typical cosines of
    0.2-0.4 toward [0, 1]); "clipscore/cosine" is the plain cosine, for runs that want the
    unclipped, unscaled signal.
    """

    name = "clipscore"

    def __init__(self, model_id: str = "openai/clip-vit-large-patch14", processor_id: str | None = None,
                 weight: float = 2.5, device: Any = "auto", dtype: Any = None, batch_size: int = 64,
                 model: torch.nn.Module | None = None, tokenizer: Any = None) -> None:
        self.weight = float(weight)
        super().__init__(load_hf_clip(model_id, processor_id, device=device, dtype=dtype,
                                      model=model, tokenizer=tokenizer), batch_size)

    def _scores(self, cos: torch.Tensor) -> dict[str, torch.Tensor]:
        return {self.name: self.weight * cos.clamp_min(0.0), f"{self.name}/cosine": cos}


class PickScore(_ClipSimilarity):
    """PickScore (Kirstain et al. 2023): `scale * exp(logit_scale) * cos`, the model's own logit.

    exp(logit_scale) is ~100 for the released model, so raw scores sit around 18-23. scale=1
    keeps that raw logit (comparable with published numbers); Flow-GRPO trains on pickscore/26
    (scale=1/26) to bring it near 1. "pickscore/cosine" is the unscaled cosine.
    """

    name = "pickscore"

    def __init__(self, model_id: str = "yuvalkirstain/PickScore_v1",
                 processor_id: str = "laion/CLIP-ViT-H-14-laion2B-s32B-b79K", scale: float = 1.0,
                 device: Any = "auto", dtype: Any = None, batch_size: int = 64,
                 model: torch.nn.Module | None = None, tokenizer: Any = None) -> None:
        self.scale = float(scale)
        super().__init__(load_hf_clip(model_id, processor_id, device=device, dtype=dtype,
                                      model=model, tokenizer=tokenizer), batch_size)
        if not math.isfinite(self.backbone.logit_scale):
            raise ValueError("pickscore: the model has no logit_scale")

    def _scores(self, cos: torch.Tensor) -> dict[str, torch.Tensor]:
        return {self.name: self.scale * self.backbone.logit_scale * cos, f"{self.name}/cosine": cos}


class PickScoreRank(PickScore):
    """PickScore's rank within its group (Flow-Factory's ``PickScore_Rank``): a group-wise reward, called once per
    group of G images. ranks = argsort(argsort(pickscore)), reward = rank / G, so 0 for the group's lowest
    PickScore up to (G - 1) / G for its highest, whatever the prompt's scale of scores (Flow-Factory
    ``rewards/pick_score.py`` ``PickScoreRankRewardModel`` at a0b2bc5).

    The scores are :class:`PickScore`'s (same model, kwargs and chunking); ``pickscore_rank/pickscore`` is that raw
    score. Equal scores get distinct ranks in row order (a stable sort). An image PickScore could not score is NaN
    and the others rank among themselves, over the count of scored images (G when every image scores). A video
    group: its clips' frames rank together and each clip scores the mean of its frames' ranks."""

    name = "pickscore_rank"
    scores_groups = True

    @torch.no_grad()
    def __call__(self, images: torch.Tensor, prompts: Sequence[str],
                 metadata: Sequence[Mapping[str, Any] | None]) -> dict[str, torch.Tensor]:
        raw = super().__call__(images, prompts, metadata)[self.name]  # [G] PickScore, NaN: could not score
        scored = torch.isfinite(raw)
        rank = torch.full_like(raw, float("nan"))
        order = torch.argsort(torch.argsort(raw[scored], stable=True))  # [M] the rank of each scored image
        rank[scored] = order.float() / max(int(scored.sum()), 1)
        return {self.name: rank, f"{self.name}/pickscore": raw}


class HPSv2(_ClipSimilarity):
    """Human Preference Score v2 (Wu et al. 2023): cos(image, prompt) under the HPS-tuned CLIP-H.

    This is the diagonal of HPSv2's `image_features @ text_features.T` (no logit scale), so
    scores sit around 0.2-0.3. `checkpoint` is the full fine-tuned CLIP state dict
    (HPS_v2_compressed.pt or HPS_v2.1_compressed.pt from the xswu/HPSv2 hub repo): a local file,
    or "hf:xswu/HPSv2/HPS_v2.1_compressed.pt" to fetch it. Preprocessing is CLIP's
    resize-shorter-side-and-crop; for square images (what text-to-image models produce) any
    aspect-preserving resize to 224 gives the same pixels.
    """

    name = "hpsv2"

    def __init__(self, checkpoint: str | None = None, arch: str = "ViT-H-14", device: Any = "auto",
                 dtype: Any = None, batch_size: int = 64, model: torch.nn.Module | None = None,
                 tokenizer: Any = None) -> None:
        if model is None and not checkpoint:
            raise ValueError("hpsv2 needs checkpoint=<path to HPS_v2.1_compressed.pt> "
                             "(or hf:xswu/HPSv2/HPS_v2.1_compressed.pt)")
        super().__init__(load_open_clip(arch, checkpoint, device=device, dtype=dtype, quick_gelu=False,
                                        model=model, tokenizer=tokenizer, kwarg="checkpoint"), batch_size)

    def _scores(self, cos: torch.Tensor) -> dict[str, torch.Tensor]:
        return {self.name: cos}
