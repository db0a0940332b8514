"""Wan2.2 T2V A14B specifics beyond tests/models/test_families.py: the expert of each step is the pipeline's (the
switch at boundary_ratio, guidance_scale_2 on the low-noise expert), rows of mixed steps go to their own expert,
LoRA on the experts lora.experts names and only there, an export that plain diffusers loads into both experts, a
GRPO window across the boundary, and folders of the other Wan layouts refused in one line."""

import math
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch

from flowrl.config import Config, ConfigError, load_config
from flowrl.core.seeding import generators
from flowrl.models import build_policy, check_pipeline_family
from flowrl.models.lora_io import (
    DIFFUSERS_WEIGHT_NAME, TRANSFORMER_2_WEIGHT_NAME, load_lora_into, lora_config_dict, lora_state_dict,
    write_lora_files,
)
from flowrl.models.wan22_t2v import Wan22T2VPolicy
from flowrl.recipes.grpo import train
from flowrl.sampling import RolloutSettings, rollout
from tools.policy_capture import capture_training_policy, lora_and_base, randomize_lora

PROMPTS = ["a red circle", "two blue squares"]
SEEDS = [11, 12]
STEPS = 4  # shifted sigmas 1.0, 0.96 (high-noise expert) | 0.86, 0.13 (low-noise expert) at boundary 0.875


@pytest.fixture(scope="module")
def policy():
    return build_policy("wan22_t2v", "tiny", seed=0)


def _spy(monkeypatch, modules: dict, calls: list):
    for name, module in modules.items():
        forward = module.forward
        monkeypatch.setattr(module, "forward", lambda _f=forward, _n=name, **kw: calls.append(
            (_n, float(kw["timestep"].flatten()[0]))) or _f(**kw))


def _experts(pipeline):
    return {"high": pipeline.transformer, "low": pipeline.transformer_2}


def test_each_step_runs_the_expert_the_pipeline_runs(policy, monkeypatch):
    ours, theirs = [], []
    _spy(monkeypatch, _experts(policy.pipeline), ours)
    with torch.no_grad():
        rollout(policy, PROMPTS[:1], RolloutSettings(num_steps=STEPS, guidance_scale=4.0, noise_level=0.0),
                group_size=1, seeds=SEEDS[:1])
        switch = len(ours)
        policy.pipeline_images(PROMPTS[:1], group_size=1, num_steps=STEPS, guidance_scale=4.0, seeds=SEEDS[:1])
    ours, theirs = ours[:switch], ours[switch:]
    assert ours == theirs  # the same expert at the same timestep, conditional and unconditional pass
    assert [name for name, _ in ours] == ["high"] * 4 + ["low"] * 4


def test_guidance_scale_2_guides_the_low_noise_expert_as_in_the_pipeline():
    policy = build_policy("wan22_t2v", "tiny", seed=0, guidance_scale_2=1.5)
    settings = RolloutSettings(num_steps=STEPS, guidance_scale=4.0, noise_level=0.0)
    ours = rollout(policy, PROMPTS, settings, group_size=1, seeds=SEEDS).images
    theirs = policy.pipeline_images(PROMPTS, group_size=1, num_steps=STEPS, guidance_scale=4.0, seeds=SEEDS)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)
    same = rollout(build_policy("wan22_t2v", "tiny", seed=0), PROMPTS, settings, group_size=1, seeds=SEEDS).images
    assert (ours - same).abs().max() > 1e-4
    with pytest.raises(ValueError, match="model.guidance_scale_2 is for two-expert families"):
        build_policy("wan", "tiny", seed=0, guidance_scale_2=1.5)


def test_rows_on_both_sides_of_the_boundary_use_their_own_expert(policy):
    cond = policy.encode(PROMPTS)
    x = policy.init_noise(2, generator=generators(SEEDS))  # [2, 16, 2, 4, 4]
    with torch.no_grad():
        mixed = policy.velocity(x, torch.tensor([0.96, 0.5]), cond, 4.0)
        high = policy.velocity(x[:1], 0.96, cond.select([0]), 4.0)
        low = policy.velocity(x[1:], 0.5, cond.select([1]), 4.0)
    torch.testing.assert_close(mixed, torch.cat([high, low]), rtol=0, atol=1e-6)


@pytest.mark.parametrize("experts, adapted", [(["high"], "transformer"), (["low"], "transformer_2")])
def test_lora_goes_only_on_the_chosen_expert(experts, adapted):
    policy = build_policy("wan22_t2v", "tiny", seed=0)
    policy.add_lora(rank=4, alpha=8.0, init_seed=0, experts=experts)
    names = [n for n, _ in policy.named_trainable_parameters()]
    assert names and all(n.startswith(f"{adapted}.") and "lora_" in n for n in names)
    other = policy.pipeline.transformer_2 if adapted == "transformer" else policy.pipeline.transformer
    assert not any("lora_" in n for n, _ in other.named_parameters())
    assert all(k.startswith(f"{adapted}.") for k in lora_state_dict(policy.transformer))


def test_an_unknown_expert_is_a_one_line_config_error(tmp_path):
    cfg = load_config(Config, "configs/smoke/wan22_t2v_tiny.yaml", [f"run_dir={tmp_path}", "lora.experts=[middle]"])
    from flowrl.recipes.build import build_training_policy

    with pytest.raises(ConfigError, match=r"^config key 'lora.experts': middle is not an expert .* high, low$"):
        build_training_policy(cfg, "cpu")
    sd3 = load_config(Config, "configs/smoke/sd3_tiny.yaml", [f"run_dir={tmp_path}", "lora.experts=[high]"])
    with pytest.raises(ConfigError, match="sd3 has one transformer"):
        build_training_policy(sd3, "cpu")


@pytest.mark.parametrize("experts", [None, ["low"]])
def test_export_loads_into_each_expert_in_plain_diffusers_and_back_into_flowrl(experts, tmp_path):
    trained = build_policy("wan22_t2v", "tiny", seed=0)
    trained.add_lora(rank=4, alpha=8.0, init_seed=0, experts=experts)
    randomize_lora(trained)
    written = write_lora_files(tmp_path, lora_state_dict(trained.transformer), lora_config_dict(trained.transformer),
                               family="wan22_t2v", base_model="tiny", config_text=None, format="all")
    names = {p.name for p in written}
    assert (DIFFUSERS_WEIGHT_NAME in names) == (experts is None) and TRANSFORMER_2_WEIGHT_NAME in names
    assert "No pytorch_lora_weights_kohya.safetensors" in (tmp_path / "README.md").read_text()
    plain = Wan22T2VPolicy.tiny_pipeline(0)
    plain.load_lora_weights(tmp_path, weight_name=TRANSFORMER_2_WEIGHT_NAME, load_into_transformer_2=True)
    if experts is None:
        plain.load_lora_weights(tmp_path)  # the high-noise expert: the default file into transformer
    assert any("lora_" in n for n, _ in plain.transformer_2.named_parameters())
    assert any("lora_" in n for n, _ in plain.transformer.named_parameters()) == (experts is None)
    kwargs = {"group_size": 1, "num_steps": STEPS, "guidance_scale": 4.0, "seeds": SEEDS}
    ours = rollout(trained, PROMPTS, RolloutSettings(num_steps=STEPS, guidance_scale=4.0, noise_level=0.0),
                   group_size=1, seeds=SEEDS).images
    wrapped = Wan22T2VPolicy(plain, height=trained.height, width=trained.width,
                             max_sequence_length=trained.max_sequence_length)
    torch.testing.assert_close(wrapped.pipeline_images(PROMPTS, **kwargs), ours, rtol=0, atol=1e-5)
    reloaded = build_policy("wan22_t2v", "tiny", seed=0)
    load_lora_into(reloaded, tmp_path)
    assert reloaded.transformer.adapted == trained.transformer.adapted
    again = rollout(reloaded, PROMPTS, RolloutSettings(num_steps=STEPS, guidance_scale=4.0, noise_level=0.0),
                    group_size=1, seeds=SEEDS).images
    torch.testing.assert_close(again, ours, rtol=0, atol=1e-5)


@pytest.mark.parametrize("plan", [
    ["sampling.window.size=2", "sampling.window.mode=fixed", "sampling.window.start_range=[1,1]"],
    ["sampling.tree.branch_steps=[1,2]", "sampling.tree.branch_factor=2"],  # 4 leaves: the smoke group
], ids=["window", "tree"])
def test_grpo_window_and_tree_across_the_boundary_train_both_experts(tmp_path, monkeypatch, plan):
    captured = capture_training_policy(monkeypatch)
    overrides = [f"run_dir={tmp_path}", "train.epochs=2", "log.progress=false", "log.eval_every=0", *plan]
    metrics = train(load_config(Config, "configs/smoke/wan22_t2v_tiny.yaml", overrides))
    assert math.isfinite(metrics["loss/total"]) and metrics["policy/onpolicy_ratio_maxdev"] < 1e-5
    lora_before, base_before = captured["before"]
    lora_after, base_after = lora_and_base(captured["policy"])
    for expert in ("transformer.", "transformer_2."):  # step 1 is the high-noise expert's, step 2 the low's;
        # the tree branches at both, so its edges train both experts too
        assert any(not torch.equal(lora_before[n], lora_after[n]) for n in lora_before if n.startswith(expert))
    assert all(torch.equal(base_before[n], base_after[n]) for n in base_before)
    assert (tmp_path / "lora" / TRANSFORMER_2_WEIGHT_NAME).is_file()


@pytest.mark.parametrize("family, index, hint", [
    ("wan22_t2v", {"expand_timesteps": False}, "model.family=wan"),
    ("wan", {"boundary_ratio": 0.875, "transformer_2": ["diffusers", "WanTransformer3DModel"]},
     "model.family=wan22_t2v"),
])
def test_a_folder_of_the_other_layout_is_one_line(tmp_path, family, index, hint):
    import json

    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "WanPipeline", **index}))
    with pytest.raises(ValueError, match=hint):
        check_pipeline_family(family, str(tmp_path), "WanPipeline")
