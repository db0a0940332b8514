"""AWM (Advantage Weighted Matching, ``nft.loss=awm``): the uniform-weighted loss against a hand computation, its
gradient against DiffusionNFT's, the recipe end to end on the tiny SD3 model, and the config errors it adds
(the reference's ghuber weighting, sampler and timesteps: tests/algorithms/test_reference_awm.py)."""

import dataclasses
import math

import pytest
import torch

import flowrl.algorithms.forward_losses as forward_losses
import flowrl.recipes.nft as nft_recipe
from flowrl.algorithms.awm import awm_loss
from flowrl.algorithms.losses import nft_loss
from flowrl.config import Config, ConfigError, NFTConfig, load_config
from flowrl.training.metrics import read_metrics
from tools.policy_capture import capture_training_policy

SMOKE = "configs/smoke/sd3_tiny.yaml"


def awm_config(tmp_path, *overrides, path=SMOKE):
    base = [f"run_dir={tmp_path}", "recipe=nft", "nft.loss=awm", "train.epochs=2", "log.progress=false",
            "log.eval_every=0", "log.report_prompts=0", "train.optimizer_steps_per_epoch=2",
            "train.learning_rate=1e-3"]
    return load_config(Config, path, base + list(overrides))


def uniform_awm(v, v_ref, target, advantages, *, kl_weight):
    """AWM with the 'uniform' weighting at ratio 1 (its value is A l + kl_weight ||v - v_ref||^2; t plays no part)."""
    return awm_loss(v, v_ref, target, advantages, torch.full((len(v),), 0.5), kl_weight=kl_weight, weighting="uniform")


def test_awm_loss_matches_a_hand_computation():
    # Uniform weighting, kl_weight k = 0.25; means over the two values of each sample. At ratio 1 the surrogate's
    # value is -A, its gradient that of A l (l the flow-matching error).
    # Sample 1: v = (1, 2), v_ref = (0, 1), target = (1, 0), A = 0.5.
    #   (v - target)^2 = (0, 4), l = 2;  (v - v_ref)^2 = (1, 1), mean 1  -> -0.5 + 0.25 * 1 = -0.25
    # Sample 2: v = (3, 4), v_ref = (3, 2), target = (1, 4), A = -1.
    #   (v - target)^2 = (4, 0), l = 2;  (v - v_ref)^2 = (0, 4), mean 2  -> 1 + 0.25 * 2 = 1.5
    v = torch.tensor([[1.0, 2.0], [3.0, 4.0]], requires_grad=True)
    v_ref = torch.tensor([[0.0, 1.0], [3.0, 2.0]])
    target = torch.tensor([[1.0, 0.0], [1.0, 4.0]])
    loss = uniform_awm(v, v_ref, target, torch.tensor([0.5, -1.0]), kl_weight=0.25)
    assert loss.shape == (2,)
    assert loss.tolist() == pytest.approx([-0.25, 1.5])
    # Gradient of A l + k mean((v - v_ref)^2): A (v - target) + k (v - v_ref) over D = 2 dims:
    #   sample 1: 0.5 (0, 2) + 0.25 (1, 1) = (0.25, 1.25);  sample 2: -1 (2, 0) + 0.25 (0, 2) = (-2, 0.5)
    loss.sum().backward()
    assert v.grad.tolist() == [pytest.approx([0.25, 1.25]), pytest.approx([-2.0, 0.5])]


def test_awm_gradient_is_nft_at_the_old_policy_and_vanishes_at_its_minimum():
    # At v = v_ref the gradient is 2 a (v_ref - target) / D, DiffusionNFT's at strength 1 with r = (1 + a) / 2
    # (non-adaptive). With a + k > 0 the minimum is v_ref + a / (a + k) (target - v_ref): zero gradient there.
    v_ref = torch.tensor([[0.5, -1.0, 2.0]])
    target = torch.tensor([[1.0, 1.0, 1.0]])
    for a, k in ((1.0, 1.0), (-0.6, 1.0), (0.3, 0.5), (0.0, 2.0)):
        v = v_ref.clone().requires_grad_(True)
        uniform_awm(v, v_ref, target, torch.tensor([a]), kl_weight=k).sum().backward()
        assert torch.allclose(v.grad, 2 * a * (v_ref - target) / 3, atol=1e-7), (a, k)
        v_nft = v_ref.clone().requires_grad_(True)
        nft_loss(v_nft, v_ref, target, torch.tensor([(1 + a) / 2]), strength=1.0).sum().backward()
        assert torch.allclose(v.grad, v_nft.grad, atol=1e-7), (a, k)
        v = (v_ref + a / (a + k) * (target - v_ref)).requires_grad_(True)
        uniform_awm(v, v_ref, target, torch.tensor([a]), kl_weight=k).sum().backward()
        assert torch.allclose(v.grad, torch.zeros_like(v), atol=1e-6), (a, k)


def test_awm_smoke_run_trains_the_lora_through_the_awm_loss(tmp_path, monkeypatch):
    captured = capture_training_policy(monkeypatch)
    calls = {"awm": [], "nft": 0}
    real_awm, real_nft = forward_losses.awm_loss, forward_losses.nft_loss

    def spy_awm(velocity, reference_velocity, target, advantages, sigma, *, kl_weight, **options):
        calls["awm"].append((advantages.detach().clone(), kl_weight))
        return real_awm(velocity, reference_velocity, target, advantages, sigma, kl_weight=kl_weight, **options)

    def spy_nft(*args, **kwargs):
        calls["nft"] += 1
        return real_nft(*args, **kwargs)

    monkeypatch.setattr(forward_losses, "awm_loss", spy_awm)
    monkeypatch.setattr(forward_losses, "nft_loss", spy_nft)
    metrics = nft_recipe.train(awm_config(tmp_path, "nft.awm_kl=0.5", "train.beta=0.1"))

    assert math.isfinite(metrics["loss/awm"]) and math.isfinite(metrics["loss/total"])
    assert "loss/nft" not in metrics and "nft/optimality_abs_dev" not in metrics
    assert metrics["loss/ema_kl"] >= 0 and metrics["loss/kl"] >= 0
    assert 0 < metrics["awm/advantage_abs"] <= 1
    # Every training forward went through awm_loss, with the configured weight and advantages in [-1, 1].
    assert calls["nft"] == 0 and calls["awm"]
    weights = torch.cat([a for a, _ in calls["awm"]])
    assert {k for _, k in calls["awm"]} == {0.5}
    assert weights.abs().max() <= 1 and weights.abs().max() > 0
    (lora_before, base_before), after = captured["before"], dict(captured["policy"].transformer.named_parameters())
    assert any(not torch.equal(lora_before[n], after[n]) for n in lora_before)
    assert all(torch.equal(base_before[n], after[n]) for n in base_before)
    assert [r["epoch"] for r in read_metrics(tmp_path)] == [0, 1]


def test_awm_config_errors_name_the_key(tmp_path):
    with pytest.raises(ConfigError, match=r"nft\.loss") as error:
        awm_config(tmp_path, "nft.loss=ppo")
    assert "\n" not in str(error.value) and "awm" in str(error.value)  # one line that lists the choices
    with pytest.raises(ConfigError, match=r"nft\.awm_kl") as error:
        awm_config(tmp_path, "nft.awm_kl=-0.1")
    assert "\n" not in str(error.value)
    assert NFTConfig().nft.loss == "nft"  # DiffusionNFT stays the default


def test_toy_awm_config_is_the_toy_nft_config_with_awms_settings():
    awm, nft = (dataclasses.asdict(load_config(Config, f"configs/toy/{name}.yaml")) for name in ("awm", "nft"))
    assert awm["nft"]["loss"] == "awm" and nft["nft"]["loss"] == "nft"
    assert awm.pop("run_dir") != nft.pop("run_dir")
    awm_keys = {"nft": {"loss", "awm_weighting", "awm_ghuber_power", "awm_clip_range", "awm_kl", "old_decay",
                        "timestep_schedule", "stratified_fraction", "timesteps_per_sample", "sampler", "sa_noise_level",
                        "sa_noise_window", "rollout_weights", "eval_ema_decay"},
                "train": {"std_scope", "beta", "weight_decay", "inner_epochs", "optimizer_steps_per_epoch"},
                "sampling": {"num_steps"}}
    for section, keys in awm_keys.items():
        changed = {k for k in awm[section] if awm[section][k] != nft[section][k]}
        assert changed <= keys, changed - keys
        for k in keys:
            awm[section].pop(k), nft[section].pop(k)
    assert awm == nft  # everything else is the toy NFT run's
