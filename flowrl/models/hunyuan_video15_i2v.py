"""HunyuanVideo-1.5 image-to-video policy adapter (``HunyuanVideo15ImageToVideoPipeline``).

Follows diffusers' ``pipelines/hunyuan_video1_5/pipeline_hunyuan_video1_5_image2video.py``. The text, the
guider, the sigmas, the latents and the decoding are text-to-video's
(:class:`~flowrl.models.hunyuan_video15.HunyuanVideo15Policy`); the first frame enters twice:

- **as latents**: the image, resized and centre-cropped to the clip's size (``resize_mode="crop"``), VAE-encoded
  (mode, times ``scaling_factor``) into one latent frame ``[C, 1, h, w]``; the transformer's conditioning channels
  hold it on latent frame 0 and zeros after, and the mask channel is 1 on frame 0, 0 after;
- **as SigLIP states** ``[T, Di]`` of the same cropped image, the transformer's image tokens (unmasked, unlike
  text-to-video's zeros).

The text encoders do not read the image, so the text is encoded (and cached) per prompt as in text-to-video.

Each prompt names its first frame in ``metadata["source_image"]`` (a path, relative to the prompt file), as an
editing family's source; :meth:`HunyuanVideo15I2VPolicy.encode` puts the latents in ``TextCond.image_latents``
``[B, C, 1, h, w]`` and the SigLIP states in ``TextCond.image_embeds`` ``[B, T, Di]``. Rewards see it as
``source_pixels``. A batch whose metadata lacks a source is one line; conditioning encoded from prompts alone
(no metadata at all: the text cache, text checks) is refused in one line when it reaches the transformer.

The pipeline picks the output size itself, the bucket of ``transformer.config.target_size`` nearest the image's
aspect ratio; flowrl samples at ``model.height`` x ``model.width`` (one size a run), cropping every source to it as
the pipeline crops to its bucket. Its MeanFlow-distilled checkpoints (``use_meanflow``: each step reads the next
timestep too) are refused in one line: flowrl's velocity is a function of the current sigma only.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Sequence

import torch

from flowrl.data.edit_sources import SOURCE_KEY, load_source_image, source_path_lists
from flowrl.models.base import TextCond
from flowrl.models.hunyuan_video15 import HunyuanVideo15Policy

SOURCE_CACHE_SIZE = 1024  # first frames kept per policy (32 x 60 x 106 latents + 729 x 1152 SigLIP states at 480p)
NEEDS = "image-to-video conditions every clip on its first frame: give every prompt of the file a source image"


class HunyuanVideo15I2VPolicy(HunyuanVideo15Policy):
    family = "hunyuan_video15_i2v"
    pipeline_class_name = "HunyuanVideo15ImageToVideoPipeline"

    @classmethod
    def tiny_pipeline(cls, seed: int = 0):
        from flowrl.models.tiny_hunyuan_video15 import tiny_hunyuan_video15_i2v_pipeline

        return tiny_hunyuan_video15_i2v_pipeline(seed)

    def __init__(self, pipeline, *, height: int | None = None, width: int | None = None,
                 max_sequence_length: int = 1000, num_frames: int | None = None):
        if pipeline.transformer.config.get("use_meanflow", False):
            raise ValueError(f"{self.family}: this transformer is MeanFlow-distilled (use_meanflow: each step reads "
                             "the next timestep as well), which flowrl's rollout does not pass: use a checkpoint "
                             "without use_meanflow")
        super().__init__(pipeline, height=height, width=width, max_sequence_length=max_sequence_length,
                         num_frames=num_frames)
        self._sources: OrderedDict = OrderedDict()  # (path, height, width, device, dtype) -> (latents, embeds)

    # --- the first frame --------------------------------------------------------------------------
    def source_image(self, path: str):
        """The image at ``path`` resized and centre-cropped to the clip's size by the pipeline's video processor."""
        return self.pipeline.video_processor.resize(load_source_image(path), height=self.height, width=self.width,
                                                    resize_mode="crop")

    @torch.no_grad()
    def source_inputs(self, path: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(latents ``[C, 1, h, w]``, SigLIP states ``[T, Di]``) of one first frame, by the pipeline's own
        ``_get_image_latents`` and ``_get_image_embeds``. Cached per path and size (least recently used out past
        ``SOURCE_CACHE_SIZE``)."""
        key = (path, self.height, self.width, self.device, self.dtype)
        if key in self._sources:
            self._sources.move_to_end(key)
            return self._sources[key]
        pipeline, image = self.pipeline, self.source_image(path)
        latents = pipeline._get_image_latents(vae=self.vae, image_processor=pipeline.video_processor, image=image,
                                              height=self.height, width=self.width, device=self.device)
        embeds = pipeline._get_image_embeds(image_encoder=pipeline.image_encoder,
                                            feature_extractor=pipeline.feature_extractor, image=image,
                                            device=self.device)
        self._sources[key] = (latents[0].to(self.dtype), embeds[0].to(self.dtype))
        if len(self._sources) > SOURCE_CACHE_SIZE:
            self._sources.popitem(last=False)
        return self._sources[key]

    def encode(self, prompts: list[str], *, negative: bool = True, metadata: Sequence[dict] | None = None
               ) -> TextCond:
        """Text conditioning (cached per prompt), plus each prompt's first frame: ``image_latents [B, C, 1, h, w]``
        and ``image_embeds [B, T, Di]``. Without metadata, the text alone (see the module docstring)."""
        cond = self.encode_text(prompts, negative=negative)
        if not metadata:
            return cond
        paths = source_path_lists(metadata, len(prompts), self.family, several=False, needs=NEEDS)
        inputs = [self.source_inputs(p[0]) for p in paths]
        cond.image_latents = torch.stack([latents for latents, _ in inputs])  # [B, C, 1, h, w]
        cond.image_embeds = torch.stack([embeds for _, embeds in inputs])  # [B, T, Di]
        return cond

    # --- the model ---------------------------------------------------------------------------------
    def image_inputs(self, x: torch.Tensor, cond: TextCond) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(conditioning latents ``[B, C, F, h, w]``: the first frame's on latent frame 0, zeros after; mask
        ``[B, 1, F, h, w]``: 1 on frame 0; SigLIP states ``[B, T, Di]``), as ``prepare_cond_latents_and_mask``."""
        if cond.image_latents is None or cond.image_embeds is None:
            raise ValueError(f"{self.family}: the conditioning has no first frame; encode(prompts, metadata=...) with "
                             f"metadata '{SOURCE_KEY}' for every prompt ({NEEDS})")
        batch, channels, frames, height, width = x.shape
        cond_latents = x.new_zeros(batch, channels, frames, height, width)
        cond_latents[:, :, :1] = cond.image_latents.to(device=x.device, dtype=x.dtype)
        mask = x.new_zeros(batch, 1, frames, height, width)
        mask[:, :, 0] = 1.0
        return cond_latents, mask, cond.image_embeds.to(device=x.device)

    # --- the reference pipeline -----------------------------------------------------------------------
    def example_metadata(self, num_prompts: int) -> list[dict]:
        """One example first frame per prompt (coloured shapes: ``assets/edit``, or drawn into a temporary folder)."""
        from flowrl.models.tiny_flux_kontext import example_source_paths

        return [{SOURCE_KEY: path} for path in example_source_paths(num_prompts)]

    def pipeline_images(self, prompts: Sequence[str], *, group_size: int, num_steps: int, guidance_scale: float,
                        seeds: Sequence[int], metadata: Sequence[dict] | None = None) -> torch.Tensor:
        """HunyuanVideo15ImageToVideoPipeline's frames ``[N, T, 3, H, W]`` for the same seeds and first frames, one
        clip a call. The pipeline takes no size: it samples at the bucket of the image's aspect ratio, so each first
        frame goes in already cropped to the clip's size, which must be that bucket (one line where it is not)."""
        from flowrl.core.seeding import generators

        self.check_seeds(prompts, group_size, seeds)
        bucket = self.pipeline.video_processor.calculate_default_height_width(self.height, self.width,
                                                                               self.pipeline.target_size)
        if tuple(bucket) != (self.height, self.width):
            raise ValueError(f"{self.family}: the pipeline samples a {self.height}x{self.width} first frame at its "
                             f"bucket {bucket[0]}x{bucket[1]} (target_size {self.pipeline.target_size}); compare "
                             "with it at a bucket size")
        paths = source_path_lists(metadata, len(prompts), self.family, several=False, needs=NEEDS)
        clips = []
        with self.guided(guidance_scale):
            for i, prompt in enumerate(prompts):
                image = self.source_image(paths[i][0])
                for seed in seeds[i * group_size:(i + 1) * group_size]:
                    clips.append(self.pipeline(
                        image=image, prompt=[prompt], negative_prompt=self.negative_prompts(1),
                        num_frames=self.num_frames, num_inference_steps=num_steps,
                        generator=generators([seed], device=self.device), output_type="pt",
                    ).frames.float())
        return torch.cat(clips)
