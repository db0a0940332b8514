"""A tiny, randomly initialised FLUX.2 [klein] pipeline for offline tests.

Same component layout as ``black-forest-labs/FLUX.2-klein-base-4B``: a ``Flux2Transformer2DModel`` (double- and
single-stream blocks, 4-axis RoPE, no guidance embedding), an ``AutoencoderKLFlux2`` (x8, 32 latent channels, a
batch-norm over the 2x2-patchified latents), a ``Qwen3ForCausalLM`` text encoder read at hidden layers 9, 18 and 27
(so it keeps 28 layers, each only 16 wide) and a dynamically shifted ``FlowMatchEulerDiscreteScheduler``. The tiny
pipeline is the *base* (undistilled) variant, ``is_distilled=False``, so the pipeline's real CFG branch (a second
pass with the empty prompt) is exercised; the step-distilled klein models run the same code with CFG off.

The VAE's batch-norm running statistics are set to seeded non-trivial values: with the default 0 / 1 the latent
de-normalisation before decoding would be the identity and a mistake there would go unnoticed.
Weights are a pure function of ``seed`` (``flowrl.models.tiny._seeded``); everything float32, eval mode, CPU.
The transformer, VAE and scheduler builders are shared with the FLUX.2 [dev] tiny pipeline (``tiny_flux2_dev``).
"""

from __future__ import annotations

import torch
from diffusers import AutoencoderKLFlux2, FlowMatchEulerDiscreteScheduler, Flux2KleinPipeline, Flux2Transformer2DModel
from transformers import Qwen3Config, Qwen3ForCausalLM

from flowrl.models.tiny import _seeded
from flowrl.models.tiny_qwen import tiny_qwen_tokenizer

TINY_FLUX2_RESOLUTION = 64  # 64 px -> 8x8 VAE latents -> 4x4 = 16 patchified tokens
TINY_FLUX2_LATENT_CHANNELS = 32  # as the FLUX.2 VAE; x4 after the 2x2 patchify = transformer in_channels 128
TINY_FLUX2_MAX_LENGTH = 32  # the chat template takes ~15 tokens, the short test prompts a few more
QWEN_HIDDEN = 16
QWEN_LAYERS = 28  # the pipeline reads hidden_states[9], [18], [27] by default
TEXT_OUT_LAYERS = (9, 18, 27)  # Flux2KleinPipeline's default text_encoder_out_layers


def _qwen3(vocab_size: int) -> Qwen3ForCausalLM:
    config = Qwen3Config(
        vocab_size=vocab_size, hidden_size=QWEN_HIDDEN, intermediate_size=2 * QWEN_HIDDEN,
        num_hidden_layers=QWEN_LAYERS, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
        max_position_embeddings=1024, tie_word_embeddings=True,  # tied, as Qwen3-4B
    )
    return Qwen3ForCausalLM(config)


def tiny_flux2_transformer(*, guidance_embeds: bool, text_dim: int = len(TEXT_OUT_LAYERS) * QWEN_HIDDEN
                           ) -> Flux2Transformer2DModel:
    """One double- and one single-stream block on 16 image tokens; ``text_dim`` is the stacked hidden states' width,
    ``guidance_embeds`` the [dev] guidance embedding (klein has none)."""
    return Flux2Transformer2DModel(
        patch_size=1, in_channels=4 * TINY_FLUX2_LATENT_CHANNELS, num_layers=1, num_single_layers=1,
        attention_head_dim=16, num_attention_heads=2, joint_attention_dim=text_dim,
        axes_dims_rope=(4, 4, 4, 4), guidance_embeds=guidance_embeds,  # 4 axes summing to the head dim
    )


def tiny_flux2_vae() -> AutoencoderKLFlux2:
    vae = AutoencoderKLFlux2(
        in_channels=3, out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
        block_out_channels=(8, 16, 16, 16), layers_per_block=1, norm_num_groups=4,
        latent_channels=TINY_FLUX2_LATENT_CHANNELS, sample_size=TINY_FLUX2_RESOLUTION,
    )
    channels = vae.bn.num_features  # 4 * latent_channels
    vae.bn.running_mean.copy_(0.3 * torch.randn(channels))
    vae.bn.running_var.copy_(torch.rand(channels) + 0.5)
    return vae


def tiny_flux2_klein_pipeline(seed: int = 0) -> Flux2KleinPipeline:
    """FLUX.2 [klein] base layout with tiny random weights (Flux2KleinPipeline's default size is 1024 px: always
    pass height/width)."""
    tokenizer = tiny_qwen_tokenizer()
    transformer = _seeded(seed, 0, lambda: tiny_flux2_transformer(guidance_embeds=False))  # klein: no guidance
    vae = _seeded(seed, 1, tiny_flux2_vae)
    text_encoder = _seeded(seed, 2, lambda: _qwen3(len(tokenizer)))
    return Flux2KleinPipeline(scheduler=tiny_flux2_scheduler(), vae=vae, text_encoder=text_encoder,
                              tokenizer=tokenizer, transformer=transformer, is_distilled=False)


def tiny_flux2_scheduler() -> FlowMatchEulerDiscreteScheduler:
    """FLUX.2's dynamically shifted scheduler (the ``mu`` the pipelines pass replaces the shift anchors)."""
    return FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True,
        base_shift=0.5, max_shift=1.15, base_image_seq_len=256, max_image_seq_len=4096,
    )
