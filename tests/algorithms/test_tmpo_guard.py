"""TMPO's Softmax Trajectory Balance gradient targets (train.tmpo_target=gradient) and flowrl's batch_sensitivity
ratio normalisation, held to numbers computed by hand, and both running in the GRPO recipe on the tiny model (full
SDE, window, tree). TMPO's release behaviour is held to its reference in test_reference_tmpo.py, GRPO-Guard's in
test_reference_guard.py."""

import math
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch

from flowrl.algorithms.ratio_norm import batch_sensitivity_log_ratio, step_sensitivities
from flowrl.algorithms.tmpo import softmax_tb_gradient as tmpo_advantages
from flowrl.config import Config, ConfigError, load_config
from flowrl.recipes.grpo import train
from flowrl.sampling.steps import velocity_sensitivity
from tools.policy_capture import capture_training_policy, lora_and_base


def test_tmpo_target_on_a_three_trajectory_group_by_hand():
    # Group of 3: log P = (0, ln 2, ln 3) -> p = (1, 2, 3) / 6; R = (1, 0, 0) at beta = ln 2 (so that
    # exp(beta R) = (2, 1, 1)) -> q = (2, 1, 1) / 4. Targets t = log q - log p:
    # t = (ln(1/2) - ln(1/6), ln(1/4) - ln(1/3), ln(1/4) - ln(1/2)) = (ln 3, ln(3/4), ln(1/2)).
    # Advantage a_j = t_j - p_j * sum(t), sum(t) = ln(3 * 3/4 * 1/2) = ln(9/8).
    log_p = torch.tensor([0.0, math.log(2), math.log(3)])
    rewards = torch.tensor([1.0, 0.0, 0.0])
    t = [math.log(3), math.log(3 / 4), math.log(1 / 2)]
    p = [1 / 6, 2 / 6, 3 / 6]
    total = math.log(9 / 8)
    expected = [t[j] - p[j] * total for j in range(3)]
    out = tmpo_advantages(log_p, rewards, torch.zeros(3, dtype=torch.long), beta=math.log(2))
    assert out.tolist() == pytest.approx(expected, rel=1e-6)


def test_tmpo_advantage_is_the_negative_gradient_of_softmax_tb():
    torch.manual_seed(0)
    log_p = torch.randn(5, dtype=torch.float64, requires_grad=True)
    rewards = torch.rand(5, dtype=torch.float64)
    loss = 0.5 * ((torch.log_softmax(log_p, 0) - torch.log_softmax(15.0 * rewards, 0)) ** 2).sum()
    loss.backward()
    out = tmpo_advantages(log_p.detach(), rewards.float(), torch.zeros(5, dtype=torch.long), beta=15.0)
    assert out.tolist() == pytest.approx((-log_p.grad).tolist(), rel=1e-5, abs=1e-5)


def test_tmpo_groups_are_separate_nan_rows_left_out_and_matched_groups_get_nothing():
    log_p = torch.tensor([0.0, 0.0, 0.3, 0.0, 0.0])
    rewards = torch.tensor([1.0, 1.0, float("nan"), 0.0, 1.0])
    groups = torch.tensor([0, 0, 0, 1, 1])
    out = tmpo_advantages(log_p, rewards, groups, beta=2.0)
    # group 0 without its NaN row: equal rewards and equal log-probs -> p = q -> no signal.
    assert out[:3].tolist() == [0.0, 0.0, 0.0]
    # group 1: p = (1/2, 1/2), q = (1, e^2) / (1 + e^2); the better row gains, the other loses.
    q = torch.tensor([1.0, math.exp(2)]) / (1 + math.exp(2))
    t = torch.log(q) - math.log(0.5)
    assert out[3:].tolist() == pytest.approx((t - 0.5 * t.sum()).tolist(), rel=1e-6)


def test_batch_sensitivity_log_ratio_on_a_hand_made_batch():
    log_ratio = torch.tensor([0.3, -0.1, -0.5], requires_grad=True)
    out = batch_sensitivity_log_ratio(log_ratio, 2.0)
    # mean -0.1: (0.4, 0.0, -0.4) / 2
    assert out.tolist() == pytest.approx([0.2, 0.0, -0.2], abs=1e-7)
    out.sum().backward()
    assert log_ratio.grad.tolist() == [0.5, 0.5, 0.5]  # the centring is detached: each row keeps its own gradient


def test_velocity_sensitivity_matches_the_sde_mean_by_hand():
    # SDE: mu = x + [v + std_t^2 / (2 sigma) (x + (1 - sigma) v)] dt, std = std_t sqrt(-dt)
    # -> d mu / d v = dt (1 + std_t^2 (1 - sigma) / (2 sigma)), sensitivity = |d mu / d v| / std.
    sigma, sigma_next, a = 0.6, 0.45, 0.7
    std_t = a * math.sqrt(sigma / (1 - sigma))
    dt = sigma_next - sigma
    expected = abs(dt * (1 + std_t ** 2 * (1 - sigma) / (2 * sigma))) / (std_t * math.sqrt(-dt))
    assert velocity_sensitivity(sigma, sigma_next, noise_level=a, kind="sde") == pytest.approx(expected, rel=1e-9)
    # CPS: mu = (1 - s') (x - s v) + sqrt(s'^2 - std^2) (x + (1 - s) v), std = s' sin(a pi / 2)
    std = sigma_next * math.sin(a * math.pi / 2)
    slope = -(1 - sigma_next) * sigma + math.sqrt(sigma_next ** 2 - std ** 2) * (1 - sigma)
    assert velocity_sensitivity(sigma, sigma_next, noise_level=a, kind="cps") == pytest.approx(abs(slope) / std,
                                                                                             rel=1e-9)


def test_step_sensitivities_rise_toward_the_clean_end_and_average_one():
    sigmas = torch.tensor([1.0, 0.9, 0.75, 0.55, 0.3, 0.0])
    scales = step_sensitivities(sigmas, [0, 1, 2, 3], noise_level=0.7, kind="sde")
    assert sum(scales.values()) / 4 == pytest.approx(1.0)
    assert scales[3] > scales[0]  # the low-noise steps move their log-ratio most per unit of velocity


def smoke(tmp_path, *overrides):
    return load_config(Config, "configs/smoke/sd3_tiny.yaml",
                       [f"run_dir={tmp_path}", "train.epochs=2", "log.progress=false", "log.eval_every=0",
                        "log.eval_images_per_prompt=2", *overrides])


@pytest.mark.parametrize("overrides", [
    ["train.loss=tmpo", "train.beta=0"],
    ["train.loss=tmpo", "train.beta=0", "sampling.tree.branch_steps=[1]", "sampling.tree.branch_factor=2"],
    ["train.loss=tmpo", "train.beta=0", "sampling.window.size=2", "sampling.window.mode=random_per_epoch",
     "sampling.num_steps=4"],
    ["train.ratio_norm=true", "train.inner_epochs=2"],
    ["train.ratio_norm=batch_sensitivity", "train.inner_epochs=2"],
])
def test_tmpo_and_guard_train_in_the_grpo_recipe(tmp_path, monkeypatch, overrides):
    captured = capture_training_policy(monkeypatch)
    metrics = train(smoke(tmp_path, *overrides))
    assert math.isfinite(metrics["loss/total"]) and metrics["advantages/abs_mean"] > 0
    assert metrics["policy/onpolicy_ratio_maxdev"] < 1e-5
    lora_before, _ = captured["before"]
    lora_after, _ = lora_and_base(captured["policy"])
    assert any(not torch.equal(lora_before[n], lora_after[n]) for n in lora_before)


@pytest.mark.parametrize("overrides, key", [
    (["train.loss=ppo"], "train.loss"),
    (["train.combine=sum"], "train.combine"),
    (["train.tmpo_beta=0"], "train.tmpo_beta"),
    (["recipe=nft", "train.loss=tmpo"], "train.loss"),
    (["recipe=nft", "train.ratio_norm=true"], "train.ratio_norm"),  # recipe grpo's key
])
def test_bad_tmpo_or_guard_settings_name_the_key(overrides, key):
    from flowrl.recipes.names import check_names

    with pytest.raises(ConfigError) as error:  # range and cross-section checks, then registry names
        check_names(load_config(Config, "configs/smoke/sd3_tiny.yaml", overrides))
    assert "\n" not in str(error.value) and key in str(error.value)


def test_zero_std_fraction_counts_groups_that_teach_nothing():
    from flowrl.algorithms.advantages import zero_std_fraction

    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.3, float("nan"), float("nan"), float("nan")])
    groups = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
    # group 0 all equal, group 1 mixed, group 2 a single finite reward, group 3 none scored
    assert zero_std_fraction(rewards, groups) == 0.75


def test_time_limit_stops_after_the_epoch_that_passes_it_and_still_reports(tmp_path):
    from flowrl.training.metrics import read_metrics

    metrics = train(smoke(tmp_path, "train.epochs=50", "train.time_limit_s=1e-9", "log.test_every=5",
                          "log.report_prompts=2"))
    records = read_metrics(tmp_path)
    assert [r["epoch"] for r in records] == [-1, 0]  # the base point, then one epoch
    assert "test/brightness" in records[-1]  # the curve ends where the run stopped
    assert (tmp_path / "lora").is_dir() and "report/after/eval/brightness" in metrics
    assert (tmp_path / "checkpoints" / "latest").exists()
