"""HunyuanVideo-1.5 text-to-video policy adapter (``HunyuanVideo15Pipeline``).

Follows diffusers' ``pipelines/hunyuan_video1_5/pipeline_hunyuan_video1_5.py``; what differs from Wan, all here:

- **Two text encoders.** A Qwen2.5-VL language model reads each prompt inside a chat template with a fixed system
  message; its third-to-last hidden state, the template's first ``prompt_template_encode_start_idx`` (108) tokens
  cropped, padded to ``tokenizer_max_length`` tokens (1000 in the pipeline, ``model.max_sequence_length`` here: the
  adapter sets the pipeline's attribute, so the pipeline's own call uses the same length). A byT5 glyph encoder
  reads the quoted text of the prompt (``"..."``), 256 tokens; a prompt without quotes gives zeros and an all-zero
  mask. flowrl stores the LLM states in ``prompt_embeds [B, L, D]`` and the glyph states, flattened, in
  ``pooled_prompt_embeds [B, 256 * D2]`` (both text, both in the text cache); padding rows are zeroed so the masks
  are rebuilt from the embeddings (:func:`~flowrl.models.base.real_token_mask`). This is exact: the transformer
  zeroes padded tokens itself and masks them in every attention.
- **Conditioning channels.** The transformer takes ``[latents, conditioning latents, mask]`` along the channels
  (``2 C + 1``); text-to-video passes zeros for both, and a zero SigLIP sequence (``vision_num_semantic_tokens``)
  that the transformer recognises as "no image" and masks out.
- **Guidance is the pipeline's guider**, not a call argument: ``ClassifierFreeGuidance`` (6.0 in the released
  configs), two passes, conditional then unconditional, mixed by the guider's formula (``guidance_rescale`` and
  ``use_original_formulation`` read from its config). :meth:`pipeline_images` swaps in ``guider.new(guidance_scale=)``.
- **Sigmas** are ``linspace(1, 0, N + 1)[:-1]`` through the scheduler's static shift (5.0 at 480p), not the
  scheduler's own ``set_timesteps(N)`` spacing.
- **Decoding** divides by the VAE's ``scaling_factor`` (no shift) and decodes one clip at a time: the VAE's causal
  attention mask (``[B, L, L]`` against ``[B, 1, L, L]`` queries) does not broadcast for a batch of several clips
  in diffusers 0.42, and one clip a call is what VAE slicing does. For the same reason, and because the pipeline's
  zero image sequence has one row per prompt rather than per video, the reference call renders one clip a call.
"""

from __future__ import annotations

import copy
import math
from typing import Sequence

import numpy as np
import torch

from flowrl.models.base import PolicyBase, TextCond, real_token_mask
from flowrl.models.sd3 import _quiet

# UniRL's HunyuanVideo-1.5 GRPO recipe (Tencent-Hunyuan/UniRL, examples/diffusion/hunyuan_video15/
# hunyuan_video15_t2v_dancegrpo_trainside.yaml, lora_cfg.target_modules): attention and feed-forward of both streams
# of every double-stream block. diffusers ships no DreamBooth-LoRA script for HunyuanVideo-1.5. The "attn." and "ff."
# suffixes also match the text token refiner's blocks, as in UniRL.
HUNYUAN_VIDEO15_LORA_TARGETS: tuple[str, ...] = (
    "attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0",
    "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj", "attn.to_add_out",
    "ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2",
)
DEFAULT_ASPECT = (9, 16)  # (height, width): the T2V pipeline's default_aspect_ratio, bucketed at target_size


class HunyuanVideo15Policy(PolicyBase):
    """HunyuanVideo-1.5 T2V; the base of :class:`~flowrl.models.hunyuan_video15_i2v.HunyuanVideo15I2VPolicy`."""

    family = "hunyuan_video15"
    pipeline_class_name = "HunyuanVideo15Pipeline"
    default_guidance = 6.0  # the released guider's guidance_scale
    preference_sites = {"timestep": "time_embed"}  # temb, the vector that modulates every block
    video = True
    tiny_size = (32, 32)
    tiny_max_sequence_length = 32
    default_num_frames = 5
    """Frames per clip when none is given: UniRL's HunyuanVideo-1.5 GRPO recipe trains on 5-frame clips (2 latent
    frames); the pipeline's own default is 121. ``model.num_frames`` sets it."""

    @classmethod
    def tiny_pipeline(cls, seed: int = 0):
        from flowrl.models.tiny_hunyuan_video15 import tiny_hunyuan_video15_pipeline

        return tiny_hunyuan_video15_pipeline(seed)

    def __init__(self, pipeline, *, height: int | None = None, width: int | None = None,
                 max_sequence_length: int = 1000, num_frames: int | None = None):
        if height is None or width is None:  # the pipeline's default: the 16:9 bucket of target_size (480 x 848)
            default = pipeline.video_processor.calculate_default_height_width(*DEFAULT_ASPECT, pipeline.target_size)
            height, width = height or default[0], width or default[1]
        super().__init__(pipeline, height=height, width=width)
        self.check_guider(pipeline.guider)
        self.max_sequence_length = max_sequence_length
        pipeline.tokenizer_max_length = max_sequence_length  # the pipeline's own text length, for its own calls too
        self.num_frames = num_frames or self.default_num_frames
        self.check_size(self.height, self.width, self.num_frames)

    def check_guider(self, guider) -> None:
        """The guider's math must be a per-step function of the velocity: classifier-free guidance at every step."""
        from diffusers.guiders import ClassifierFreeGuidance

        if not isinstance(guider, ClassifierFreeGuidance) or (guider._start, guider._stop) != (0.0, 1.0):
            raise ValueError(f"{self.family}: the pipeline's guider is {type(guider).__name__} with start/stop "
                             f"{getattr(guider, '_start', None)}/{getattr(guider, '_stop', None)}; flowrl follows "
                             "ClassifierFreeGuidance over every step (start 0, stop 1): reset model_index.json's guider")

    # --- size ----------------------------------------------------------------------------------
    @property
    def size_multiple(self) -> int:
        return self.pipeline.vae_scale_factor_spatial * self.transformer.config.patch_size

    def check_size(self, height: int, width: int, num_frames: int | None = None) -> None:
        temporal = self.pipeline.vae_scale_factor_temporal
        if num_frames is not None and (num_frames < 1 or (num_frames - 1) % temporal):
            raise ValueError(f"{self.family} needs num_frames = {temporal} k + 1 (1, 5, 9, ... 121), got {num_frames}")
        multiple = self.size_multiple
        if height % multiple or width % multiple:
            raise ValueError(f"{self.family} needs height and width divisible by {multiple}, got {height}x{width}")

    def default_lora_targets(self) -> tuple[str, ...]:
        return HUNYUAN_VIDEO15_LORA_TARGETS

    @classmethod
    def load_exported_lora(cls, pipeline, directory) -> None:
        """The HunyuanVideo-1.5 pipelines have no ``load_lora_weights`` (no LoRA loader mixin in diffusers 0.42): a
        plain diffusers user loads the export into the transformer, ``transformer.load_lora_adapter``, whose
        ``transformer.`` key prefix the export carries."""
        from flowrl.models.lora_io import DIFFUSERS_WEIGHT_NAME

        pipeline.transformer.load_lora_adapter(str(directory), weight_name=DIFFUSERS_WEIGHT_NAME, prefix="transformer")

    # --- latents -------------------------------------------------------------------------------
    def latent_shape(self, n: int) -> tuple[int, int, int, int, int]:
        """``(n, C, F, h, w)`` as ``prepare_latents``: F = (frames - 1) / 4 + 1, h, w = pixels / 16, C = 32."""
        spatial, temporal = self.pipeline.vae_scale_factor_spatial, self.pipeline.vae_scale_factor_temporal
        return (n, self.pipeline.num_channels_latents, (self.num_frames - 1) // temporal + 1,
                self.height // spatial, self.width // spatial)

    def sigmas(self, num_steps: int) -> torch.Tensor:
        """``[num_steps + 1]``: the pipeline's ``linspace(1, 0, N + 1)[:-1]`` through the scheduler's shift, then 0."""
        scheduler = copy.deepcopy(self.pipeline.scheduler)
        scheduler.set_timesteps(sigmas=np.linspace(1.0, 0.0, num_steps + 1)[:-1], device="cpu")
        return scheduler.sigmas.float()

    # --- text ----------------------------------------------------------------------------------
    def encode_batch(self, prompts: list[str], device) -> tuple[torch.Tensor, torch.Tensor]:
        """The pipeline's ``encode_prompt``: LLM states ``[B, L, D]`` and glyph states flattened ``[B, 256 * D2]``,
        each zero where its mask is 0 (see the module docstring)."""
        with _quiet(type(self.pipeline).__module__):
            embeds, mask, glyph, glyph_mask = self.pipeline.encode_prompt(prompt=prompts, device=device,
                                                                          batch_size=len(prompts))
        embeds = torch.where(mask.bool()[..., None], embeds, torch.zeros_like(embeds))  # [B, L, D]
        glyph = torch.where(glyph_mask.bool()[..., None], glyph, torch.zeros_like(glyph))  # [B, 256, D2]
        return embeds, glyph.flatten(1)

    def finish_cond(self, cond: TextCond) -> TextCond:
        cond.prompt_mask = real_token_mask(cond.prompt_embeds)
        if cond.has_negative:
            cond.negative_prompt_mask = real_token_mask(cond.negative_prompt_embeds)
        return cond

    def text_inputs(self, embeds: torch.Tensor, glyph: torch.Tensor, mask: torch.Tensor | None) -> dict:
        """The transformer's text arguments from one side of the conditioning: masks as 0/1 in the transformer's dtype,
        as ``encode_prompt`` returns them."""
        glyph = glyph.unflatten(1, (-1, self.transformer.config.text_embed_2_dim))  # [B, 256, D2]
        mask = real_token_mask(embeds) if mask is None else mask
        return dict(encoder_hidden_states=embeds.to(self.dtype), encoder_attention_mask=mask.to(self.dtype),
                    encoder_hidden_states_2=glyph.to(self.dtype),
                    encoder_attention_mask_2=real_token_mask(glyph).to(self.dtype))

    # --- the model -----------------------------------------------------------------------------
    def image_inputs(self, x: torch.Tensor, cond: TextCond) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(conditioning latents ``[B, C, F, h, w]``, mask ``[B, 1, F, h, w]``, SigLIP states ``[B, T, Di]``):
        text-to-video's zeros (``prepare_cond_latents_and_mask``; the zero image sequence the transformer masks)."""
        batch, channels, frames, height, width = x.shape
        zeros = x.new_zeros(batch, channels, frames, height, width)
        image_embeds = x.new_zeros(batch, self.pipeline.vision_num_semantic_tokens, self.pipeline.vision_states_dim)
        return zeros, x.new_zeros(batch, 1, frames, height, width), image_embeds

    def cfg_active(self, guidance_scale: float) -> bool:
        """Whether the guider runs the unconditional pass at ``guidance_scale`` (its ``_is_cfg_enabled``)."""
        guider = self.pipeline.guider
        off_value = 0.0 if guider.use_original_formulation else 1.0
        return guider._enabled and not math.isclose(guidance_scale, off_value)

    def velocity(self, x: torch.Tensor, sigma, cond: TextCond, guidance_scale: float) -> torch.Tensor:
        """v(x, sigma) ``[B, C, F, h, w]``: the conditional pass, and where the guider is active the unconditional
        one, mixed as ``ClassifierFreeGuidance.forward`` does."""
        x = x.to(self.dtype)
        cond_latents, mask, image_embeds = self.image_inputs(x, cond)
        hidden = torch.cat([x, cond_latents.to(self.dtype), mask.to(self.dtype)], dim=1)  # [B, 2C + 1, F, h, w]
        timestep = (torch.as_tensor(sigma, dtype=torch.float32, device=x.device) * 1000).expand(x.shape[0])
        common = dict(hidden_states=hidden, image_embeds=image_embeds.to(self.dtype), timestep=timestep.to(self.dtype))
        text = self.run_transformer(**common, **self.text_inputs(cond.prompt_embeds, cond.pooled_prompt_embeds,
                                                                 cond.prompt_mask))
        if not self.cfg_active(guidance_scale):
            return text
        if not cond.has_negative:
            raise ValueError("guidance_scale != 1 needs negative embeddings: encode(prompts, negative=True)")
        uncond = self.run_transformer(**common, **self.text_inputs(
            cond.negative_prompt_embeds, cond.negative_pooled_prompt_embeds, cond.negative_prompt_mask))
        guider = self.pipeline.guider
        pred = (text if guider.use_original_formulation else uncond) + guidance_scale * (text - uncond)
        if guider.guidance_rescale > 0.0:
            from diffusers.guiders.guider_utils import rescale_noise_cfg

            pred = rescale_noise_cfg(pred, text, guider.guidance_rescale)
        return pred

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Clean latents ``[N, C, F, h, w]`` -> frames ``[N, T, 3, H, W]`` in [0, 1] (float32), one clip a VAE call
        (see the module docstring), ``latents / scaling_factor`` as the pipeline decodes."""
        scaled = latents.to(self.vae.dtype) / self.vae.config.scaling_factor
        videos = [self.vae.decode(clip, return_dict=False)[0] for clip in scaled.split(1)]  # [1, 3, T, H, W] each
        video = torch.cat(videos)
        return (video.float() / 2 + 0.5).clamp(0, 1).permute(0, 2, 1, 3, 4).contiguous()

    # --- the reference pipeline ----------------------------------------------------------------
    @staticmethod
    def check_seeds(prompts: Sequence[str], group_size: int, seeds: Sequence[int]) -> None:
        if len(seeds) != len(prompts) * group_size:
            raise ValueError(f"need {len(prompts) * group_size} seeds, got {len(seeds)}")

    def pipeline_images(self, prompts: Sequence[str], *, group_size: int, num_steps: int, guidance_scale: float,
                        seeds: Sequence[int], metadata: Sequence[dict] | None = None) -> torch.Tensor:
        """HunyuanVideo15Pipeline's frames ``[N, T, 3, H, W]`` for the same seeds, one clip a call (see the module
        docstring), with the guider at ``guidance_scale``."""
        from flowrl.core.seeding import generators

        self.check_seeds(prompts, group_size, seeds)
        rows = [(prompt, seed) for i, prompt in enumerate(prompts) for seed in seeds[i * group_size:(i + 1) * group_size]]
        with self.guided(guidance_scale):
            return torch.cat([self.pipeline(
                prompt=[prompt], negative_prompt=self.negative_prompts(1), height=self.height, width=self.width,
                num_frames=self.num_frames, num_inference_steps=num_steps,
                generator=generators([seed], device=self.device), output_type="pt",
            ).frames.float() for prompt, seed in rows])

    def guided(self, guidance_scale: float):
        """A context in which the pipeline's guider runs at ``guidance_scale`` (the guider's ``new``)."""
        import contextlib

        @contextlib.contextmanager
        def swap():
            guider = self.pipeline.guider
            with _quiet("diffusers.guiders"):
                self.pipeline.guider = guider.new(guidance_scale=guidance_scale)
            try:
                yield
            finally:
                self.pipeline.guider = guider

        return swap()
