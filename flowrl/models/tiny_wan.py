"""A tiny, randomly initialised Wan2.1 text-to-video pipeline for offline tests.

Same classes and component layout as ``Wan-AI/Wan2.1-T2V-1.3B-Diffusers`` (a ``WanPipeline`` of a
``WanTransformer3DModel`` with (1, 2, 2) patches, the causal 3-D ``AutoencoderKLWan`` with 16 latent channels,
x8 spatial and x4 temporal compression, and a UMT5 encoder), every network shrunk to ~10-100k parameters.
The released scheduler is UniPC with ``flow_shift=3.0``; the tiny one is the flow-matching Euler scheduler
with the same static shift, so that the pipeline's own loop is exactly flowrl's Euler ODE (the policy adapter
swaps the released model's scheduler the same way, see :mod:`flowrl.models.wan`).

The tokenizer is the tiny T5 one of :mod:`flowrl.models.tiny` (UMT5 uses the same SentencePiece-Unigram
kind of tokenizer with ``<pad>`` = 0, ``</s>`` = 1). Weights are a pure function of ``seed`` (``_seeded``).
"""

from __future__ import annotations

from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler, WanPipeline, WanTransformer3DModel
from transformers import UMT5Config, UMT5EncoderModel

from flowrl.models.tiny import _seeded, _t5_vocab, tiny_t5_tokenizer

TINY_WAN_SIZE = (32, 32)  # pixels: 4x4 latents -> 2x2 patches per latent frame (Wan needs multiples of 16)
TINY_WAN_FRAMES = 5  # (5 - 1) / 4 + 1 = 2 latent frames
TINY_WAN_TEXT_LENGTH = 16
WAN_FLOW_SHIFT = 3.0  # Wan2.1 T2V's static shift at 480p (5.0 at 720p)
_TEXT_DIM = 32


def _umt5_encoder() -> UMT5EncoderModel:
    config = UMT5Config(  # umt5-xxl flavour: gated-gelu, relative position buckets, no dropout
        vocab_size=len(_t5_vocab()), d_model=_TEXT_DIM, d_kv=8, d_ff=2 * _TEXT_DIM, num_layers=2, num_heads=4,
        relative_attention_num_buckets=8, relative_attention_max_distance=32, feed_forward_proj="gated-gelu",
        dropout_rate=0.0, is_encoder_decoder=False,
    )
    return UMT5EncoderModel(config)


def _wan_vae() -> AutoencoderKLWan:
    """4 levels (x8 spatial; 4-8 channels instead of 96-384), temporal downsampling on the last two (x4),
    16 latent channels, Wan's own per-channel latents_mean / latents_std (the class defaults, as released)."""
    return AutoencoderKLWan(base_dim=4, z_dim=16, dim_mult=[1, 2, 2, 2], num_res_blocks=1, attn_scales=[],
                            temperal_downsample=[False, True, True], dropout=0.0)


def tiny_wan_transformer(**config) -> WanTransformer3DModel:
    """The tiny Wan2.1 transformer (2 blocks of 2 heads of 16); ``config`` overrides keys (image-to-video: 36 input
    channels, the CLIP image layers)."""
    return WanTransformer3DModel(**{
        "patch_size": (1, 2, 2), "num_attention_heads": 2, "attention_head_dim": 16, "in_channels": 16,
        "out_channels": 16, "text_dim": _TEXT_DIM, "freq_dim": 32, "ffn_dim": 64, "num_layers": 2,
        "cross_attn_norm": True, "qk_norm": "rms_norm_across_heads", "eps": 1e-6, "rope_max_seq_len": 64, **config,
    })


def tiny_wan_pipeline(seed: int = 0) -> WanPipeline:
    """Wan2.1 T2V layout with tiny random weights (call it with num_frames=5, 32x32 px)."""
    transformer = _seeded(seed, 0, tiny_wan_transformer)
    vae = _seeded(seed, 1, _wan_vae)
    text_encoder = _seeded(seed, 2, _umt5_encoder)
    return WanPipeline(
        tokenizer=tiny_t5_tokenizer(), text_encoder=text_encoder, vae=vae, transformer=transformer,
        scheduler=FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=WAN_FLOW_SHIFT),
    )
