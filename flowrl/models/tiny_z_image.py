"""A tiny, randomly initialised Z-Image pipeline for offline tests.

Same component layout as Tongyi-MAI/Z-Image-Turbo (``ZImagePipeline``): a single-stream
``ZImageTransformer2DModel`` (noise and context refiners, then joint layers over ``[image, caption]``), the
FLUX.1 VAE layout (16 latent channels, scaling 0.3611, shift 0.1159, no quant convs), a Qwen3 text encoder
(``Qwen3Model``, of which the pipeline reads ``hidden_states[-2]``) with a Qwen2 tokenizer, and the
released scheduler config: ``FlowMatchEulerDiscreteScheduler`` with a static shift of 3.0 (no dynamic
shifting, so the ``mu`` the pipeline computes is ignored). Every network is shrunk to ~100k parameters, except
the transformer's timestep MLP, whose 1024-wide hidden layer is hard-coded in diffusers (~0.3M).
Weights are a pure function of ``seed`` (``flowrl.models.tiny._seeded``); the tokenizer is built locally.
"""

from __future__ import annotations

from diffusers import FlowMatchEulerDiscreteScheduler, ZImagePipeline, ZImageTransformer2DModel
from transformers import Qwen3Config, Qwen3Model

from flowrl.models.tiny import TINY_LATENT_CHANNELS, _seeded, tiny_vae
from flowrl.models.tiny_qwen import tiny_qwen_tokenizer

TINY_Z_IMAGE_RESOLUTION = 64  # 64 px -> 8x8 latent -> 4x4 = 16 image tokens (2x2 patches)
TINY_Z_IMAGE_MAX_LENGTH = 32  # the chat-templated prompts are 10-20 tokens; the pipeline default is 512
_QWEN_WIDTH = 32  # Qwen3 hidden size = the transformer's cap_feat_dim (2560 for Qwen3-4B)
_DIM, _HEADS = 32, 2  # head_dim 16 = sum(axes_dims)


def _qwen3_encoder(vocab_size: int, pad_token_id: int) -> Qwen3Model:
    """A 2-layer Qwen3 (GQA, q/k RMS norms): hidden_states[-2] is the output of its first layer."""
    config = Qwen3Config(
        vocab_size=vocab_size, hidden_size=_QWEN_WIDTH, intermediate_size=2 * _QWEN_WIDTH, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=1024,
        rms_norm_eps=1e-6, tie_word_embeddings=True, pad_token_id=pad_token_id, attention_dropout=0.0,
    )
    return Qwen3Model(config)


def tiny_z_image_pipeline(seed: int = 0) -> ZImagePipeline:
    """Z-Image-Turbo layout (Qwen3 text encoder, single-stream DiT, static shift 3.0) with tiny random weights.

    ZImagePipeline's default size is 1024 px whatever the components: always pass height/width."""
    tokenizer = tiny_qwen_tokenizer()
    transformer = _seeded(seed, 0, lambda: ZImageTransformer2DModel(
        all_patch_size=(2,), all_f_patch_size=(1,), in_channels=TINY_LATENT_CHANNELS, dim=_DIM,
        n_layers=1, n_refiner_layers=1, n_heads=_HEADS, n_kv_heads=_HEADS, norm_eps=1e-5, qk_norm=True,
        cap_feat_dim=_QWEN_WIDTH, rope_theta=256.0, t_scale=1000.0,
        axes_dims=[4, 6, 6], axes_lens=[256, 64, 64],  # caption positions come first on axis 0: > max length + 1
    ))
    vae = _seeded(seed, 1, lambda: tiny_vae(scaling_factor=0.3611, shift_factor=0.1159))
    text_encoder = _seeded(seed, 2, lambda: _qwen3_encoder(len(tokenizer), tokenizer.pad_token_id))
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=False)
    return ZImagePipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                          transformer=transformer)
