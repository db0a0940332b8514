"""SDPO's math (flowrl/algorithms/sdpo.py) held to numbers worked out by hand from the reference's formulas
(github.com/ZiyiZhang27/sdpo @ fcee34db, scripts/train_sdpo.py and pipeline_with_logprob_sdpo.py): discounted
returns and per-step group advantages on a 3-step toy trajectory, temporal importance weights, the dense reward
predicted from latent similarity, and the pair difference loss with its clipping."""

import math
from functools import partial

import torch

from flowrl.algorithms.advantages import grpo_advantages
from flowrl.algorithms.combine import COMBINERS
from flowrl.algorithms.dense import stepwise_advantages
from flowrl.algorithms.sdpo import (
    cosine_similarities, discounted_returns, least_similar_anchors, pair_difference_loss, predicted_rewards,
    temporal_weights,
)

EPS = 1e-4  # grpo_advantages' eps: (G - mean) / (std + eps)


def test_returns_and_stepwise_advantages_of_a_3_step_trajectory_by_hand():
    # Four trajectories of one prompt (two pairs), dense rewards r_j at steps 0, 1, 2, gamma 0.5:
    # G_2 = r_2, G_1 = r_1 + 0.5 G_2, G_0 = r_0 + 0.5 G_1 (the reference's loop, rewards[:, t] += gamma * next).
    rewards = torch.tensor([[-1.5, 1.0, 4.0],    # G = [-1.5 + 1.5, 1 + 2, 4] = [0, 3, 4]
                            [2.5, 3.0, 0.0],     # G = [2.5 + 1.5, 3 + 0, 0] = [4, 3, 0]
                            [1.5, -1.0, 4.0],    # G = [1.5 + 0.5, -1 + 2, 4] = [2, 1, 4]
                            [1.5, 1.0, 0.0]])    # G = [1.5 + 0.5, 1 + 0, 0] = [2, 1, 0]
    returns = discounted_returns(rewards, 0.5)
    torch.testing.assert_close(returns, torch.tensor([[0.0, 3, 4], [4, 3, 0], [2, 1, 4], [2, 1, 0]]))
    # Per step over the group (the reference's per-(prompt, step) normalisation):
    # step 0: G [0, 4, 2, 2], mean 2, deviations [-2, 2, 0, 0], population std sqrt(8 / 4) = sqrt(2);
    # step 1: G [3, 3, 1, 1], mean 2, deviations [1, 1, -1, -1], std 1;
    # step 2: G [4, 0, 4, 0], mean 2, deviations [2, -2, 2, -2], std 2.
    s2 = math.sqrt(2)
    expected = torch.tensor([[-2 / (s2 + EPS), 1 / (1 + EPS), 2 / (2 + EPS)],
                             [2 / (s2 + EPS), 1 / (1 + EPS), -2 / (2 + EPS)],
                             [0.0, -1 / (1 + EPS), 2 / (2 + EPS)],
                             [0.0, -1 / (1 + EPS), -2 / (2 + EPS)]])
    advantages, combined = stepwise_advantages({"r": returns}, {"r": 1.0}, torch.zeros(4, dtype=torch.long),
                                               COMBINERS["weighted"], partial(grpo_advantages, std_scope="group"),
                                               clip=5.0)
    torch.testing.assert_close(advantages, expected)
    torch.testing.assert_close(combined, returns)
    # gamma 0: each step's own reward; gamma 1: the undiscounted sum of what follows.
    torch.testing.assert_close(discounted_returns(rewards, 0.0), rewards)
    torch.testing.assert_close(discounted_returns(rewards[:1], 1.0), torch.tensor([[3.5, 5.0, 4.0]]))


def test_temporal_importance_weights_by_hand():
    # lam**j / log_scale, j = 0 the first (noisiest) step: 0.9**[0, 1, 2] / 2.
    torch.testing.assert_close(temporal_weights(3, 0.9, 2.0), torch.tensor([0.5, 0.45, 0.405], dtype=torch.float64))
    torch.testing.assert_close(temporal_weights(2, 1.0, 1.0), torch.ones(2, dtype=torch.float64))


def test_dense_rewards_interpolate_the_queried_ones_by_latent_similarity():
    # Four states' clean predictions (2-d latents, one row): first [1, 0], then [1, 1], [-1, 1], last [0, 1].
    x0 = torch.tensor([[[1.0, 0.0], [1.0, 1.0], [-1.0, 1.0], [0.0, 1.0]]])  # [1, 4, 2]
    # Anchor: argmin over states of cos(x, first) + cos(x, last): state 0: 1 + 0; 1: 1/sqrt2 + 1/sqrt2;
    # 2: -1/sqrt2 + 1/sqrt2 = 0; 3: 0 + 1. The least similar is state 2.
    assert least_similar_anchors(x0, 1).tolist() == [[2]]
    queried = torch.tensor([[0, 3, 2]])  # first, last, anchor (the reference's order of overrides)
    sims = cosine_similarities(x0, queried)
    torch.testing.assert_close(sims[0, 1], torch.tensor([1 / math.sqrt(2), 1 / math.sqrt(2), 0.0],
                                                        dtype=torch.float64))
    # Queried rewards 1 (first), 3 (last), 5 (anchor). State 1: (1/sqrt2 * 1 + 1/sqrt2 * 3 + 0 * 5) / (2/sqrt2) = 2;
    # the queried states keep their own rewards.
    dense = predicted_rewards(torch.tensor([[1.0, 3.0, 5.0]]), sims, queried)
    torch.testing.assert_close(dense, torch.tensor([[1.0, 2.0, 5.0, 3.0]], dtype=torch.float64))
    # Unequal weights: first [1, 0], [2, 1], last [0, 1], only the first and the last queried (rewards 1 and 3).
    # State 1: cos to the first 2/sqrt5, to the last 1/sqrt5: (2/sqrt5 * 1 + 1/sqrt5 * 3) / (3/sqrt5) = 5/3.
    x0 = torch.tensor([[[1.0, 0.0], [2.0, 1.0], [0.0, 1.0]]])
    queried = torch.tensor([[0, 2]])
    dense = predicted_rewards(torch.tensor([[1.0, 3.0]]), cosine_similarities(x0, queried), queried)
    torch.testing.assert_close(dense, torch.tensor([[1.0, 5 / 3, 3.0]], dtype=torch.float64))


def test_pair_difference_loss_and_its_clipping_on_two_pairs_by_hand():
    clip = 0.1
    log_probs = torch.tensor([[0.3, 0.1], [0.5, 0.0]], requires_grad=True)
    old = torch.tensor([[0.1, 0.15], [0.0, 0.0]])
    advantages = torch.tensor([[1.0, -1.0], [0.3, 0.1]])
    weights = torch.tensor([0.5, 1.0])
    loss, stats = pair_difference_loss(log_probs, old, advantages, weights, clip_range=clip)
    # Pair 0: log-ratios [0.2, -0.05], d = 0.25; clamped to +-0.1: [0.1, -0.05], d_clip = 0.15; dA = 2, w = 0.5:
    #   unclipped (0.125 - 2)^2 = 3.515625, clipped (0.075 - 2)^2 = 3.705625 -> the clipped one.
    # Pair 1: log-ratios [0.5, 0], d = 0.5, d_clip = 0.1; dA = 0.2, w = 1:
    #   unclipped (0.5 - 0.2)^2 = 0.09, clipped (0.1 - 0.2)^2 = 0.01 -> the unclipped one.
    torch.testing.assert_close(loss, torch.tensor([3.705625, 0.09]))
    assert stats["clipped"].tolist() == [1.0, 0.0]
    loss.sum().backward()
    # Gradients: pair 0 through the clipped term only, member 0 clamped (no gradient), member 1:
    #   2 (0.075 - 2) * 0.5 * (-1) = 1.925; pair 1 through the unclipped term: 2 (0.5 - 0.2) * 1 * [1, -1].
    torch.testing.assert_close(log_probs.grad, torch.tensor([[0.0, 1.925], [0.6, -0.6]]))
