"""A tiny, randomly initialised Wan2.2 TI2V-5B text-to-video pipeline for offline tests.

Same classes and component layout as ``Wan-AI/Wan2.2-TI2V-5B-Diffusers``: a ``WanPipeline`` with
``expand_timesteps=True`` and no ``boundary_ratio`` (one transformer), a ``WanTransformer3DModel`` with (1, 2, 2)
patches and 48 latent channels, and the Wan2.2 ``AutoencoderKLWan``: residual down/up blocks, a 2x2 pixel
patchify (12 channels in and out), 48 latent channels, x16 spatial and x4 temporal compression. Every network is
shrunk to ~10-300k parameters. The UMT5 encoder and tokenizer are the Wan2.1 tiny pipeline's
(:mod:`flowrl.models.tiny_wan`); the scheduler is the flow-matching Euler one with TI2V-5B's static shift 5.0, so
that the pipeline's own loop is flowrl's Euler ODE (the adapter swaps the released UniPC the same way).

The VAE's 48 per-channel ``latents_mean`` / ``latents_std`` are spread deterministic values, not the released
ones: the class defaults hold 16 (Wan2.1's), and what the tests need is that the un-normalisation is exercised
channel by channel. Weights are a pure function of ``seed`` (``_seeded``).
"""

from __future__ import annotations

from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler, WanPipeline, WanTransformer3DModel

from flowrl.models.tiny import _seeded, tiny_t5_tokenizer
from flowrl.models.tiny_wan import _TEXT_DIM, _umt5_encoder

TINY_WAN22_SIZE = (64, 64)  # pixels: 4x4 latents (x16) -> 2x2 patches per latent frame (multiples of 32)
TINY_WAN22_FRAMES = 5  # (5 - 1) / 4 + 1 = 2 latent frames
WAN22_LATENT_CHANNELS = 48
WAN22_FLOW_SHIFT = 5.0  # TI2V-5B's sample_shift


def _wan22_vae() -> AutoencoderKLWan:
    """Wan2.2's VAE layout shrunk: residual blocks, patch 2 (12 = 3 x 2 x 2 channels), 3 downsamplings (x8, x16 with
    the patch), temporal on the last two (x4), z_dim 48."""
    channels = WAN22_LATENT_CHANNELS
    return AutoencoderKLWan(
        base_dim=8, decoder_base_dim=8, z_dim=channels, dim_mult=[1, 2, 2, 2], num_res_blocks=1, attn_scales=[],
        temperal_downsample=[False, True, True], dropout=0.0, is_residual=True, in_channels=12, out_channels=12,
        patch_size=2, scale_factor_spatial=16, scale_factor_temporal=4,
        latents_mean=[round(-0.5 + i / channels, 4) for i in range(channels)],
        latents_std=[round(0.5 + 2 * i / channels, 4) for i in range(channels)],
    )


def tiny_wan22_ti2v_pipeline(seed: int = 0) -> WanPipeline:
    """Wan2.2 TI2V-5B layout with tiny random weights (call it with num_frames=5, 64x64 px)."""
    transformer = _seeded(seed, 0, lambda: WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16, in_channels=WAN22_LATENT_CHANNELS,
        out_channels=WAN22_LATENT_CHANNELS, text_dim=_TEXT_DIM, freq_dim=32, ffn_dim=64, num_layers=2,
        cross_attn_norm=True, qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=64,
    ))
    vae = _seeded(seed, 1, _wan22_vae)
    text_encoder = _seeded(seed, 2, _umt5_encoder)
    return WanPipeline(
        tokenizer=tiny_t5_tokenizer(), text_encoder=text_encoder, vae=vae, transformer=transformer,
        scheduler=FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=WAN22_FLOW_SHIFT),
        expand_timesteps=True,
    )
