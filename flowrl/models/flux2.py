"""FLUX.2 [klein] policy adapter (``Flux2KleinPipeline``: klein 4B / 9B, distilled and base).

The latent layout, position ids, schedule, text encoding and decoding are FLUX.2's, shared with [dev]
(:mod:`flowrl.models.flux2_base`). What is klein's own:

- Text is one Qwen3 LLM read at hidden layers 9, 18 and 27.
- Guidance: no guidance embedding. The base models use real CFG with the empty prompt (a second, unconditional
  pass); the step-distilled models (``is_distilled`` in the pipeline config) ignore ``guidance_scale``.
"""

from __future__ import annotations

import torch

from flowrl.models.base import TextCond
from flowrl.models.flux2_base import Flux2PolicyBase

# train_dreambooth_lora_flux2_klein.py (diffusers examples): the attention projections of the double-stream
# blocks and the fused QKV+MLP input of the single-stream blocks; their output projections ``attn.to_out`` are
# listed per block (``FLUX2_SINGLE_OUT``) because the bare name would also match the double blocks' ModuleList.
FLUX2_LORA_TARGETS: tuple[str, ...] = ("to_k", "to_q", "to_v", "to_out.0", "to_qkv_mlp_proj")
FLUX2_SINGLE_OUT = "single_transformer_blocks.{}.attn.to_out"
TEXT_ENCODER_OUT_LAYERS = (9, 18, 27)  # Flux2KleinPipeline's default text_encoder_out_layers


class Flux2KleinPolicy(Flux2PolicyBase):
    family = "flux2_klein"
    pipeline_class_name = "Flux2KleinPipeline"
    default_guidance = 4.0  # Flux2KleinPipeline.__call__'s default (the base models' CFG; distilled ignore it)
    preference_sites = {"timestep": "time_guidance_embed"}  # the timestep + guidance embedding
    tiny_max_sequence_length = 32
    text_encoder_out_layers = TEXT_ENCODER_OUT_LAYERS

    @classmethod
    def tiny_pipeline(cls, seed: int = 0):
        from flowrl.models.tiny_flux2 import tiny_flux2_klein_pipeline

        return tiny_flux2_klein_pipeline(seed)

    @property
    def is_distilled(self) -> bool:
        """Step-distilled klein models sample without CFG, whatever the guidance scale."""
        return bool(self.pipeline.config.get("is_distilled", False))

    def default_lora_targets(self) -> tuple[str, ...]:
        singles = self.transformer.config.num_single_layers
        return FLUX2_LORA_TARGETS + tuple(FLUX2_SINGLE_OUT.format(i) for i in range(singles))

    def encode(self, prompts: list[str], *, negative: bool | None = None, metadata=None) -> TextCond:
        """The empty prompt is the CFG negative of the base models; distilled ones need none (default)."""
        return self.encode_text(prompts, negative=not self.is_distilled if negative is None else negative)

    def velocity(self, x: torch.Tensor, sigma, cond: TextCond, guidance_scale: float) -> torch.Tensor:
        """v(x, sigma) ``[B, C, h, w]``; base models with ``guidance_scale > 1``: v_u + w (v_c - v_u), both
        branches in one batched pass (the pipeline runs two; same math, one forward for DDP)."""
        batch, _, h, w = x.shape
        timestep = self.timesteps(sigma, batch, x.device)  # [B]
        tokens = self.pack(x.to(self.dtype))  # [B, h*w, C]
        common = dict(guidance=None, img_ids=self.image_ids(h, w), txt_ids=cond.text_ids)
        if guidance_scale > 1 and not self.is_distilled:
            if not cond.has_negative:
                raise ValueError("guidance_scale > 1 needs negative embeddings: encode(prompts, negative=True)")
            out = self.run_transformer(
                hidden_states=torch.cat([tokens, tokens]), timestep=torch.cat([timestep, timestep]),
                encoder_hidden_states=torch.cat([cond.negative_prompt_embeds, cond.prompt_embeds]), **common,
            )
            uncond, text = out.chunk(2)
            out = uncond + guidance_scale * (text - uncond)
        else:
            out = self.run_transformer(hidden_states=tokens, timestep=timestep,
                                       encoder_hidden_states=cond.prompt_embeds, **common)
        return self.unpack(out, h, w)
