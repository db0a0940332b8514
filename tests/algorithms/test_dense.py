"""Dense per-step credit (train.credit): DenseGRPO's reward gains and the cosine split held to numbers
computed by hand, the look-ahead against the rollout it must reproduce, smoke runs of each credit mode
in the GRPO recipe on the tiny model, and the settings it refuses."""

import math
import os
from concurrent.futures import Future

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
from accelerate import Accelerator

from flowrl.algorithms.advantages import grpo_advantages
from flowrl.algorithms.combine import weighted_sum
from flowrl.algorithms.dense import (
    cosine_advantages, cosine_gain_weights, lookahead_states, ode_lookahead, predict_x0, reward_gains,
    stepwise_advantages, top_step_share,
)
from flowrl.config import Config, ConfigError, load_config
from flowrl.models import build_policy
from flowrl.algorithms.credit import cosine_credit, ode_credit
from flowrl.recipes.grpo import train
from flowrl.sampling import RolloutSettings, StepPlan, rollout
from tools.policy_capture import capture_training_policy, lora_and_base

PROMPTS = ["a red circle", "two blue squares"]


def group_estimator(rewards, group_ids):
    return grpo_advantages(rewards, group_ids, std_scope="group")


@pytest.fixture(scope="module")
def sd3():
    return build_policy("sd3", "tiny", seed=0)


# --- dense_ode: reward gains and their per-step normalisation, by hand ------------------------------------

def test_dense_gains_and_advantages_on_a_two_step_toy_by_hand():
    # Group 0 (3 rows), group 1 (2 rows); look-ahead rewards R_0 (from x_0), R_1 (from x_1), final R_2.
    step_rewards = torch.tensor([[0.2, 0.6], [0.5, 0.4], [0.8, 0.8], [0.0, 1.0], [0.0, 0.0]])  # [N, K] = [R_0, R_1]
    final = torch.tensor([0.9, 0.4, 0.5, 1.0, 1.0])  # R_2
    groups = torch.tensor([0, 0, 0, 1, 1])
    gains = reward_gains(step_rewards, final)
    # dR_0 = R_1 - R_0, dR_1 = R_2 - R_1
    expected_gains = [[0.4, 0.3], [-0.1, 0.0], [0.0, -0.3], [1.0, 0.0], [0.0, 1.0]]
    assert gains.tolist() == [pytest.approx(row, abs=1e-6) for row in expected_gains]

    advantages, combined = stepwise_advantages({"r": gains}, {"r": 1.0}, groups, weighted_sum, group_estimator,
                                               clip=1.2)
    assert torch.equal(combined, gains)
    # Group 0, step 0: dR = (0.4, -0.1, 0), mean 0.1, deviations (0.3, -0.2, -0.1), population std
    # sqrt(0.14 / 3) = 0.21602; 0.3 / (0.21602 + 1e-4) = 1.388 is clipped to 1.2.
    std = math.sqrt(0.14 / 3) + 1e-4
    assert advantages[:3, 0].tolist() == pytest.approx([1.2, -0.2 / std, -0.1 / std], rel=1e-5)
    # Group 0, step 1: dR = (0.3, 0, -0.3), mean 0, std sqrt(0.06) = 0.24495; +-0.3 / 0.24505 = +-1.224 -> +-1.2.
    assert advantages[:3, 1].tolist() == pytest.approx([1.2, 0.0, -1.2], abs=1e-5)
    # Group 1 is normalised on its own: dR_0 = (1, 0) and dR_1 = (0, 1), mean 0.5, std 0.5 -> +-0.5 / 0.5001.
    assert advantages[3:].tolist() == [pytest.approx([0.5 / 0.5001, -0.5 / 0.5001], rel=1e-5),
                                       pytest.approx([-0.5 / 0.5001, 0.5 / 0.5001], rel=1e-5)]


def test_dense_gains_of_two_rewards_are_weighted_and_a_nan_gain_is_left_out():
    # Step 0: a = (1, 0, 5), b = (0, 0, NaN) -> combined a + 0.5 b = (1, 0, NaN): the NaN row gets 0 and
    # the other two are normalised alone (mean 0.5, std 0.5). Step 1: a = (0, 2, 4), b = (2, 0, 0) ->
    # (1, 2, 4), mean 7/3, deviations (-4/3, -1/3, 5/3), std sqrt(42 / 27).
    a = torch.tensor([[1.0, 0.0], [0.0, 2.0], [5.0, 4.0]])
    b = torch.tensor([[0.0, 2.0], [0.0, 0.0], [float("nan"), 0.0]])
    advantages, combined = stepwise_advantages({"a": a, "b": b}, {"a": 1.0, "b": 0.5}, torch.zeros(3, dtype=torch.long),
                                               weighted_sum, group_estimator, clip=5.0)
    assert torch.isnan(combined[2, 0]) and combined[:, 1].tolist() == [1.0, 2.0, 4.0]
    assert advantages[:, 0].tolist() == pytest.approx([0.5 / 0.5001, -0.5 / 0.5001, 0.0], rel=1e-5)
    std = math.sqrt(42 / 27) + 1e-4
    assert advantages[:, 1].tolist() == pytest.approx([-4 / 3 / std, -1 / 3 / std, 5 / 3 / std], rel=1e-5)


def test_lookahead_states_are_the_trained_steps_and_their_successors():
    assert lookahead_states([0, 1, 2], 4) == [0, 1, 2, 3]
    assert lookahead_states([0, 2], 4) == [0, 1, 2, 3]
    assert lookahead_states([1], 4) == [1, 2]
    assert lookahead_states([3], 4) == [3]  # R_4 is the rollout's own final reward


class LinearPolicy:
    """v(x) = x, so an Euler step from sigma to sigma' multiplies x by 1 + sigma' - sigma."""

    def velocity(self, x, sigma, cond, guidance_scale):
        return x


def test_ode_lookahead_caps_its_model_calls_by_stepping_to_zero():
    sigmas = torch.tensor([1.0, 0.5, 0.25, 0.0])
    x = torch.full((2, 1, 2, 2), 2.0)
    # Full: 2 * (1 - 0.5) * (1 - 0.25) * (1 - 0.25) = 0.5625.
    assert ode_lookahead(LinearPolicy(), x, sigmas, None, 1.0).flatten().tolist() == pytest.approx([0.5625] * 8)
    assert ode_lookahead(LinearPolicy(), x, sigmas, None, 1.0, steps=5).flatten().tolist() == pytest.approx(
        [0.5625] * 8)
    # Two calls: 1 -> 0.5 (x 0.5), then straight 0.5 -> 0 (x 0.5): 2 * 0.25 = 0.5.
    assert ode_lookahead(LinearPolicy(), x, sigmas, None, 1.0, steps=2).flatten().tolist() == pytest.approx([0.5] * 8)
    # One call: x - sigma v = 2 - 1 * 2 = 0, the clean-latent prediction.
    assert ode_lookahead(LinearPolicy(), x, sigmas, None, 1.0, steps=1).flatten().tolist() == [0.0] * 8


# --- dense_cosine: the split by x0-prediction gains, by hand ------------------------------------------------

def test_cosine_weights_on_hand_made_vectors():
    final = torch.tensor([[1.0, 0.0]] * 3)
    # x0_preds [N, K+1, 2] with K = 2; the last state's prediction is the clean latent itself.
    x0_preds = torch.tensor([
        [[0.0, 1.0], [1.0, 1.0], [1.0, 0.0]],  # cos (0, 1/sqrt2, 1): gains (0.7071, 0.2929), sum 1
        [[1.0, 0.0], [0.0, 1.0], [1.0, 0.0]],  # cos (1, 0, 1): gains (-1, 1) -> clamped (0, 1)
        [[2.0, 0.0], [3.0, 0.0], [1.0, 0.0]],  # cos 1 everywhere: no gain -> uniform
    ])
    weights = cosine_gain_weights(x0_preds, final, [0, 1])
    half = 1 / math.sqrt(2)
    assert weights.tolist() == [pytest.approx([half, 1 - half], rel=1e-6), [0.0, 1.0], [0.5, 0.5]]
    # A[n, k] = A_n * K * w[n, k] with K = 2 trained steps: each row's credit sums to K * A_n.
    advantages = cosine_advantages(torch.tensor([2.0, -1.0, 0.5]), weights, 2)
    assert advantages.tolist() == [pytest.approx([4 * half, 4 * (1 - half)], rel=1e-6), [0.0, -2.0], [0.5, 0.5]]


def test_cosine_weights_normalise_over_the_trained_steps_only():
    # Unit vectors at cos (0, 0.6, 0.8, 1) to x0 = (1, 0): gains (0.6, 0.2, 0.2); training steps 0 and 2
    # only -> (0.6, 0, 0.2) / 0.8 = (0.75, 0, 0.25).
    x0_preds = torch.tensor([[[0.0, 1.0], [0.6, 0.8], [0.8, 0.6], [1.0, 0.0]]])
    weights = cosine_gain_weights(x0_preds, torch.tensor([[1.0, 0.0]]), [0, 2])
    assert weights.tolist() == [pytest.approx([0.75, 0.0, 0.25], rel=1e-6)]
    # Without any gain on the trained steps the split is uniform over them.
    flat = torch.tensor([[[1.0, 0.0], [1.0, 0.0], [0.0, 1.0], [1.0, 0.0]]])
    assert cosine_gain_weights(flat, torch.tensor([[1.0, 0.0]]), [0, 1]).tolist() == [[0.5, 0.5, 0.0]]


def test_top_step_share_by_hand():
    advantages = torch.tensor([[1.0, -1.0, 2.0], [0.0, 0.0, 0.0], [0.0, -3.0, 1.0]])
    mask = torch.tensor([[True, True, False], [True, True, True], [True, True, True]])
    share, has_credit = top_step_share(advantages, mask)
    # row 0: |A| (1, 1) on its trained steps -> 1/2; row 1 has no credit; row 2: 3 of 4.
    assert has_credit.tolist() == [True, False, True]
    assert share[has_credit].tolist() == [0.5, 0.75]


# --- the fast paths against the simple ones on the tiny model ----------------------------------------------

def window_rollout(policy, store):
    # Stored steps 0 and 1 of 4; steps 2 and 3 are ODE.
    settings = RolloutSettings(num_steps=4, guidance_scale=4.5, noise_level=0.7,
                               plan=StepPlan(4, sde_start=0, sde_size=2), store_x0_preds=store)
    return rollout(policy, PROMPTS, settings, group_size=2, seeds=[1, 2, 3, 4])


def test_lookahead_from_the_last_stored_state_reproduces_the_rollout(sd3):
    traj = window_rollout(sd3, store=True)
    cond = traj.cond.select(traj.prompt_ids)
    schedule = sd3.sigmas(4)
    last = traj.num_stored_steps  # state K = 2 lies at position 2 of the schedule; the rollout's ODE runs 2 -> 4
    clean = ode_lookahead(sd3, traj.latents[:, last], schedule[2:], cond, 4.5)
    torch.testing.assert_close(clean, traj.final_latents, rtol=0, atol=1e-6)
    torch.testing.assert_close(sd3.decode(clean), traj.images, rtol=0, atol=1e-6)
    # A one-call look-ahead is the clean-latent prediction the rollout stored for dense_cosine.
    for k in range(last + 1):
        one_step = ode_lookahead(sd3, traj.latents[:, k], schedule[k:], cond, 4.5, steps=1)
        torch.testing.assert_close(one_step.float(), traj.x0_preds[:, k], rtol=0, atol=1e-5)


def test_stored_x0_predictions_equal_recomputed_ones(sd3):
    traj = window_rollout(sd3, store=True)
    assert traj.x0_preds.shape == traj.latents.shape and traj.x0_preds.dtype == torch.float32
    cond = traj.cond.select(traj.prompt_ids)
    again = predict_x0(sd3, traj.latents, traj.sigmas, cond, 4.5, batch_size=3)
    # Batches of 3 vs the rollout's 4 pick different GEMM kernels: relative 1e-5 on predictions of |x0| <= ~5.
    torch.testing.assert_close(again, traj.x0_preds, rtol=1e-5, atol=1e-5)
    assert window_rollout(sd3, store=False).x0_preds is None
    # Full SDE: the last stored state is the clean latent, its own prediction.
    full = rollout(sd3, PROMPTS, RolloutSettings(num_steps=4, guidance_scale=4.5, noise_level=0.7, store_x0_preds=True),
                   group_size=2, seeds=[1, 2, 3, 4])
    assert torch.equal(full.x0_preds[:, -1], full.final_latents.float())
    tree = rollout(sd3, PROMPTS, RolloutSettings(num_steps=4, guidance_scale=4.5, noise_level=0.7,
                                                 plan=StepPlan(4, branch_steps=(2,), branch_factor=2),
                                                 store_x0_preds=True),
                   group_size=2, seeds=[1, 2])
    assert tree.x0_preds.shape == tree.latents.shape  # children inherit their parent's predictions
    assert torch.equal(tree.x0_preds[0, :3], tree.x0_preds[1, :3])
    # The recipe's credit is the same from stored and from recomputed predictions.
    row_adv = torch.tensor([1.0, -1.0, 0.5, -0.5])
    trained = torch.ones(4, 2, dtype=torch.bool)  # [N, K] every row trains both stored steps
    stored = cosine_credit(sd3, traj, row_adv, trained, guidance=4.5, batch_size=4)
    traj.x0_preds = None
    torch.testing.assert_close(cosine_credit(sd3, traj, row_adv, trained, guidance=4.5, batch_size=4), stored,
                               rtol=1e-4, atol=1e-4)
    assert stored.sum(1).tolist() == pytest.approx((2 * row_adv).tolist(), rel=1e-5)


class BrightnessScorer:
    """The AsyncScorer surface ode_credit uses: submit(...) -> a finished Future of {name: [N]}."""

    def __init__(self):
        self.calls = 0

    def submit(self, images, prompts, metadata, groups=None):
        self.calls += 1
        future = Future()
        future.set_result({"brightness": images.mean(dim=(1, 2, 3))})
        return future


def test_ode_credit_scores_each_state_once_and_normalises_its_gains(sd3):
    traj = rollout(sd3, PROMPTS, RolloutSettings(num_steps=4, guidance_scale=4.5, noise_level=0.7), group_size=2,
                   seeds=[5, 6, 7, 8])
    traj.rewards = {"brightness": traj.images.mean(dim=(1, 2, 3))}
    scorer, schedule = BrightnessScorer(), sd3.sigmas(4)
    advantages, gains = ode_credit(sd3, traj, scorer, [0, 1, 2], traj.group_ids, slice(0, 4),
                                   accelerator=Accelerator(cpu=True), schedule=schedule, guidance=4.5,
                                   weights={"brightness": 1.0}, combine=weighted_sum, estimator=group_estimator,
                                   clip=5.0, steps=None, batch_size=3)
    assert scorer.calls == 4  # states 0..3, one batched reward call each; R_4 is the rollout's reward
    cond = traj.cond.select(traj.prompt_ids)
    looked = torch.stack([sd3.decode(ode_lookahead(sd3, traj.latents[:, k], schedule[k:], cond, 4.5)).mean((1, 2, 3))
                          for k in range(4)], dim=1)  # [N, K] the simple path: one state at a time, all rows
    expected_gains = torch.cat([looked[:, 1:], traj.rewards["brightness"][:, None]], dim=1) - looked
    torch.testing.assert_close(gains, expected_gains, rtol=0, atol=1e-5)
    for k in range(4):
        torch.testing.assert_close(advantages[:, k], group_estimator(gains[:, k], traj.group_ids).clamp(-5, 5))


# --- the GRPO recipe with each credit mode ------------------------------------------------------------------

def smoke(tmp_path, *overrides):
    return load_config(Config, "configs/smoke/sd3_tiny.yaml",
                       [f"run_dir={tmp_path}", "train.epochs=2", "log.progress=false", "log.eval_every=0",
                        "log.eval_images_per_prompt=2", "log.report_prompts=0", "train.export_lora=false",
                        *overrides])


@pytest.mark.parametrize("overrides", [
    ["train.credit=terminal"],
    ["train.credit=dense_cosine"],
    ["train.credit=dense_cosine", "sampling.window.size=2", "train.clip_range=1e-5"],
    ["train.credit=dense_ode"],
    ["train.credit=dense_ode", "train.dense_lookahead=1", "sampling.window.size=2", "train.clip_range=1e-5"],
])
def test_each_credit_mode_trains_in_the_grpo_recipe(tmp_path, monkeypatch, overrides):
    captured = capture_training_policy(monkeypatch)
    metrics = train(smoke(tmp_path, *overrides))
    assert math.isfinite(metrics["loss/total"])
    assert metrics["policy/onpolicy_ratio_maxdev"] < 1e-5
    lora_before, _ = captured["before"]
    lora_after, _ = lora_and_base(captured["policy"])
    assert any(not torch.equal(lora_before[n], lora_after[n]) for n in lora_before)
    if overrides[0] == "train.credit=terminal":
        assert "advantages/dense_abs_mean" not in metrics
    else:
        assert 0 < metrics["advantages/dense_abs_mean"] < math.inf
        assert 1 / 3 <= metrics["advantages/dense_top_share"] <= 1  # 3 trained steps at most
    if overrides[0] == "train.credit=dense_ode":
        assert math.isfinite(metrics["reward/dense_gain_mean"])


# --- settings dense credit refuses --------------------------------------------------------------------------

@pytest.mark.parametrize("overrides, key", [
    (["train.credit=dense"], "train.credit"),
    (["train.credit=dense_ode", "train.loss=tmpo"], "train.credit"),
    (["train.credit=dense_cosine", "train.loss=tmpo"], "train.credit"),
    (["train.credit=dense_ode", "train.dense_lookahead=0"], "train.dense_lookahead"),
    (["train.dense_lookahead=2"], "train.dense_lookahead"),
    (["train.credit=dense_cosine", "train.dense_lookahead=2"], "train.dense_lookahead"),
])
def test_bad_credit_settings_name_the_key(overrides, key):
    with pytest.raises(ConfigError) as error:
        load_config(Config, "configs/smoke/sd3_tiny.yaml", overrides)
    assert "\n" not in str(error.value) and key in str(error.value)


@pytest.mark.parametrize("overrides", [["sampling.tree.branch_steps=[1]"], ["recipe=nft"]])
def test_dense_credit_with_a_tree_or_recipe_nft_fails_when_the_config_loads(tmp_path, overrides):
    with pytest.raises(ConfigError) as error:
        smoke(tmp_path, "train.credit=dense_ode", *overrides)
    assert "\n" not in str(error.value) and "train.credit" in str(error.value)


@pytest.mark.parametrize("credit", ["dense_cosine", "dense_ode"])
def test_dense_credit_is_refused_on_trees_and_is_no_key_of_recipe_nft(credit):
    with pytest.raises(ConfigError, match="train.credit.*sampling.tree.branch_steps"):
        load_config(Config, "configs/smoke/sd3_tiny.yaml", [f"train.credit={credit}", "sampling.tree.branch_steps=[2]"])
    with pytest.raises(ConfigError, match="unknown config key 'train.credit'.*recipe grpo option; recipe nft"):
        load_config(Config, "configs/smoke/sd3_tiny.yaml", ["recipe=nft", f"train.credit={credit}"])
    load_config(Config, "configs/smoke/sd3_tiny.yaml", ["train.credit=terminal", "sampling.tree.branch_steps=[2]"])
    load_config(Config, "configs/smoke/sd3_tiny.yaml", [f"train.credit={credit}"])
