"""Stable Diffusion 3 / 3.5 policy adapter.

SD3 uses a static time shift (3.0 for SD3.5-M/L) baked into its FlowMatchEulerDiscreteScheduler,
classifier-free guidance by batching the unconditional and conditional passes, and three text
encoders (CLIP-L, CLIP-G, T5) whose embeddings we compute once per prompt batch with the
pipeline's own ``encode_prompt`` (or look up in the text cache: ``flowrl.models.text_cache``); the
negative is the empty prompt's embedding, encoded like any other prompt.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager

import torch

from flowrl.models.base import SD3_LORA_TARGETS, PolicyBase, TextCond


class SD3Policy(PolicyBase):
    family = "sd3"
    pipeline_class_name = "StableDiffusion3Pipeline"
    default_guidance = 4.5  # SD3.5-medium's model card
    # timestep + pooled text sum into one vector (temb); "blocks": the joint blocks whose image stream w modulates
    preference_sites = {"timestep": "time_text_embed", "pooled": "time_text_embed.text_embedder",
                        "blocks": "transformer_blocks"}

    @classmethod
    def tiny_pipeline(cls, seed: int = 0):
        from flowrl.models.tiny import tiny_sd3_pipeline

        return tiny_sd3_pipeline(seed)

    def __init__(self, pipeline, *, height: int | None = None, width: int | None = None,
                 max_sequence_length: int = 256):
        default = pipeline.default_sample_size * pipeline.vae_scale_factor
        super().__init__(pipeline, height=height or default, width=width or default)
        self.max_sequence_length = max_sequence_length

    def default_lora_targets(self) -> tuple[str, ...]:
        return SD3_LORA_TARGETS

    def latent_shape(self, n: int) -> tuple[int, int, int, int]:
        scale = self.pipeline.vae_scale_factor
        return (n, self.transformer.config.in_channels, self.height // scale, self.width // scale)

    def encode_batch(self, prompts: list[str], device) -> tuple[torch.Tensor, torch.Tensor]:
        with _quiet(type(self.pipeline).__module__):
            embeds, _, pooled, _ = self.pipeline.encode_prompt(
                prompt=prompts, prompt_2=None, prompt_3=None, device=device, do_classifier_free_guidance=False,
                max_sequence_length=self.max_sequence_length,
            )
        return embeds, pooled

    def velocity(self, x: torch.Tensor, sigma, cond: TextCond, guidance_scale: float) -> torch.Tensor:
        """v(x, sigma) ``[B, C, h, w]``; with ``guidance_scale > 1`` the CFG mix v_u + w (v_c - v_u)."""
        batch = x.shape[0]
        timestep = (torch.as_tensor(sigma, dtype=torch.float32, device=x.device) * 1000).expand(batch)
        x = x.to(self.dtype)
        if guidance_scale > 1:
            if not cond.has_negative:
                raise ValueError("guidance_scale > 1 needs negative embeddings: encode(prompts, negative=True)")
            out = self.run_transformer(
                hidden_states=torch.cat([x, x]),
                timestep=torch.cat([timestep, timestep]),
                encoder_hidden_states=torch.cat([cond.negative_prompt_embeds, cond.prompt_embeds]),
                pooled_projections=torch.cat([cond.negative_pooled_prompt_embeds, cond.pooled_prompt_embeds]),
            )
            uncond, text = out.chunk(2)
            return uncond + guidance_scale * (text - uncond)
        return self.run_transformer(
            hidden_states=x, timestep=timestep, encoder_hidden_states=cond.prompt_embeds,
            pooled_projections=cond.pooled_prompt_embeds,
        )


@contextmanager
def _quiet(logger_name: str):
    """Silence a pipeline's warnings while it encodes: it warns on every batch that the T5 prompt was
    truncated to ``max_sequence_length``, which is the configured behaviour (the toy model uses 1)."""
    logger = logging.getLogger(logger_name)
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)
