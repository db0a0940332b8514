"""Wan2.1 text-to-video specifics beyond tests/models/test_families.py: the 5-D latent layout and its noise, the frames
layout of decode, the UniPC -> Euler scheduler swap, the LoRA targets, video through the reward seam (frame
sampling for image rewards), the verifiable video rewards on synthetic clips with hand-computed scores, and the
VideoRLVR early-step preset."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import math

import pytest
import torch

from flowrl.config import Config, load_config
from flowrl.models import build_policy
from flowrl.rewards_api import build_reward, check_batch, frame_indices, score
from flowrl.core.seeding import generators


@pytest.fixture(scope="module")
def policy():
    return build_policy("wan", "tiny", seed=0)


def test_latents_are_5d_and_drawn_like_the_pipeline(policy):
    assert policy.latent_shape(3) == (3, 16, 2, 4, 4)  # 5 frames -> 2 latent frames, 32 px -> 4
    ours = policy.init_noise(3, generator=generators([1, 2, 3]))
    theirs = policy.pipeline.prepare_latents(3, 16, 32, 32, 5, torch.float32, policy.device, generators([1, 2, 3]))
    assert torch.equal(ours, theirs)


def test_decode_returns_frames_first_video_in_unit_range(policy):
    video = policy.decode(torch.randn(2, 16, 2, 4, 4, generator=torch.Generator().manual_seed(0)))
    assert video.shape == (2, 5, 3, 32, 32) and video.dtype == torch.float32
    assert 0 <= video.min() and video.max() <= 1


def test_a_unipc_scheduler_is_swapped_for_euler_with_its_flow_shift(policy):
    from diffusers import FlowMatchEulerDiscreteScheduler, UniPCMultistepScheduler

    from flowrl.models.tiny_wan import tiny_wan_pipeline
    from flowrl.models.wan import WanPolicy

    pipeline = tiny_wan_pipeline(0)
    pipeline.scheduler = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True,
                                                 flow_shift=5.0, num_train_timesteps=1000)  # as released (720p)
    swapped = WanPolicy(pipeline, height=32, width=32, max_sequence_length=16)
    assert isinstance(pipeline.scheduler, FlowMatchEulerDiscreteScheduler)
    assert pipeline.scheduler.config.shift == 5.0
    expected = FlowMatchEulerDiscreteScheduler(shift=5.0)
    expected.set_timesteps(4)
    torch.testing.assert_close(swapped.sigmas(4), expected.sigmas.float(), rtol=0, atol=0)
    assert policy.sigmas(4)[-1] == 0 and not torch.equal(policy.sigmas(4), swapped.sigmas(4))  # shift 3 vs 5


def test_lora_targets_every_attention_projection(policy):
    names = [n for n, _ in policy.transformer.named_modules()]
    for target in policy.default_lora_targets():
        hits = [n for n in names if n.endswith("." + target)]
        assert {h.split(".")[2] for h in hits} == {"attn1", "attn2"}, target  # self- and cross-attention


def _moving_square(start_col: int, step: int, frames: int = 4, size: int = 10) -> torch.Tensor:
    """[1, T, 3, size, size]: a white 2x2 square on black, rows 4-5, moving ``step`` columns per frame."""
    video = torch.zeros(1, frames, 3, size, size)
    for t in range(frames):
        col = start_col + step * t
        video[0, t, :, 4:6, col:col + 2] = 1.0
    return video


def test_motion_direction_scores_the_centroid_displacement_by_hand():
    reward = build_reward("motion_direction")
    right, left = _moving_square(1, 1), _moving_square(5, -1)  # cols 1-2 -> 4-5, and 5-6 -> 2-3
    clips = torch.cat([right, left])
    out = reward(clips, ["a square moving right", "a square moving right"], [{}, {}])
    # centroid x = mean pixel-centre column / 10: (2.0 -> 5.0) / 10 = +0.3 and (6.0 -> 3.0) / 10 = -0.3; y fixed
    torch.testing.assert_close(out["motion_direction"], torch.tensor([0.3, -0.3]))
    torch.testing.assert_close(out["motion_direction/dy"], torch.tensor([0.0, 0.0]))
    out = reward(clips, ["a square moving left", "no direction here"], [{}, {"direction": "left"}])
    torch.testing.assert_close(out["motion_direction"], torch.tensor([-0.3, 0.3]))  # the metadata names it
    out = reward(clips, ["a square", "a square floating up"], [{}, {}])
    assert math.isnan(out["motion_direction"][0]) and out["motion_direction"][1] == 0  # none named; no y motion
    blank = torch.zeros(1, 4, 3, 10, 10)
    assert math.isnan(reward(blank, ["moving right"], [{}])["motion_direction"][0])  # nothing to track


def test_temporal_consistency_by_hand():
    reward = build_reward("temporal_consistency")
    moving = _moving_square(1, 2, frames=3)  # every step: 4 pixels off, 4 on, 3 channels, of 300 values
    still = _moving_square(1, 0, frames=3)
    out = reward(torch.cat([moving, still]), ["a", "b"], [{}, {}])["temporal_consistency"]
    torch.testing.assert_close(out, torch.tensor([1 - 24 / 300, 1.0]))


def test_image_rewards_score_sampled_frames_averaged_per_clip():
    assert frame_indices(5) == [0, 2, 4] and frame_indices(2) == [0, 1] and frame_indices(1) == [0]
    video = torch.zeros(2, 5, 3, 4, 4)
    for t in range(5):
        video[0, t] = t / 4  # grey levels 0, .25, .5, .75, 1
    video[1] = 0.5
    out = score([build_reward("brightness"), build_reward("temporal_consistency")], video, ["a", "b"], [{}, {}])
    torch.testing.assert_close(out["brightness"], torch.tensor([(0 + 0.5 + 1) / 3, 0.5]))  # frames 0, 2, 4
    torch.testing.assert_close(out["temporal_consistency"], torch.tensor([0.75, 1.0]))  # the whole clip
    with pytest.raises(ValueError, match=r"\[N,3,H,W\]"):
        check_batch(video, ["a", "b"], [{}, {}])  # an image reward's own check still wants images


def test_videorlvr_preset_puts_the_sde_window_on_the_first_steps():
    cfg = load_config(Config, "configs/wan21_t2v_1_3b/grpo_videorlvr.yaml", [])
    window = cfg.sampling.window
    assert (window.size, window.mode, window.start_range) == (4, "fixed", [0, 0])
    assert cfg.model.family == "wan" and {r.name for r in cfg.rewards} == {"motion_direction", "temporal_consistency"}


def test_eval_writes_clips_as_film_strips_and_reads_them_back_as_clips(tmp_path):
    """``flowrl eval`` renders to PNG files and scores what it reads back: a video must come back as a clip
    ``[T, 3, H, W]`` (so video rewards still see motion), equal to the render up to PNG rounding."""
    from flowrl.data.prompts import PromptSet
    from flowrl.eval.runner import _render_missing, read_images
    from flowrl.eval.held_out import render

    cfg = load_config(Config, "configs/smoke/wan_tiny.yaml", ["eval.images_per_prompt=2", "eval.num_steps=2"])
    policy = build_policy("wan", "tiny", seed=0)
    suite = PromptSet(["a red square moving right"])
    _render_missing(policy, suite, [0], tmp_path, cfg, base=True, label="base", settings={})
    images, latents = read_images(tmp_path, 1, 2)
    assert images.shape == (2, 5, 3, policy.height, policy.width) and latents.shape[:3] == (2, 16, 2)
    expected = render(policy, suite, images_per_prompt=2, num_steps=2, guidance=cfg.sampling.guidance_scale,
                      seed=cfg.eval.seed)
    assert (images - expected).abs().max() <= 0.5 / 255 + 1e-6
