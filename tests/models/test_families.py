"""Every model family behind the Policy seam, held to the same bar on its tiny offline pipeline.

Per family: the ODE rollout reproduces the family's own diffusers pipeline (same seeds, steps, guidance),
the recorded log-prob equals the one recomputed from the stored latents, the tiny pipeline saves and
reloads with plain diffusers, a GRPO smoke run trains the LoRA and leaves the base untouched, an
exported LoRA gives the same images in plain diffusers (``load_lora_weights``) as in flowrl, and the text
embeddings are as long as ``model.max_sequence_length`` says.
SD3 and FLUX.1 have their own, older tests (tests/sampling/test_rollout.py, tests/recipes/test_grpo.py,
tests/commands/test_export.py); they are listed here too so that every family passes the same checks.
"""

import math
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import diffusers
import pytest
import torch

from flowrl.config import Config, load_config
from flowrl.models import FAMILIES, build_policy, policy_class
from flowrl.models.lora_io import load_lora_into, lora_config_dict, lora_state_dict, write_lora_files
from flowrl.recipes.grpo import train
from flowrl.sampling import RolloutSettings, rollout, sde_step
from tools.policy_capture import capture_training_policy, lora_and_base, randomize_lora

PROMPTS = ["a red circle", "two blue squares"]
SEEDS = [11, 12, 13, 14]  # 2 prompts x group 2
STEPS = 3


@pytest.fixture(scope="module", params=FAMILIES)
def family(request):
    return request.param


@pytest.fixture(scope="module")
def policy(family):
    return build_policy(family, "tiny", seed=0)


def _ode_images(policy, guidance=None):
    guidance = policy.default_guidance if guidance is None else guidance
    traj = rollout(policy, PROMPTS, RolloutSettings(num_steps=STEPS, guidance_scale=guidance, noise_level=0.0),
                   group_size=2, seeds=SEEDS, metadata=policy.example_metadata(len(PROMPTS)))
    return traj.images


def _pipeline_images(policy, guidance=None):
    guidance = policy.default_guidance if guidance is None else guidance
    return policy.pipeline_images(PROMPTS, group_size=2, num_steps=STEPS, guidance_scale=guidance, seeds=SEEDS,
                                  metadata=policy.example_metadata(len(PROMPTS)))


def _wrap(policy, pipeline):
    """A second policy of the same family, size and text length around another pipeline object."""
    pipeline.set_progress_bar_config(disable=True)
    return type(policy)(pipeline, height=policy.height, width=policy.width,
                        max_sequence_length=policy.max_sequence_length)


def test_ode_rollout_reproduces_the_family_pipeline(policy):
    ours, theirs = _ode_images(policy), _pipeline_images(policy)
    assert ours.shape == theirs.shape and ours.shape[0] == len(SEEDS)
    assert torch.isfinite(ours).all() and ours.std() > 0
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)


def test_recorded_log_prob_equals_the_recomputed_one(policy):
    guidance = policy.default_guidance
    traj = rollout(policy, PROMPTS, RolloutSettings(num_steps=STEPS, guidance_scale=guidance, noise_level=0.7),
                   group_size=2, seeds=SEEDS, metadata=policy.example_metadata(len(PROMPTS)))
    assert traj.latents.shape[:2] == (len(SEEDS), STEPS + 1)
    assert traj.latents.shape[2:] == policy.latent_shape(1)[1:]
    cond = traj.cond.select(traj.prompt_ids)
    for k in range(STEPS):
        v = policy.velocity(traj.latents[:, k], traj.sigmas[k], cond, guidance)
        again = sde_step(v, traj.latents[:, k], traj.sigmas[k], traj.sigmas[k + 1], noise_level=0.7,
                         prev_sample=traj.latents[:, k + 1])
        assert torch.isfinite(traj.log_probs[:, k]).all()
        torch.testing.assert_close(again.log_prob, traj.log_probs[:, k], rtol=0, atol=1e-6)


def test_tiny_pipeline_saves_and_reloads_with_plain_diffusers(policy, tmp_path):
    policy.pipeline.save_pretrained(tmp_path)
    pipeline_class = getattr(diffusers, policy.pipeline_class_name)
    reloaded = pipeline_class.from_pretrained(tmp_path)
    assert type(reloaded) is type(policy.pipeline)
    torch.testing.assert_close(_pipeline_images(_wrap(policy, reloaded)), _pipeline_images(policy), rtol=0, atol=0)


def test_grpo_smoke_run_trains_the_lora_and_not_the_base(family, tmp_path, monkeypatch):
    captured = capture_training_policy(monkeypatch)
    overrides = [f"run_dir={tmp_path}", "train.epochs=2", "log.progress=false", "log.eval_every=1",
                 "log.eval_images_per_prompt=2"]
    metrics = train(load_config(Config, f"configs/smoke/{family}_tiny.yaml", overrides))
    assert math.isfinite(metrics["loss/total"])
    lora_before, base_before = captured["before"]
    lora_after, base_after = lora_and_base(captured["policy"])
    assert any(not torch.equal(lora_before[n], lora_after[n]) for n in lora_before)
    assert all(torch.equal(base_before[n], base_after[n]) for n in base_before)
    assert metrics["policy/onpolicy_ratio_maxdev"] < 1e-5
    assert (tmp_path / "lora" / "pytorch_lora_weights.safetensors").is_file()


def test_exported_lora_gives_the_same_images_in_plain_diffusers(family, tmp_path):
    trained = build_policy(family, "tiny", seed=0)
    trained.add_lora(rank=4, alpha=8.0, init_seed=0)
    randomize_lora(trained)  # a LoRA far from its zero init, so that it visibly changes the images
    write_lora_files(tmp_path, lora_state_dict(trained.transformer), lora_config_dict(trained.transformer),
                     family=family, base_model="tiny", config_text=None, format="diffusers")
    plain = policy_class(family).tiny_pipeline(0)
    policy_class(family).load_exported_lora(plain, tmp_path)  # a file per expert for a two-expert family
    ours = _ode_images(trained)
    torch.testing.assert_close(_pipeline_images(_wrap(trained, plain)), ours, rtol=0, atol=1e-5)
    base = _ode_images(build_policy(family, "tiny", seed=0))
    assert (ours - base).abs().max() > 1e-3  # the adapter is really there
    reloaded = build_policy(family, "tiny", seed=0)
    load_lora_into(reloaded, tmp_path / "pytorch_lora_weights.safetensors")
    torch.testing.assert_close(_ode_images(reloaded), ours, rtol=0, atol=1e-5)


@pytest.mark.parametrize("name", ["sd3", "qwen_image", "z_image", "wan"])
def test_a_configured_negative_prompt_drives_cfg_as_in_the_family_pipeline(name):
    """``model.negative_prompt`` replaces the empty negative in flowrl's CFG exactly as the pipeline's own
    ``negative_prompt`` argument does in the pipeline's."""
    policy = build_policy(name, "tiny", seed=0, negative_prompt="blurry dark photo")
    empty = _ode_images(build_policy(name, "tiny", seed=0), guidance=4.0)
    ours = _ode_images(policy, guidance=4.0)
    torch.testing.assert_close(ours, _pipeline_images(policy, guidance=4.0), rtol=0, atol=1e-5)
    assert (ours - empty).abs().max() > 1e-4  # the negative really changed


def test_num_frames_sets_the_clip_length_of_a_video_family_and_is_refused_elsewhere():
    policy = build_policy("wan", "tiny", seed=0, num_frames=9)
    assert policy.latent_shape(2)[2] == 3  # (9 - 1) / 4 + 1 latent frames
    with pytest.raises(ValueError, match="model.num_frames is for video families"):
        build_policy("sd3", "tiny", seed=0, num_frames=9)


def test_family_parity_script_prints_the_readme_figure():
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "tools.family_parity", "--family", "flux_kontext"], check=True,
                         capture_output=True, text=True).stdout
    line = out.strip()
    assert line.startswith("flux_kontext") and float(line.rsplit("=", 1)[1]) < 1e-5


@pytest.mark.parametrize("name", [f for f in FAMILIES if not f.startswith("qwen_image_edit")])
def test_every_family_encodes_text_to_model_max_sequence_length(name):
    """The text tokens follow model.max_sequence_length (SD3: T5's part, after CLIP's 77). Qwen-Image-Edit's text
    holds its source's vision tokens and needs a source: tests/models/test_family_qwen_image_edit.py."""
    prompt = ["a red circle on a blue square beside a green triangle under a yellow star in a grey room"]
    lengths = [build_policy(name, "tiny", seed=0, max_sequence_length=n).encode(prompt, negative=False)
               .prompt_embeds.shape[1] for n in (8, 12)]
    assert lengths == ([77 + 8, 77 + 12] if name == "sd3" else [8, 12])
