"""BranchGRPO against its reference (Fredreic1849/BranchGRPO, fastvideo/train_branchgrpo_flux.py @ 19fbb9fc):
per-tree, per-depth standardised edge advantages, the 4x split noise scored with the unscaled std, DanceGRPO's
SDE that script samples with, and the recipe's use of them (TMPO's trees left as they were)."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import math
import sys

import numpy as np
import pytest
import torch

from flowrl.algorithms.advantages import edge_advantages, grpo_advantages
from flowrl.algorithms.branch import branch_advantages, depth_standardised_advantages, tree_roots
from flowrl.config import Config, ConfigError, load_config
from flowrl.models import build_policy
from flowrl.sampling import RolloutSettings, StepPlan, rollout, sde_step, transition
from flowrl.sampling.steps import ScheduleSteps, gaussian_log_prob

SMOKE = "configs/smoke/sd3_tiny.yaml"


@pytest.fixture(scope="module")
def policy():
    return build_policy("sd3", "tiny", seed=0)


def two_trees(policy, split_noise_scale=1.0, kind="sde", noise_level=0.7):
    """Two prompts, one root each, split x2 before steps 1 and 2: 2 trees of 4 leaves, 4 stored steps."""
    settings = RolloutSettings(num_steps=4, guidance_scale=4.5, noise_level=noise_level, kind=kind,
                               plan=StepPlan(4, branch_steps=(1, 2), branch_factor=2,
                                             split_noise_scale=split_noise_scale))
    return rollout(policy, ["a red circle", "two blue squares"], settings, group_size=4, seeds=[11, 12])


# --- advantages ----------------------------------------------------------------------------------------------

def test_depth_standardised_advantages_on_two_depth_two_trees_by_hand(policy):
    traj = two_trees(policy)
    assert tree_roots(traj.parent).tolist() == [0, 0, 0, 0, 4, 4, 4, 4]
    rewards = torch.tensor([1.0, 3.0, 2.0, 6.0,    # prompt A's tree
                            1.0, 3.0, 3.0, 1.0])   # prompt B's tree
    # By hand, with the reference's rule (node reward = mean of its leaves; per tree and depth
    # (r - mean) / (unbiased std + 1e-8), 0 for a lone node or std < 1e-6):
    # column 0 (depth 1): one node per tree -> 0.
    # column 1 (depth 2): A's nodes mean(1, 3) = 2 and mean(2, 6) = 4: mean 3, unbiased std sqrt(2) -> -+1/sqrt(2);
    #   B's nodes 2 and 2: std 0 -> 0 (standardised over the batch they would get -+0.5774 against A's).
    # columns 2, 3 (leaves): A: mean 3, deviations (-2, 0, -1, 3), unbiased std sqrt(14/3) = 2.1602469;
    #   B: mean 2, deviations (-1, 1, 1, -1), unbiased std sqrt(4/3) = 1.1547005.
    r = 1 / math.sqrt(2)
    a_std, b_std = math.sqrt(14 / 3), math.sqrt(4 / 3)
    leaves = [-2 / a_std, 0.0, -1 / a_std, 3 / a_std, -1 / b_std, 1 / b_std, 1 / b_std, -1 / b_std]
    first_level = [-r, -r, r, r, 0.0, 0.0, 0.0, 0.0]
    expected = torch.tensor([[0.0, node, leaf, leaf] for node, leaf in zip(first_level, leaves)])
    scored = torch.ones(8, dtype=torch.bool)
    by_reward = branch_advantages(rewards, scored, traj.edge_ids, traj.parent, clip=5.0)
    torch.testing.assert_close(by_reward, expected, rtol=1e-6, atol=1e-7)
    # The recipe passes the group-normalised advantages, a positive affine map of each tree's rewards: same result.
    normalised = grpo_advantages(rewards, traj.group_ids, std_scope="global")
    torch.testing.assert_close(branch_advantages(normalised, scored, traj.edge_ids, traj.parent, clip=5.0), expected,
                               rtol=1e-6, atol=1e-7)
    # flowrl's former backup (sampling.tree.backup: leaf_mean) gives the first-level edges of A only
    # mean(-2, 0) / sqrt(3.5) = -0.5345 (group std, population), not -0.7071.
    old = edge_advantages(grpo_advantages(rewards, traj.group_ids, std_scope="group"), traj.edge_ids)
    assert old[0, 1].item() == pytest.approx(-1 / (math.sqrt(3.5) + 1e-4), rel=1e-6)


def reference_node_advantages(leaf_rewards, split_steps, num_steps):
    """The reference's algorithm written out on an explicit binary tree (numpy): nodes keyed by (depth, path of
    child choices); a node's reward is the mean of the leaves below it; per depth, z-score with the unbiased
    std + 1e-8. Returns {(depth, path): advantage}."""
    leaves = len(leaf_rewards)
    nodes = {}
    for depth in range(1, num_steps + 1):
        splits = sum(1 for s in split_steps if s < depth)  # the step depth-1 -> depth has happened
        width = leaves // 2**splits  # leaves below each node of this depth
        keys = [(depth, j // width) for j in range(leaves)]
        groups = {}
        for key, reward in zip(keys, leaf_rewards):
            groups.setdefault(key, []).append(reward)
        rewards = {key: float(np.mean(v)) for key, v in groups.items()}
        values = np.array(list(rewards.values()))
        std = values.std(ddof=1) if len(values) > 1 else 0.0
        for key, value in rewards.items():
            nodes[key] = 0.0 if len(values) <= 1 or std < 1e-6 else (value - values.mean()) / (std + 1e-8)
    return nodes


def test_sixteen_leaves_split_at_0_3_6_9_match_the_reference_algorithm():
    split_steps, num_steps, leaves = (0, 3, 6, 9), 12, 16
    rewards = np.random.default_rng(0).normal(size=leaves)
    nodes = reference_node_advantages(rewards, split_steps, num_steps)
    # flowrl's edge ids for the same tree: the column-k edge of leaf j is its depth-(k + 1) node.
    edge_ids = torch.tensor([[1000 * (k + 1) + j // (leaves // 2 ** sum(s <= k for s in split_steps))
                              for k in range(num_steps)] for j in range(leaves)])
    ours = depth_standardised_advantages(torch.tensor(rewards), edge_ids, torch.zeros(leaves, dtype=torch.long))
    for j in range(leaves):
        for k in range(num_steps):
            width = leaves // 2 ** sum(s <= k for s in split_steps)
            assert ours[j, k].item() == pytest.approx(nodes[(k + 1, j // width)], abs=1e-6)
    # Shared edges carry as much signal as the leaves': two nodes always get -+1/sqrt(2).
    assert ours[:, 0].abs().tolist() == pytest.approx([1 / math.sqrt(2)] * leaves, rel=1e-6)


def test_unscored_leaves_are_left_out_and_get_nothing(policy):
    traj = two_trees(policy)
    rewards = torch.tensor([1.0, float("nan"), 2.0, 6.0, 1.0, 1.0, 1.0, 1.0])
    out = branch_advantages(rewards, torch.isfinite(rewards), traj.edge_ids, traj.parent, clip=5.0)
    # A's first-level nodes: leaf 0 alone (1) and mean(2, 6) = 4: -+1/sqrt(2). Leaf 1's own edges: 0.
    # A's leaves among themselves: 1, 2, 6: mean 3, unbiased std sqrt(7). B is flat: 0 everywhere.
    assert out[:, 1].tolist()[:4] == pytest.approx([-1 / math.sqrt(2)] * 2 + [1 / math.sqrt(2)] * 2, rel=1e-6)
    assert out[:, 3].tolist() == pytest.approx([-2 / math.sqrt(7), 0.0, -1 / math.sqrt(7), 3 / math.sqrt(7),
                                                0, 0, 0, 0], rel=1e-6, abs=1e-7)
    assert torch.isfinite(out).all()


def test_advantages_are_clipped_after_standardising():
    # 10 leaves of one tree, one outlier: mean 0.19, unbiased std sqrt((0.81^2 + 9 * 0.09^2) / 9) = 0.2846, so the
    # outlier's z-score is 0.81 / 0.2846 = 2.846, clipped at 2 here; the others get -0.09 / 0.2846 = -0.316.
    rewards = torch.tensor([1.0] + [0.1] * 9)
    edge_ids = torch.arange(10)[:, None]
    out = branch_advantages(rewards, torch.ones(10, dtype=torch.bool), edge_ids, torch.full((10,), -1), clip=2.0)
    # 10 separate roots: each is its own tree with one node, so nothing.
    assert out.abs().max().item() == 0.0
    parent = torch.tensor([-1] + [0] * 9)  # one tree
    out = branch_advantages(rewards, torch.ones(10, dtype=torch.bool), edge_ids, parent, clip=2.0)
    assert out[0, 0].item() == 2.0 and out[1, 0].item() == pytest.approx(-0.09 / math.sqrt(0.081), rel=1e-5)


# --- split noise ---------------------------------------------------------------------------------------------

def test_sde_step_scales_the_noise_but_not_the_log_prob():
    torch.manual_seed(0)
    x, v = torch.randn(3, 4, 8, 8), torch.randn(3, 4, 8, 8)
    plain = sde_step(v, x, 0.8, 0.7, noise_level=0.7, generator=torch.Generator().manual_seed(5))
    split = sde_step(v, x, 0.8, 0.7, noise_level=0.7, generator=torch.Generator().manual_seed(5), noise_scale=4.0)
    torch.testing.assert_close(split.prev_sample - split.mean, 4 * (plain.prev_sample - plain.mean), rtol=1e-5,
                               atol=1e-6)
    assert torch.equal(split.std, plain.std)
    # The recorded log-prob is the unscaled Gaussian's, which is what scoring the sample again gives.
    torch.testing.assert_close(split.log_prob, gaussian_log_prob(split.prev_sample, split.mean, plain.std))
    again = sde_step(v, x, 0.8, 0.7, noise_level=0.7, prev_sample=split.prev_sample)
    assert torch.equal(again.log_prob, split.log_prob)
    assert (split.log_prob < gaussian_log_prob(split.prev_sample, split.mean, 4 * plain.std)).all()
    # The schedule's fast path draws the same.
    steps = ScheduleSteps(torch.tensor([0.9, 0.8, 0.7]), noise_level=0.7)
    fast = steps.step(1, v, x, generator=torch.Generator().manual_seed(5), noise_scale=4.0)
    assert torch.equal(fast.prev_sample, split.prev_sample) and torch.equal(fast.log_prob, split.log_prob)


@pytest.mark.parametrize("kind, noise_level", [("sde", 0.7), ("dance", 0.3)])
def test_split_steps_draw_four_times_the_noise_and_record_the_unscaled_log_prob(policy, kind, noise_level):
    plain, split = two_trees(policy, 1.0, kind, noise_level), two_trees(policy, 4.0, kind, noise_level)
    sigmas = split.sigmas
    for k in range(4):  # stored column k is schedule step k; steps 1 and 2 are the split steps
        eps = {}
        for name, traj in (("plain", plain), ("split", split)):
            x, x_next = traj.latents[:, k], traj.latents[:, k + 1]
            cond = traj.cond.select(traj.prompt_ids)
            with torch.no_grad():
                velocity = policy.velocity(x, float(sigmas[k]), cond, 4.5)
            mean, std = transition(velocity, x, float(sigmas[k]), float(sigmas[k + 1]), noise_level=noise_level,
                                   kind=kind)
            eps[name] = (x_next - mean) / std
            # Recomputed as the loss does (prev_sample given): equal to the recorded log-prob, the unscaled std's.
            again = sde_step(velocity, x, float(sigmas[k]), float(sigmas[k + 1]), noise_level=noise_level,
                             kind=kind, prev_sample=x_next).log_prob
            torch.testing.assert_close(again, traj.log_probs[:, k], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(gaussian_log_prob(x_next, mean, std), traj.log_probs[:, k], rtol=1e-5, atol=1e-5)
        # Each row's noise comes from its seed, the same in both runs: 4x on the split steps, 1x elsewhere.
        factor = 4.0 if k in (1, 2) else 1.0
        torch.testing.assert_close(eps["split"], factor * eps["plain"], rtol=1e-3, atol=1e-3)


# --- DanceGRPO's SDE, BranchGRPO's sampler ---------------------------------------------------------------------

def test_dance_step_is_the_reference_step():
    """flux_step_with_split of the reference (sde_solver=True), written out: mean = x + dsigma v - 1/2 eta^2
    score dsigma with score = -(x - (1 - sigma) x0_hat) / sigma^2, std = eta sqrt(sigma - sigma_next)."""
    torch.manual_seed(1)
    x, v, x_next = torch.randn(2, 16, 8), torch.randn(2, 16, 8), torch.randn(2, 16, 8)
    eta, sigma, sigma_next = 0.3, 0.944, 0.875
    x0_hat = x - sigma * v
    score = -(x - x0_hat * (1 - sigma)) / sigma**2
    mean = x + (sigma_next - sigma) * v + (-0.5 * eta**2 * score) * (sigma_next - sigma)
    std = eta * math.sqrt(sigma - sigma_next)
    log_prob = (-((x_next - mean) ** 2) / (2 * std**2) - math.log(std) - 0.5 * math.log(2 * math.pi)).mean(dim=(1, 2))
    ours = sde_step(v, x, sigma, sigma_next, noise_level=eta, kind="dance", prev_sample=x_next)
    torch.testing.assert_close(ours.mean, mean, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ours.log_prob, log_prob, rtol=1e-5, atol=1e-5)
    assert ours.std.flatten().tolist() == pytest.approx([std] * 2, rel=1e-6)


# --- config and recipe -----------------------------------------------------------------------------------------

def test_tree_settings_and_their_checks():
    cfg = load_config(Config, SMOKE, ["sampling.tree.branch_steps=[1]"])
    assert cfg.sampling.tree.split_noise_scale == 4.0 and cfg.sampling.tree.backup == "depth_standardised"
    with pytest.raises(ConfigError, match="split_noise_scale"):
        load_config(Config, SMOKE, ["sampling.tree.branch_steps=[1]", "sampling.tree.split_noise_scale=0"])
    with pytest.raises(ConfigError, match="backup"):
        load_config(Config, SMOKE, ["sampling.tree.backup=leaf_max"])
    assert load_config(Config, "configs/toy/grpo_tree.yaml").sampling.kind == "dance"


@pytest.mark.parametrize("extra, backup_calls, noise", [
    ([], True, 4.0),
    (["sampling.tree.backup=leaf_mean"], False, 4.0),
    (["train.loss=tmpo", "train.beta=0"], False, 1.0),  # TMPO keeps its own targets and its splits' own noise
])
def test_the_recipe_uses_the_reference_tree_by_default(tmp_path, monkeypatch, extra, backup_calls, noise):
    import flowrl.algorithms.credit as credit
    import flowrl.recipes.grpo as grpo

    plans, calls = [], []
    sampling = sys.modules["flowrl.sampling.rollout"]
    real_rollout, real_backup = sampling.rollout, credit.branch_advantages

    def recording_rollout(policy, prompts, settings, **kwargs):
        plans.append(settings.plan)
        return real_rollout(policy, prompts, settings, **kwargs)

    def recording_backup(*args, **kwargs):
        calls.append(real_backup(*args, **kwargs))
        return calls[-1]

    monkeypatch.setattr(sampling, "rollout", recording_rollout)
    monkeypatch.setattr(credit, "branch_advantages", recording_backup)
    cfg = load_config(Config, SMOKE, [f"run_dir={tmp_path}", "train.epochs=1", "log.progress=false", "log.eval_every=0",
                                      "log.report_prompts=0", "train.export_lora=false",
                                      "sampling.tree.branch_steps=[0,2]", *extra])
    metrics = grpo.train(cfg)
    assert math.isfinite(metrics["loss/total"])
    assert metrics["policy/onpolicy_ratio_maxdev"] < 1e-5  # 4x split noise, yet the recorded log-probs are the loss's
    assert {p.split_noise_scale for p in plans} == {noise}
    assert bool(calls) == backup_calls
    if backup_calls:
        assert calls[0].shape == (8, 4) and calls[0][:, 0].abs().gt(0).all()  # the split at step 0 carries signal
