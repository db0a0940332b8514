"""LTX-2 specifics beyond tests/models/test_families.py: the video and audio noise drawn like the pipeline, the
dynamic shift against the pipeline's own calculate_shift, the guidance path (one joint pass, batched under CFG),
the audio as deterministic state under an SDE rollout, the video-only LoRA targets, and the one-line refusals
(frame count, size, text length, a velocity at a video state no rollout reached)."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import pytest
import torch

from flowrl.core.seeding import generators
from flowrl.models import build_policy
from flowrl.models.ltx2 import NO_AUDIO_STATE
from flowrl.sampling import RolloutSettings, rollout


@pytest.fixture(scope="module")
def policy():
    return build_policy("ltx2", "tiny", seed=0)


def test_video_then_audio_noise_drawn_like_the_pipeline(policy):
    pipe = policy.pipeline
    assert policy.latent_shape(2) == (2, 4, 3, 4, 4)  # 5 frames -> 3 latent frames (x2), 32 px -> 4 (x8)
    ours = policy.init_noise(2, generator=generators([1, 2]))
    gens = generators([1, 2])
    video = pipe.prepare_latents(2, 4, 32, 32, 5, 0.0, torch.float32, policy.device, gens)  # packed [2, 48, 4]
    audio = pipe.prepare_audio_latents(2, 2, policy.audio_shape(2)[2], 8, 0.0, torch.float32, policy.device, gens)
    assert torch.equal(pipe._pack_latents(ours), video)
    assert torch.equal(policy.audio_track.lookup(policy_keys(ours), torch.tensor(1.0)), audio)


def policy_keys(x):
    from flowrl.models.ltx2 import state_keys

    return state_keys(x)


def test_sigmas_follow_the_pipelines_dynamic_shift(policy):
    from diffusers.pipelines.ltx2.pipeline_ltx2 import calculate_shift, retrieve_timesteps

    import copy

    scheduler = copy.deepcopy(policy.pipeline.scheduler)
    mu = calculate_shift(3 * 4 * 4, 1024, 4096, 0.95, 2.05)  # the video tokens, the released config's constants
    retrieve_timesteps(scheduler, 6, "cpu", sigmas=np.linspace(1.0, 1 / 6, 6), mu=mu)
    assert torch.equal(policy.sigmas(6), scheduler.sigmas.float())
    assert policy.sigmas(6)[-2] == pytest.approx(0.1)  # stretched to shift_terminal


def test_guidance_is_one_joint_pass_batched_under_cfg(policy):
    calls = []
    hook = policy.transformer.register_forward_pre_hook(
        lambda module, args, kwargs: calls.append((kwargs["hidden_states"].shape[0],
                                                   kwargs["audio_hidden_states"].shape[0])), with_kwargs=True)
    try:
        rollout(policy, ["a red circle"], RolloutSettings(num_steps=2, guidance_scale=4.0, noise_level=0.0),
                group_size=2, seeds=[1, 2])
        rollout(policy, ["a red circle"], RolloutSettings(num_steps=2, guidance_scale=1.0, noise_level=0.0),
                group_size=2, seeds=[1, 2])
    finally:
        hook.remove()
    assert calls == [(4, 4), (4, 4), (2, 2), (2, 2)]  # [uncond, cond] in one pass; no unconditional half at 1.0


def test_sde_noise_is_on_the_video_only_and_the_audio_follows_euler(policy):
    settings = RolloutSettings(num_steps=3, guidance_scale=1.0, noise_level=0.7)
    traj = rollout(policy, ["a red circle"], settings, group_size=2, seeds=[5, 6])
    track, sigmas = policy.audio_track, traj.row_sigmas[0]
    keys = [policy_keys(traj.latents[:, k]) for k in range(traj.num_stored_steps)]  # the clean x_K has no audio
    audio = [track.lookup(k, sigmas[i]) for i, k in enumerate(keys)]  # [2, L, Ca*M] per state a step starts from
    # Every stored state's audio is the deterministic Euler step of the joint pass from the state before it.
    cond = policy.encode(["a red circle"], negative=False).select([0, 0])
    for k in range(len(keys) - 1):
        _, audio_velocity = policy.joint_velocity(traj.latents[:, k], audio[k], sigmas[k], cond, 1.0, 1.0, cfg=False)
        torch.testing.assert_close(audio[k + 1], audio[k] + (sigmas[k + 1] - sigmas[k]) * audio_velocity,
                                   rtol=0, atol=0)
    assert not torch.equal(traj.latents[:, 1], traj.latents[:, 0])  # the video moved, with noise


def test_lora_targets_the_video_stream_only():
    policy = build_policy("ltx2", "tiny", seed=0)
    policy.add_lora(rank=2, alpha=2)
    adapted = {name.rsplit(".lora_A", 1)[0] for name, _ in policy.transformer.named_parameters() if ".lora_A" in name}
    assert adapted and not any("audio" in name for name in adapted)  # audio_attn*, audio_ff, a2v / v2a untouched
    suffixes = {name.split(".", 2)[2] for name in adapted}
    assert suffixes == set(policy.default_lora_targets())


@pytest.mark.parametrize("kwargs, message", [
    (dict(num_frames=6), r"LTX-2 needs num_frames = 2 k \+ 1 \(1, 3, 5, ... 121\), got 6"),
    (dict(height=48, width=32), "LTX-2 needs height and width divisible by 32, got 48x32"),
    (dict(max_sequence_length=10), "must be a multiple of 4"),
])
def test_bad_sizes_are_one_line(kwargs, message):
    with pytest.raises(ValueError, match=message) as error:
        build_policy("ltx2", "tiny", seed=0, **kwargs)
    assert "\n" not in str(error.value)


def test_a_video_state_no_rollout_reached_is_one_line(policy):
    cond = policy.encode(["a red circle"], negative=False)
    fresh = torch.randn(policy.latent_shape(1), generator=torch.Generator().manual_seed(0))  # e.g. NFT's x_t
    policy.audio_track.pending = None
    with pytest.raises(ValueError) as error:
        policy.velocity(fresh, 0.5, cond, 1.0)
    assert str(error.value) == NO_AUDIO_STATE and "\n" not in NO_AUDIO_STATE
    with pytest.raises(ValueError, match="no audio state"):  # per-row noise levels: a forward-process loss
        policy.velocity(fresh.repeat(2, 1, 1, 1, 1), torch.tensor([0.3, 0.6]), cond.select([0, 0]), 1.0)
