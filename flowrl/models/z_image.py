"""Z-Image / Z-Image-Turbo policy adapter (diffusers ``ZImagePipeline``).

Z-Image differs from the other families in four ways, all hidden here:

* Its transformer takes Python lists, one entry per sample: latents as ``[C, 1, h, w]`` tensors and captions as
  ``[L_i, D]`` tensors of each prompt's real tokens only (``ZImagePipeline._encode_prompt`` drops the padding).
  flowrl's text cache needs one fixed length, so the rows are stored zero-padded to ``max_sequence_length``
  and the lists are rebuilt from a mask (:meth:`ZImagePolicy.finish_cond`).
* Its time input runs backwards: the transformer sees ``(1000 - t) / 1000 = 1 - sigma`` and predicts the
  velocity from noise towards data, which the pipeline negates before the Euler step. :meth:`velocity`
  returns that negated prediction, so ``x_next = x + (sigma_next - sigma) v`` exactly as in the scheduler.
* Its guidance scale counts from 0: the pipeline mixes ``pos + g (pos - neg)`` and guides whenever ``g > 0``
  (Z-Image-Turbo samples with ``g = 0``). flowrl's ``guidance_scale`` w is the usual ``neg + w (pos - neg)``
  (guidance only for w > 1, as every other family and ``train.cfg=false`` assume), so ``g = w - 1``:
  w = 1 is Turbo's unguided sampling, w = 5 the base model's g = 4. :meth:`pipeline_guidance` converts.
* Its sigmas are ``linspace(1, 1/n, n)`` shifted by the scheduler: the pipeline always computes a dynamic
  ``mu`` from the image sequence length, which the released schedulers (static shift 3.0) ignore.
"""

from __future__ import annotations

import copy
from typing import Sequence

import torch

from flowrl.models.base import PolicyBase, TextCond, real_token_mask, with_padding_masks

# The diffusers DreamBooth-LoRA script for Z-Image (examples/dreambooth/train_dreambooth_lora_z_image.py)
# adapts the attention projections of every block (noise refiner, context refiner, joint layers).
Z_IMAGE_LORA_TARGETS: tuple[str, ...] = ("to_k", "to_q", "to_v", "to_out.0")


class ZImagePolicy(PolicyBase):
    family = "z_image"
    pipeline_class_name = "ZImagePipeline"
    default_guidance = 1.0  # Z-Image-Turbo's model card samples with the pipeline's guidance_scale=0 (no CFG)
    preference_sites = {"timestep": "t_embedder"}  # the adaLN input
    tiny_size = (64, 64)
    tiny_max_sequence_length = 32

    @classmethod
    def tiny_pipeline(cls, seed: int = 0):
        from flowrl.models.tiny_z_image import tiny_z_image_pipeline

        return tiny_z_image_pipeline(seed)

    def __init__(self, pipeline, *, height: int | None = None, width: int | None = None,
                 max_sequence_length: int = 512, cfg_normalization: float = 0.0, cfg_truncation: float = 1.0):
        """``cfg_normalization`` (> 0: cap the guided prediction's norm at that multiple of the conditional one's)
        and ``cfg_truncation`` (guidance off once ``1 - sigma`` exceeds it) are the pipeline's two CFG options,
        with its defaults (both off)."""
        super().__init__(pipeline, height=height or 1024, width=width or 1024)  # the pipeline's default size
        self.max_sequence_length = max_sequence_length
        self.cfg_normalization = float(cfg_normalization)
        self.cfg_truncation = float(cfg_truncation)

    def default_lora_targets(self) -> tuple[str, ...]:
        return Z_IMAGE_LORA_TARGETS

    # --- latents -------------------------------------------------------------------------
    def latent_shape(self, n: int) -> tuple[int, int, int, int]:
        scale = self.pipeline.vae_scale_factor * 2  # the VAE factor, then the transformer's 2x2 patches
        return (n, self.transformer.config.in_channels, 2 * (self.height // scale), 2 * (self.width // scale))

    def init_noise(self, n: int, generator=None) -> torch.Tensor:
        """Initial noise ``[n, C, h, w]``, in float32 whatever the model dtype: ZImagePipeline draws and keeps its
        latents in float32 and casts them to the transformer's dtype only as its input."""
        from diffusers.utils.torch_utils import randn_tensor

        return randn_tensor(self.latent_shape(n), generator=generator, device=self.device, dtype=torch.float32)

    def sigmas(self, num_steps: int) -> torch.Tensor:
        """The pipeline's schedule, ``[num_steps + 1]`` ending at 0: ``linspace(1, 1/n, n)`` through the scheduler's
        shift, with the ``mu`` the pipeline computes from the image sequence length (used only by a scheduler
        with ``use_dynamic_shifting``; the released ones shift statically by 3.0)."""
        from diffusers.pipelines.z_image.pipeline_z_image import get_default_z_image_sigmas

        from flowrl.models.flux import dynamic_mu

        scheduler = copy.deepcopy(self.pipeline.scheduler)
        _, _, h, w = self.latent_shape(1)
        mu = dynamic_mu((h // 2) * (w // 2), scheduler.config)
        scheduler.set_timesteps(sigmas=get_default_z_image_sigmas(num_steps), mu=mu, device="cpu")
        return scheduler.sigmas.float()

    # --- text ------------------------------------------------------------------------------
    def encode_batch(self, prompts: list[str], device) -> tuple[torch.Tensor, torch.Tensor]:
        """The pipeline's own encoding (chat template, Qwen3 ``hidden_states[-2]``, real tokens only), stacked
        front-aligned and zero-padded to ``max_sequence_length``: (embeds ``[B, L, D]``, pooled ``[B, 0]``)."""
        rows, _ = self.pipeline.encode_prompt(  # a copy: _encode_prompt rewrites its list in place
            prompt=list(prompts), device=device, do_classifier_free_guidance=False,
            max_sequence_length=self.max_sequence_length,
        )
        length, width = self.max_sequence_length, rows[0].shape[-1]
        embeds = rows[0].new_zeros(len(rows), length, width)  # [B, L, D]
        for i, row in enumerate(rows):  # row: [L_i, D], L_i <= L (the tokenizer truncates to L)
            embeds[i, :len(row)] = row
        return embeds, embeds.new_zeros(len(rows), 0)

    finish_cond = staticmethod(with_padding_masks)  # masks [B, L] of each prompt's real tokens (zero padding)

    # --- the model ---------------------------------------------------------------------------
    @staticmethod
    def pipeline_guidance(guidance_scale: float) -> float:
        """flowrl's w (``neg + w (pos - neg)``, guided for w > 1) -> ZImagePipeline's g (``pos + g (pos - neg)``,
        guided for g > 0): ``g = w - 1``, and 0 (unguided) for every w <= 1."""
        return float(guidance_scale) - 1.0 if guidance_scale > 1 else 0.0

    def velocity(self, x: torch.Tensor, sigma, cond: TextCond, guidance_scale: float) -> torch.Tensor:
        """v(x, sigma) ``[B, C, h, w]`` float32, one ZImagePipeline step: with guidance (w > 1, unless truncated at
        this sigma) the conditional and the negative rows run as one batch, mixed ``pos + (w - 1) (pos - neg)``,
        optionally renormalised; the model's prediction is negated into flowrl's velocity."""
        batch = x.shape[0]
        t = torch.as_tensor(sigma, dtype=torch.float32, device=x.device) * 1000  # the scheduler's timestep
        t_norm = (1000 - t) / 1000  # the transformer's time input, 1 - sigma
        scale = self.pipeline_guidance(guidance_scale)
        # The pipeline drops guidance (and its negative pass) once 1 - sigma > cfg_truncation; 1 - sigma never
        # exceeds 1, so the default 1.0 needs no look at sigma (a device sync per step).
        if scale > 0 and self.cfg_truncation < 1 and t_norm.item() > self.cfg_truncation:
            scale = 0.0
        captions = _caption_rows(cond.prompt_embeds, cond.prompt_mask)  # B x [L_i, D]
        latents = x.to(self.dtype)
        if scale > 0:
            if not cond.has_negative:
                raise ValueError("guidance_scale > 1 needs negative embeddings: encode(prompts, negative=True)")
            captions = captions + _caption_rows(cond.negative_prompt_embeds, cond.negative_prompt_mask)
            latents = latents.repeat(2, 1, 1, 1)  # [2B, C, h, w]: conditional rows, then negative rows
        out = self.run_transformer(
            x=list(latents.unsqueeze(2).unbind(0)),  # 2B or B x [C, 1, h, w]
            t=t_norm.expand(latents.shape[0]),
            cap_feats=captions,
        )
        pred = torch.stack([o.float() for o in out]).squeeze(2)  # [2B or B, C, h, w]
        if scale > 0:
            pos, neg = pred[:batch], pred[batch:]
            pred = pos + scale * (pos - neg)
            if self.cfg_normalization > 0:
                pred = torch.stack([self._renormalise(p, q) for p, q in zip(pos, pred)])
        return -pred

    def _renormalise(self, pos: torch.Tensor, guided: torch.Tensor) -> torch.Tensor:
        """The pipeline's cfg_normalization for one sample: the guided prediction's norm capped at
        ``cfg_normalization`` times the conditional one's."""
        limit = torch.linalg.vector_norm(pos) * self.cfg_normalization
        norm = torch.linalg.vector_norm(guided)
        return guided * (limit / norm) if norm > limit else guided

    def pipeline_images(self, prompts: Sequence[str], *, group_size: int, num_steps: int, guidance_scale: float,
                        seeds: Sequence[int], metadata: Sequence[dict] | None = None) -> torch.Tensor:
        """ZImagePipeline for the same images, flowrl's guidance converted to the pipeline's (:meth:`pipeline_guidance`)
        and the same CFG options and negative prompt."""
        from flowrl.core.seeding import generators

        return self.pipeline(
            prompt=list(prompts), negative_prompt=self.negative_prompts(len(prompts)),
            num_images_per_prompt=group_size, num_inference_steps=num_steps,
            guidance_scale=self.pipeline_guidance(guidance_scale), cfg_normalization=self.cfg_normalization,
            cfg_truncation=self.cfg_truncation, height=self.height, width=self.width,
            generator=generators(list(seeds), device=self.device), output_type="pt",
            max_sequence_length=self.max_sequence_length,
        ).images


def _caption_rows(embeds: torch.Tensor, mask: torch.Tensor | None) -> list[torch.Tensor]:
    """[B, L, D] zero-padded embeddings -> the transformer's ``cap_feats``: B tensors ``[L_i, D]``, real tokens."""
    mask = real_token_mask(embeds) if mask is None else mask
    return [row[keep] for row, keep in zip(embeds, mask)]
