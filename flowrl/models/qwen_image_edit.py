"""Qwen-Image-Edit policy adapter: instruction-based image editing on the Qwen-Image transformer.

Qwen-Image-Edit is Qwen-Image (same transformer class, VAE, text encoder, true CFG and dynamic ``mu``) with the
source image entering twice, both hidden here:

* the VAE latents of the source (resized to about 1024 x 1024 px at its own aspect ratio, normalised per channel)
  are packed into 2x2 patches like the noisy latents and appended to them along the sequence; ``img_shapes``
  lists one grid per image, noisy first, so the rotary positions tell them apart. The transformer attends over
  all; only the noisy tokens' output is the velocity (and enters the CFG norm rescale);
* the Qwen2.5-VL text encoder reads the source too: its processor turns the image into vision tokens of the
  chat template, so the text embedding depends on the image, and the negative prompt is encoded with the same
  image. Text is therefore encoded per (prompt, source) pair, never through the prompt-keyed text cache.

Each prompt names its source in ``metadata["source_image"]`` (a path; ``flowrl.data.load_prompts`` makes a
relative one relative to the prompt file); an editing prompt without one is a one-line error.
:meth:`QwenImageEditPolicy.encode` puts the source latents in ``TextCond.image_latents`` ``[B, K, C, hs, ws]``
(K sources per prompt, one here; :mod:`flowrl.models.qwen_image_edit_plus` takes several). The sources of a
batch must give grids of one size (sources of one aspect ratio), as one transformer call needs.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Sequence

import torch
import torch.nn.functional as F
from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus import VAE_IMAGE_SIZE, calculate_dimensions

from flowrl.data.edit_sources import SOURCE_KEY, load_source_image, source_path_lists
from flowrl.models.base import TextCond
from flowrl.models.qwen_image import QwenImagePolicy

LATENT_CACHE_SIZE = 1024  # source latents kept per policy (16 x 128 x 128 bf16 at 1024 px: ~0.5 MB each)


class QwenImageEditPolicy(QwenImagePolicy):
    family = "qwen_image_edit"
    pipeline_class_name = "QwenImageEditPipeline"
    default_guidance = 4.0  # QwenImageEditPipeline's true_cfg_scale default (the model card samples with 4.0)
    several_sources = False  # one source per prompt; Qwen-Image-Edit-Plus takes a list
    tiny_max_sequence_length = 128  # the tiny template's kept part, 4 vision tokens per source and the prompt
    vae_area = VAE_IMAGE_SIZE  # px: the area a source is resized to before the VAE, the pipelines' 1024 x 1024

    @classmethod
    def tiny_pipeline(cls, seed: int = 0):
        from flowrl.models.tiny_qwen_image_edit import tiny_qwen_image_edit_pipeline

        return tiny_qwen_image_edit_pipeline(seed)

    def __init__(self, pipeline, *, height: int | None = None, width: int | None = None,
                 max_sequence_length: int = 2048):  # a 1024 px source alone is ~1.4k vision tokens
        super().__init__(pipeline, height=height, width=width, max_sequence_length=max_sequence_length)
        self._source_latents: OrderedDict = OrderedDict()  # (path, device, dtype) -> [C, hs, ws]

    # --- the source images ------------------------------------------------------------------
    @staticmethod
    def area_size(image, area: int) -> tuple[int, int]:
        """(height, width) of ``image`` scaled to ``area`` pixels at its aspect ratio, multiples of 32 (as the
        pipeline sizes it)."""
        width, height = calculate_dimensions(area, image.size[0] / image.size[1])
        return height, width

    def vae_input(self, image) -> torch.Tensor:
        """``[1, 3, H, W]`` in [-1, 1]: the source resized to the VAE area, then preprocessed (the Edit pipeline)."""
        processor = self.pipeline.image_processor
        height, width = self.area_size(image, self.vae_area)
        return processor.preprocess(processor.resize(image, height, width), height, width)

    def condition_images(self, images: list):
        """What the text encoder's processor sees: the Edit pipeline hands it the source at the VAE size."""
        height, width = self.area_size(images[0], self.vae_area)
        return self.pipeline.image_processor.resize(images[0], height, width)

    def pipeline_image(self, images: list):
        """The pipeline's ``image`` argument for one prompt: the single source."""
        return images[0]

    @torch.no_grad()
    def source_latents(self, path: str) -> torch.Tensor:
        """``[C, hs, ws]`` latents of one source as the pipeline makes them: the VAE mode of the preprocessed
        source, normalised with the VAE's ``latents_mean``/``latents_std``. Cached per path (least recently used
        out past ``LATENT_CACHE_SIZE``): the ~1 Mpx VAE encoding runs once per source."""
        key = (path, self.device, self.dtype)
        if key in self._source_latents:
            self._source_latents.move_to_end(key)
            return self._source_latents[key]
        pixels = self.vae_input(load_source_image(path)).unsqueeze(2)  # [1, 3, 1, H, W]
        latents = self.vae.encode(pixels.to(device=self.device, dtype=self.vae.dtype)).latent_dist.mode()
        config = self.vae.config
        shape = (1, config.z_dim, 1, 1, 1)
        mean = torch.tensor(config.latents_mean).view(shape).to(latents.device, latents.dtype)
        std = torch.tensor(config.latents_std).view(shape).to(latents.device, latents.dtype)
        latents = ((latents - mean) / std)[0, :, 0].to(self.dtype)  # [C, hs, ws]
        self._source_latents[key] = latents
        if len(self._source_latents) > LATENT_CACHE_SIZE:
            self._source_latents.popitem(last=False)
        return latents

    # --- conditioning -------------------------------------------------------------------------
    @torch.no_grad()
    def encode(self, prompts: list[str], *, negative: bool = True, metadata: Sequence[dict] | None = None
               ) -> TextCond:
        """Text read together with each prompt's sources (and the negative with the same sources), zero-padded
        to ``max_sequence_length``, plus the source latents ``[B, K, C, hs, ws]`` in ``image_latents``."""
        if self.text_cache is not None:
            raise ValueError(f"{self.family}: the text embedding depends on the source image; model.text_cache "
                             "keys prompts alone: set model.text_cache=none")
        if not self.text_encoders():
            raise RuntimeError(f"{self.family}: the text encoder was freed; it reads every source image: set "
                               "model.free_text_encoders=false")
        sources = source_path_lists(metadata, len(prompts), self.family, several=self.several_sources)
        images = {path: load_source_image(path) for paths in sources for path in paths}
        rows = [[images[p] for p in paths] for paths in sources]
        embeds = torch.cat([self.instruction_embeds(p, r) for p, r in zip(prompts, rows)])  # [B, L, D]
        cond = TextCond(embeds, embeds.new_zeros(len(prompts), 0))
        if negative:
            cond.negative_prompt_embeds = torch.cat([self.instruction_embeds(self.negative_prompt, r) for r in rows])
            cond.negative_pooled_prompt_embeds = embeds.new_zeros(len(prompts), 0)
        latents = [[self.source_latents(p) for p in paths] for paths in sources]
        shapes = {tuple(tuple(x.shape) for x in row) for row in latents}
        if len(shapes) > 1:
            raise ValueError(f"{self.family}: the sources of one batch give latent grids {sorted(shapes)}; one "
                             "transformer call needs one size: give the prompts of a file sources of one aspect ratio")
        cond.image_latents = torch.stack([torch.stack(row) for row in latents])  # [B, K, C, hs, ws]
        return self.finish_cond(cond)

    def instruction_embeds(self, prompt: str, images: list) -> torch.Tensor:
        """``[1, max_sequence_length, D]``: the pipeline's ``encode_prompt`` of one prompt with its sources,
        zero-padded (the transformer masks the padding). Longer text is an error: cutting it would cut the
        instruction, which follows the vision tokens."""
        device = next(self.text_encoders()[0].parameters()).device
        embeds, _ = self.pipeline.encode_prompt(prompt=[prompt], image=self.condition_images(images), device=device)
        if embeds.shape[1] > self.max_sequence_length:
            raise ValueError(f"{self.family}: the instruction with its source image(s) is {embeds.shape[1]} text "
                             f"tokens, more than model.max_sequence_length={self.max_sequence_length}; raise it")
        embeds = F.pad(embeds, (0, 0, 0, self.max_sequence_length - embeds.shape[1]))  # [1, L, D]
        return embeds.to(device=self.device, dtype=self.cond_dtype or embeds.dtype)

    # --- the model ------------------------------------------------------------------------------
    def velocity(self, x: torch.Tensor, sigma, cond: TextCond, guidance_scale: float) -> torch.Tensor:
        """v(x, sigma) ``[B, C, h, w]``: the noisy tokens, then each source's, through the transformer with one
        grid per image in ``img_shapes``; the velocity and true CFG of the noisy part only (the pipeline's loop)."""
        if cond.image_latents is None:
            raise ValueError(f"{self.family}: no source latents; encode the prompts with their metadata "
                             f"'{SOURCE_KEY}'")
        _, _, h, w = x.shape
        sources = cond.image_latents.to(device=x.device, dtype=self.dtype)  # [B, K, C, hs, ws]
        noisy = self.pack(x.to(self.dtype))  # [B, S, 4C], S = (h/2)(w/2)
        tokens = torch.cat([noisy] + [self.pack(sources[:, k]) for k in range(sources.shape[1])], dim=1)
        source_grid = (1, sources.shape[3] // 2, sources.shape[4] // 2)
        shapes = [(1, h // 2, w // 2)] + [source_grid] * sources.shape[1]
        out = self.token_velocity(tokens, shapes, sigma, cond, guidance_scale, num_noisy=noisy.shape[1])
        return self.unpack(out, h, w)

    # --- the reference pipeline ---------------------------------------------------------------
    def example_metadata(self, num_prompts: int) -> list[dict]:
        """One example source per prompt (coloured shapes: ``assets/edit``, or drawn into a temporary folder)."""
        from flowrl.models.tiny_flux_kontext import example_source_paths

        return [{SOURCE_KEY: path} for path in example_source_paths(num_prompts)]

    def pipeline_images(self, prompts: Sequence[str], *, group_size: int, num_steps: int, guidance_scale: float,
                        seeds: Sequence[int], metadata: Sequence[dict] | None = None) -> torch.Tensor:
        """The family's diffusers pipeline for the images an ODE rollout of the same seeds makes: ``[N, 3, H, W]``.
        One call per prompt (Plus takes one prompt per call), the sources as loaded (the pipeline resizes them),
        ``guidance_scale`` as ``true_cfg_scale`` with ``negative_prompt`` enabling it."""
        from flowrl.core.seeding import generators

        sources = source_path_lists(metadata, len(prompts), self.family, several=self.several_sources)
        seeds = list(seeds)
        if len(seeds) != len(prompts) * group_size:
            raise ValueError(f"need {len(prompts) * group_size} seeds, got {len(seeds)}")
        cfg, images = guidance_scale > 1, []
        for i, prompt in enumerate(prompts):
            images.append(self.pipeline(
                image=self.pipeline_image([load_source_image(p) for p in sources[i]]), prompt=[prompt],
                negative_prompt=[self.negative_prompt] if cfg else None, true_cfg_scale=guidance_scale,
                num_images_per_prompt=group_size, num_inference_steps=num_steps, height=self.height, width=self.width,
                generator=generators(seeds[i * group_size:(i + 1) * group_size], device=self.device), output_type="pt",
            ).images)
        return torch.cat(images)
