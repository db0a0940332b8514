"""FLUX.2 [dev] policy adapter (``Flux2Pipeline``: the 32B guidance-distilled FLUX.2 [dev]).

The latent layout, position ids, schedule, text encoding and decoding are FLUX.2's, shared with [klein]
(:mod:`flowrl.models.flux2_base`). What is [dev]'s own:

- Text is a Mistral-3 (Mistral Small 3.x) LLM, prompted with FLUX.2's system message through its processor's chat
  template and read at hidden layers 10, 20 and 30 (``Flux2Pipeline``'s defaults).
- Guidance is distilled into the transformer: ``guidance_scale`` enters as an embedding beside the timestep, one
  pass per step, no unconditional branch and no negative prompt (as FLUX.1 [dev]). ``Flux2Pipeline`` passes it
  whatever its value, so guidance 1.0 is a real input too, not "guidance off".
"""

from __future__ import annotations

import torch

from flowrl.models.base import TextCond
from flowrl.models.flux2_base import Flux2PolicyBase

# train_dreambooth_lora_flux2.py (diffusers examples)'s default ``lora_layers``: the attention projections; as
# suffixes they match the double-stream blocks only (a single-stream block's output projection is ``attn.to_out``).
FLUX2_DEV_LORA_TARGETS: tuple[str, ...] = ("to_k", "to_q", "to_v", "to_out.0")
TEXT_ENCODER_OUT_LAYERS = (10, 20, 30)  # Flux2Pipeline's default text_encoder_out_layers


class Flux2DevPolicy(Flux2PolicyBase):
    family = "flux2_dev"
    pipeline_class_name = "Flux2Pipeline"
    default_guidance = 4.0  # Flux2Pipeline.__call__'s default and the model card's
    guidance_in_model = True  # the distilled-guidance embedding: one pass, no CFG batch
    preference_sites = {"timestep": "time_guidance_embed"}  # the timestep + guidance embedding, as klein
    # FLUX.2's system message alone takes ~30 tokens of the tiny tokenizer: room for it and the test prompts
    tiny_max_sequence_length = 48
    text_encoder_out_layers = TEXT_ENCODER_OUT_LAYERS

    @classmethod
    def tiny_pipeline(cls, seed: int = 0):
        from flowrl.models.tiny_flux2_dev import tiny_flux2_dev_pipeline

        return tiny_flux2_dev_pipeline(seed)

    def default_lora_targets(self) -> tuple[str, ...]:
        return FLUX2_DEV_LORA_TARGETS

    def encode(self, prompts: list[str], *, negative: bool = False, metadata=None) -> TextCond:
        """No negative by default: guidance is an embedding, never a second pass on a negative prompt."""
        return self.encode_text(prompts, negative=negative)

    def velocity(self, x: torch.Tensor, sigma, cond: TextCond, guidance_scale: float) -> torch.Tensor:
        """v(x, sigma) ``[B, C, h, w]``: one transformer pass with ``guidance_scale`` in the guidance embedding
        (float32, as the pipeline builds it; the transformer scales it by 1000)."""
        batch, _, h, w = x.shape
        guidance = None
        if self.transformer.config.guidance_embeds:
            guidance = torch.full((batch,), float(guidance_scale), device=x.device, dtype=torch.float32)  # [B]
        out = self.run_transformer(
            hidden_states=self.pack(x.to(self.dtype)),  # [B, h*w, C]
            timestep=self.timesteps(sigma, batch, x.device), guidance=guidance,
            encoder_hidden_states=cond.prompt_embeds, img_ids=self.image_ids(h, w), txt_ids=cond.text_ids,
        )  # [B, h*w, C]
        return self.unpack(out, h, w)
