"""What every FLUX.2 pipeline does the same way: the shared half of the [klein] and [dev] adapters.

``Flux2KleinPipeline`` and ``Flux2Pipeline`` run one transformer class (``Flux2Transformer2DModel``), one VAE
(``AutoencoderKLFlux2``) and one schedule; they differ in the text encoder (Qwen3 vs Mistral-3, both read at three
hidden layers through the pipeline's own ``encode_prompt``) and in guidance (klein: real CFG or none; dev: a
distilled-guidance embedding). :class:`Flux2PolicyBase` holds the common half, so each adapter only says how it
guides (:meth:`velocity`, :meth:`encode`):

- Latents. The pipelines draw their noise already 2x2-patchified, ``[N, 4C, h/2, w/2]`` (128 channels for the
  32-channel FLUX.2 VAE), and the transformer sees that grid flattened row-major into a token sequence. flowrl
  keeps this patchified grid as its latent layout (the natural one before packing), so ``init_noise`` is the
  pipeline's own draw and packing is a reshape.
- Position ids have four axes (t, h, w, l): image tokens ``(0, row, col, 0)``, text tokens ``(0, 0, 0, index)``.
- Decoding undoes the VAE's batch-norm latent normalisation (its running mean / variance) before un-patchifying.
- The time shift ``mu`` is FLUX.2's empirical fit in both the image sequence length and the number of steps.
- Text is the LLM's hidden states at ``text_encoder_out_layers`` stacked along the features, padded to
  ``max_sequence_length``; there is no pooled vector (zero-width ``[B, 0]``) and the transformer does not mask.
"""

from __future__ import annotations

import copy

import numpy as np
import torch

from flowrl.models.base import PolicyBase, TextCond


class Flux2PolicyBase(PolicyBase):
    """The FLUX.2 layout, schedule, text and decoding; a subclass sets ``text_encoder_out_layers`` (its pipeline's
    default) and implements ``velocity`` (how it guides)."""

    tiny_size = (64, 64)
    text_encoder_out_layers: tuple[int, ...] = ()  # the pipeline's default hidden layers of its text encoder

    def __init__(self, pipeline, *, height: int | None = None, width: int | None = None,
                 max_sequence_length: int = 512, text_encoder_out_layers=None):
        default = pipeline.default_sample_size * pipeline.vae_scale_factor
        super().__init__(pipeline, height=height or default, width=width or default)
        self.max_sequence_length = max_sequence_length
        self.text_encoder_out_layers = tuple(text_encoder_out_layers or type(self).text_encoder_out_layers)

    def latent_shape(self, n: int) -> tuple[int, int, int, int]:
        """``prepare_latents``' shape: the VAE grid (x8) 2x2-patchified, ``[n, 4C, h/2, w/2]``."""
        scale = self.pipeline.vae_scale_factor * 2
        return (n, self.transformer.config.in_channels, self.height // scale, self.width // scale)

    # --- text --------------------------------------------------------------------------------
    def encode_batch(self, prompts: list[str], device) -> tuple[torch.Tensor, torch.Tensor]:
        """The LLM's hidden states padded to ``max_sequence_length`` ``[B, L, layers * D]``; pooled ``[B, 0]``."""
        embeds, _ = self.pipeline.encode_prompt(
            prompt=prompts, device=device, max_sequence_length=self.max_sequence_length,
            text_encoder_out_layers=self.text_encoder_out_layers,
        )
        return embeds, embeds.new_zeros(embeds.shape[0], 0)

    def finish_cond(self, cond: TextCond) -> TextCond:
        """Text position ids ``[L, 4]`` = (0, 0, 0, index), as the pipelines' ``_prepare_text_ids``."""
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
        from diffusers.pipelines.flux2.pipeline_flux2 import compute_empirical_mu

        scheduler = copy.deepcopy(self.pipeline.scheduler)
        mu = compute_empirical_mu(image_seq_len=self.image_seq_len(), num_steps=num_steps)
        if scheduler.config.get("use_flow_sigmas", False):  # as the pipelines: the scheduler's own sigmas
            scheduler.set_timesteps(num_steps, device="cpu", mu=mu)
        else:
            scheduler.set_timesteps(sigmas=np.linspace(1.0, 1 / num_steps, num_steps), device="cpu", mu=mu)
        return scheduler.sigmas.float()

    # --- transformer inputs --------------------------------------------------------------------
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

    def timesteps(self, sigma, batch: int, device) -> torch.Tensor:
        """``[batch]`` transformer timesteps in the pipelines' rounding: the scheduler's ``sigma * 1000`` (float32)
        cast to the latents' dtype, then divided by 1000."""
        timestep = (torch.as_tensor(sigma, dtype=torch.float32, device=device) * 1000).expand(batch)
        return timestep.to(self.dtype) / 1000

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
        """The family's FLUX.2 pipeline for the same seeds, steps, guidance and text layers (``output_type="pt"``)."""
        from flowrl.core.seeding import generators

        return self.pipeline(
            prompt=list(prompts), num_images_per_prompt=group_size, num_inference_steps=num_steps,
            guidance_scale=guidance_scale, height=self.height, width=self.width,
            generator=generators(list(seeds), device=self.device), output_type="pt",
            max_sequence_length=self.max_sequence_length, text_encoder_out_layers=self.text_encoder_out_layers,
        ).images
