"""The pretrained toy-world flow model shipped in assets/toy (trained by scripts/train_toy_model.py).

Guards: it loads offline with plain diffusers and with flowrl's build_policy, flowrl's ODE rollout
reproduces the pipeline, the weights stay small, and its ToyEval accuracy on held-out prompts stays
in a loose band (a regression guard; the measured numbers are in assets/toy/README.md).
"""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import pytest
import torch
from diffusers import StableDiffusion3Pipeline

from flowrl.models import build_policy
from flowrl.sampling import RolloutSettings, rollout
from flowrl.core.seeding import generators
from flowrl.toy.prompts import TASKS, heldout_prompts
from rewards.toyeval import ToyEval
from tests import REPO

TOY = REPO / "assets" / "toy"
# Documented sampling defaults of the toy model (assets/toy/README.md).
STEPS, GUIDANCE, MAX_SEQ, RESOLUTION = 10, 3.0, 1, 32


@pytest.fixture(scope="module")
def pipe():
    pipeline = StableDiffusion3Pipeline.from_pretrained(str(TOY), dtype=torch.float32)
    pipeline.set_progress_bar_config(disable=True)
    return pipeline


def test_weights_are_safetensors_and_small():
    weights = list(TOY.rglob("*.safetensors"))
    assert {w.parent.name for w in weights} >= {"transformer", "vae", "text_encoder", "text_encoder_2"}
    assert not list(TOY.rglob("*.bin")), "weights must be stored as safetensors only"
    total = sum(w.stat().st_size for w in weights)
    assert total <= 20 * 2**20, f"weights take {total / 2**20:.1f} MiB > 20 MiB"


def test_plain_diffusers_pipeline_generates_offline(pipe):
    assert pipe.default_sample_size * pipe.vae_scale_factor == RESOLUTION
    images = pipe(["a red circle", "two blue squares"], num_inference_steps=4, guidance_scale=GUIDANCE,
                  max_sequence_length=MAX_SEQ, generator=generators([1, 2]), output_type="pt").images
    assert images.shape == (2, 3, RESOLUTION, RESOLUTION)
    assert torch.isfinite(images).all() and images.min() >= 0 and images.max() <= 1


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_loading_warns_nothing_about_torch_dtype(dtype, recwarn, capfd):
    """flowrl passes ``dtype=``: diffusers (a FutureWarning) and transformers (a log line) deprecate torch_dtype."""
    policy = build_policy("sd3", str(TOY), max_sequence_length=MAX_SEQ, dtype=dtype)
    assert policy.pipeline.transformer.dtype == policy.pipeline.text_encoder.dtype == getattr(torch, dtype)
    deprecations = [w for w in recwarn if issubclass(w.category, (FutureWarning, DeprecationWarning))
                    and "dtype" in str(w.message)]
    assert not deprecations, [str(w.message) for w in deprecations]
    assert "torch_dtype" not in capfd.readouterr().err


def test_flowrl_ode_rollout_matches_the_pipeline(pipe):
    policy = build_policy("sd3", str(TOY), max_sequence_length=MAX_SEQ)
    assert (policy.height, policy.width) == (RESOLUTION, RESOLUTION)
    prompts, seeds = ["a green square above a purple diamond", "three yellow triangles"], [3, 4, 5, 6]
    traj = rollout(policy, prompts, RolloutSettings(num_steps=STEPS, guidance_scale=GUIDANCE, noise_level=0.0),
                   group_size=2, seeds=seeds)
    reference = pipe([p for p in prompts for _ in range(2)], num_inference_steps=STEPS, guidance_scale=GUIDANCE,
                     max_sequence_length=MAX_SEQ, generator=generators(seeds), output_type="pt").images
    torch.testing.assert_close(traj.images, reference, rtol=0, atol=1e-5)


def test_heldout_toyeval_is_in_a_loose_band(pipe):
    by_task: dict[str, list] = {}
    for item in heldout_prompts(0):  # prompts RL never trains on
        by_task.setdefault(item[1]["task"], []).append(item)
    rng = np.random.default_rng(0)
    items = [by_task[t][i] for t in TASKS for i in rng.integers(len(by_task[t]), size=8)]  # 32, stratified
    prompts, metas = [p for p, _ in items], [m for _, m in items]
    images = pipe(prompts, num_inference_steps=STEPS, guidance_scale=GUIDANCE, max_sequence_length=MAX_SEQ,
                  generator=generators(range(100, 132)), output_type="pt").images
    scores = ToyEval()(images, prompts, metas)
    strict, partial = scores["toyeval"].mean().item(), scores["toyeval/partial"].mean().item()
    assert 0.05 <= strict <= 0.9, f"held-out ToyEval strict {strict:.3f} outside [0.05, 0.9]"
    assert partial > strict
