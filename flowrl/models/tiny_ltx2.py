"""A tiny, randomly initialised LTX-2 text-to-audio+video pipeline for offline tests.

Same classes and component layout as ``Lightricks/LTX-2`` (an ``LTX2Pipeline`` of an ``LTX2VideoTransformer3DModel``
with its video and audio streams, the ``LTX2TextConnectors`` with learnable registers, the causal
``AutoencoderKLLTX2Video``, the mel-spectrogram ``AutoencoderKLLTX2Audio``, an ``LTX2Vocoder``, a Gemma-3 text
encoder whose every hidden state the pipeline reads, and the dynamically shifted flow-matching Euler scheduler),
every network shrunk to a few thousand parameters. The sizes follow diffusers' own LTX-2 pipeline tests
(``tests/pipelines/ltx2``), except the text encoder, built here instead of downloaded, and the video VAE, which
patchifies 4x4 like the released one so 32 px clips are 4x4 latents.

The tokenizer is a real ``GemmaTokenizer`` (BPE with byte fallback, ``▁`` for spaces, ``<pad>`` 0, ``<eos>`` 1,
``<bos>`` 2), its merges learnt offline by :func:`flowrl.models.tiny.trained_byte_bpe_json`'s trainer kind on a
small fixed corpus. Weights are a pure function of ``seed`` (``_seeded``).
"""

from __future__ import annotations

import functools
import json

from diffusers import (
    AutoencoderKLLTX2Audio,
    AutoencoderKLLTX2Video,
    FlowMatchEulerDiscreteScheduler,
    LTX2Pipeline,
    LTX2VideoTransformer3DModel,
)
from diffusers.pipelines.ltx2 import LTX2TextConnectors
from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder
from transformers import Gemma3Config, Gemma3ForConditionalGeneration, GemmaTokenizer

from flowrl.models.tiny import _T5_WORDS, _seeded

TINY_LTX2_SIZE = (32, 32)  # pixels: x8 compression -> 4x4 latents; LTX2Pipeline needs multiples of 32
TINY_LTX2_FRAMES = 5  # (5 - 1) / 2 + 1 = 3 latent frames (the tiny VAE compresses time x2, the released one x8)
TINY_LTX2_TEXT_LENGTH = 16  # a multiple of the connectors' 4 registers, as 1024 is of the released 128
GEMMA_HIDDEN, GEMMA_LAYERS = 16, 2  # the pipeline stacks all 3 hidden states: 48 features per token
TINY_GEMMA_VOCAB = 600
GEMMA_SPECIAL_TOKENS = ("<pad>", "<eos>", "<bos>", "<unk>", "<mask>")  # ids 0..4, as Gemma's
# LTX-2's scheduler config (as LTX-Video's): the mu of calculate_shift(video tokens) between base_shift 0.95 at 1024
# tokens and max_shift 2.05 at 4096, an exponential time shift, then stretched to end at shift_terminal 0.1.
LTX2_SCHEDULER_CONFIG = dict(num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=True, base_shift=0.95,
                             max_shift=2.05, base_image_seq_len=1024, max_image_seq_len=4096, shift_terminal=0.1,
                             time_shift_type="exponential")
_CORPUS = (
    "a video of " + " ".join(_T5_WORDS),
    "the camera pans slowly as a person walks through the scene with soft ambient sound",
    "worst quality, inconsistent motion, blurry, jittery, distorted",
)


@functools.lru_cache(maxsize=1)
def _gemma_vocab_and_merges() -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Gemma's tokenizer kind trained offline: spaces as ``▁``, words split after each space, BPE with the 256
    byte-fallback pieces ``<0x00>``..``<0xFF>`` after the special tokens, as in Gemma's vocabulary."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers

    specials = list(GEMMA_SPECIAL_TOKENS) + [f"<0x{b:02X}>" for b in range(256)]
    tokenizer = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    tokenizer.normalizer = normalizers.Replace(" ", "▁")
    tokenizer.pre_tokenizer = pre_tokenizers.Split(pattern="▁", behavior="merged_with_next")
    trainer = trainers.BpeTrainer(vocab_size=TINY_GEMMA_VOCAB, special_tokens=specials, show_progress=False)
    tokenizer.train_from_iterator(list(_CORPUS) * 4, trainer=trainer)
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m)
              for m in json.loads(tokenizer.to_str())["model"]["merges"]]
    vocab = tokenizer.get_vocab()
    return dict(sorted(vocab.items(), key=lambda item: item[1])), merges


def tiny_gemma_tokenizer(model_max_length: int = 1024) -> GemmaTokenizer:
    """A ``GemmaTokenizer`` (left padding, ``<bos>`` first) over the offline vocabulary."""
    vocab, merges = _gemma_vocab_and_merges()
    return GemmaTokenizer(vocab=dict(vocab), merges=list(merges), add_bos_token=True, model_max_length=model_max_length)


def _gemma3(vocab_size: int) -> Gemma3ForConditionalGeneration:
    """Gemma-3's conditional-generation model (the class LTX-2 ships) with a 2-layer, 16-wide text tower and a
    one-layer vision tower the text-to-video pipeline never runs."""
    config = Gemma3Config(
        text_config=dict(vocab_size=vocab_size, hidden_size=GEMMA_HIDDEN, intermediate_size=32,
                         num_hidden_layers=GEMMA_LAYERS, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                         max_position_embeddings=256, sliding_window=8, rope_theta=10000.0, attention_dropout=0.0),
        vision_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                           image_size=28, patch_size=14, vision_use_head=False),
        mm_tokens_per_image=4, pad_token_id=0, eos_token_id=1, bos_token_id=2,
    )
    return Gemma3ForConditionalGeneration(config)


def tiny_ltx2_transformer() -> LTX2VideoTransformer3DModel:
    """Two joint blocks: video stream 2 heads x 8, audio stream 2 heads x 4, both reading the connectors' text."""
    return LTX2VideoTransformer3DModel(
        in_channels=4, out_channels=4, patch_size=1, patch_size_t=1, num_attention_heads=2, attention_head_dim=8,
        cross_attention_dim=16, audio_in_channels=4, audio_out_channels=4, audio_num_attention_heads=2,
        audio_attention_head_dim=4, audio_cross_attention_dim=8, num_layers=2, qk_norm="rms_norm_across_heads",
        caption_channels=GEMMA_HIDDEN, rope_double_precision=False, rope_type="split",
        vae_scale_factors=(2, 8, 8),
    )


def _connectors() -> LTX2TextConnectors:
    return LTX2TextConnectors(
        caption_channels=GEMMA_HIDDEN, text_proj_in_factor=GEMMA_LAYERS + 1,
        video_connector_num_attention_heads=4, video_connector_attention_head_dim=4, video_connector_num_layers=1,
        video_connector_num_learnable_registers=4, audio_connector_num_attention_heads=4,
        audio_connector_attention_head_dim=4, audio_connector_num_layers=1, audio_connector_num_learnable_registers=4,
        connector_rope_base_seq_len=32, rope_theta=10000.0, rope_double_precision=False,
        causal_temporal_positioning=False, rope_type="split",
    )


def tiny_ltx2_vae() -> AutoencoderKLLTX2Video:
    """4x4 patches and one spatio-temporal level: x8 spatial, x2 temporal, 4 latent channels."""
    vae = AutoencoderKLLTX2Video(
        in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(8,), decoder_block_out_channels=(8,),
        layers_per_block=(1,), decoder_layers_per_block=(1, 1), spatio_temporal_scaling=(True,),
        decoder_spatio_temporal_scaling=(True,), decoder_inject_noise=(False, False), downsample_type=("spatial",),
        upsample_residual=(False,), upsample_factor=(1,), timestep_conditioning=False, patch_size=4, patch_size_t=1,
        encoder_causal=True, decoder_causal=False,
    )
    return vae


def _audio_vae() -> AutoencoderKLLTX2Audio:
    return AutoencoderKLLTX2Audio(
        base_channels=4, output_channels=2, ch_mult=(1,), num_res_blocks=1, attn_resolutions=None, in_channels=2,
        resolution=32, latent_channels=2, norm_type="pixel", causality_axis="height", dropout=0.0,
        mid_block_add_attention=False, sample_rate=16000, mel_hop_length=160, is_causal=True, mel_bins=8,
    )


def _vocoder() -> LTX2Vocoder:
    return LTX2Vocoder(in_channels=2 * 8, hidden_channels=32, out_channels=2, upsample_kernel_sizes=[4, 4],
                       upsample_factors=[2, 2], resnet_kernel_sizes=[3], resnet_dilations=[[1, 3, 5]],
                       leaky_relu_negative_slope=0.1, output_sampling_rate=16000)


def tiny_ltx2_pipeline(seed: int = 0) -> LTX2Pipeline:
    """LTX-2's layout with tiny random weights (call it with num_frames=5, 32x32 px, max_sequence_length=16)."""
    tokenizer = tiny_gemma_tokenizer()
    return LTX2Pipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**LTX2_SCHEDULER_CONFIG),
        vae=_seeded(seed, 1, tiny_ltx2_vae),
        audio_vae=_seeded(seed, 3, _audio_vae),
        text_encoder=_seeded(seed, 2, lambda: _gemma3(len(tokenizer))),
        tokenizer=tokenizer,
        connectors=_seeded(seed, 4, _connectors),
        transformer=_seeded(seed, 0, tiny_ltx2_transformer),
        vocoder=_seeded(seed, 5, _vocoder),
    )
