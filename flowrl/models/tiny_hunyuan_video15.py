"""Tiny, randomly initialised HunyuanVideo-1.5 pipelines (text-to-video and image-to-video) for offline tests.

Same classes and component layout as ``hunyuanvideo-community/HunyuanVideo-1.5-Diffusers-480p_t2v`` / ``_i2v``
(``HunyuanVideo15Pipeline`` / ``HunyuanVideo15ImageToVideoPipeline``: a ``HunyuanVideo15Transformer3DModel``, an
``AutoencoderKLHunyuanVideo15`` compressing x16 in space and x4 in time, a Qwen2.5-VL language model with a Qwen2
tokenizer, a byT5 glyph encoder (``T5EncoderModel`` + ``ByT5Tokenizer``), a ``ClassifierFreeGuidance`` guider at
the released 6.0, and for I2V a SigLIP vision tower with its image processor), every network shrunk.

Two things are kept exact because the pipeline hard-codes them:

* the chat template's prefix is ``prompt_template_encode_start_idx`` = 108 tokens, the count the pipeline crops.
  The tiny byte-level BPE is learnt on a corpus holding HunyuanVideo-1.5's system message, with every merge the
  corpus offers (708 entries): the prefix is then exactly 108 tokens, so the crop removes the template and nothing
  of the prompt. The tokenizer is built from its vocabulary and merges, as ``Qwen2Tokenizer.from_pretrained``
  rebuilds it (Qwen's split pattern and NFC, not the trainer's GPT-2 pattern): the system message's runs of spaces
  split differently under the two, and a saved and reloaded pipeline must tokenize as the original;
* the transformer's input has ``2 C + 1`` channels: the noisy latents, the conditioning latents and the mask.

One thing is shrunk outside the components: the glyph length. The transformer's byT5 projection has a hidden width
of 2048 whatever its input (diffusers writes the number in), so each glyph token costs about 8 MFLOP; at the
pipeline's 256 tokens that was most of the tiny model's work. The builders set the pipeline's own
``tokenizer_2_max_length`` to ``GLYPH_TOKENS``, so the pipeline's calls and flowrl's (which go through its
``encode_prompt``) read the same length; a saved and reloaded pipeline is back at 256, still self-consistent.

Weights are a pure function of ``seed`` (:func:`flowrl.models.tiny._seeded`); float32, eval mode, CPU.
"""

from __future__ import annotations

import inspect

from diffusers import (
    AutoencoderKLHunyuanVideo15,
    FlowMatchEulerDiscreteScheduler,
    HunyuanVideo15ImageToVideoPipeline,
    HunyuanVideo15Pipeline,
    HunyuanVideo15Transformer3DModel,
)
from diffusers.guiders import ClassifierFreeGuidance
from transformers import (
    ByT5Tokenizer,
    Qwen2_5_VLTextConfig,
    Qwen2_5_VLTextModel,
    Qwen2Tokenizer,
    SiglipImageProcessor,
    SiglipVisionConfig,
    SiglipVisionModel,
    T5Config,
    T5EncoderModel,
)

from flowrl.models.tiny import _seeded, trained_byte_bpe_json
from flowrl.models.tiny_qwen import _CORPUS, QWEN_CHAT_TEMPLATE, QWEN_SPECIAL_TOKENS

TINY_HUNYUAN_VIDEO15_SIZE = 32  # px: 2x2 latents (x16 VAE), patch 1: 4 tokens a latent frame
LATENT_CHANNELS = 8  # the released VAE has 32; the transformer takes 2 C + 1 = 17 channels
TEXT_DIM, GLYPH_DIM, IMAGE_DIM = 32, 24, 16  # Qwen2.5-VL hidden, byT5 d_model, SigLIP hidden
GLYPH_TOKENS = 32  # byT5 tokens a prompt; the pipeline's 256 (``tokenizer_2_max_length``), shortened: see below
SHIFT = 5.0  # the 480p checkpoints' flow shift (UniRL's HunyuanVideo-1.5 recipe samples with shift 5.0)
GUIDANCE = 6.0  # the released guider's guidance_scale
TOKENIZER_VOCAB = 1024  # above the corpus' 708 entries: every merge (see the module docstring)


def hunyuan_system_message() -> str:
    """HunyuanVideo-1.5's system message, read from the pipeline (its ``_get_mllm_prompt_embeds`` default)."""
    signature = inspect.signature(HunyuanVideo15Pipeline._get_mllm_prompt_embeds)
    return signature.parameters["system_message"].default


def tiny_hunyuan_tokenizer() -> Qwen2Tokenizer:
    """A Qwen2 tokenizer (byte-level BPE, Qwen special tokens and chat template) whose rendering of the system turn
    and the user turn's header is exactly the 108 tokens the pipeline crops."""
    import json

    corpus = _CORPUS + (hunyuan_system_message(),)
    model = json.loads(trained_byte_bpe_json(corpus, TOKENIZER_VOCAB, tuple(QWEN_SPECIAL_TOKENS)))["model"]
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    tokenizer = Qwen2Tokenizer(vocab=model["vocab"], merges=merges, pad_token="<|endoftext|>", eos_token="<|im_end|>",
                               unk_token=None, model_max_length=4096)
    tokenizer.add_special_tokens({"additional_special_tokens": [
        t for t in QWEN_SPECIAL_TOKENS if t not in (tokenizer.pad_token, tokenizer.eos_token)]})
    tokenizer.chat_template = QWEN_CHAT_TEMPLATE
    return tokenizer


def _qwen_text_model(tokenizer) -> Qwen2_5_VLTextModel:
    """A 3-layer Qwen2.5-VL language model (the pipeline reads the third hidden state from the end: layer 1)."""
    config = Qwen2_5_VLTextConfig(
        vocab_size=-(-len(tokenizer) // 64) * 64, hidden_size=TEXT_DIM, intermediate_size=64, num_hidden_layers=3,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=2048, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [2, 3, 3]},  # head_dim / 2
        pad_token_id=tokenizer.pad_token_id,
    )
    return Qwen2_5_VLTextModel(config)


def _byt5_encoder(tokenizer: ByT5Tokenizer) -> T5EncoderModel:
    """A 1-layer byT5 encoder over the 384 byte ids (3 specials, 256 bytes, 125 sentinels)."""
    config = T5Config(vocab_size=len(tokenizer), d_model=GLYPH_DIM, d_kv=8, d_ff=48, num_layers=1, num_heads=2,
                      relative_attention_num_buckets=8, relative_attention_max_distance=32,
                      feed_forward_proj="gated-gelu", dropout_rate=0.0, is_encoder_decoder=False)
    return T5EncoderModel(config)


def _transformer(task_type: str) -> HunyuanVideo15Transformer3DModel:
    return HunyuanVideo15Transformer3DModel(
        in_channels=2 * LATENT_CHANNELS + 1, out_channels=LATENT_CHANNELS, num_attention_heads=2,
        attention_head_dim=8, num_layers=2, num_refiner_layers=1, mlp_ratio=2.0, patch_size=1, patch_size_t=1,
        text_embed_dim=TEXT_DIM, text_embed_2_dim=GLYPH_DIM, image_embed_dim=IMAGE_DIM, rope_axes_dim=(2, 2, 4),
        target_size=TINY_HUNYUAN_VIDEO15_SIZE,  # the tiny size is the pipeline's square bucket
        task_type=task_type,
    )


def _vae() -> AutoencoderKLHunyuanVideo15:
    return AutoencoderKLHunyuanVideo15(
        latent_channels=LATENT_CHANNELS, block_out_channels=(8, 8, 16, 16, 32), layers_per_block=1,
        spatial_compression_ratio=16, temporal_compression_ratio=4,  # the released compression
    )


def _components(seed: int, task_type: str) -> dict:
    tokenizer, tokenizer_2 = tiny_hunyuan_tokenizer(), ByT5Tokenizer()
    return dict(
        transformer=_seeded(seed, 0, lambda: _transformer(task_type)),
        vae=_seeded(seed, 1, _vae),
        text_encoder=_seeded(seed, 2, lambda: _qwen_text_model(tokenizer)),
        text_encoder_2=_seeded(seed, 3, lambda: _byt5_encoder(tokenizer_2)),
        tokenizer=tokenizer, tokenizer_2=tokenizer_2,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=SHIFT),
        guider=ClassifierFreeGuidance(guidance_scale=GUIDANCE),
    )


def tiny_hunyuan_video15_pipeline(seed: int = 0) -> HunyuanVideo15Pipeline:
    """HunyuanVideo-1.5 text-to-video layout with tiny random weights."""
    pipeline = HunyuanVideo15Pipeline(**_components(seed, "t2v"))
    pipeline.tokenizer_2_max_length = GLYPH_TOKENS
    pipeline.set_progress_bar_config(disable=True)
    return pipeline


def tiny_hunyuan_video15_i2v_pipeline(seed: int = 0) -> HunyuanVideo15ImageToVideoPipeline:
    """HunyuanVideo-1.5 image-to-video layout with tiny random weights: plus a 1-layer SigLIP tower (28 px, patch
    14: 4 image tokens) and its image processor."""
    image_encoder = _seeded(seed, 4, lambda: SiglipVisionModel(SiglipVisionConfig(
        hidden_size=IMAGE_DIM, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=28,
        patch_size=14)))
    pipeline = HunyuanVideo15ImageToVideoPipeline(
        **_components(seed, "i2v"), image_encoder=image_encoder,
        feature_extractor=SiglipImageProcessor(size={"height": 28, "width": 28}),
    )
    pipeline.tokenizer_2_max_length = GLYPH_TOKENS
    pipeline.set_progress_bar_config(disable=True)
    return pipeline
