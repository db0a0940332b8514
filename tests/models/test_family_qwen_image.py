"""Qwen-Image specifics behind tests/models/test_families.py: the text padding and its masks, the noise and sigmas of
``QwenImagePipeline``, the true-CFG norm rescale and the LoRA targets, on the tiny offline pipeline."""

import math
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import pytest
import torch
from transformers import Qwen2_5_VLForConditionalGeneration

from flowrl.models import build_policy
from flowrl.models.base import real_token_mask as text_mask
from flowrl.models.qwen_image import QWEN_IMAGE_LORA_TARGETS, QwenImagePolicy
from flowrl.core.seeding import generators

PROMPTS = ["a red circle", "two blue squares", ""]


@pytest.fixture(scope="module")
def policy():
    return build_policy("qwen_image", "tiny", seed=0)


def test_text_encoder_saves_and_reloads(policy, tmp_path):
    encoder = policy.pipeline.text_encoder
    encoder.save_pretrained(tmp_path)
    reloaded = Qwen2_5_VLForConditionalGeneration.from_pretrained(tmp_path).eval()
    assert encoder.config.text_config.vocab_size >= len(policy.pipeline.tokenizer)
    tokens = policy.pipeline.tokenizer(["a red circle"], return_tensors="pt")
    with torch.no_grad():
        ours = encoder(**tokens, output_hidden_states=True).hidden_states[-1]
        theirs = reloaded(**tokens, output_hidden_states=True).hidden_states[-1]
    torch.testing.assert_close(theirs, ours, rtol=0, atol=0)


def test_embeddings_have_a_fixed_length_and_masks_from_the_padding(policy):
    embeds, pooled = policy.encode_batch(PROMPTS, "cpu")
    assert embeds.shape[:2] == (3, policy.max_sequence_length) and pooled.shape == (3, 0)
    theirs, their_mask = policy.pipeline.encode_prompt(PROMPTS, device="cpu",
                                                       max_sequence_length=policy.max_sequence_length)
    length = theirs.shape[1]
    torch.testing.assert_close(embeds[:, :length], theirs, rtol=0, atol=0)
    assert (embeds[:, length:] == 0).all()
    cond = policy.encode(PROMPTS)
    assert cond.prompt_mask.shape == (3, policy.max_sequence_length)
    assert torch.equal(cond.prompt_mask[:, :length], their_mask.bool())
    assert not cond.prompt_mask[:, length:].any() and cond.negative_prompt_mask.sum(1).eq(7).all()  # "" -> 7 tokens


def test_masked_zero_padding_leaves_the_transformer_output_unchanged(policy):
    embeds, mask = policy.pipeline.encode_prompt(PROMPTS, device="cpu", max_sequence_length=32)  # [3, L, D]
    assert mask is not None  # "" is shorter: the pipeline itself pads and masks
    extra = torch.nn.functional.pad(embeds, (0, 0, 0, 9))
    x = torch.randn(3, 16, 64, generator=torch.Generator().manual_seed(0))  # [3, S, 4C] packed
    common = dict(hidden_states=x, timestep=torch.full((3,), 0.5), img_shapes=[[(1, 4, 4)]] * 3)
    with torch.no_grad():
        out = policy.transformer(encoder_hidden_states=embeds, encoder_hidden_states_mask=mask, **common)[0]
        padded = policy.transformer(encoder_hidden_states=extra, encoder_hidden_states_mask=text_mask(extra),
                                    **common)[0]
    torch.testing.assert_close(padded, out, rtol=0, atol=1e-6)
    trimmed, trimmed_mask = QwenImagePolicy.trim_text(extra, text_mask(extra))
    assert trimmed.shape == embeds.shape and torch.equal(trimmed_mask, mask.bool())


def test_init_noise_is_the_pipeline_noise(policy):
    n, (_, c, h, w) = 3, policy.latent_shape(1)
    ours = policy.init_noise(n, generator=generators([5, 6, 7], device=policy.device))  # [3, C, h, w]
    theirs = policy.pipeline.prepare_latents(n, c, policy.height, policy.width, policy.dtype, policy.device,
                                             generators([5, 6, 7], device=policy.device))  # [3, S, 4C]
    torch.testing.assert_close(policy.pack(ours), theirs, rtol=0, atol=0)
    torch.testing.assert_close(policy.unpack(theirs, h, w), ours, rtol=0, atol=0)


def test_sigmas_follow_the_released_dynamic_exponential_shift(policy):
    big = QwenImagePolicy(policy.pipeline, height=1024, width=1024)  # 4096 packed tokens
    steps = 10
    sigmas = big.sigmas(steps)
    mu = 0.5 + (0.9 - 0.5) * (4096 - 256) / (8192 - 256)
    base = np.linspace(1.0, 1 / steps, steps)
    shifted = math.exp(mu) / (math.exp(mu) + (1 / base - 1))
    one_minus = 1 - shifted
    stretched = 1 - one_minus / (one_minus[-1] / (1 - 0.02))  # the terminal sigma 0.02
    assert sigmas.shape == (steps + 1,) and sigmas[-1] == 0
    torch.testing.assert_close(sigmas[:-1], torch.tensor(stretched, dtype=torch.float32), rtol=0, atol=1e-6)
    assert sigmas[-2].item() == pytest.approx(0.02, abs=1e-6)


def test_true_cfg_keeps_the_conditional_norm_per_token(policy):
    cond = policy.encode(PROMPTS[:2])
    x = torch.randn(policy.latent_shape(2), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        plain = policy.velocity(x, 0.7, cond, 1.0)
        guided = policy.velocity(x, 0.7, cond, 4.0)
    norms = [torch.norm(policy.pack(v), dim=-1) for v in (plain, guided)]  # [2, S]
    torch.testing.assert_close(norms[1], norms[0], rtol=1e-5, atol=1e-6)
    assert (guided - plain).abs().max() > 1e-4
    with pytest.raises(ValueError, match="negative"):
        policy.velocity(x, 0.7, policy.encode(PROMPTS[:2], negative=False), 4.0)


def test_lora_targets_the_image_attention_projections():
    policy = build_policy("qwen_image", "tiny", seed=0)
    policy.add_lora(rank=2, alpha=4.0, init_seed=0)
    wrapped = {n.rsplit(".lora_A", 1)[0] for n, _ in policy.named_trainable_parameters() if ".lora_A" in n}
    blocks = len(policy.transformer.transformer_blocks)
    assert len(wrapped) == 4 * blocks
    assert {n.split("attn.", 1)[1] for n in wrapped} == set(QWEN_IMAGE_LORA_TARGETS)


def test_text_cache_gives_the_live_conditioning_and_masks(tmp_path):
    from flowrl.models.text_cache import attach_text_cache

    policy = build_policy("qwen_image", "tiny", seed=0)
    live = policy.encode(PROMPTS[:2])
    attach_text_cache(policy, tmp_path / "cache", PROMPTS[:2], free=True)
    assert policy.pipeline.text_encoder is None
    cached = policy.encode(PROMPTS[:2])
    for name in ("prompt_embeds", "pooled_prompt_embeds", "negative_prompt_embeds", "prompt_mask",
                 "negative_prompt_mask"):
        assert torch.equal(getattr(cached, name), getattr(live, name)), name
