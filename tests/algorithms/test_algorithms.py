"""Advantage estimators, tree backup and the clipped loss, held to hand-computed numbers."""

import math

import pytest
import torch

from flowrl.algorithms.advantages import edge_advantages, grpo_advantages, mean_advantages
from flowrl.algorithms.combine import weighted_sum
from flowrl.algorithms.losses import gaussian_mean_kl, grpo_clip_loss


def test_grpo_advantages_per_group_std():
    # group 0: rewards 1, 3 -> mean 2, std 1 -> (-1, 1) / (1 + 1e-4)
    # group 1: rewards 2, 2, 5 -> mean 3, std sqrt(((1 + 1 + 4) / 3)) = sqrt(2)
    rewards = torch.tensor([1.0, 3.0, 2.0, 2.0, 5.0])
    groups = torch.tensor([0, 0, 1, 1, 1])
    adv = grpo_advantages(rewards, groups, std_scope="group")
    expected = [-1 / 1.0001, 1 / 1.0001, -1 / (math.sqrt(2) + 1e-4), -1 / (math.sqrt(2) + 1e-4), 2 / (math.sqrt(2) + 1e-4)]
    assert adv.tolist() == pytest.approx(expected, rel=1e-6)


def test_grpo_advantages_global_std():
    rewards = torch.tensor([1.0, 3.0, 2.0, 2.0, 5.0])
    groups = torch.tensor([0, 0, 1, 1, 1])
    # global population std of [1, 3, 2, 2, 5]: mean 2.6, var (2.56 + .16 + .36 + .36 + 5.76) / 5 = 1.84
    std = math.sqrt(1.84)
    adv = grpo_advantages(rewards, groups, std_scope="global")
    expected = [-1 / (std + 1e-4), 1 / (std + 1e-4), -1 / (std + 1e-4), -1 / (std + 1e-4), 2 / (std + 1e-4)]
    assert adv.tolist() == pytest.approx(expected, rel=1e-6)


def test_nan_rewards_are_excluded_and_get_zero_advantage():
    rewards = torch.tensor([1.0, float("nan"), 3.0, 0.0, 0.0])
    groups = torch.tensor([0, 0, 0, 1, 1])
    adv = grpo_advantages(rewards, groups, std_scope="group")
    assert adv[1] == 0
    assert adv[0].item() == pytest.approx(-1 / 1.0001) and adv[2].item() == pytest.approx(1 / 1.0001)
    assert adv[3] == 0 and adv[4] == 0  # constant group: no signal
    assert mean_advantages(rewards, groups).tolist() == pytest.approx([-1.0, 0.0, 1.0, 0.0, 0.0])


def test_edge_advantages_back_up_leaf_means():
    # 4 leaves of one tree: step 0 shared by all, step 1 shared in pairs, step 2 per leaf.
    leaf_adv = torch.tensor([1.0, 3.0, -2.0, 0.0])
    edges = torch.tensor([[0, 1, 3], [0, 1, 4], [0, 2, 5], [0, 2, 6]])
    out = edge_advantages(leaf_adv, edges)
    assert out[:, 0].tolist() == [0.5] * 4
    assert out[:, 1].tolist() == [2.0, 2.0, -1.0, -1.0]
    assert out[:, 2].tolist() == leaf_adv.tolist()


def test_weighted_sum_combiner():
    rewards = {"a": torch.tensor([1.0, 0.0]), "b": torch.tensor([0.0, 2.0])}
    adv, combined = weighted_sum(rewards, {"a": 2.0, "b": 0.5}, torch.tensor([0, 0]),
                                 lambda r, g: r - r.mean())
    assert combined.tolist() == [2.0, 1.0] and adv.tolist() == [0.5, -0.5]


def test_grpo_clip_loss_by_hand():
    # ratio = exp(logp - old) = [1.5, 0.5, 1.02, 0.98]; eps = 0.1 (low), 0.2 (high)
    old = torch.zeros(4)
    logp = torch.log(torch.tensor([1.5, 0.5, 1.02, 0.98]))
    adv = torch.tensor([1.0, 1.0, -2.0, -2.0])
    loss, stats = grpo_clip_loss(logp, old, adv, clip_low=0.1, clip_high=0.2)
    # A>0, rho=1.5: max(-1.5, -1.2) = -1.2 (clipped branch)
    # A>0, rho=0.5: max(-0.5, -0.9) = -0.5 (unclipped branch: pessimism keeps the low ratio)
    # A<0, rho=1.02: max(2.04, 2.04) = 2.04
    # A<0, rho=0.98: max(1.96, 1.96) = 1.96
    assert loss.tolist() == pytest.approx([-1.2, -0.5, 2.04, 1.96], rel=1e-6)
    assert stats["clipped"].tolist() == [1.0, 1.0, 0.0, 0.0]


def test_kl_between_equal_std_gaussians_by_hand():
    mean = torch.tensor([[1.0, 2.0], [0.0, 0.0]])
    ref = torch.tensor([[0.0, 0.0], [0.0, 3.0]])
    std = torch.tensor([[2.0], [1.0]])
    # row 0: mean((1, 4)) / (2 * 4) = 2.5 / 8; row 1: mean((0, 9)) / 2 = 2.25
    assert gaussian_mean_kl(mean, ref, std).tolist() == pytest.approx([2.5 / 8, 2.25])
