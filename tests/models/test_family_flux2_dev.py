"""FLUX.2 [dev] specifics the shared family tests do not pin down: the pipeline's noise draw and Mistral-3 text at
hidden layers 10/20/30, the guidance embedding (one pass, guidance a real input at any value), the DreamBooth LoRA
targets, and a model folder of another FLUX.2 pipeline refused in one line. Its empirical time shift is tested
beside klein's (test_family_flux2_klein.py)."""

import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch

from flowrl.core.seeding import generators
from flowrl.models import build_policy, check_pipeline_family
from flowrl.sampling import RolloutSettings, rollout


@pytest.fixture(scope="module")
def policy():
    return build_policy("flux2_dev", "tiny", seed=0)


def test_noise_and_mistral_text_are_the_pipelines(policy):
    pipe = policy.pipeline
    assert type(pipe.text_encoder).__name__ == "Mistral3ForConditionalGeneration"
    noise = policy.init_noise(3, generator=generators([1, 2, 3]))
    packed, latent_ids = pipe.prepare_latents(3, policy.transformer.config.in_channels // 4, policy.height,
                                              policy.width, torch.float32, "cpu", generators([1, 2, 3]))
    torch.testing.assert_close(policy.pack(noise), packed, rtol=0, atol=0)
    torch.testing.assert_close(policy.image_ids(*noise.shape[2:]), latent_ids[0], rtol=0, atol=0)
    assert policy.text_encoder_out_layers == (10, 20, 30)
    embeds, text_ids = pipe.encode_prompt(["a red circle"], max_sequence_length=policy.max_sequence_length)
    cond = policy.encode(["a red circle"])
    assert cond.pooled_prompt_embeds.shape == (1, 0) and not cond.has_negative  # guidance-distilled: no negative
    torch.testing.assert_close(cond.text_ids, text_ids[0], rtol=0, atol=0)
    torch.testing.assert_close(cond.prompt_embeds, embeds, rtol=0, atol=1e-6)
    assert not torch.allclose(cond.prompt_embeds, policy.encode(["two blue squares"]).prompt_embeds)  # not truncated


def test_guidance_is_one_embedded_pass(policy, monkeypatch):
    cond = policy.encode(["a red circle", "two blue squares"])
    x = policy.init_noise(2, generator=generators([5, 6]))
    calls = []
    forward = policy.transformer.forward
    monkeypatch.setattr(policy.transformer, "forward",
                        lambda **kw: calls.append((kw["hidden_states"].shape[0], kw["guidance"])) or forward(**kw))
    with torch.no_grad():
        strong, weak = policy.velocity(x, 0.5, cond, 4.0), policy.velocity(x, 0.5, cond, 1.0)
    assert [batch for batch, _ in calls] == [2, 2]  # no unconditional half
    assert calls[0][1].dtype == torch.float32 and calls[0][1].tolist() == [4.0, 4.0]
    assert calls[1][1].tolist() == [1.0, 1.0]  # 1.0 is an input like any other, as in Flux2Pipeline
    assert (strong - weak).abs().max() > 1e-4


def test_ode_rollout_matches_the_pipeline_at_another_guidance(policy):
    prompts, seeds = ["a red circle"], [3, 4]
    ours = rollout(policy, prompts, RolloutSettings(num_steps=2, guidance_scale=2.5, noise_level=0.0),
                   group_size=2, seeds=seeds).images
    theirs = policy.pipeline_images(prompts, group_size=2, num_steps=2, guidance_scale=2.5, seeds=seeds)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)


def test_lora_targets_are_the_dreambooth_scripts():
    policy = build_policy("flux2_dev", "tiny", seed=0)
    policy.add_lora(rank=2, alpha=2.0)
    wrapped = sorted(n for n, m in policy.transformer.named_modules() if hasattr(m, "lora_A"))
    assert wrapped == sorted(["transformer_blocks.0.attn.to_q", "transformer_blocks.0.attn.to_k",
                              "transformer_blocks.0.attn.to_v", "transformer_blocks.0.attn.to_out.0"])


@pytest.mark.parametrize("family, found, hint", [("flux2_dev", "Flux2KleinPipeline", "model.family=flux2_klein"),
                                                 ("flux2_klein", "Flux2Pipeline", "model.family=flux2_dev")])
def test_a_folder_of_the_other_flux2_pipeline_is_one_line(tmp_path, family, found, hint):
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": found}))
    expected = "Flux2Pipeline" if family == "flux2_dev" else "Flux2KleinPipeline"
    with pytest.raises(ValueError) as error:
        check_pipeline_family(family, str(tmp_path), expected)
    message = str(error.value)
    assert "\n" not in message and found in message and hint in message


def test_the_cli_refuses_a_model_folder_that_is_not_a_flux2_pipeline(tmp_path, capsys):
    from flowrl.cli import main

    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "model_index.json").write_text(json.dumps({"_class_name": "Flux2KleinPipeline"}))
    code = main(["train", "configs/smoke/flux2_dev_tiny.yaml", f"model.path={tmp_path / 'model'}",
                 f"run_dir={tmp_path / 'run'}"])
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert code == 2 and len(err) == 1
    assert err[0].startswith("flowrl train: error:") and "model.family=flux2_klein" in err[0]
    assert not (tmp_path / "run").exists()
