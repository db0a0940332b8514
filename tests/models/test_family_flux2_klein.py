"""FLUX.2 [klein] specifics the shared family tests do not pin down: the pipeline's noise draw and text position
ids, its empirical time shift (and FLUX.2 [dev]'s, the same code), the batch-norm latent de-normalisation, the distilled models' ignored guidance, and
the DreamBooth LoRA targets."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import pytest
import torch
from diffusers.pipelines.flux2 import pipeline_flux2, pipeline_flux2_klein

from flowrl.models import build_policy
from flowrl.core.seeding import generators


@pytest.fixture(scope="module")
def policy():
    return build_policy("flux2_klein", "tiny", seed=0)


def test_noise_and_text_ids_are_the_pipelines(policy):
    pipe = policy.pipeline
    noise = policy.init_noise(3, generator=generators([1, 2, 3]))
    packed, latent_ids = pipe.prepare_latents(3, policy.transformer.config.in_channels // 4, policy.height,
                                              policy.width, torch.float32, "cpu", generators([1, 2, 3]))
    torch.testing.assert_close(policy.pack(noise), packed, rtol=0, atol=0)
    torch.testing.assert_close(policy.image_ids(*noise.shape[2:]), latent_ids[0], rtol=0, atol=0)
    embeds, text_ids = pipe.encode_prompt(["a red circle"], max_sequence_length=policy.max_sequence_length)
    cond = policy.encode(["a red circle"])
    assert cond.pooled_prompt_embeds.shape == (1, 0) and cond.has_negative  # the tiny model is a base model
    torch.testing.assert_close(cond.text_ids, text_ids[0], rtol=0, atol=0)
    torch.testing.assert_close(cond.prompt_embeds, embeds, rtol=0, atol=1e-6)


@pytest.mark.parametrize("family, pipeline_module, steps", [
    ("flux2_klein", pipeline_flux2_klein, (4, 28)), ("flux2_dev", pipeline_flux2, (4, 50)),
])
def test_sigmas_follow_the_empirical_mu(family, pipeline_module, steps):
    """Both FLUX.2 families share the time shift (flowrl/models/flux2_base.py); each is held to its own pipeline's."""
    policy = build_policy(family, "tiny", seed=0)
    for n in steps:
        mu = pipeline_module.compute_empirical_mu(image_seq_len=policy.image_seq_len(), num_steps=n)
        timesteps, _ = pipeline_module.retrieve_timesteps(policy.pipeline.scheduler, n, "cpu",
                                                          sigmas=np.linspace(1.0, 1 / n, n), mu=mu)
        sigmas = policy.sigmas(n)
        assert sigmas.shape == (n + 1,) and sigmas[-1] == 0
        torch.testing.assert_close(sigmas[:-1] * 1000, timesteps.float(), rtol=0, atol=0)


def test_decode_undoes_the_batch_norm(policy):
    vae = policy.vae
    assert not torch.allclose(vae.bn.running_mean, torch.zeros_like(vae.bn.running_mean))
    latents = torch.randn(policy.latent_shape(1), generator=torch.Generator().manual_seed(0))
    std = torch.sqrt(vae.bn.running_var + vae.config.batch_norm_eps).view(1, -1, 1, 1)
    raw = policy.pipeline._unpatchify_latents(latents * std + vae.bn.running_mean.view(1, -1, 1, 1))
    with torch.no_grad():
        expected = (vae.decode(raw).sample / 2 + 0.5).clamp(0, 1)
    torch.testing.assert_close(policy.decode(latents), expected, rtol=0, atol=0)
    assert policy.decode(latents).shape == (1, 3, policy.height, policy.width)


def test_distilled_models_ignore_guidance():
    policy = build_policy("flux2_klein", "tiny", seed=0)
    policy.pipeline.register_to_config(is_distilled=True)
    cond = policy.encode(["a red circle"])
    assert not cond.has_negative
    x = policy.init_noise(1, generator=generators([5]))
    with torch.no_grad():
        torch.testing.assert_close(policy.velocity(x, 0.5, cond, 4.0), policy.velocity(x, 0.5, cond, 1.0),
                                   rtol=0, atol=0)


def test_lora_targets_are_the_dreambooth_scripts():
    policy = build_policy("flux2_klein", "tiny", seed=0)
    policy.add_lora(rank=2, alpha=2.0)
    wrapped = sorted(n for n, m in policy.transformer.named_modules() if hasattr(m, "lora_A"))
    assert wrapped == sorted(["transformer_blocks.0.attn.to_q", "transformer_blocks.0.attn.to_k",
                              "transformer_blocks.0.attn.to_v", "transformer_blocks.0.attn.to_out.0",
                              "single_transformer_blocks.0.attn.to_qkv_mlp_proj",
                              "single_transformer_blocks.0.attn.to_out"])
