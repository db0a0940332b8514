"""FLUX.2 [klein] policy adapter (``Flux2KleinPipeline``: klein 4B / 9B, distilled and base).

What differs from FLUX.1, all hidden here:

- Latents. The pipeline draws its noise already 2x2-patchified, ``[N, 4C, h/2, w/2]`` (128 channels for the
  32-channel FLUX.2 VAE), and the transformer sees that grid flattened row-major into a token sequence. flowrl
  keeps this patchified grid as its latent layout (the natural one before packing), so ``init_noise`` is the
  pipeline's own draw and packing is a reshape inside :meth:`velocity`.
- Position ids have four axes (t, h, w, l): image tokens ``(0, row, col, 0)``, text tokens ``(0, 0, 0, index)``.
- Decoding undoes the VAE's batch-norm latent normalisation (its running mean / variance) before un-patchifying.
- The time shift ``mu`` is FLUX.2's empirical fit in both the image sequence length and the number of steps.
- Text is one Qwen3 LLM read at several hidden layers (stacked along the features), padded to
  ``max_sequence_length``; there is no pooled vector (zero-width ``[B, 0]``) and the transformer does not mask.
- Guidance: no guidance embedding. The base models use real CFG with the empty prompt (a second, unconditional
  pass); the step-distilled models (``is_distilled`` in the pipeline config) ignore ``guidance_scale``.
"""

from __future__ import annotations

import copy

import numpy as np
import torch

from flowrl.models.base import PolicyBase, TextCond

# train_dreambooth_lora_flux2_klein.py (diffusers examples): the attention projections of the double-stream
# blocks and the fused QKV+MLP input of the single-stream blocks; their output projections ``attn.to_out`` are
# listed per block (``FLUX2_SINGLE_OUT``) because the bare name would also match the double blocks' ModuleList.
FLUX2_LORA_TARGETS: tuple[str, ...] = ("to_k", "to_q", "to_v", "to_out.0", "to_qkv_mlp_proj")
FLUX2_SINGLE_OUT = "single_transformer_blocks.{}.attn.to_out"
TEXT_ENCODER_OUT_LAYERS = (9, 18, 27)  # Flux2KleinPipeline's default text_encoder_out_layers


class Flux2KleinPolicy(PolicyBase):
    family = "flux2_klein"
    pipeline_class_name = "Flux2KleinPipeline"
    default_guidance = 4.0  # Flux2KleinPipeline.__call__'s default (the base models' CFG; distilled ignore it)
    preference_sites = {"timestep": "time_guidance_embed"}  # the timestep + guidance embedding
    tiny_size = (64, 64)
    tiny_max_sequence_length = 32

    @classmethod
    def tiny_pipeline(cls, seed: int = 0):
        from flowrl.models.tiny_flux2 import tiny_flux2_klein_pipeline

        return tiny_flux2_klein_pipeline(seed)

    def __init__(self, pipeline, *, height: int | None = None, width: int | None = None,
                 max_sequence_length: int = 512, text_encoder_out_layers=TEXT_ENCODER_OUT_LAYERS):
        default = pipeline.default_sample_size * pipeline.vae_scale_factor
        super().__init__(pipeline, height=height or default, width=width or default)
        self.max_sequence_length = max_sequence_length
        self.text_encoder_out_layers = tuple(text_encoder_out_layers)

    @property
    def is_distilled(self) -> bool:
        """Step-distilled klein models sample without CFG, whatever the guidance scale."""
        return bool(self.pipeline.config.get("is_distilled", False))

    def default_lora_targets(self) -> tuple[str, ...]:
        singles = self.transformer.config.num_single_layers
        return FLUX2_LORA_TARGETS + tuple(FLUX2_SINGLE_OUT.format(i) for i in range(singles))

    def latent_shape(self, n: int) -> tuple[int, int, int, int]:
        """``prepare_latents``' shape: the VAE grid (x8) 2x2-patchified, ``[n, 4C, h/2, w/2]``."""
        scale = self.pipeline.vae_scale_factor * 2
        return (n, self.transformer.config.in_channels, self.height // scale, self.width // scale)

    # --- text --------------------------------------------------------------------------------
    def encode(self, prompts: list[str], *, negative: bool | None = None, metadata=None) -> TextCond:
        """The empty prompt is the CFG negative of the base models; distilled ones need none (default)."""
        return self.encode_text(prompts, negative=not self.is_distilled if negative is None else negative)

    def encode_batch(self, prompts: list[str], device) -> tuple[torch.Tensor, torch.Tensor]:
        """Qwen3 hidden states padded to ``max_sequence_length`` ``[B, L, layers * D]``; pooled ``[B, 0]``."""
        embeds, _ = self.pipeline.encode_prompt(
            prompt=prompts, device=device, max_sequence_length=self.max_sequence_length,
            text_encoder_out_layers=self.text_encoder_out_layers,
        )
        return embeds, embeds.new_zeros(embeds.shape[0], 0)

    def finish_cond(self, cond: TextCond) -> TextCond:
        """Text position ids ``[L, 4]`` = (0, 0, 0, index), as ``Flux2KleinPipeline._prepare_text_ids``."""
        length = cond.prompt_embeds.shape[1]
        ids = torch.zeros(length, 4, dtype=torch.long, device=cond.prompt_embeds.device)
        ids[:, 3] = torch.arange(length, device=ids.device)
        cond.text_ids = ids
        return cond

    # --- schedule ----------------------------------------------------------------------------
    def image_seq_len(self) -> int:
        _, _, h, w = self.latent_shape(1)
        return h * w

    def sigmas(self, num_steps: int) -> torch.Tensor:
        """Linear sigmas 1 -> 1/n shifted by FLUX.2's empirical ``mu(seq_len, n)``; ``[n + 1]`` ending at 0."""
        from diffusers.pipelines.flux2.pipeline_flux2_klein import compute_empirical_mu

        scheduler = copy.deepcopy(self.pipeline.scheduler)
        mu = compute_empirical_mu(image_seq_len=self.image_seq_len(), num_steps=num_steps)
        if scheduler.config.get("use_flow_sigmas", False):  # as the pipeline: the scheduler's own sigmas
            scheduler.set_timesteps(num_steps, device="cpu", mu=mu)
        else:
            scheduler.set_timesteps(sigmas=np.linspace(1.0, 1 / num_steps, num_steps), device="cpu", mu=mu)
        return scheduler.sigmas.float()

    # --- transformer -------------------------------------------------------------------------
    @staticmethod
    def pack(x: torch.Tensor) -> torch.Tensor:
        """[B, C, h, w] -> [B, h*w, C] token sequence (row-major), as ``_pack_latents``."""
        b, c, h, w = x.shape
        return x.reshape(b, c, h * w).permute(0, 2, 1)

    @staticmethod
    def unpack(x: torch.Tensor, h: int, w: int) -> torch.Tensor:
        """Inverse of :meth:`pack` (what ``_unpack_latents_with_ids`` scatters for row-major ids)."""
        b, _, c = x.shape
        return x.permute(0, 2, 1).reshape(b, c, h, w)

    def image_ids(self, h: int, w: int) -> torch.Tensor:
        """[h*w, 4] ids (0, row, col, 0), cached per shape and device (no per-step host-to-device copy)."""
        key = (h, w, self.device)
        if getattr(self, "_image_ids_key", None) != key:
            ids = torch.cartesian_prod(torch.arange(1), torch.arange(h), torch.arange(w), torch.arange(1))
            self._image_ids, self._image_ids_key = ids.to(self.device), key
        return self._image_ids

    def velocity(self, x: torch.Tensor, sigma, cond: TextCond, guidance_scale: float) -> torch.Tensor:
        """v(x, sigma) ``[B, C, h, w]``; base models with ``guidance_scale > 1``: v_u + w (v_c - v_u), both
        branches in one batched pass (the pipeline runs two; same math, one forward for DDP)."""
        batch, _, h, w = x.shape
        timestep = (torch.as_tensor(sigma, dtype=torch.float32, device=x.device) * 1000).expand(batch)
        timestep = timestep.to(self.dtype) / 1000
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

    # --- images ------------------------------------------------------------------------------
    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Patchified normalised latents ``[N, 4C, h, w]`` -> images ``[N, 3, 16h, 16w]`` in [0, 1] (float32):
        undo the VAE batch-norm, un-patchify 2x2, decode."""
        vae = self.vae
        mean = vae.bn.running_mean.view(1, -1, 1, 1).to(latents.device, latents.dtype)
        std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps).to(
            latents.device, latents.dtype)
        latents = self.pipeline._unpatchify_latents(latents * std + mean)
        images = vae.decode(latents.to(vae.dtype), return_dict=False)[0]
        return (images.float() / 2 + 0.5).clamp(0, 1)

    def pipeline_images(self, prompts, *, group_size: int, num_steps: int, guidance_scale: float, seeds,
                        metadata=None) -> torch.Tensor:
        """``Flux2KleinPipeline`` for the same seeds, steps, guidance and text layers (``output_type="pt"``)."""
        from flowrl.core.seeding import generators

        return self.pipeline(
            prompt=list(prompts), num_images_per_prompt=group_size, num_inference_steps=num_steps,
            guidance_scale=guidance_scale, height=self.height, width=self.width,
            generator=generators(list(seeds), device=self.device), output_type="pt",
            max_sequence_length=self.max_sequence_length, text_encoder_out_layers=self.text_encoder_out_layers,
        ).images
