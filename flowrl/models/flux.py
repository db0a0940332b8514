"""FLUX.1 policy adapter.

FLUX differs from SD3 in three ways, all hidden here: latents are packed into a sequence of 2x2
patches with position ids; the time shift is dynamic, ``mu`` growing linearly with the image
sequence length; and FLUX.1-dev is guidance-distilled, so the guidance scale is an embedding fed to
the transformer (one pass, no unconditional branch).
"""

from __future__ import annotations

import copy

import numpy as np
import torch

from flowrl.models.base import FLUX_LORA_TARGETS, PolicyBase, TextCond


def dynamic_mu(image_seq_len: int, config) -> float:
    """Dynamic shift: linear in the packed sequence length between the scheduler config's two anchors (diffusers'
    own ``calculate_shift``, which FLUX.1, Kontext and Qwen-Image pipelines call)."""
    from diffusers.pipelines.flux.pipeline_flux import calculate_shift

    return calculate_shift(image_seq_len, config.get("base_image_seq_len", 256), config.get("max_image_seq_len", 4096),
                           config.get("base_shift", 0.5), config.get("max_shift", 1.15))


def pack_patches(x: torch.Tensor) -> torch.Tensor:
    """[B, C, h, w] -> [B, (h/2)(w/2), 4C] sequence of 2x2 patches (FLUX.1's and Qwen-Image's ``_pack_latents``)."""
    b, c, h, w = x.shape
    x = x.reshape(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5)
    return x.reshape(b, (h // 2) * (w // 2), c * 4)


def unpack_patches(x: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """Inverse of :func:`pack_patches`: [B, (h/2)(w/2), 4C] -> [B, C, h, w]."""
    b, _, packed_channels = x.shape
    x = x.reshape(b, h // 2, w // 2, packed_channels // 4, 2, 2).permute(0, 3, 1, 4, 2, 5)
    return x.reshape(b, packed_channels // 4, h, w)


class FluxPolicy(PolicyBase):
    family = "flux"
    pipeline_class_name = "FluxPipeline"
    default_guidance = 3.5  # FLUX.1-dev's model card
    guidance_in_model = True  # the distilled-guidance embedding: one pass, no CFG batch
    # timestep + pooled text sum into one vector (temb); "blocks": the joint blocks whose image stream w modulates
    preference_sites = {"timestep": "time_text_embed", "pooled": "time_text_embed.text_embedder",
                        "blocks": "transformer_blocks"}

    @classmethod
    def tiny_pipeline(cls, seed: int = 0):
        from flowrl.models.tiny import tiny_flux_pipeline

        return tiny_flux_pipeline(seed)

    def __init__(self, pipeline, *, height: int | None = None, width: int | None = None,
                 max_sequence_length: int = 512):
        default = pipeline.default_sample_size * pipeline.vae_scale_factor
        super().__init__(pipeline, height=height or default, width=width or default)
        self.max_sequence_length = max_sequence_length

    def default_lora_targets(self) -> tuple[str, ...]:
        return FLUX_LORA_TARGETS

    def latent_shape(self, n: int) -> tuple[int, int, int, int]:
        scale = self.pipeline.vae_scale_factor * 2  # the VAE factor, then 2x2 packing
        channels = self.transformer.config.in_channels // 4
        return (n, channels, 2 * (self.height // scale), 2 * (self.width // scale))

    def encode(self, prompts: list[str], *, negative: bool = False, metadata=None) -> TextCond:
        """FLUX.1-dev needs no negative prompt; ``negative=True`` adds the empty one for true-CFG variants."""
        return self.encode_text(prompts, negative=negative)

    def encode_batch(self, prompts: list[str], device) -> tuple[torch.Tensor, torch.Tensor]:
        embeds, pooled, _ = self.pipeline.encode_prompt(
            prompt=prompts, prompt_2=None, device=device, max_sequence_length=self.max_sequence_length,
        )
        return embeds, pooled

    def finish_cond(self, cond: TextCond) -> TextCond:
        """Text position ids ``[L, 3]``: zeros, as ``FluxPipeline.encode_prompt`` makes them."""
        length = cond.prompt_embeds.shape[1]
        cond.text_ids = torch.zeros(length, 3, device=cond.prompt_embeds.device, dtype=cond.prompt_embeds.dtype)
        return cond

    def image_seq_len(self) -> int:
        _, _, h, w = self.latent_shape(1)
        return (h // 2) * (w // 2)

    def sigmas(self, num_steps: int) -> torch.Tensor:
        """Linear sigmas 1 -> 1/n, shifted by the resolution-dependent ``mu``; ``[n + 1]`` ending at 0."""
        scheduler = copy.deepcopy(self.pipeline.scheduler)
        mu = dynamic_mu(self.image_seq_len(), scheduler.config)
        scheduler.set_timesteps(sigmas=np.linspace(1.0, 1 / num_steps, num_steps), mu=mu, device="cpu")
        return scheduler.sigmas.float()

    pack = staticmethod(pack_patches)
    unpack = staticmethod(unpack_patches)

    def image_ids(self, h: int, w: int) -> torch.Tensor:
        """[(h/2)(w/2), 3] position ids of the packed patches (row, column in channels 1, 2).

        Cached per shape/device/dtype: rebuilding them on the CPU every step would make each step
        wait for a host-to-device copy."""
        key = (h, w, self.device, self.dtype)
        if getattr(self, "_image_ids_key", None) != key:
            ids = torch.zeros(h // 2, w // 2, 3)
            ids[..., 1] = torch.arange(h // 2)[:, None]
            ids[..., 2] = torch.arange(w // 2)[None, :]
            self._image_ids, self._image_ids_key = ids.reshape(-1, 3).to(device=self.device, dtype=self.dtype), key
        return self._image_ids

    def velocity(self, x: torch.Tensor, sigma, cond: TextCond, guidance_scale: float,
                 true_cfg_scale: float = 1.0) -> torch.Tensor:
        """v(x, sigma) ``[B, C, h, w]``; ``guidance_scale`` drives the distilled-guidance embedding."""
        _, _, h, w = x.shape
        out = self.token_velocity(self.pack(x.to(self.dtype)), self.image_ids(h, w), sigma, cond, guidance_scale,
                                  true_cfg_scale)
        return self.unpack(out, h, w)

    def token_velocity(self, tokens: torch.Tensor, ids: torch.Tensor, sigma, cond: TextCond, guidance_scale: float,
                       true_cfg_scale: float = 1.0) -> torch.Tensor:
        """The transformer's output ``[B, S, 4C]`` for image tokens ``[B, S, 4C]`` with position ids ``[S, 3]``:
        the timestep, the guidance embedding and (``true_cfg_scale > 1``) the true-CFG mix with the negative."""
        batch = tokens.shape[0]
        timestep = (torch.as_tensor(sigma, dtype=torch.float32, device=tokens.device) * 1000).expand(batch)
        timestep = timestep.to(self.dtype) / 1000
        guidance = None
        if self.transformer.config.guidance_embeds:
            guidance = torch.full((batch,), float(guidance_scale), device=tokens.device, dtype=torch.float32)
        common = dict(hidden_states=tokens, timestep=timestep, guidance=guidance, img_ids=ids, txt_ids=cond.text_ids)
        out = self.run_transformer(encoder_hidden_states=cond.prompt_embeds,
                                   pooled_projections=cond.pooled_prompt_embeds, **common)
        if true_cfg_scale > 1:
            negative = self.run_transformer(encoder_hidden_states=cond.negative_prompt_embeds,
                                            pooled_projections=cond.negative_pooled_prompt_embeds, **common)
            out = negative + true_cfg_scale * (out - negative)
        return out
