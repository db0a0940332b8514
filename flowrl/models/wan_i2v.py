"""Wan image-to-video policy adapters (``WanImageToVideoPipeline``): Wan2.1 I2V-14B, and the base of Wan2.2 I2V A14B.

The flow, the CFG, the text and the decoding are Wan's text-to-video (:class:`~flowrl.models.wan.WanPolicy`); what
image-to-video adds is the first frame, which :class:`ImageToVideo` holds for either Wan adapter (Wan2.2 A14B's two
experts: :mod:`flowrl.models.wan22_i2v`). It follows ``pipeline_wan_i2v.py`` of diffusers:

- Each prompt names its first frame in ``metadata["source_image"]`` (a path, relative to the prompt file), as an
  editing prompt names its source (:mod:`flowrl.data.edit_sources`); rewards get it as ``source_pixels``, the same
  way. The image is resized to the clip's size with the pipeline's own video processor (Lanczos, as Kontext).
- ``prepare_latents`` turns it into the condition ``[1, T + C, F, h, w]``: the image followed by ``num_frames - 1``
  black frames, VAE-encoded (the mode) and normalised with the VAE's per-channel statistics (C = 16 channels), after
  a mask of T = 4 channels (the VAE's temporal factor: one per pixel frame folded into the first latent frame) that
  is 1 on the given frame and 0 elsewhere. :meth:`ImageToVideo.first_frame` calls that method itself, so the
  condition is the pipeline's to the bit, and keeps it per (path, size, frames).
- The transformer's input is the noisy latents ``[B, C, F, h, w]`` with the condition concatenated on the channel
  axis (36 channels); its output, the velocity, has C. The noise is drawn with the VAE's C channels, not the
  transformer's ``in_channels``.
- Wan2.1 I2V also reads the image through CLIP (``image_encoder``, ``image_processor``): the penultimate layer's
  states (``encode_image``), ``[1, 257, 1280]`` for the released ViT-H/14, go to every pass as
  ``encoder_hidden_states_image``, the unconditional one included. Wan2.2 A14B has no image encoder.

The condition rides in :class:`~flowrl.models.base.TextCond` (``image_latents``, ``image_embeds``), one row per prompt,
so trajectory rows, the text-cache path and the loss's recomputation index it like the text. ``encode`` without
metadata gives the text alone (what the text cache and the text-length check need); the transformer is never run
without a first frame: a prompt without ``source_image`` is one line, and so is a conditioning without the frame.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Sequence

import torch

from flowrl.data.edit_sources import SOURCE_KEY, load_source_image, resize_source, source_path_lists
from flowrl.models.base import TextCond
from flowrl.models.wan import WanPolicy

FIRST_FRAME_CACHE_SIZE = 256
"""First frames kept per policy: a 5-frame 480 x 832 condition is 20 x 2 x 60 x 104 values (0.5 MB in bf16), an
81-frame one 5 MB; an epoch of the same prompts re-encodes nothing."""
NEEDS_FIRST_FRAME = "an image-to-video family starts every clip from its prompt's source image"
I2V_TWO_EXPERTS = ("a two-expert Wan2.2 I2V A14B pipeline (boundary_ratio set, transformer_2): set "
                   "model.family=wan22_i2v")
I2V_ONE_EXPERT = "a one-transformer Wan2.1 I2V pipeline (no boundary_ratio): set model.family=wan_i2v"
EXPAND_TIMESTEPS = ("a WanImageToVideoPipeline with expand_timesteps (Wan2.2 TI2V-5B's image-to-video: a clean first "
                    "latent frame and per-token timesteps), which flowrl does not train; its text-to-video is "
                    "model.family=wan22_ti2v on a WanPipeline folder")


class ImageToVideo:
    """The first frame of ``WanImageToVideoPipeline`` for a Wan adapter (mixed in before it; see the module
    docstring): the condition in ``encode``, its concatenation in ``guided_velocity``, the pipeline call."""

    pipeline_class_name = "WanImageToVideoPipeline"

    def __init__(self, pipeline, **kwargs):
        if pipeline.config.get("expand_timesteps", False):
            raise ValueError(f"model.path holds {EXPAND_TIMESTEPS}")
        super().__init__(pipeline, **kwargs)
        if self.pipeline.transformer.config.image_dim is not None and pipeline.image_encoder is None:
            raise ValueError(f"{self.family}: the transformer takes CLIP image states (image_dim set) but the pipeline "
                             "has no image_encoder: load the model's full folder (image_encoder, image_processor)")
        self._first_frames: OrderedDict = OrderedDict()  # (path, H, W, frames, device, dtype) -> (condition, embeds)

    @classmethod
    def layout(cls, two_experts: bool) -> str:
        return I2V_TWO_EXPERTS if two_experts else I2V_ONE_EXPERT

    @classmethod
    def index_mismatch(cls, index: dict) -> str | None:
        if index.get("expand_timesteps"):
            return f"it holds {EXPAND_TIMESTEPS}"
        return super().index_mismatch(index)

    def latent_shape(self, n: int) -> tuple[int, int, int, int, int]:
        """``(n, C, F, h, w)`` with C the VAE's latent channels (``prepare_latents``' ``num_channels_latents``), not
        the transformer's input channels (C plus the condition's)."""
        _, _, frames, height, width = super().latent_shape(n)
        return (n, self.vae.config.z_dim, frames, height, width)

    # --- the first frame -------------------------------------------------------------------
    def encode(self, prompts: list[str], *, negative: bool = True, metadata: Sequence[dict] | None = None
               ) -> TextCond:
        """The text (cached or live) plus each prompt's first frame: ``image_latents`` ``[B, T + C, F, h, w]`` and,
        for Wan2.1, ``image_embeds`` ``[B, 257, 1280]``. Without metadata, the text alone."""
        cond = self.encode_text(prompts, negative=negative)
        if metadata is None:
            return cond
        paths = source_path_lists(metadata, len(prompts), self.family, several=False, needs=NEEDS_FIRST_FRAME)
        frames = [self.first_frame(path) for path, in paths]
        cond.image_latents = torch.cat([condition for condition, _ in frames])
        if frames[0][1] is not None:
            cond.image_embeds = torch.cat([embeds for _, embeds in frames])
        return cond

    def source_image(self, path: str):
        """The first frame at ``path`` resized to the clip's size by the pipeline's video processor (PIL): what
        ``pipeline_images`` passes, so the pipeline's own resize is the identity."""
        return resize_source(load_source_image(path), self.height, self.width, self.pipeline.video_processor)

    @torch.no_grad()
    def first_frame(self, path: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The condition ``[1, T + C, F, h, w]`` of the image at ``path`` from the pipeline's own ``prepare_latents``
        (float32, then the policy's dtype, as the pipeline casts its transformer input), and its CLIP states
        ``[1, tokens, D]`` where the transformer reads them (None otherwise). Cached per path, size and frames."""
        key = (path, self.height, self.width, self.num_frames, self.device, self.dtype)
        if key in self._first_frames:
            self._first_frames.move_to_end(key)
            return self._first_frames[key]
        image = self.source_image(path)
        pixels = self.pipeline.video_processor.preprocess(image, height=self.height, width=self.width)  # [1, 3, H, W]
        pixels = pixels.to(self.device, dtype=torch.float32)
        placeholder = torch.zeros(self.latent_shape(1), device=self.device)  # skips the pipeline's noise draw
        _, condition = self.pipeline.prepare_latents(
            pixels, 1, self.vae.config.z_dim, self.height, self.width, self.num_frames, torch.float32, self.device,
            None, placeholder)  # [1, T + C, F, h, w]
        embeds = None
        if self.pipeline.transformer.config.image_dim is not None:
            embeds = self.pipeline.encode_image(image, self.device).to(self.dtype)  # [1, tokens, D]
        self._first_frames[key] = (condition.to(self.dtype), embeds)
        if len(self._first_frames) > FIRST_FRAME_CACHE_SIZE:
            self._first_frames.popitem(last=False)
        return self._first_frames[key]

    # --- the model --------------------------------------------------------------------------
    def guided_velocity(self, x: torch.Tensor, timestep: torch.Tensor, cond: TextCond, guidance_scale: float, *,
                        cfg: bool, **expert) -> torch.Tensor:
        """v ``[B, C, F, h, w]`` of the noisy ``x`` with the first frame's condition concatenated on the channel axis
        (``[B, 2C + T, F, h, w]``, the pipeline's ``latent_model_input``) and, for Wan2.1, its CLIP states in both
        CFG passes."""
        if cond.image_latents is None:
            raise ValueError(f"{self.family}: the conditioning has no first frame; encode the prompts with their "
                             f"metadata, each naming '{SOURCE_KEY}'")
        condition = cond.image_latents.to(device=x.device, dtype=self.dtype)  # [B, T + C, F, h, w]
        model_input = torch.cat([x.to(self.dtype), condition], dim=1)  # [B, 2C + T, F, h, w]
        if cond.image_embeds is not None:
            expert["encoder_hidden_states_image"] = cond.image_embeds.to(device=x.device, dtype=self.dtype)
        return super().guided_velocity(model_input, timestep, cond, guidance_scale, cfg=cfg, **expert)

    # --- the reference pipeline ---------------------------------------------------------------
    def example_metadata(self, num_prompts: int) -> list[dict]:
        """One example first frame per prompt (the coloured shapes of ``assets/edit``)."""
        from flowrl.models.tiny_flux_kontext import example_source_paths

        return [{SOURCE_KEY: path} for path in example_source_paths(num_prompts)]

    def pipeline_images(self, prompts: Sequence[str], *, group_size: int, num_steps: int, guidance_scale: float,
                        seeds: Sequence[int], metadata: Sequence[dict] | None = None) -> torch.Tensor:
        """WanImageToVideoPipeline's frames ``[N, T, 3, H, W]`` for the clips an ODE rollout of the same seeds makes.

        One call per prompt, with the prompt repeated ``group_size`` times and one video each: the pipeline takes
        one image per call, and repeats its CLIP states once per prompt, not per video (``num_videos_per_prompt >
        1`` would not match the text's batch)."""
        from flowrl.core.seeding import generators

        paths = source_path_lists(metadata, len(prompts), self.family, several=False, needs=NEEDS_FIRST_FRAME)
        seeds = list(seeds)
        if len(seeds) != len(prompts) * group_size:
            raise ValueError(f"need {len(prompts) * group_size} seeds, got {len(seeds)}")
        clips = []
        for i, prompt in enumerate(prompts):
            clips.append(self.pipeline(
                image=self.source_image(paths[i][0]), prompt=[prompt] * group_size,
                negative_prompt=self.negative_prompts(group_size), num_videos_per_prompt=1,
                num_inference_steps=num_steps, guidance_scale=guidance_scale, height=self.height, width=self.width,
                num_frames=self.num_frames, generator=generators(seeds[i * group_size:(i + 1) * group_size],
                                                                 device=self.device),
                output_type="pt", max_sequence_length=self.max_sequence_length, **self.pipeline_guidance(),
            ).frames.float())
        return torch.cat(clips)


class WanI2VPolicy(ImageToVideo, WanPolicy):
    """Wan2.1 I2V-14B (480P or 720P): one transformer, CLIP image states and the first frame's latents."""

    family = "wan_i2v"
    default_guidance = 5.0  # WanImageToVideoPipeline's default and the Wan2.1 I2V model card's
    default_height, default_width = 480, 832  # WanImageToVideoPipeline's defaults (the 480P model)
    checkpoint_name = "Wan2.1 I2V-14B"

    @classmethod
    def tiny_pipeline(cls, seed: int = 0):
        from flowrl.models.tiny_wan_i2v import tiny_wan_i2v_pipeline

        return tiny_wan_i2v_pipeline(seed)
