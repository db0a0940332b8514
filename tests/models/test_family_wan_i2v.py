"""Wan2.1 I2V-14B specifics beyond tests/models/test_families.py: the transformer sees the pipeline's own input (the
noisy latents, the first frame's mask and latents on the channel axis, CLIP states in both CFG passes), the noise has
the VAE's channels, the first frame comes from each prompt's metadata and is cached, rewards see it as source pixels,
and a prompt without one, a conditioning without one, lora.experts and a folder of another Wan layout are one line."""

import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import pytest
import torch

from flowrl.core.seeding import generators
from flowrl.data.edit_sources import source_pixels
from flowrl.data.prompts import load_prompts
from flowrl.models import build_policy, check_pipeline_family
from flowrl.models.wan import WAN_LORA_TARGETS
from flowrl.models.wan_i2v import WanI2VPolicy
from flowrl.rewards_api import with_source_pixels
from flowrl.sampling import RolloutSettings, rollout

PROMPTS = ["a red circle rolls", "a blue square spins"]
SEEDS = [11, 12]


@pytest.fixture(scope="module")
def policy():
    return build_policy("wan_i2v", "tiny", seed=0)


def _spy(monkeypatch, transformer, calls: list):
    forward = transformer.forward
    monkeypatch.setattr(transformer, "forward", lambda **kw: calls.append(
        {k: v.clone() for k, v in kw.items() if isinstance(v, torch.Tensor)}) or forward(**kw))


def test_the_transformer_sees_the_pipelines_input_in_both_cfg_passes(policy, monkeypatch):
    metadata = policy.example_metadata(1)
    calls = []
    _spy(monkeypatch, policy.pipeline.transformer, calls)
    settings = RolloutSettings(num_steps=2, guidance_scale=5.0, noise_level=0.0)
    with torch.no_grad():
        rollout(policy, PROMPTS[:1], settings, group_size=2, seeds=SEEDS, metadata=metadata)
        ours = len(calls)
        policy.pipeline_images(PROMPTS[:1], group_size=2, num_steps=2, guidance_scale=5.0, seeds=SEEDS,
                               metadata=metadata)
    ours, theirs = calls[:ours], calls[ours:]
    assert len(ours) == len(theirs) == 4  # 2 steps x (conditional, unconditional)
    for mine, pipe in zip(ours, theirs):
        assert mine.keys() == pipe.keys()
        for key in mine:
            torch.testing.assert_close(mine[key], pipe[key], rtol=0, atol=0, msg=key)
    first = ours[0]
    assert first["hidden_states"].shape == (2, 36, 2, 4, 4)  # 16 noisy + 4 mask + 16 first-frame channels
    mask = first["hidden_states"][:, 16:20]  # [2, 4, F, h, w]: 1 on the 4 pixel frames folded into latent frame 0
    assert torch.equal(mask[:, :, 0], torch.ones_like(mask[:, :, 0])) and not mask[:, :, 1:].any()
    assert first["encoder_hidden_states_image"].shape == (2, 17, 16)  # CLIP's penultimate states, 17 tokens of 16
    assert torch.equal(ours[1]["encoder_hidden_states_image"], first["encoder_hidden_states_image"])  # the uncond pass


def test_noise_has_the_vae_channels_and_the_pipelines_draw(policy):
    assert policy.latent_shape(2) == (2, 16, 2, 4, 4)  # not the transformer's 36 input channels
    noise = policy.init_noise(2, generator=generators(SEEDS))
    pipe = policy.pipeline
    pixels = pipe.video_processor.preprocess(policy.source_image(policy.example_metadata(1)[0]["source_image"]),
                                             height=32, width=32)
    theirs, _ = pipe.prepare_latents(pixels, 2, 16, 32, 32, 5, torch.float32, "cpu", generators(SEEDS))
    assert torch.equal(noise, theirs)


def test_the_first_frame_comes_from_the_metadata_and_is_cached(policy, monkeypatch):
    metadata = load_prompts("assets/prompts/i2v_train.jsonl").metadata[:3]
    assert all(os.path.isfile(m["source_image"]) for m in metadata)
    cond = policy.encode(["a", "b", "c"], metadata=metadata)
    assert cond.image_latents.shape == (3, 20, 2, 4, 4) and cond.image_embeds.shape == (3, 17, 16)
    assert not torch.equal(cond.image_latents[0], cond.image_latents[1])  # each prompt its own frame
    assert torch.equal(cond.select([2, 0]).image_embeds, cond.image_embeds[[2, 0]])  # rows index the frame
    calls = []
    monkeypatch.setattr(policy.vae, "encode", lambda *a, **k: calls.append(1))
    monkeypatch.setattr(policy.pipeline, "encode_image", lambda *a, **k: calls.append(1))
    again = policy.encode(["a", "b", "c"], metadata=metadata)
    assert not calls and torch.equal(again.image_latents, cond.image_latents)


def test_the_first_frame_conditions_the_clip(policy):
    settings = RolloutSettings(num_steps=2, guidance_scale=5.0, noise_level=0.0)
    sources = policy.example_metadata(2)
    clips = [rollout(policy, PROMPTS[:1], settings, group_size=1, seeds=SEEDS[:1], metadata=[meta]).images
             for meta in sources]
    assert (clips[0] - clips[1]).abs().max() > 1e-3  # same prompt and seed, another first frame


def test_rewards_see_the_first_frame_at_the_clips_size(policy):
    metadata = policy.example_metadata(1)
    clips = torch.zeros(1, 5, 3, 32, 32)  # [N, T, 3, H, W]
    seen = with_source_pixels(clips, metadata)[0]["source_pixels"]
    path = metadata[0]["source_image"]
    assert seen.shape == (3, 32, 32)
    torch.testing.assert_close(seen, source_pixels(path, 32, 32), rtol=0, atol=0)
    frame = torch.from_numpy(np.asarray(policy.source_image(path), dtype=np.float32) / 255).permute(2, 0, 1)
    torch.testing.assert_close(seen, frame, rtol=0, atol=0)  # the frame the policy encodes, as the reward sees it


def test_a_prompt_or_conditioning_without_its_first_frame_is_one_line(policy):
    with pytest.raises(ValueError, match=r"^wan_i2v: prompt 1 of the batch has no metadata 'source_image' \(a path\); "
                                         "an image-to-video family starts every clip") as error:
        policy.encode(PROMPTS, metadata=policy.example_metadata(1) + [{}])
    assert "\n" not in str(error.value)
    text = policy.encode(PROMPTS)  # no metadata at all: the text alone
    assert text.image_latents is None and text.prompt_embeds.shape[0] == 2
    with pytest.raises(ValueError, match="^wan_i2v: the conditioning has no first frame; .* 'source_image'$"):
        policy.velocity(policy.init_noise(2), 0.5, text, 5.0)
    with pytest.raises(ValueError, match="no metadata 'source_image'"):
        rollout(policy, PROMPTS[:1], RolloutSettings(num_steps=2, guidance_scale=5.0, noise_level=0.7), group_size=1,
                seeds=SEEDS[:1], metadata=[{"task": "video"}])


def test_lora_targets_and_one_transformer():
    policy = build_policy("wan_i2v", "tiny", seed=0)
    assert policy.default_lora_targets() == WAN_LORA_TARGETS
    with pytest.raises(ValueError, match=r"lora.experts: wan_i2v has one transformer; .*\(wan22_t2v, wan22_i2v\)"):
        policy.add_lora(rank=4, alpha=8.0, experts=["high"])
    with pytest.raises(ValueError, match=r"model.guidance_scale_2 is for two-expert families \(wan22_t2v, wan22_i2v\)"):
        build_policy("wan_i2v", "tiny", seed=0, guidance_scale_2=3.0)


@pytest.mark.parametrize("family, index, hint", [
    ("wan_i2v", {"boundary_ratio": 0.9, "transformer_2": ["diffusers", "WanTransformer3DModel"]},
     "a two-expert Wan2.2 I2V A14B pipeline .*: set model.family=wan22_i2v$"),
    ("wan22_i2v", {"image_encoder": ["transformers", "CLIPVisionModel"]},
     "a one-transformer Wan2.1 I2V pipeline .*: set model.family=wan_i2v$"),
    ("wan_i2v", {"expand_timesteps": True}, "expand_timesteps .* model.family=wan22_ti2v on a WanPipeline folder$"),
])
def test_a_folder_of_another_wan_layout_is_one_line(tmp_path, family, index, hint):
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "WanImageToVideoPipeline", **index}))
    with pytest.raises(ValueError, match=hint):
        check_pipeline_family(family, str(tmp_path), "WanImageToVideoPipeline")


def test_a_text_to_video_folder_or_pipeline_is_one_line(tmp_path):
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "WanPipeline"}))
    with pytest.raises(ValueError, match="holds a WanPipeline, but model.family=wan_i2v needs a "
                                         "WanImageToVideoPipeline: set model.family=wan$"):
        check_pipeline_family("wan_i2v", str(tmp_path), "WanImageToVideoPipeline")
    from flowrl.models.tiny_wan22_i2v import tiny_wan22_i2v_pipeline

    with pytest.raises(ValueError, match="^model.path holds a two-expert Wan2.2 I2V A14B pipeline .*wan22_i2v$"):
        WanI2VPolicy(tiny_wan22_i2v_pipeline(0), height=32, width=32)
    pipeline = WanI2VPolicy.tiny_pipeline(0)
    pipeline.image_encoder = None
    with pytest.raises(ValueError, match="^wan_i2v: the transformer takes CLIP image states .* no image_encoder"):
        WanI2VPolicy(pipeline, height=32, width=32)
