"""A tiny, randomly initialised Wan2.1 I2V-14B pipeline for offline tests.

Same classes and component layout as ``Wan-AI/Wan2.1-I2V-14B-480P-Diffusers``: a ``WanImageToVideoPipeline`` of a
``WanTransformer3DModel`` that takes 36 input channels (16 noisy latent channels, then the first frame's 4 mask and
16 latent channels) and CLIP image states (``image_dim``, with the added key/value projections of its cross
attention), the Wan2.1 VAE (16 latent channels, x8 spatial, x4 temporal), UMT5 text, and a ``CLIPVisionModel`` with
its ``CLIPImageProcessor``. The text encoder, tokenizer and VAE are the tiny Wan2.1 T2V pipeline's
(:mod:`flowrl.models.tiny_wan`); the CLIP tower is 2 layers of 16 on 32 px inputs in 8 px patches (17 tokens; the
released ViT-H/14 gives 257 of 1280 on 224 px). The scheduler is the flow-matching Euler one with the 480P model's
static shift 3.0 (its UniPC ``flow_shift``; the adapter swaps the released UniPC the same way), so that the
pipeline's own loop is flowrl's Euler ODE. Weights are a pure function of ``seed`` (``_seeded``).
"""

from __future__ import annotations

from diffusers import FlowMatchEulerDiscreteScheduler, WanImageToVideoPipeline
from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel

from flowrl.models.tiny import _seeded, tiny_t5_tokenizer
from flowrl.models.tiny_wan import _umt5_encoder, _wan_vae, tiny_wan_transformer

I2V_IN_CHANNELS = 16 + 4 + 16  # noisy latents, the first frame's mask (a channel per folded frame), its latents
WAN21_I2V_FLOW_SHIFT = 3.0  # Wan2.1 I2V-14B-480P's flow_shift (5.0 at 720P)
_CLIP_DIM = 16
_CLIP_SIZE = 32
# OpenAI CLIP's normalisation, which the released laion/CLIP-ViT-H-14 processor uses too
_CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
_CLIP_STD = [0.26862954, 0.26130258, 0.27577711]


def _clip_vision() -> CLIPVisionModel:
    return CLIPVisionModel(CLIPVisionConfig(
        hidden_size=_CLIP_DIM, intermediate_size=2 * _CLIP_DIM, num_hidden_layers=2, num_attention_heads=2,
        image_size=_CLIP_SIZE, patch_size=8, projection_dim=_CLIP_DIM, hidden_act="gelu",
    ))


def tiny_clip_image_processor() -> CLIPImageProcessor:
    """The released processor's steps (bicubic resize of the short side, centre crop, OpenAI normalisation) at 32 px."""
    return CLIPImageProcessor(
        do_resize=True, size={"shortest_edge": _CLIP_SIZE}, resample=3, do_center_crop=True,
        crop_size={"height": _CLIP_SIZE, "width": _CLIP_SIZE}, do_rescale=True, do_normalize=True,
        image_mean=_CLIP_MEAN, image_std=_CLIP_STD, do_convert_rgb=True,
    )


def tiny_i2v_transformer(**config):
    """The tiny Wan transformer with image-to-video's 36 input channels (``config``: the CLIP image layers)."""
    return tiny_wan_transformer(in_channels=I2V_IN_CHANNELS, **config)


def tiny_wan_i2v_pipeline(seed: int = 0) -> WanImageToVideoPipeline:
    """Wan2.1 I2V-14B layout with tiny random weights (call it with num_frames=5, 32x32 px)."""
    transformer = _seeded(seed, 0, lambda: tiny_i2v_transformer(
        image_dim=_CLIP_DIM, added_kv_proj_dim=2 * 16))  # the added k/v project the embedded image: inner_dim wide
    return WanImageToVideoPipeline(
        tokenizer=tiny_t5_tokenizer(), text_encoder=_seeded(seed, 2, _umt5_encoder), vae=_seeded(seed, 1, _wan_vae),
        transformer=transformer, image_encoder=_seeded(seed, 4, _clip_vision),
        image_processor=tiny_clip_image_processor(),
        scheduler=FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=WAN21_I2V_FLOW_SHIFT),
    )
