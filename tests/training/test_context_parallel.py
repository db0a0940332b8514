"""Sequence (context) parallelism: the data x ring x ulysses layout, its one-line errors, and diffusers' context
parallelism on 2 gloo CPU processes against one process."""

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from flowrl.config import Config, ConfigError, load_config
from flowrl.core.context_parallel import (
    ContextLayout,
    context_parallel_models,
    device_refusal,
    has_context_plan,
    latent_tokens,
)
from flowrl.data.prompts import epoch_prompt_indices
from flowrl.recipes.start import check_context_parallel, context_layout, start_run
from tests import REPO

SMOKE = "configs/smoke/sd3_tiny.yaml"


def test_layout_mesh_and_context_groups():
    layout = ContextLayout(world=8, ulysses=2, ring=2)
    assert (layout.degree, layout.data_world, layout.mesh_shape) == (4, 2, (2, 2, 2))
    assert [layout.data_rank(r) for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert layout.context_group(5) == [4, 5, 6, 7]  # consecutive ranks: one node's
    off = ContextLayout(world=8)
    assert not off.enabled and off.data_world == 8 and off.context_group(3) == [3]


def test_a_context_group_samples_one_data_ranks_rows():
    """Every process of a context group draws the prompts (and so the rows and seeds) of its data rank, and the
    data ranks together draw what a plain data-parallel launch of data_world processes draws."""
    layout = ContextLayout(world=8, ulysses=4)
    draws = {rank: epoch_prompt_indices(100, 3, seed=0, epoch=5, rank=layout.data_rank(rank),
                                        world_size=layout.data_world) for rank in range(8)}
    assert all(draws[r] == draws[layout.context_group(r)[0]] for r in range(8))
    assert draws[0] != draws[4]
    plain = [epoch_prompt_indices(100, 3, seed=0, epoch=5, rank=r, world_size=2) for r in range(2)]
    assert [draws[0], draws[4]] == plain


def test_one_line_errors():
    with pytest.raises(ValueError, match="does not divide the 6 processes"):
        ContextLayout(world=6, ulysses=4).check_world()
    with pytest.raises(ValueError, match="7 latent tokens per row do not split over a context group of 2"):
        ContextLayout(world=2, ring=2).check_sequence(7)
    ContextLayout(world=2, ring=2).check_sequence(None)  # not known: nothing to check
    with pytest.raises(ConfigError, match="config key 'parallel.context.ulysses': must be in"):
        load_config(Config, SMOKE, ["parallel.context.ulysses=0"])


def test_latent_tokens():
    assert latent_tokens((1, 16, 21, 90, 160), (1, 2, 2)) == 21 * 45 * 80  # Wan 720p x 81 frames: 75,600
    assert latent_tokens((1, 16, 128, 128), 2) == 64 * 64
    assert latent_tokens((1, 4096, 64), 2) is None  # packed latents: not known here


def test_which_transformers_have_a_plan():
    from diffusers import (
        FluxTransformer2DModel,
        SD3Transformer2DModel,
        WanTransformer3DModel,
    )

    assert has_context_plan(WanTransformer3DModel) and has_context_plan(FluxTransformer2DModel)
    assert not has_context_plan(SD3Transformer2DModel)


def test_two_expert_wan_splits_both_experts():
    from flowrl.models.wan_experts import WanExperts

    experts = WanExperts(_tiny_wan(), _tiny_wan())
    assert context_parallel_models(experts) == [experts.transformer, experts.transformer_2]
    whole = _tiny_wan()
    assert context_parallel_models(whole) == [whole]


def _tiny_wan():
    from diffusers import WanTransformer3DModel

    return WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=8, in_channels=4,
                                 out_channels=4, text_dim=16, freq_dim=16, ffn_dim=32, num_layers=1)


def test_start_up_checks_say_what_is_wrong_in_one_line():
    cfg = load_config(Config, SMOKE, ["parallel.context.ulysses=2"])
    with pytest.raises(ConfigError, match="does not divide the 3 processes"):
        context_layout(cfg, 3)
    layout = context_layout(cfg, 2)
    from diffusers import SD3Transformer2DModel

    sd3 = SimpleNamespace(transformer=SD3Transformer2DModel(sample_size=8, patch_size=2, in_channels=4, num_layers=1,
                                                            attention_head_dim=8, num_attention_heads=2,
                                                            joint_attention_dim=16, caption_projection_dim=16,
                                                            pooled_projection_dim=16, out_channels=4),
                          latent_shape=lambda n: (n, 4, 8, 8))
    with pytest.raises(ConfigError, match="model family 'sd3': diffusers has no context-parallel plan"):
        check_context_parallel(cfg, layout, sd3, device_type="cpu")
    odd = SimpleNamespace(transformer=_tiny_wan(), latent_shape=lambda n: (n, 4, 3, 2, 2))  # 3 tokens
    with pytest.raises(ConfigError, match="3 latent tokens per row do not split"):
        check_context_parallel(cfg, layout, odd, device_type="cpu")
    wan = SimpleNamespace(transformer=_tiny_wan(), latent_shape=lambda n: (n, 4, 2, 4, 4))
    check_context_parallel(cfg, layout, wan, device_type="cpu")  # Ulysses runs on CPU processes (gloo)
    ring = load_config(Config, SMOKE, ["parallel.context.ring=2"])
    with pytest.raises(ConfigError, match="ring attention .* needs a GPU per process") as error:
        check_context_parallel(ring, context_layout(ring, 2), wan, device_type="cpu")
    assert "\n" not in str(error.value)
    assert device_refusal(ContextLayout(world=2, ring=2), "cuda", torch.bfloat16) is None
    assert "set model.dtype bf16" in device_refusal(ContextLayout(world=2, ring=2), "cuda", torch.float32)
    assert device_refusal(ContextLayout(world=2, ulysses=2), "cpu", torch.float32) is None
    four = load_config(Config, SMOKE, ["parallel.context.ulysses=4"])
    with pytest.raises(ConfigError, match="Ulysses degree 4 does not divide the 2 attention heads"):
        check_context_parallel(four, context_layout(four, 4), wan, device_type="cpu")
    check_context_parallel(load_config(Config, SMOKE), context_layout(load_config(Config, SMOKE), 2), sd3,
                           device_type="cpu")  # off: nothing checked


def test_a_launch_the_degree_does_not_divide_stops_before_the_run_dir(tmp_path):
    cfg = load_config(Config, SMOKE, [f"run_dir={tmp_path / 'run'}", "parallel.context.ulysses=2"])
    with pytest.raises(ConfigError, match="does not divide the 1 processes"):
        start_run(cfg)
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_ulysses_on_two_gloo_processes_matches_one(tmp_path):
    """diffusers' Ulysses attention over flowrl's mesh, 2 CPU processes: the rollout's velocities and log-probs equal
    one process's, and one GRPO-clip step's LoRA gradients, summed over the context group, equal its gradients to
    float32 rounding (measured: 0 and 0 for the rollout, 3.4e-7 relative for the gradients)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                             "scripts/bench/context_parallel_check.py", str(tmp_path), "ulysses", "cpu"],
                            cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    for rank in range(2):
        measured = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert measured["lora_tensors"] == 32 and measured["grad_norm"] > 0
        assert measured["velocity"] <= 1e-6 and measured["log_prob"] <= 1e-6, measured
        assert measured["grad_relative"] < 1e-5, measured


def test_gpu_bench_context_parallel_section_needs_two_gpus():
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run([sys.executable, "scripts/bench/gpu_full_size.py", "--context-parallel"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert proc.stdout.strip() == "context parallelism needs 2 or more GPUs on this machine (found 0); nothing checked"
