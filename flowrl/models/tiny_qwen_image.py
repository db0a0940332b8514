"""A tiny, randomly initialised Qwen-Image pipeline for offline tests.

Same classes and component layout as ``Qwen/Qwen-Image`` (``QwenImagePipeline`` with a
``QwenImageTransformer2DModel``, an ``AutoencoderKLQwenImage``, a ``Qwen2_5_VLForConditionalGeneration``
text encoder and a Qwen2 tokenizer) and the released scheduler config (dynamic exponential time shift
between 256 and 8192 tokens, terminal sigma 0.02), but every network shrunk to ~100k parameters. The
text encoder is a full Qwen2.5-VL (a language model plus a one-block vision tower, never used for text
prompts), so it saves and reloads under its real class; its vocabulary is the tiny Qwen tokenizer's,
and its vision token ids point at that tokenizer's ``<|vision_start|>``/``<|image_pad|>`` entries.

Weights are a pure function of ``seed`` (:func:`flowrl.models.tiny._seeded`). Everything is float32, eval
mode, on the CPU.
"""

from __future__ import annotations

from diffusers import (
    AutoencoderKLQwenImage,
    FlowMatchEulerDiscreteScheduler,
    QwenImagePipeline,
    QwenImageTransformer2DModel,
)
from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

from flowrl.models.tiny import _seeded
from flowrl.models.tiny_qwen import tiny_qwen_tokenizer

TINY_QWEN_IMAGE_RESOLUTION = 64  # 64 px -> 8x8 latent -> 4x4 = 16 packed image tokens
TINY_QWEN_IMAGE_TEXT_DIM = 32  # the text encoder's hidden size = the transformer's joint_attention_dim
TINY_QWEN_IMAGE_MAX_LENGTH = 32  # prompt tokens kept after the template prefix (the pipeline allows 1024)
LATENT_CHANNELS = 16  # z_dim of the Qwen-Image VAE (latents_mean/std have 16 entries)

# Qwen/Qwen-Image scheduler/scheduler_config.json.
QWEN_IMAGE_SCHEDULER_CONFIG = dict(
    num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=0.9,
    base_image_seq_len=256, max_image_seq_len=8192, shift_terminal=0.02, time_shift_type="exponential",
    invert_sigmas=False, stochastic_sampling=False,
)


def _round_up(n: int, multiple: int = 64) -> int:
    return -(-n // multiple) * multiple


def tiny_qwen2_5_vl(tokenizer) -> Qwen2_5_VLForConditionalGeneration:
    """A 2-layer Qwen2.5-VL language model (hidden 32, GQA 2:1, M-RoPE 2+3+3) with a 1-block vision tower."""
    ids = tokenizer.convert_tokens_to_ids
    head_dim = TINY_QWEN_IMAGE_TEXT_DIM // 2
    text_config = dict(
        vocab_size=_round_up(len(tokenizer)), hidden_size=TINY_QWEN_IMAGE_TEXT_DIM, intermediate_size=64,
        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=2048,
        rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 1e6,
                                            "mrope_section": [2, 3, 3]},  # sums to head_dim / 2
        bos_token_id=ids("<|endoftext|>"), eos_token_id=ids("<|im_end|>"), pad_token_id=tokenizer.pad_token_id,
    )
    assert sum(text_config["rope_parameters"]["mrope_section"]) * 2 == head_dim
    vision_config = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, patch_size=14,
                         out_hidden_size=TINY_QWEN_IMAGE_TEXT_DIM, fullatt_block_indexes=[0])
    config = Qwen2_5_VLConfig(
        text_config=text_config, vision_config=vision_config,
        image_token_id=ids("<|image_pad|>"), video_token_id=ids("<|image_pad|>"),
        vision_start_token_id=ids("<|vision_start|>"), vision_end_token_id=ids("<|vision_end|>"),
    )
    return Qwen2_5_VLForConditionalGeneration(config)


def tiny_qwen_image_pipeline(seed: int = 0) -> QwenImagePipeline:
    """Qwen-Image layout (MMDiT with 2x2 packing, Qwen2.5-VL text, 3-D causal VAE) with tiny random weights."""
    tokenizer = tiny_qwen_tokenizer()
    transformer = _seeded(seed, 0, lambda: QwenImageTransformer2DModel(
        patch_size=2, in_channels=4 * LATENT_CHANNELS, out_channels=LATENT_CHANNELS, num_layers=2,
        attention_head_dim=16, num_attention_heads=2, joint_attention_dim=TINY_QWEN_IMAGE_TEXT_DIM,
        axes_dims_rope=(4, 6, 6),  # sums to attention_head_dim
    ))
    vae = _seeded(seed, 1, lambda: AutoencoderKLQwenImage(
        base_dim=8, z_dim=LATENT_CHANNELS, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
        temperal_downsample=[False, True, True],  # 3 downsamplings: vae_scale_factor 8 as released
    ))
    text_encoder = _seeded(seed, 2, lambda: tiny_qwen2_5_vl(tokenizer))
    pipeline = QwenImagePipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**QWEN_IMAGE_SCHEDULER_CONFIG),
        vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, transformer=transformer,
    )
    pipeline.set_progress_bar_config(disable=True)
    return pipeline
