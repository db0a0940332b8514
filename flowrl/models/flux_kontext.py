"""FLUX.1 Kontext [dev] policy adapter: instruction-based image editing on the FLUX.1 transformer.

Kontext is FLUX.1 [dev] (same transformer class, text encoders, VAE, guidance embedding and dynamic
``mu``) with one addition: the source image is VAE-encoded, packed into 2x2 patches like the noisy latents
and appended to them along the sequence, its position ids marked with 1 in their first channel. The
transformer attends over both; only the noisy tokens' output is the velocity. Everything else is
:class:`~flowrl.models.flux.FluxPolicy`'s.

Each prompt names its source in ``metadata["source_image"]`` (a path; ``flowrl.data.load_prompts`` makes a
relative one relative to the prompt file). :meth:`FluxKontextPolicy.encode` turns it into
``TextCond.image_latents`` ``[B, C, h, w]`` (VAE layout, one row per prompt, so trajectory rows index it like
the text). The source is resized to the policy's output size: the tokens then line up with the noisy ones,
and an edit reward compares the output with a source of the same size (``source_pixels``).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Sequence

import torch

from flowrl.data.edit_sources import SOURCE_KEY, load_source_image, resize_source, source_paths
from flowrl.models.base import TextCond
from flowrl.models.flux import FluxPolicy

LATENT_CACHE_SIZE = 4096  # source latents kept per policy (16 x 48 x 48 bf16 at 384 px: ~74 kB each)


class FluxKontextPolicy(FluxPolicy):
    family = "flux_kontext"
    pipeline_class_name = "FluxKontextPipeline"
    default_guidance = 2.5  # FLUX.1 Kontext [dev]'s model card (the distilled-guidance embedding)

    @classmethod
    def tiny_pipeline(cls, seed: int = 0):
        from flowrl.models.tiny_flux_kontext import tiny_flux_kontext_pipeline

        return tiny_flux_kontext_pipeline(seed)

    def __init__(self, pipeline, *, height: int | None = None, width: int | None = None,
                 max_sequence_length: int = 512):
        super().__init__(pipeline, height=height, width=width, max_sequence_length=max_sequence_length)
        self.check_size(self.height, self.width)
        self._source_latents: OrderedDict = OrderedDict()  # (path, size, device, dtype) -> [1, C, h, w]

    # --- the source image ------------------------------------------------------------------
    def encode(self, prompts: list[str], *, negative: bool = False, metadata=None) -> TextCond:
        """Text conditioning plus each prompt's source latents ``[B, C, h, w]`` in ``image_latents``."""
        cond = self.encode_text(prompts, negative=negative)
        paths = source_paths(metadata, len(prompts))
        if paths is not None:
            cond.image_latents = torch.cat([self.source_latents(p) for p in paths])
        return cond

    def source_image(self, path: str):
        """The source at ``path`` resized to the policy's size by the pipeline's own image processor (PIL)."""
        return resize_source(load_source_image(path), self.height, self.width, self.pipeline.image_processor)

    @torch.no_grad()
    def source_latents(self, path: str) -> torch.Tensor:
        """``[1, C, h, w]`` latents of one source, as FluxKontextPipeline makes them: its image processor's
        preprocessing (to [-1, 1]), the VAE mode (``sample_mode="argmax"``), then ``(z - shift) * scaling``.
        Cached per path (least recently used out past ``LATENT_CACHE_SIZE``): an epoch re-encodes nothing."""
        key = (path, self.height, self.width, self.device, self.dtype)
        if key in self._source_latents:
            self._source_latents.move_to_end(key)
            return self._source_latents[key]
        processor = self.pipeline.image_processor
        pixels = processor.preprocess(self.source_image(path), self.height, self.width)  # [1, 3, H, W]
        pixels = pixels.to(device=self.device, dtype=self.vae.dtype)
        latents = self.vae.encode(pixels).latent_dist.mode()  # [1, C, h, w]
        config = self.vae.config
        latents = ((latents - config.shift_factor) * config.scaling_factor).to(self.dtype)
        self._source_latents[key] = latents
        if len(self._source_latents) > LATENT_CACHE_SIZE:
            self._source_latents.popitem(last=False)
        return latents

    def source_image_ids(self, h: int, w: int) -> torch.Tensor:
        """``[(h/2)(w/2), 3]`` ids of the source tokens: the noisy grid's, first channel 1 (the pipeline's)."""
        key = (h, w, self.device, self.dtype)
        if getattr(self, "_source_ids_key", None) != key:
            ids = self.image_ids(h, w).clone()
            ids[:, 0] = 1
            self._source_ids, self._source_ids_key = ids, key
        return self._source_ids

    # --- the model --------------------------------------------------------------------------
    def velocity(self, x: torch.Tensor, sigma, cond: TextCond, guidance_scale: float,
                 true_cfg_scale: float = 1.0) -> torch.Tensor:
        """v(x, sigma) ``[B, C, h, w]``: the noisy tokens, then the source tokens, through the transformer;
        the output of the noisy part only (FluxKontextPipeline's loop). Without a source: FLUX.1's."""
        if cond.image_latents is None:
            return super().velocity(x, sigma, cond, guidance_scale, true_cfg_scale)
        _, _, h, w = x.shape
        source = cond.image_latents.to(device=x.device, dtype=self.dtype)  # [B, C, hs, ws]
        noisy = self.pack(x.to(self.dtype))  # [B, S, 4C], S = (h/2)(w/2)
        tokens = torch.cat([noisy, self.pack(source)], dim=1)  # [B, S + Ss, 4C]
        ids = torch.cat([self.image_ids(h, w), self.source_image_ids(*source.shape[2:])])  # [S + Ss, 3]
        out = self.token_velocity(tokens, ids, sigma, cond, guidance_scale, true_cfg_scale)  # [B, S + Ss, 4C]
        return self.unpack(out[:, :noisy.shape[1]], h, w)

    # --- the reference pipeline ---------------------------------------------------------------
    def example_metadata(self, num_prompts: int) -> list[dict]:
        """One example source per prompt (coloured shapes: ``assets/edit``, or drawn into a temporary folder)."""
        from flowrl.models.tiny_flux_kontext import example_source_paths

        return [{SOURCE_KEY: path} for path in example_source_paths(num_prompts)]

    def pipeline_images(self, prompts: Sequence[str], *, group_size: int, num_steps: int, guidance_scale: float,
                        seeds: Sequence[int], metadata: Sequence[dict] | None = None) -> torch.Tensor:
        """FluxKontextPipeline for the images an ODE rollout of the same seeds makes: ``[N, 3, H, W]``.

        One call per prompt: with several source images and ``num_images_per_prompt > 1`` the pipeline tiles
        the images (i0, i1, i0, i1) but repeats the prompts (p0, p0, p1, p1), pairing prompts with the wrong
        sources. The source goes in already at the policy's size, with ``_auto_resize=False`` and
        ``max_area=height * width``: the pipeline then neither resizes the source to a preferred Kontext
        resolution nor changes the output size, so its tokens are the policy's."""
        from flowrl.core.seeding import generators

        paths, seeds = source_paths(metadata, len(prompts)), list(seeds)
        if len(seeds) != len(prompts) * group_size:
            raise ValueError(f"need {len(prompts) * group_size} seeds, got {len(seeds)}")
        images = []
        for i, prompt in enumerate(prompts):
            images.append(self.pipeline(
                image=None if paths is None else self.source_image(paths[i]), prompt=[prompt],
                num_images_per_prompt=group_size, num_inference_steps=num_steps, guidance_scale=guidance_scale,
                height=self.height, width=self.width, max_area=self.height * self.width, _auto_resize=False,
                generator=generators(seeds[i * group_size:(i + 1) * group_size], device=self.device),
                output_type="pt", max_sequence_length=self.max_sequence_length,
            ).images)
        return torch.cat(images)
