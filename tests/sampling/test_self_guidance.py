"""Feature self-guidance: the dispersal step by hand, the identity at scale 0, more in-group diversity on the tiny
families, the one-image error and the config's one-line errors."""

import math
import os
from dataclasses import replace

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch

from flowrl.config import Config, ConfigError, load_config
from flowrl.eval.metrics import latent_gmd
from flowrl.models import build_policy
from flowrl.sampling import RolloutSettings, rollout
from flowrl.sampling.self_guidance import ONE_IMAGE_ERROR, SelfGuidance, dispersal_energy, disperse, installed
from tests import REPO

SMOKE = REPO / "configs/smoke/sd3_tiny.yaml"


@pytest.fixture(scope="module")
def sd3():
    return build_policy("sd3", "tiny", seed=0)


def test_dispersal_step_matches_a_hand_computation_on_two_vectors():
    # h1 = (2, 0), h2 = (3, 4): directions u1 = (1, 0), u2 = (0.6, 0.8), cos = 0.6. With two rows the ordered pairs
    # are (1, 2) and (2, 1), so G = log mean(exp(0.6), exp(0.6)) = 0.6 / temperature.
    # dG/du1 = (u2 - cos u1) / T = (0, 0.8) and dG/du2 = (u1 - cos u2) / T = (0.64, -0.48) at T = 1.
    # One step at scale 0.5: u1 - 0.5 (0, 0.8) = (1, -0.4), u2 - 0.5 (0.64, -0.48) = (0.28, 1.04); both have norm
    # sqrt(1.16); each row keeps its norm (2 and 5): h1' = 2 (1, -0.4) / sqrt(1.16), h2' = 5 (0.28, 1.04) / sqrt(1.16).
    h = torch.tensor([[2.0, 0.0], [3.0, 4.0]])
    groups = torch.tensor([0, 0])
    assert dispersal_energy(h, groups, 1.0).item() == pytest.approx(0.6)
    assert dispersal_energy(h, groups, 0.5).item() == pytest.approx(1.2)
    out = disperse(h, groups, scale=0.5, iterations=1, temperature=1.0)
    root = math.sqrt(1.16)
    expected = torch.tensor([[2 / root, -0.8 / root], [1.4 / root, 5.2 / root]])
    torch.testing.assert_close(out, expected)
    # The pair moved apart: cos 0.6 -> (0.28 - 0.416) / 1.16.
    assert torch.nn.functional.cosine_similarity(out[0], out[1], dim=0).item() == pytest.approx(-0.136 / 1.16)
    # A row of another group changes nothing in group 0 and is itself left alone (a group of one has no pairs).
    with_other = disperse(torch.cat([h, torch.tensor([[1.0, 1.0]])]), torch.tensor([0, 0, 1]), scale=0.5,
                          iterations=1, temperature=1.0)
    torch.testing.assert_close(with_other[:2], expected)
    torch.testing.assert_close(with_other[2], torch.tensor([1.0, 1.0]))


def test_scale_zero_is_the_identity_bit_for_bit(sd3):
    assert SelfGuidance.maybe(0.0, [0], [0, 1], 30, 1.0, 0.4) is None
    ode = RolloutSettings(num_steps=4, guidance_scale=4.5, noise_level=0.0)
    rows = dict(group_size=4, seeds=[1, 2, 3, 4])
    plain = rollout(sd3, ["a red circle"], ode, **rows)
    off = rollout(sd3, ["a red circle"], replace(ode, self_guidance=SelfGuidance.maybe(0.0, [0], [0, 1], 30, 1.0, 0.4)),
                  **rows)
    assert torch.equal(plain.final_latents, off.final_latents)
    # A guided rollout removes its hooks: the next unguided one is the plain one again.
    rollout(sd3, ["a red circle"], replace(ode, self_guidance=SelfGuidance(0.5, blocks=(0,), steps=(0, 1))), **rows)
    again = rollout(sd3, ["a red circle"], ode, **rows)
    assert torch.equal(plain.final_latents, again.final_latents)


@pytest.mark.parametrize("family, guidance", [("sd3", 4.5), ("flux", 3.5), ("flux_kontext", 2.5), ("flux2_klein", 1.0),
                                              ("qwen_image", 4.0), ("z_image", 1.0), ("wan", 5.0)])
def test_guidance_spreads_the_images_of_one_prompt(family, guidance, sd3):
    policy = sd3 if family == "sd3" else build_policy(family, "tiny", seed=0)
    ode = RolloutSettings(num_steps=4, guidance_scale=guidance, noise_level=0.0)
    rows = dict(group_size=4, seeds=[1, 2, 3, 4])
    plain = rollout(policy, ["a red circle"], ode, **rows)
    guided = rollout(policy, ["a red circle"],
                     replace(ode, self_guidance=SelfGuidance(0.5, blocks=(0,), steps=(0, 1), manifold_mix=0.4)), **rows)
    assert not torch.equal(plain.images, guided.images)
    assert latent_gmd(guided.final_latents).item() > latent_gmd(plain.final_latents).item()


def test_one_image_per_prompt_is_one_line_error(sd3):
    guide = SelfGuidance(0.5, blocks=(0,), steps=(0,))
    with pytest.raises(ValueError, match=ONE_IMAGE_ERROR):
        rollout(sd3, ["a red circle", "a blue square"],
                RolloutSettings(num_steps=2, guidance_scale=1.0, noise_level=0.0, self_guidance=guide), group_size=1,
                seeds=[1, 2])
    with pytest.raises(ValueError, match=ONE_IMAGE_ERROR):  # rows of a group split apart
        with installed(guide, sd3.transformer, 0, torch.tensor([0, 0, 1])):
            pass
    with pytest.raises(ValueError, match=r"blocks \[7\] out of range: SD3Transformer2DModel has 2 blocks"):
        rollout(sd3, ["a red circle"], RolloutSettings(num_steps=2, guidance_scale=1.0, noise_level=0.0,
                                                       self_guidance=SelfGuidance(0.5, blocks=(7,), steps=(0,))),
                group_size=2, seeds=[1, 2])


@pytest.mark.parametrize("overrides, key", [
    (["sampling.self_guidance.scale=-0.1"], "sampling.self_guidance.scale"),
    (["sampling.self_guidance.scale=0.1", "sampling.self_guidance.steps=[4]"], "sampling.self_guidance.steps"),
    (["sampling.self_guidance.blocks=[]"], "sampling.self_guidance.blocks"),
    (["sampling.self_guidance.manifold_mix=1.5"], "sampling.self_guidance.manifold_mix"),
    (["sampling.self_guidance.temperature=0"], "sampling.self_guidance.temperature"),
    (["sampling.self_guidance.scale=0.1", "sampling.self_guidance.in_rollouts=true"],
     "sampling.self_guidance.in_rollouts"),  # recipe grpo: log-probs are recomputed row by row
    (["recipe=nft", "sampling.self_guidance.scale=0.1", "sampling.self_guidance.in_rollouts=true",
      "sampling.group_size=1"], "sampling.self_guidance.in_rollouts"),
])
def test_bad_self_guidance_configs_are_one_line(overrides, key):
    with pytest.raises(ConfigError) as error:
        load_config(Config, SMOKE, overrides)
    message = str(error.value)
    assert "\n" not in message and key in message


def test_nft_accepts_guided_rollouts():
    cfg = load_config(Config, SMOKE, ["recipe=nft", "sampling.self_guidance.scale=0.1",
                                      "sampling.self_guidance.in_rollouts=true"])
    assert cfg.sampling.self_guidance.settings()["scale"] == 0.1


def test_flowrl_sample_with_one_image_per_prompt_is_one_line_and_writes_nothing(tmp_path):
    import contextlib
    import io

    from flowrl.cli import main

    out, stderr = tmp_path / "grid" / "samples.png", io.StringIO()
    with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(io.StringIO()):
        code = main(["sample", str(SMOKE), "--prompt", "a red circle", "--num-per-prompt", "1", "--out", str(out),
                     "sampling.self_guidance.scale=0.5"])
    lines = [line for line in stderr.getvalue().splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and ONE_IMAGE_ERROR in lines[0], stderr.getvalue()
    assert not out.parent.exists()
