"""Wan2.2 TI2V-5B text-to-video specifics beyond tests/models/test_families.py: the 48-channel x16 latent layout and
its noise, the per-token timesteps of ``expand_timesteps`` (the pipeline's, passed to the transformer as it
passes them), decoding through the Wan2.2 VAE, and the folders of the other Wan pipelines refused in one line."""

import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch

from flowrl.core.seeding import generators
from flowrl.models import build_policy, check_pipeline_family


@pytest.fixture(scope="module")
def policy():
    return build_policy("wan22_ti2v", "tiny", seed=0)


def test_latents_have_48_channels_at_x16_and_are_drawn_like_the_pipeline(policy):
    assert policy.pipeline.config.expand_timesteps and policy.pipeline.config.boundary_ratio is None
    assert policy.latent_shape(3) == (3, 48, 2, 4, 4)  # 5 frames -> 2 latent frames, 64 px / 16 -> 4
    ours = policy.init_noise(3, generator=generators([1, 2, 3]))
    theirs = policy.pipeline.prepare_latents(3, 48, 64, 64, 5, torch.float32, policy.device, generators([1, 2, 3]))
    assert torch.equal(ours, theirs)
    assert policy.size_multiple == 32
    with pytest.raises(ValueError, match="divisible by 32"):
        policy.check_size(48, 64)


def test_timesteps_are_per_token_as_the_pipeline_builds_them(policy, monkeypatch):
    x = policy.init_noise(2, generator=generators([5, 6]))  # [2, 48, 2, 4, 4]
    timestep = policy.timesteps(0.75, x)
    mask = torch.ones(x.shape, dtype=torch.float32)
    t = torch.tensor(750.0)
    expected = (mask[0][0][:, ::2, ::2] * t).flatten().unsqueeze(0).expand(2, -1)  # WanPipeline's expand_timesteps
    assert timestep.shape == (2, 2 * 2 * 2) and timestep.dtype == torch.float32
    assert torch.equal(timestep, expected)
    seen = []
    forward = policy.transformer.forward
    monkeypatch.setattr(policy.transformer, "forward", lambda **kw: seen.append(kw["timestep"]) or forward(**kw))
    cond = policy.encode(["a red circle", "two blue squares"])
    with torch.no_grad():
        policy.velocity(x, 0.75, cond, policy.default_guidance)
    assert len(seen) == 2 and all(torch.equal(s, expected) for s in seen)  # conditional and unconditional pass


def test_wan21_keeps_one_timestep_per_clip():
    wan = build_policy("wan", "tiny", seed=0)
    x = wan.init_noise(2, generator=generators([5, 6]))
    assert wan.timesteps(0.5, x).shape == (2,)


def test_decode_goes_through_the_wan22_vae_to_frames_first_video(policy):
    latents = torch.randn(2, 48, 2, 4, 4, generator=torch.Generator().manual_seed(0))
    video = policy.decode(latents)
    assert video.shape == (2, 5, 3, 64, 64) and video.dtype == torch.float32
    assert 0 <= video.min() and video.max() <= 1
    vae = policy.vae
    mean = torch.tensor(vae.config.latents_mean).view(1, 48, 1, 1, 1)
    std = torch.tensor(vae.config.latents_std).view(1, 48, 1, 1, 1)
    with torch.no_grad():
        plain = vae.decode(latents * std + mean, return_dict=False)[0]  # [2, 3, 5, 64, 64]
    torch.testing.assert_close(video, (plain / 2 + 0.5).clamp(0, 1).permute(0, 2, 1, 3, 4), rtol=0, atol=1e-5)


def test_a_two_expert_pipeline_is_refused():
    from flowrl.models.tiny_wan22_ti2v import tiny_wan22_ti2v_pipeline
    from flowrl.models.wan22_ti2v import Wan22TI2VPolicy

    pipeline = tiny_wan22_ti2v_pipeline(0)
    pipeline.register_to_config(boundary_ratio=0.875)
    with pytest.raises(ValueError, match="two-expert Wan2.2 A14B"):
        Wan22TI2VPolicy(pipeline, height=64, width=64, max_sequence_length=16)


@pytest.mark.parametrize("family, index, hint", [
    ("wan22_ti2v", {"expand_timesteps": False}, "model.family=wan"),
    ("wan", {"expand_timesteps": True}, "model.family=wan22_ti2v"),
    ("wan22_ti2v", {"expand_timesteps": False, "boundary_ratio": 0.875}, "two-expert Wan2.2 A14B"),
])
def test_a_folder_of_another_wan_pipeline_is_one_line(tmp_path, family, index, hint):
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "WanPipeline", **index}))
    with pytest.raises(ValueError) as error:
        check_pipeline_family(family, str(tmp_path), "WanPipeline")
    message = str(error.value)
    assert "\n" not in message and hint in message
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "WanPipeline",
                                                          "expand_timesteps": family == "wan22_ti2v"}))
    check_pipeline_family(family, str(tmp_path), "WanPipeline")  # its own folder passes


def test_the_cli_refuses_a_wan21_folder_for_wan22_ti2v(tmp_path, capsys):
    from flowrl.cli import main

    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "model_index.json").write_text(json.dumps({"_class_name": "WanPipeline",
                                                                     "expand_timesteps": False}))
    code = main(["train", "configs/smoke/wan22_ti2v_tiny.yaml", f"model.path={tmp_path / 'model'}",
                 f"run_dir={tmp_path / 'run'}"])
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert code == 2 and len(err) == 1
    assert err[0].startswith("flowrl train: error:") and "model.family=wan" in err[0]
    assert not (tmp_path / "run").exists()
