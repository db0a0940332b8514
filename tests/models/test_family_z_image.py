"""Z-Image specifics the shared family tests do not reach: CFG (batched, normalised, truncated) against the
pipeline, the guidance convention, the fixed-length text rows and their masks, the schedule, the LoRA targets."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch

from flowrl.models import build_policy
from flowrl.models.z_image import Z_IMAGE_LORA_TARGETS, ZImagePolicy
from flowrl.sampling import RolloutSettings, rollout

PROMPTS = ["a red circle", "two blue squares"]
SEEDS = [11, 12, 13, 14]
STEPS = 3


@pytest.fixture(scope="module")
def policy():
    return build_policy("z_image", "tiny", seed=0)


def _ode(policy, guidance):
    return rollout(policy, PROMPTS, RolloutSettings(num_steps=STEPS, guidance_scale=guidance, noise_level=0.0),
                   group_size=2, seeds=SEEDS).images


def _pipeline(policy, guidance):
    return policy.pipeline_images(PROMPTS, group_size=2, num_steps=STEPS, guidance_scale=guidance, seeds=SEEDS)


def test_guidance_counts_from_one_here_and_from_zero_in_the_pipeline():
    assert ZImagePolicy.pipeline_guidance(1.0) == 0.0 and ZImagePolicy.pipeline_guidance(0.0) == 0.0
    assert ZImagePolicy.pipeline_guidance(5.0) == 4.0


@pytest.mark.parametrize("normalization, truncation", [(0.0, 1.0), (1.0, 1.0), (0.0, 0.1)])
def test_cfg_rollout_reproduces_the_pipeline(policy, normalization, truncation):
    """w = 4 (the pipeline's 3): plain, with the guided norm capped at the conditional one's, and truncated (no
    guidance once 1 - sigma > 0.1: the last two of three steps)."""
    policy.cfg_normalization, policy.cfg_truncation = normalization, truncation
    try:
        ours, theirs = _ode(policy, 4.0), _pipeline(policy, 4.0)
    finally:
        policy.cfg_normalization, policy.cfg_truncation = 0.0, 1.0
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)
    if (normalization, truncation) != (0.0, 1.0):  # the option really changed the images
        assert (ours - _ode(policy, 4.0)).abs().max() > 1e-4
    assert (ours - _ode(policy, 1.0)).abs().max() > 1e-4  # and guidance did


def test_the_schedule_is_the_pipelines(policy):
    _pipeline(policy, 1.0)
    torch.testing.assert_close(policy.sigmas(STEPS), policy.pipeline.scheduler.sigmas.cpu(), rtol=0, atol=0)
    assert policy.sigmas(STEPS)[0] == 1 and policy.sigmas(STEPS)[-1] == 0


def test_text_rows_are_the_pipelines_real_tokens_zero_padded(policy):
    cond = policy.encode(PROMPTS + [""])
    rows, _ = policy.pipeline.encode_prompt(prompt=PROMPTS + [""], device="cpu", do_classifier_free_guidance=False,
                                            max_sequence_length=policy.max_sequence_length)
    assert cond.prompt_embeds.shape[:2] == (3, policy.max_sequence_length)
    assert cond.pooled_prompt_embeds.shape == (3, 0)
    for embeds, mask, row in zip(cond.prompt_embeds, cond.prompt_mask, rows):
        assert int(mask.sum()) == len(row) and mask[:len(row)].all()  # front-aligned real tokens
        torch.testing.assert_close(embeds[mask], row, rtol=0, atol=1e-6)
        assert embeds[~mask].eq(0).all()
    assert cond.negative_prompt_mask is not None and cond.negative_prompt_mask.sum(-1).eq(len(rows[2])).all()


def test_unguided_velocity_needs_no_negative(policy):
    cond = policy.encode(PROMPTS, negative=False)
    x = policy.init_noise(2, generator=torch.Generator().manual_seed(0))
    assert x.dtype == torch.float32
    assert policy.velocity(x, torch.tensor(0.5), cond, 1.0).shape == x.shape
    with pytest.raises(ValueError, match="negative"):
        policy.velocity(x, torch.tensor(0.5), cond, 4.0)


def test_lora_targets_adapt_every_attention_block(policy):
    names = [n for n, _ in policy.transformer.named_modules()]
    for block in ("noise_refiner.0", "context_refiner.0", "layers.0"):
        for target in Z_IMAGE_LORA_TARGETS:
            assert f"{block}.attention.{target}" in names
    assert hasattr(policy.pipeline, "load_lora_weights")
