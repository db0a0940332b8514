"""Qwen-Image policy adapter.

Qwen-Image differs from FLUX.1 in four ways, all hidden here:

* its text is the last hidden state of a Qwen2.5-VL language model run on a chat template, with the
  template's prefix (``prompt_template_encode_start_idx`` tokens) dropped, so the prompt length varies and
  the transformer takes a text mask; there is no pooled vector;
* guidance is true classifier-free guidance with a negative prompt (two transformer passes), followed
  by a rescale of the combined prediction to the norm of the conditional one;
* its VAE is the 3-D causal (Wan-style) one: latents are ``[B, C, 1, h, w]`` and normalised per channel
  with ``latents_mean``/``latents_std`` instead of a scaling and shift factor;
* the time shift is dynamic (``mu`` from the packed sequence length) on an exponential shift with a
  terminal sigma, all in the scheduler config.

flowrl keeps its latents 4-D ``[N, C, h, w]`` (the frame axis of a single image squeezed), packs them
into 2x2 patches inside :meth:`QwenImagePolicy.velocity`, and restores the frame axis in :meth:`decode`.
"""

from __future__ import annotations

import copy

import numpy as np
import torch
import torch.nn.functional as F

from flowrl.models.base import PolicyBase, TextCond, real_token_mask, unnormalise_latents, with_padding_masks
from flowrl.models.flux import dynamic_mu, pack_patches, unpack_patches

# diffusers examples/dreambooth/train_dreambooth_lora_qwen_image.py (its default without --lora_layers):
# the image-stream attention projections of every block.
QWEN_IMAGE_LORA_TARGETS: tuple[str, ...] = ("to_k", "to_q", "to_v", "to_out.0")


class QwenImagePolicy(PolicyBase):
    family = "qwen_image"
    pipeline_class_name = "QwenImagePipeline"
    default_guidance = 4.0  # QwenImagePipeline's true_cfg_scale default (the model card samples with 4.0)
    preference_sites = {"timestep": "time_text_embed"}  # the timestep projection (no pooled text)
    tiny_size = (64, 64)
    tiny_max_sequence_length = 32

    @classmethod
    def tiny_pipeline(cls, seed: int = 0):
        from flowrl.models.tiny_qwen_image import tiny_qwen_image_pipeline

        return tiny_qwen_image_pipeline(seed)

    def __init__(self, pipeline, *, height: int | None = None, width: int | None = None,
                 max_sequence_length: int = 512):
        default = pipeline.default_sample_size * pipeline.vae_scale_factor  # 1024 px
        super().__init__(pipeline, height=height or default, width=width or default)
        self.max_sequence_length = max_sequence_length

    def default_lora_targets(self) -> tuple[str, ...]:
        return QWEN_IMAGE_LORA_TARGETS

    def latent_shape(self, n: int) -> tuple[int, int, int, int]:
        """``[n, C, h, w]``: the pipeline's ``[n, 1, C, h, w]`` noise without its frame axis.

        Same number of elements in the same order, so :meth:`PolicyBase.init_noise` draws exactly the noise of
        ``QwenImagePipeline.prepare_latents`` for the same generators (one or one per image)."""
        scale = self.pipeline.vae_scale_factor * 2  # the VAE factor, then 2x2 packing
        channels = self.transformer.config.in_channels // 4
        return (n, channels, 2 * (self.height // scale), 2 * (self.width // scale))

    # --- text ------------------------------------------------------------------------------
    def encode_batch(self, prompts: list[str], device) -> tuple[torch.Tensor, torch.Tensor]:
        """The pipeline's own ``encode_prompt``, zero-padded from the batch's longest prompt to a fixed
        ``max_sequence_length`` (the text cache concatenates chunks); pooled is zero-width ``[B, 0]``."""
        embeds, _ = self.pipeline.encode_prompt(prompt=prompts, device=device,
                                                max_sequence_length=self.max_sequence_length)
        embeds = F.pad(embeds, (0, 0, 0, self.max_sequence_length - embeds.shape[1]))  # [B, max_len, D]
        return embeds, embeds.new_zeros(embeds.shape[0], 0)

    finish_cond = staticmethod(with_padding_masks)  # the text masks [B, L], from encode_batch's zero padding

    # --- sampling --------------------------------------------------------------------------
    def image_seq_len(self) -> int:
        _, _, h, w = self.latent_shape(1)
        return (h // 2) * (w // 2)

    def sigmas(self, num_steps: int) -> torch.Tensor:
        """The pipeline's sigmas: linspace(1, 1/n, n), shifted by ``mu`` of the packed sequence length (exponential
        shift, stretched to the terminal sigma, as the scheduler config says); ``[n + 1]`` ending at 0."""
        scheduler = copy.deepcopy(self.pipeline.scheduler)
        mu = dynamic_mu(self.image_seq_len(), scheduler.config)
        scheduler.set_timesteps(sigmas=np.linspace(1.0, 1 / num_steps, num_steps), mu=mu, device="cpu")
        return scheduler.sigmas.float()

    pack = staticmethod(pack_patches)  # [B, C, h, w] -> [B, (h/2)(w/2), 4C], QwenImagePipeline._pack_latents
    unpack = staticmethod(unpack_patches)

    @staticmethod
    def trim_text(embeds: torch.Tensor, mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Cut ``[B, L, D]`` text to the batch's longest real prompt; the mask is None when nothing is padding.

        This hands the transformer what ``encode_prompt`` hands it for the same rows (real tokens come first,
        RoPE positions depend only on the index, padding is masked out of attention), and skips the attention
        work on up to ``max_sequence_length`` padding tokens."""
        mask = real_token_mask(embeds) if mask is None else mask  # [B, L]
        length = max(int(mask.sum(dim=1).max()), 1)
        embeds, mask = embeds[:, :length], mask[:, :length]
        return embeds, (None if bool(mask.all()) else mask)

    def velocity(self, x: torch.Tensor, sigma, cond: TextCond, guidance_scale: float) -> torch.Tensor:
        """v(x, sigma) ``[B, C, h, w]``; with ``guidance_scale > 1`` the true CFG of :meth:`token_velocity`."""
        _, _, h, w = x.shape
        out = self.token_velocity(self.pack(x.to(self.dtype)), [(1, h // 2, w // 2)], sigma, cond, guidance_scale)
        return self.unpack(out, h, w)

    def token_velocity(self, tokens: torch.Tensor, img_shapes: list[tuple[int, int, int]], sigma, cond: TextCond,
                       guidance_scale: float, num_noisy: int | None = None) -> torch.Tensor:
        """The transformer on packed image tokens ``[B, S, 4C]`` (the noisy ones first, then any conditioning
        image's, one ``(frames, h, w)`` grid each in ``img_shapes``) -> the velocity of the first ``num_noisy``
        (default all) ``[B, num_noisy, 4C]``. With ``guidance_scale > 1`` the pipeline's true CFG: a second pass
        on the negative, v_n + w (v_c - v_n), rescaled per token to the norm of v_c."""
        batch, num_noisy = tokens.shape[0], num_noisy or tokens.shape[1]
        timestep = (torch.as_tensor(sigma, dtype=torch.float32, device=tokens.device) * 1000).expand(batch)
        timestep = timestep.to(self.dtype) / 1000  # as the pipeline: t (= 1000 sigma) in the latents' dtype, / 1000
        common = dict(hidden_states=tokens, timestep=timestep, img_shapes=[list(img_shapes)] * batch)
        embeds, mask = self.trim_text(cond.prompt_embeds, cond.prompt_mask)
        out = self.run_transformer(encoder_hidden_states=embeds, encoder_hidden_states_mask=mask, **common)
        out = out[:, :num_noisy]  # [B, num_noisy, 4C]
        if guidance_scale > 1:
            if not cond.has_negative:
                raise ValueError("guidance_scale > 1 needs negative embeddings: encode(prompts, negative=True)")
            embeds, mask = self.trim_text(cond.negative_prompt_embeds, cond.negative_prompt_mask)
            negative = self.run_transformer(encoder_hidden_states=embeds, encoder_hidden_states_mask=mask, **common)
            negative = negative[:, :num_noisy]
            combined = negative + guidance_scale * (out - negative)  # [B, num_noisy, 4C]
            out = combined * (torch.norm(out, dim=-1, keepdim=True) / torch.norm(combined, dim=-1, keepdim=True))
        return out

    # --- images ----------------------------------------------------------------------------
    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Clean latents ``[N, C, h, w]`` -> images ``[N, 3, H, W]`` in [0, 1]: the frame axis restored and the
        per-channel normalisation undone exactly as ``QwenImagePipeline`` does (x / (1 / std) + mean)."""
        latents = unnormalise_latents(latents.unsqueeze(2), self.vae)  # [N, C, 1, h, w]
        images = self.vae.decode(latents, return_dict=False)[0][:, :, 0]  # [N, 3, H, W]
        return (images.float() / 2 + 0.5).clamp(0, 1)

    def pipeline_images(self, prompts, *, group_size: int, num_steps: int, guidance_scale: float, seeds,
                        metadata=None) -> torch.Tensor:
        """``QwenImagePipeline`` for the same seeds: ``guidance_scale`` is its ``true_cfg_scale``, and the negative
        is ``negative_prompt``, one per prompt (any non-None negative enables its CFG; flowrl's default is "")."""
        from flowrl.core.seeding import generators

        cfg = guidance_scale > 1
        return self.pipeline(
            prompt=list(prompts), negative_prompt=self.negative_prompts(len(prompts)) if cfg else None, true_cfg_scale=guidance_scale,
            num_images_per_prompt=group_size, num_inference_steps=num_steps, height=self.height, width=self.width,
            generator=generators(list(seeds), device=self.device), output_type="pt",
            max_sequence_length=self.max_sequence_length,
        ).images
