"""Tiny, randomly initialised SD3 and FLUX.1 pipelines for offline tests.

The real models (SD3 / SD3.5, FLUX.1-dev) are loaded elsewhere by hub id and weigh
gigabytes. Tests and CI have neither the hub nor a GPU, yet every code path that
touches a pipeline (prompt encoding, latent packing, the flow-matching scheduler,
VAE decoding, save/load, LoRA wrapping, the RL samplers) should still run. The
builders here return *real* ``diffusers`` pipeline objects of the same classes,
with the same component layout and scheduler settings as the released models, but
with every network shrunk to ~100k parameters (the CLIP encoders hold 0.8-1.6M,
nearly all in their 49408-token embedding tables). Nothing is downloaded: configs
are written in code and the tokenizers are built locally (CLIP from the BPE file
shipped inside ``open_clip``, T5 from a small fixed Unigram vocabulary).

The parts (``tiny_sd3_transformer``, ``tiny_vae``, ``tiny_clip_text_encoder``,
``tiny_t5_encoder``, ``sd3_pipeline_of``) take their sizes as arguments and draw from the global RNG;
``scripts/train_toy_model.py`` builds the shipped toy model from them with its own sizes and seeds.

The pipelines' weights are a pure function of ``seed``: each component is initialised under its
own seed inside ``torch.random.fork_rng``, so the caller's global RNG is untouched.
Everything is float32, in eval mode, on CPU. The images are noise, of course.

Needs transformers >= 5 (tokenizers built from in-memory vocabularies).
"""

from __future__ import annotations

import functools
import gzip
import importlib.util
import os
import string

import torch
from diffusers import (
    AutoencoderKL,
    FlowMatchEulerDiscreteScheduler,
    FluxPipeline,
    FluxTransformer2DModel,
    SD3Transformer2DModel,
    StableDiffusion3Pipeline,
)
from transformers import (
    CLIPTextConfig,
    CLIPTextModel,
    CLIPTextModelWithProjection,
    CLIPTokenizer,
    T5Config,
    T5EncoderModel,
    T5TokenizerFast,
)

# Both VAEs have 4 blocks, so vae_scale_factor = 2**3 = 8 like the real models.
TINY_VAE_SCALE_FACTOR = 8
TINY_LATENT_CHANNELS = 16  # as SD3 and FLUX
# 64 px -> 8x8 latent -> 4x4 = 16 image tokens (SD3: 2x2 patches, FLUX: 2x2 packing).
TINY_SD3_RESOLUTION = 64
TINY_FLUX_RESOLUTION = 64
CLIP_MAX_LENGTH = 77
# The tiny T5 has relative position buckets, so any length works; the pipeline
# defaults (SD3: 256, FLUX: 512) are fine, but passing this keeps tests fast.
TINY_T5_MAX_LENGTH = 32
T5_MODEL_MAX_LENGTH = 512  # tokenizer_3 / tokenizer_2.model_max_length, as released


def _seeded(seed: int, component: int, build):
    """Build one component under its own seed, without touching the global RNG."""
    default_dtype = torch.get_default_dtype()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed * 1000 + component)
        torch.set_default_dtype(torch.float32)  # fp32 from the start: no cast afterwards
        try:
            module = build()
        finally:
            torch.set_default_dtype(default_dtype)
    return module.eval()


# --------------------------------------------------------------------------- CLIP
def _byte_alphabet() -> list[str]:
    """256 printable stand-ins for the bytes 0..255, in byte-level BPE order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    printable = set(keep)
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:  # unprintable bytes are mapped past 255
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in keep] + [chars[b] for b in range(256) if b not in printable]


@functools.lru_cache(maxsize=1)
def _clip_bpe() -> tuple[dict[str, int], list[tuple[str, str]]]:
    """OpenAI CLIP's vocabulary (49408 ids) and merges, from open_clip's shipped file."""
    spec = importlib.util.find_spec("open_clip")  # locate without importing the package
    if spec is None:
        raise ModuleNotFoundError("the tiny SD3 / FLUX.1 pipelines' CLIP tokenizer reads the BPE file that "
                                  "open_clip_torch ships, which is not installed: pip install 'flowrl[rewards]'",
                                  name="open_clip")
    path = os.path.join(spec.submodule_search_locations[0], "bpe_simple_vocab_16e6.txt.gz")
    with gzip.open(path, "rt", encoding="utf-8") as fh:
        lines = fh.read().split("\n")
    merges = [tuple(line.split()) for line in lines[1 : 49152 - 256 - 2 + 1]]  # same cut as CLIP
    return _clip_vocab(merges), merges  # <|startoftext|>, <|endoftext|>: ids 49406, 49407


def _clip_vocab(merges) -> dict[str, int]:
    """CLIP's id layout: 256 byte symbols, the same with ``</w>``, one token per merge, two specials."""
    alphabet = _byte_alphabet()
    tokens = alphabet + [c + "</w>" for c in alphabet] + ["".join(m) for m in merges]
    tokens += ["<|startoftext|>", "<|endoftext|>"]
    return {tok: i for i, tok in enumerate(tokens)}


def tiny_clip_tokenizer(pad_token: str = "<|endoftext|>") -> CLIPTokenizer:
    """The real CLIP BPE tokenizer (ids identical to openai/clip-vit-large-patch14)."""
    vocab, merges = _clip_bpe()
    return CLIPTokenizer(vocab=dict(vocab), merges=list(merges), pad_token=pad_token,
                         model_max_length=CLIP_MAX_LENGTH)


def clip_bpe_merges_of(words, merges: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """The merges CLIP's BPE applies to ``words`` (lowercase ASCII), in rank order.

    BPE merges the lowest-ranked adjacent pair until none is left. A merge table cut to the merges
    this loop applies tokenizes the same words into the same pieces: at every step the applied pair
    is the lowest-ranked one of the full table, so it is also the lowest of the cut one.
    """
    rank = {pair: i for i, pair in enumerate(merges)}
    used: set[tuple[str, str]] = set()
    for word in set(words):
        parts = [*word[:-1], word[-1] + "</w>"]
        while len(parts) > 1:
            pairs = [(rank.get((a, b), len(rank)), i) for i, (a, b) in enumerate(zip(parts, parts[1:]))]
            best, i = min(pairs)
            if best == len(rank):
                break
            used.add(merges[best])
            parts[i:i + 2] = [parts[i] + parts[i + 1]]
    return sorted(used, key=rank.__getitem__)


def clip_tokenizer_for(texts, pad_token: str = "<|endoftext|>",
                       model_max_length: int = CLIP_MAX_LENGTH) -> CLIPTokenizer:
    """CLIP's BPE tokenizer cut to the words of ``texts``: same pieces, a vocabulary of ~500 + merges.

    For models trained from scratch on a closed grammar (the toy world): the full 49408-entry table
    would put almost all of a tiny text encoder's weights in embedding rows no prompt ever uses.
    Ids: the 256 byte symbols, the same with ``</w>``, the kept merges in CLIP's rank order, then
    ``<|startoftext|>`` and ``<|endoftext|>``. Words outside ``texts`` still tokenize, into bytes.
    """
    _, merges = _clip_bpe()
    words = {w for text in texts for w in text.lower().split()}
    if not all(w.isascii() and w.isalnum() for w in words):
        raise ValueError("clip_tokenizer_for takes lowercase-able ASCII words without punctuation")
    kept = clip_bpe_merges_of(words, merges)
    return CLIPTokenizer(vocab=_clip_vocab(kept), merges=kept, pad_token=pad_token, model_max_length=model_max_length)


def tiny_clip_text_encoder(width: int, *, vocab: dict[str, int] | None = None, max_positions: int = CLIP_MAX_LENGTH,
                           cls=CLIPTextModelWithProjection,
                           layers: int = 2) -> CLIPTextModel | CLIPTextModelWithProjection:
    """A CLIP text encoder of ``width`` (projection of the same width) and ``layers`` layers, initialised from the
    global RNG.

    ``vocab``: the tokenizer's vocabulary (default: CLIP's full 49408 ids; a model trained on a closed grammar
    passes the cut one of :func:`clip_tokenizer_for`); ``max_positions``: the longest token sequence."""
    vocab = vocab if vocab is not None else _clip_bpe()[0]
    config = CLIPTextConfig(
        vocab_size=len(vocab), hidden_size=width, intermediate_size=2 * width,
        projection_dim=width, num_hidden_layers=layers, num_attention_heads=2,
        max_position_embeddings=max_positions, hidden_act="quick_gelu",
        bos_token_id=vocab["<|startoftext|>"], eos_token_id=vocab["<|endoftext|>"], pad_token_id=1,
    )
    return cls(config)


# ----------------------------------------------------------------------------- T5
# A hand-written Unigram vocabulary: special tokens, whole words likely in prompts,
# then single characters so that any ASCII text can be segmented; other text -> <unk>.
_T5_WORDS = (
    "a an the of and with in on at to by for from is are photo picture image painting drawing "
    "portrait illustration render style art digital oil watercolor sketch cinematic detailed "
    "high quality realistic beautiful cute small large red green blue yellow black white "
    "cat dog bird horse car house tree flower sky sea mountain city street person man woman "
    "child face hand table chair cup apple banana forest river sun moon night day two three"
).split()


@functools.lru_cache(maxsize=1)
def _t5_vocab() -> tuple[tuple[str, float], ...]:
    pieces = {"<pad>": 0.0, "</s>": 0.0, "<unk>": 0.0, "▁": -2.0}  # ids 0, 1, 2, 3 as in T5
    for word in _T5_WORDS:
        pieces.setdefault("▁" + word, -6.0)
    for ch in string.ascii_letters + string.digits + string.punctuation:
        pieces.setdefault("▁" + ch, -9.0)
        pieces.setdefault(ch, -10.0)
    pieces.update({f"<extra_id_{i}>": 0.0 for i in reversed(range(100))})  # sentinels last, as in T5
    return tuple(pieces.items())


@functools.lru_cache(maxsize=None)
def trained_byte_bpe_json(corpus: tuple[str, ...], vocab_size: int, special_tokens: tuple[str, ...]) -> str:
    """A byte-level BPE (the kind Qwen's and Mistral's tokenizers are) trained offline on ``corpus`` with
    ``special_tokens`` first, as ``tokenizers`` JSON: the same bytes on every machine, one training per arguments."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(special_tokens),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(list(corpus) * 4, trainer=trainer)
    return tokenizer.to_str()


def tiny_t5_tokenizer() -> T5TokenizerFast:
    return T5TokenizerFast(vocab=list(_t5_vocab()), extra_ids=100, model_max_length=T5_MODEL_MAX_LENGTH)


def tiny_t5_encoder(d_model: int, *, layers: int = 2, heads: int = 4, d_kv: int | None = None, d_ff: int | None = None,
                    max_distance: int = 32) -> T5EncoderModel:
    """A T5 v1.1 encoder (gated-gelu, no dropout, as t5-v1_1-xxl) over :func:`tiny_t5_tokenizer`'s vocabulary,
    initialised from the global RNG; ``d_kv`` defaults to ``d_model // 4``, ``d_ff`` to ``2 * d_model``."""
    config = T5Config(
        vocab_size=len(_t5_vocab()), d_model=d_model, d_kv=d_kv or d_model // 4, d_ff=d_ff or 2 * d_model,
        num_layers=layers, num_heads=heads,
        relative_attention_num_buckets=8, relative_attention_max_distance=max_distance,
        feed_forward_proj="gated-gelu", dropout_rate=0.0, is_encoder_decoder=False,
    )
    return T5EncoderModel(config)


# ---------------------------------------------------------------------------- VAE
def tiny_vae(scaling_factor: float = 1.0, shift_factor: float = 0.0, *, channels: tuple[int, ...] = (8, 16, 16, 16),
             norm_groups: int = 4, latent_channels: int = TINY_LATENT_CHANNELS, sample_size: int = TINY_SD3_RESOLUTION,
             mid_block_attention: bool = True) -> AutoencoderKL:
    """A VAE of ``len(channels)`` levels (each but the last halves the size: the default 4 levels give x8 and
    16 latent channels, as SD3/FLUX), one layer per block, no quant convs; initialised from the global RNG."""
    return AutoencoderKL(
        in_channels=3, out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * len(channels), up_block_types=("UpDecoderBlock2D",) * len(channels),
        block_out_channels=channels, layers_per_block=1, norm_num_groups=norm_groups,
        latent_channels=latent_channels, sample_size=sample_size, mid_block_add_attention=mid_block_attention,
        scaling_factor=scaling_factor, shift_factor=shift_factor,
        use_quant_conv=False, use_post_quant_conv=False,
    )


# ---------------------------------------------------------------------------- SD3
# CLIP-L (16) and CLIP-G (32) hidden states are concatenated (48) and zero-padded to
# the T5 width (64) = joint_attention_dim; pooled = 16 + 32 projections = 48.
_SD3_CLIP_L, _SD3_CLIP_G, _SD3_T5 = 16, 32, 64


def tiny_sd3_transformer(*, sample_size: int = TINY_SD3_RESOLUTION // TINY_VAE_SCALE_FACTOR,
                         patch_size: int = 2, latent_channels: int = TINY_LATENT_CHANNELS, layers: int = 2,
                         heads: int = 2, head_dim: int = 16, joint_attention_dim: int = _SD3_T5,
                         pooled_projection_dim: int = _SD3_CLIP_L + _SD3_CLIP_G, pos_embed_max_size: int = 32,
                         qk_norm: str | None = None) -> SD3Transformer2DModel:
    """An MMDiT of ``layers`` joint blocks of ``heads`` x ``head_dim`` channels (the caption projection as wide),
    initialised from the global RNG. The defaults: 8x8 latents (default height 64 px) in 2x2 patches, up to
    32x32 patches (512 px), text of the tiny SD3's widths."""
    return SD3Transformer2DModel(
        sample_size=sample_size, patch_size=patch_size, in_channels=latent_channels, out_channels=latent_channels,
        num_layers=layers, attention_head_dim=head_dim, num_attention_heads=heads,
        caption_projection_dim=head_dim * heads,
        joint_attention_dim=joint_attention_dim, pooled_projection_dim=pooled_projection_dim,
        pos_embed_max_size=pos_embed_max_size, qk_norm=qk_norm,
    )


def sd3_pipeline_of(transformer, vae, text_encoders, tokenizers, *, shift: float = 3.0) -> StableDiffusion3Pipeline:
    """An SD3 pipeline of these networks: ``text_encoders`` / ``tokenizers`` are the (CLIP-L, CLIP-G, T5)
    triples, the scheduler is SD3's flow-matching Euler with ``shift``."""
    (text_encoder, text_encoder_2, text_encoder_3), (tokenizer, tokenizer_2, tokenizer_3) = text_encoders, tokenizers
    return StableDiffusion3Pipeline(
        transformer=transformer,
        scheduler=FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=shift),
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        text_encoder_2=text_encoder_2,
        tokenizer_2=tokenizer_2,
        text_encoder_3=text_encoder_3,
        tokenizer_3=tokenizer_3,
    )


def tiny_sd3_pipeline(seed: int = 0) -> StableDiffusion3Pipeline:
    """SD3-medium layout (MMDiT, 2 CLIP + T5, shift 3.0) with tiny random weights."""
    transformer = _seeded(seed, 0, tiny_sd3_transformer)
    vae = _seeded(seed, 1, lambda: tiny_vae(scaling_factor=1.5305, shift_factor=0.0609))
    text_encoder = _seeded(seed, 2, lambda: tiny_clip_text_encoder(_SD3_CLIP_L))
    text_encoder_2 = _seeded(seed, 3, lambda: tiny_clip_text_encoder(_SD3_CLIP_G))
    text_encoder_3 = _seeded(seed, 4, lambda: tiny_t5_encoder(_SD3_T5))
    return sd3_pipeline_of(transformer, vae, (text_encoder, text_encoder_2, text_encoder_3),
                           (tiny_clip_tokenizer(), tiny_clip_tokenizer(pad_token="!"),  # bigG pads with "!" (id 0)
                            tiny_t5_tokenizer()), shift=3.0)


# --------------------------------------------------------------------------- FLUX
# CLIP-L pooled output (32) -> pooled_projection_dim; T5 width (64) -> joint_attention_dim.
_FLUX_CLIP, _FLUX_T5 = 32, 64


def tiny_flux_pipeline(seed: int = 0) -> FluxPipeline:
    """FLUX.1-dev layout (guidance-distilled, CLIP + T5, dynamic shift) with tiny random weights.

    FluxPipeline's default size is hard-coded (1024 px): always pass height/width.
    """
    transformer = _seeded(seed, 0, lambda: FluxTransformer2DModel(
        patch_size=1, in_channels=4 * TINY_LATENT_CHANNELS,  # 2x2-packed latents: 64 channels
        num_layers=1, num_single_layers=1, attention_head_dim=16, num_attention_heads=2,
        joint_attention_dim=_FLUX_T5, pooled_projection_dim=_FLUX_CLIP,
        guidance_embeds=True, axes_dims_rope=(4, 6, 6),  # sums to attention_head_dim
    ))
    vae = _seeded(seed, 1, lambda: tiny_vae(scaling_factor=0.3611, shift_factor=0.1159))
    text_encoder = _seeded(seed, 2, lambda: tiny_clip_text_encoder(_FLUX_CLIP, cls=CLIPTextModel))
    text_encoder_2 = _seeded(seed, 3, lambda: tiny_t5_encoder(_FLUX_T5))
    scheduler = FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True,
        base_shift=0.5, max_shift=1.15, base_image_seq_len=256, max_image_seq_len=4096,
    )
    return FluxPipeline(
        transformer=transformer,
        scheduler=scheduler,
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tiny_clip_tokenizer(),
        text_encoder_2=text_encoder_2,
        tokenizer_2=tiny_t5_tokenizer(),
    )
