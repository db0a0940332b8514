"""Wan2.2 I2V A14B specifics beyond tests/models/test_families.py: each step runs the expert the pipeline runs on the
pipeline's 36-channel input (no CLIP states), guidance_scale_2 guides the low-noise expert as in the pipeline, the
LoRA goes on the experts lora.experts names and exports a file per expert that plain diffusers loads, an unknown
expert is one line, and a Wan2.1 I2V pipeline given as this family is one line. Folder refusals of both I2V
families: tests/models/test_family_wan_i2v.py."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch

from flowrl.config import Config, ConfigError, load_config
from flowrl.models import build_policy
from flowrl.models.lora_io import (
    DIFFUSERS_WEIGHT_NAME, TRANSFORMER_2_WEIGHT_NAME, load_lora_into, lora_config_dict, lora_state_dict,
    write_lora_files,
)
from flowrl.models.wan22_i2v import Wan22I2VPolicy
from flowrl.models.wan_i2v import WanI2VPolicy
from flowrl.sampling import RolloutSettings, rollout
from tools.policy_capture import randomize_lora

PROMPTS = ["a red circle rolls", "a blue square spins"]
SEEDS = [11, 12]
STEPS = 4  # timesteps 1000, 910 (high-noise expert) | 717, 24 (low-noise expert) at boundary 0.9, shift 5


@pytest.fixture(scope="module")
def policy():
    return build_policy("wan22_i2v", "tiny", seed=0)


def _spy(monkeypatch, pipeline, calls: list):
    for name, module in (("high", pipeline.transformer), ("low", pipeline.transformer_2)):
        forward = module.forward
        monkeypatch.setattr(module, "forward", lambda _f=forward, _n=name, **kw: calls.append(
            (_n, float(kw["timestep"].flatten()[0]), kw["hidden_states"].clone(),
             kw.get("encoder_hidden_states_image"))) or _f(**kw))


def test_each_step_runs_the_pipelines_expert_on_the_pipelines_input(policy, monkeypatch):
    metadata = policy.example_metadata(1)
    calls = []
    _spy(monkeypatch, policy.pipeline, calls)
    with torch.no_grad():
        rollout(policy, PROMPTS[:1], RolloutSettings(num_steps=STEPS, guidance_scale=3.5, noise_level=0.0),
                group_size=1, seeds=SEEDS[:1], metadata=metadata)
        switch = len(calls)
        policy.pipeline_images(PROMPTS[:1], group_size=1, num_steps=STEPS, guidance_scale=3.5, seeds=SEEDS[:1],
                               metadata=metadata)
    ours, theirs = calls[:switch], calls[switch:]
    assert [(name, t) for name, t, _, _ in ours] == [(name, t) for name, t, _, _ in theirs]
    assert [name for name, *_ in ours] == ["high"] * 4 + ["low"] * 4  # conditional and unconditional passes
    for (_, _, mine, image), (_, _, pipe, _) in zip(ours, theirs):
        assert mine.shape == (1, 36, 2, 4, 4) and image is None  # the first frame through its latents alone
        torch.testing.assert_close(mine, pipe, rtol=0, atol=0)


def test_guidance_scale_2_guides_the_low_noise_expert_as_in_the_pipeline():
    policy = build_policy("wan22_i2v", "tiny", seed=0, guidance_scale_2=1.5)
    metadata = policy.example_metadata(2)
    settings = RolloutSettings(num_steps=STEPS, guidance_scale=3.5, noise_level=0.0)
    ours = rollout(policy, PROMPTS, settings, group_size=1, seeds=SEEDS, metadata=metadata).images
    theirs = policy.pipeline_images(PROMPTS, group_size=1, num_steps=STEPS, guidance_scale=3.5, seeds=SEEDS,
                                    metadata=metadata)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)
    same = rollout(build_policy("wan22_i2v", "tiny", seed=0), PROMPTS, settings, group_size=1, seeds=SEEDS,
                   metadata=metadata).images
    assert (ours - same).abs().max() > 1e-4


def test_rows_on_both_sides_of_the_boundary_carry_their_own_first_frame(policy):
    cond = policy.encode(PROMPTS, metadata=policy.example_metadata(2))
    x = policy.init_noise(2, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        mixed = policy.velocity(x, torch.tensor([0.96, 0.5]), cond, 3.5)
        high = policy.velocity(x[:1], 0.96, cond.select([0]), 3.5)
        low = policy.velocity(x[1:], 0.5, cond.select([1]), 3.5)
    torch.testing.assert_close(mixed, torch.cat([high, low]), rtol=0, atol=1e-6)


def test_an_unknown_expert_is_a_one_line_config_error(tmp_path):
    from flowrl.recipes.build import build_training_policy

    cfg = load_config(Config, "configs/smoke/wan22_i2v_tiny.yaml", [f"run_dir={tmp_path}", "lora.experts=[middle]"])
    with pytest.raises(ConfigError, match=r"^config key 'lora.experts': middle is not an expert .* high, low$"):
        build_training_policy(cfg, "cpu")


def test_export_of_the_low_noise_expert_loads_in_plain_diffusers_and_back(tmp_path):
    trained = build_policy("wan22_i2v", "tiny", seed=0)
    trained.add_lora(rank=4, alpha=8.0, init_seed=0, experts=["low"])
    assert all(n.startswith("transformer_2.") for n, _ in trained.named_trainable_parameters())
    randomize_lora(trained)
    written = write_lora_files(tmp_path, lora_state_dict(trained.transformer), lora_config_dict(trained.transformer),
                               family="wan22_i2v", base_model="tiny", config_text=None, format="diffusers")
    assert {p.name for p in written} >= {TRANSFORMER_2_WEIGHT_NAME} and not (tmp_path / DIFFUSERS_WEIGHT_NAME).exists()
    plain = Wan22I2VPolicy.tiny_pipeline(0)
    Wan22I2VPolicy.load_exported_lora(plain, tmp_path)
    assert any("lora_" in n for n, _ in plain.transformer_2.named_parameters())
    assert not any("lora_" in n for n, _ in plain.transformer.named_parameters())
    metadata = trained.example_metadata(2)
    settings = RolloutSettings(num_steps=STEPS, guidance_scale=3.5, noise_level=0.0)
    ours = rollout(trained, PROMPTS, settings, group_size=1, seeds=SEEDS, metadata=metadata).images
    wrapped = Wan22I2VPolicy(plain, height=trained.height, width=trained.width,
                             max_sequence_length=trained.max_sequence_length)
    theirs = wrapped.pipeline_images(PROMPTS, group_size=1, num_steps=STEPS, guidance_scale=3.5, seeds=SEEDS,
                                     metadata=metadata)
    torch.testing.assert_close(theirs, ours, rtol=0, atol=1e-5)
    reloaded = build_policy("wan22_i2v", "tiny", seed=0)
    load_lora_into(reloaded, tmp_path)
    assert reloaded.transformer.adapted == ("transformer_2",)
    again = rollout(reloaded, PROMPTS, settings, group_size=1, seeds=SEEDS, metadata=metadata).images
    torch.testing.assert_close(again, ours, rtol=0, atol=1e-5)


def test_a_wan21_i2v_pipeline_given_as_this_family_is_one_line():
    with pytest.raises(ValueError, match="^model.path holds a one-transformer Wan2.1 I2V pipeline .*wan_i2v$"):
        Wan22I2VPolicy(WanI2VPolicy.tiny_pipeline(0), height=32, width=32)
    assert Wan22I2VPolicy.pipeline_class_name == "WanImageToVideoPipeline" and Wan22I2VPolicy.preference_sites == {}
