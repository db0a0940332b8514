"""HunyuanVideo-1.5 (hunyuan_video15, hunyuan_video15_i2v): what the shared family checks do not pin down.

The tiny tokenizer's template prefix is the 108 tokens the pipeline crops, the sigmas and the noise are the
pipeline's, guidance is the guider's (two passes, one at 1.0), the byT5 glyph states ride in the pooled slot and
equal the pipeline's, the LoRA targets are UniRL's, the first frame conditions I2V on latent frame 0, and every
bad input is one line.
"""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import pytest
import torch

from flowrl.models import build_policy
from flowrl.models.hunyuan_video15 import HUNYUAN_VIDEO15_LORA_TARGETS


@pytest.fixture(scope="module")
def t2v():
    return build_policy("hunyuan_video15", "tiny", seed=0)


@pytest.fixture(scope="module")
def i2v():
    return build_policy("hunyuan_video15_i2v", "tiny", seed=0)


def test_the_tiny_template_prefix_is_the_crop_and_survives_a_reload(t2v, tmp_path):
    from diffusers.pipelines.hunyuan_video1_5.pipeline_hunyuan_video1_5 import format_text_input
    from transformers import Qwen2Tokenizer

    pipeline = t2v.pipeline
    tokenizer = pipeline.tokenizer
    chat = format_text_input(["a red circle"], pipeline.system_message)
    ids = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    ids = ids[0] if isinstance(ids[0], list) else ids
    starts = [i for i, t in enumerate(ids) if t == tokenizer.convert_tokens_to_ids("<|im_start|>")]
    assert starts[1] + 3 == pipeline.prompt_template_encode_start_idx == 108  # "<|im_start|>", "u", "ser", "\n"
    tokenizer.save_pretrained(tmp_path)
    again = Qwen2Tokenizer.from_pretrained(tmp_path).apply_chat_template(chat, add_generation_prompt=True,
                                                                         tokenize=True, return_dict=True)
    assert again["input_ids"] == ids or again["input_ids"][0] == ids


def test_sigmas_and_noise_are_the_pipelines(t2v):
    from diffusers.pipelines.hunyuan_video1_5.pipeline_hunyuan_video1_5 import retrieve_timesteps

    import copy

    scheduler = copy.deepcopy(t2v.pipeline.scheduler)
    retrieve_timesteps(scheduler, 4, "cpu", sigmas=np.linspace(1.0, 0.0, 5)[:-1])
    torch.testing.assert_close(t2v.sigmas(4), scheduler.sigmas, rtol=0, atol=0)
    assert t2v.sigmas(4)[1] > 0.75  # shift 5: 0.75 -> 0.9375
    ours = t2v.init_noise(2, generator=torch.Generator().manual_seed(3))
    theirs = t2v.pipeline.prepare_latents(2, t2v.pipeline.num_channels_latents, 32, 32, 5, torch.float32, "cpu",
                                          torch.Generator().manual_seed(3))
    torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
    assert ours.shape == (2, 8, 2, 2, 2)  # (5 - 1) / 4 + 1 latent frames, 32 px / 16


def test_glyph_text_rides_in_the_pooled_slot_as_the_pipeline_encodes_it(t2v):
    cond = t2v.encode(['a sign that reads "OPEN"', "a red circle"], negative=False)
    _, mask, glyph, glyph_mask = t2v.pipeline.encode_prompt(['a sign that reads "OPEN"', "a red circle"],
                                                            device="cpu", batch_size=2)
    stored = cond.pooled_prompt_embeds.unflatten(1, (t2v.pipeline.tokenizer_2_max_length, -1))  # [B, 32, D2]
    assert glyph_mask[0].sum() > 0 and glyph_mask[1].sum() == 0  # only quoted text reaches byT5
    # to GEMM rounding: flowrl encodes in chunks of TEXT_CHUNK prompts, this call two
    torch.testing.assert_close(stored[0][glyph_mask[0].bool()], glyph[0][glyph_mask[0].bool()], rtol=0, atol=1e-6)
    assert stored[1].abs().sum() == 0
    assert torch.equal(cond.prompt_mask, mask.bool())  # the LLM mask, rebuilt from the zeroed padding


def test_guidance_is_the_guiders_two_passes_and_one_at_1(t2v):
    calls = []
    handle = t2v.transformer.register_forward_pre_hook(lambda _m, _a, kw: calls.append(kw["hidden_states"].shape[0]),
                                                       with_kwargs=True)
    try:
        cond = t2v.encode(["a red circle"], negative=True)
        x = t2v.init_noise(1, generator=torch.Generator().manual_seed(0))
        guided = t2v.velocity(x, 0.5, cond, 6.0)
        plain = t2v.velocity(x, 0.5, cond, 1.0)
    finally:
        handle.remove()
    assert calls == [1, 1, 1]  # conditional + unconditional at 6.0, conditional only at 1.0 (the guider is off)
    assert (guided - plain).abs().max() > 1e-4


def test_lora_targets_are_unirls_and_reach_both_streams(t2v):
    assert t2v.default_lora_targets() == HUNYUAN_VIDEO15_LORA_TARGETS
    policy = build_policy("hunyuan_video15", "tiny", seed=0)
    policy.add_lora(rank=2, alpha=2.0, init_seed=0)
    names = [n for n, _ in policy.named_trainable_parameters()]
    assert any("transformer_blocks.0.attn.add_q_proj" in n for n in names)
    assert any("transformer_blocks.1.ff_context.net.2" in n for n in names)


def test_the_first_frame_conditions_latent_frame_0(i2v):
    cond = i2v.encode(["a red circle"], negative=False, metadata=i2v.example_metadata(1))
    assert cond.image_latents.shape == (1, 8, 1, 2, 2) and cond.image_embeds.shape == (1, 4, 16)
    x = i2v.init_noise(1, generator=torch.Generator().manual_seed(0))
    latents, mask, embeds = i2v.image_inputs(x, cond)
    assert torch.equal(latents[:, :, :1], cond.image_latents) and latents[:, :, 1:].abs().sum() == 0
    assert mask[:, :, 0].eq(1).all() and mask[:, :, 1:].eq(0).all()
    other = i2v.encode(["a red circle"], negative=False, metadata=i2v.example_metadata(2)[1:])
    assert (i2v.velocity(x, 0.5, cond, 1.0) - i2v.velocity(x, 0.5, other, 1.0)).abs().max() > 1e-5


@pytest.mark.parametrize("kwargs, message", [
    ({"num_frames": 6}, "needs num_frames = 4 k \\+ 1"),
    ({"height": 40, "width": 32}, "needs height and width divisible by 16, got 40x32"),
])
def test_a_size_or_frame_count_the_model_cannot_take_is_one_line(kwargs, message):
    for family in ("hunyuan_video15", "hunyuan_video15_i2v"):
        with pytest.raises(ValueError, match=message):
            build_policy(family, "tiny", seed=0, **kwargs)


def test_an_i2v_prompt_without_its_first_frame_is_one_line(i2v):
    with pytest.raises(ValueError, match="prompt 1 of the batch has no metadata 'source_image'.*first frame"):
        i2v.encode(["a", "b"], metadata=i2v.example_metadata(1) + [{}])
    text_only = i2v.encode(["a"], negative=False)
    x = i2v.init_noise(1, generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="the conditioning has no first frame"):
        i2v.velocity(x, 0.5, text_only, 1.0)


def test_i2v_reference_at_a_size_the_pipeline_would_not_pick_is_one_line():
    policy = build_policy("hunyuan_video15_i2v", "tiny", seed=0, height=32, width=64)
    with pytest.raises(ValueError, match="samples a 32x64 first frame at its bucket"):
        policy.pipeline_images(["a"], group_size=1, num_steps=1, guidance_scale=1.0, seeds=[0],
                               metadata=policy.example_metadata(1))


def test_meanflow_checkpoints_and_step_limited_guiders_are_one_line():
    from flowrl.models.hunyuan_video15 import HunyuanVideo15Policy
    from flowrl.models.hunyuan_video15_i2v import HunyuanVideo15I2VPolicy

    pipeline = HunyuanVideo15I2VPolicy.tiny_pipeline(0)
    pipeline.transformer.register_to_config(use_meanflow=True)
    with pytest.raises(ValueError, match="MeanFlow-distilled"):
        HunyuanVideo15I2VPolicy(pipeline, height=32, width=32)
    pipeline = HunyuanVideo15Policy.tiny_pipeline(0)
    pipeline.guider = pipeline.guider.new(stop=0.5)
    with pytest.raises(ValueError, match="ClassifierFreeGuidance over every step"):
        HunyuanVideo15Policy(pipeline, height=32, width=32)
