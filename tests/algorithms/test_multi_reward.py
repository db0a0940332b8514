"""Multi-reward combiners (GDPO, MARBLE) against hand-computed numbers and brute force, the amortised
MARBLE gradient against the explicit per-reward sum, both recipes training under MARBLE, and GARDO's
gate and diversity weighting on hand-made groups."""

import itertools
import math
import warnings

import pytest
import torch

from flowrl.algorithms.advantages import grpo_advantages
from flowrl.algorithms.combine import (
    correlation_weighted, correlation_weights, gdpo, marble_initial, reward_advantages, weighted_sum,
)
from flowrl.algorithms.gardo import (
    build_features, diversity_weighted, gated_rows, nearest_neighbour_distances, uncertainty, win_rates,
)
from flowrl.algorithms.losses import grpo_clip_loss
from flowrl.algorithms.marble import MarbleBalancer, balanced_backward, measure_reward_gradients, min_norm_weights
from flowrl.commands.train import run_train
from flowrl.config import Config, ConfigError, load_config
from flowrl.training.stats import StatsAccumulator
from flowrl.algorithms.forward_losses import NftLoss

GROUPS = torch.tensor([0, 0, 1, 1])


def group_estimator(rewards, group_ids):
    return grpo_advantages(rewards, group_ids, std_scope="group")


def test_gdpo_matches_a_hand_computed_two_reward_two_group_case():
    rewards = {"a": torch.tensor([1.0, 0.0, 3.0, 1.0]), "b": torch.tensor([0.0, 2.0, 5.0, 1.0])}
    advantages, combined = gdpo(rewards, {"a": 1.0, "b": 0.5}, GROUPS, group_estimator, eps=0.0)
    # Group z-scores: a -> [1, -1, 1, -1], b -> [-1, 1, 1, -1]; weighted sum [0.5, -0.5, 1.5, -1.5],
    # batch mean 0 and std sqrt(1.25).
    expected = torch.tensor([0.5, -0.5, 1.5, -1.5]) / math.sqrt(1.25)
    torch.testing.assert_close(advantages, expected, atol=1e-6, rtol=0)
    torch.testing.assert_close(combined, torch.tensor([1.0, 1.0, 5.5, 1.5]))
    # The weighted sum sees group 0 as flat (1, 1): it would teach nothing there.
    flat, _ = weighted_sum(rewards, {"a": 1.0, "b": 0.5}, GROUPS, group_estimator)
    assert flat[:2].abs().max() < 1e-6


def test_gdpo_leaves_nan_rows_out_of_the_batch_statistics():
    rewards = {"a": torch.tensor([1.0, 0.0, 3.0, float("nan")]), "b": torch.tensor([0.0, 2.0, 5.0, 1.0])}
    advantages, combined = gdpo(rewards, {"a": 1.0, "b": 0.5}, GROUPS, group_estimator)
    assert advantages[3] == 0 and math.isnan(combined[3])
    # Row 3 is out of b's group too, so row 2 is alone in group 1 (z 0); rows 0, 1 sum to +-0.5 before
    # the batch z-score over rows 0-2: [0.5, -0.5, 0] / sqrt(1/6).
    expected = torch.tensor([0.5, -0.5, 0.0, 0.0]) / math.sqrt(1 / 6)
    torch.testing.assert_close(advantages, expected, atol=1e-3, rtol=0)


def test_gdpo_with_weights_that_do_not_match_the_rewards_names_them():
    rewards = {"a": torch.ones(4), "b": torch.zeros(4)}
    with pytest.raises(ValueError, match=r"weights for \['c'\] have no reward signal.*rewards \['b'\] have no weight"):
        gdpo(rewards, {"a": 1.0, "c": 1.0}, GROUPS, group_estimator)
    with pytest.raises(ValueError, match="every reward weight is 0"):
        gdpo(rewards, {"a": 0.0, "b": 0.0}, GROUPS, group_estimator)


def test_correlation_weights_favour_the_rewards_that_conflict():
    rewards = {"a": torch.tensor([1.0, 0.0, 1.0, 0.0]), "b": torch.tensor([0.0, 1.0, 0.0, 1.0]),
               "c": torch.tensor([1.0, 1.0, 0.0, 0.0]), "logged": torch.zeros(4)}
    weights = {"a": 1.0, "b": 1.0, "c": 1.0, "logged": 0.0}
    # corr(a, b) = -1, corr(a, c) = corr(b, c) = 0: difficulties 0.75, 0.75, 0.5, rescaled to total 3.
    assert correlation_weights(rewards, weights) == pytest.approx({"a": 1.125, "b": 1.125, "c": 0.75})
    advantages, combined = correlation_weighted(rewards, weights, GROUPS, group_estimator)
    expected, _ = gdpo(rewards, {"a": 1.125, "b": 1.125, "c": 0.75, "logged": 0.0}, GROUPS, group_estimator)
    torch.testing.assert_close(advantages, expected)
    torch.testing.assert_close(combined, torch.tensor([2.0, 2.0, 1.0, 1.0]))
    # One reward, or a constant one beside it (correlation 0: difficulty 1/2 each), leaves weights alone.
    assert correlation_weights({"a": rewards["a"]}, {"a": 2.0}) == {"a": 2.0}
    assert correlation_weights({"a": rewards["a"], "z": torch.ones(4)}, {"a": 2.0, "z": 1.0}) == pytest.approx(
        {"a": 2.0, "z": 1.0})


def test_marble_initial_is_the_weighted_sum_of_per_reward_advantages_without_zero_weights():
    rewards = {"a": torch.tensor([1.0, 0.0, 3.0, 1.0]), "b": torch.tensor([0.0, 2.0, 5.0, 1.0]),
               "logged": torch.tensor([9.0, 0.0, 0.0, 9.0])}
    weights = {"a": 2.0, "b": 1.0, "logged": 0.0}
    per_reward = reward_advantages(rewards, weights, GROUPS, group_estimator)
    assert set(per_reward) == {"a", "b"}
    advantages, _ = marble_initial(rewards, weights, GROUPS, group_estimator)
    torch.testing.assert_close(advantages, 2 * per_reward["a"] + per_reward["b"])


def brute_force_min_norm(gram: torch.Tensor, step: float) -> tuple[torch.Tensor, float]:
    k, n = gram.shape[0], round(1 / step)
    best, best_value = None, float("inf")
    for counts in itertools.product(range(n + 1), repeat=k - 1):
        if sum(counts) > n:
            continue
        alpha = torch.tensor([*counts, n - sum(counts)], dtype=torch.float64) / n
        value = float(alpha @ gram @ alpha)
        if value < best_value:
            best, best_value = alpha, value
    return best, best_value


@pytest.mark.parametrize("k", [2, 3])
@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_min_norm_solver_matches_brute_force_on_the_simplex(k, seed):
    vectors = torch.randn(k, 5, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    vectors[1] -= 1.5 * vectors[0]  # a conflict, so that interior and face optima both occur across seeds
    gram = vectors @ vectors.T
    alpha = min_norm_weights(gram)
    assert alpha.min() >= 0 and abs(float(alpha.sum()) - 1) < 1e-9
    grid_alpha, grid_value = brute_force_min_norm(gram, 0.002 if k == 2 else 0.01)
    value = float(alpha @ gram @ alpha)
    assert value <= grid_value + 1e-12  # never worse than the grid
    # and the grid's best point is within one grid cell's worth of objective of it
    assert grid_value - value <= 2 * 0.01 * float(gram.abs().max()) + 1e-9
    assert (alpha - grid_alpha).abs().max() < 0.05


def test_min_norm_solver_hand_cases():
    # Two orthogonal unit vectors: the midpoint, norm^2 1/2.
    torch.testing.assert_close(min_norm_weights(torch.eye(2, dtype=torch.float64)),
                               torch.tensor([0.5, 0.5], dtype=torch.float64))
    # g1 = (1, 0), g2 = (2, 0): the hull's nearest point to 0 is g1 itself.
    torch.testing.assert_close(min_norm_weights(torch.tensor([[1.0, 2.0], [2.0, 4.0]], dtype=torch.float64)),
                               torch.tensor([1.0, 0.0], dtype=torch.float64))


def test_balancer_turns_a_negative_worst_cosine_positive():
    balancer = MarbleBalancer({"a": 1.0, "b": 1.0})
    grads = torch.tensor([[1.0, 0.0], [-0.9, 0.1]], dtype=torch.float64)  # the weighted sum follows a only
    stats = balancer.update(grads)
    assert stats["marble/worst_cos_negative_weighted"] == 1.0 and stats["marble/worst_cos_weighted"] < 0
    assert stats["marble/worst_cos_negative_marble"] == 0.0 and stats["marble/worst_cos_marble"] > 0
    assert stats["marble/alpha/a"] == pytest.approx(0.5)
    # Weights alpha_k * mean norm / ||g_k||: the update is the mean norm times the unit vectors' midpoint.
    norms = grads.norm(dim=1)
    torch.testing.assert_close(balancer.weights, 0.5 * norms.mean() / norms)
    update = balancer.weights @ grads
    midpoint = 0.5 * (grads[0] / norms[0] + grads[1] / norms[1])
    torch.testing.assert_close(update, norms.mean() * midpoint)


def test_balancer_smooths_alpha_and_leaves_a_reward_without_gradient_out():
    balancer = MarbleBalancer({"a": 1.0, "b": 1.0, "c": 1.0}, ema=0.5)
    balancer.update(torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.0, 0.0]], dtype=torch.float64))
    assert balancer.weights[2] == 0 and balancer.alpha.tolist() == pytest.approx([0.5, 0.5, 0.0])
    balancer.update(torch.tensor([[1.0, 0.0], [2.0, 0.0], [0.0, 3.0]], dtype=torch.float64))
    # new alpha: min-norm of (1,0), (1,0), (0,1) puts 1/2 on c and 1/2 spread over a, b (a face of
    # optima: any split), then the EMA halves the step from the old alpha.
    new = balancer.alpha * 2 - torch.tensor([0.5, 0.5, 0.0], dtype=torch.float64)
    assert float(new.sum()) == pytest.approx(1.0) and float(new[2]) == pytest.approx(0.5)


class TinyVelocity(torch.nn.Module):
    """v = x W: a stand-in for the transformer whose gradients are easy to compare."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(3, 3, generator=torch.Generator().manual_seed(0),
                                                     dtype=torch.float64))  # float64: compare to 1e-10

    def forward(self, x):
        return x @ self.weight


def nft_backward(model, old, x, target):
    def backward(advantage, stats=None):
        velocity = model(x)
        sigma = torch.full((x.shape[0],), 0.5, dtype=torch.float64)
        loss = NftLoss(strength=1.0, adaptive=False)(velocity, old(x).detach(), target, advantage, sigma)
        loss.sum().backward()
    return backward


def grpo_backward(model, x, old_log_probs):
    def backward(advantage, stats=None):
        log_probs = -((model(x) - 1.0) ** 2).mean(dim=1)  # [B], any differentiable log-prob
        loss, _ = grpo_clip_loss(log_probs, old_log_probs, advantage, clip_low=1e9, clip_high=1e9)  # unclipped
        loss.sum().backward()
    return backward


@pytest.mark.parametrize("loss", ["nft", "grpo_unclipped"])
def test_amortised_marble_gradient_equals_the_explicit_weighted_sum(loss):
    torch.manual_seed(0)
    model, old = TinyVelocity(), TinyVelocity()
    with torch.no_grad():
        old.weight.add_(0.1 * torch.randn(3, 3))
    x, target = torch.randn(6, 3, dtype=torch.float64), torch.randn(6, 3, dtype=torch.float64)
    backward = (nft_backward(model, old, x, target) if loss == "nft"
                else grpo_backward(model, x, -((x @ old.weight - 1.0) ** 2).mean(dim=1).detach()))
    advantages = {"a": torch.rand(6, dtype=torch.float64) * 2 - 1, "b": torch.rand(6, dtype=torch.float64) * 2 - 1}
    params = [model.weight]
    # Explicit: grad L(0) + sum_k w_k (grad L(A_k) - grad L(0)), each term its own backward pass.
    grads = measure_reward_gradients(params, backward, advantages, ["a", "b"])
    backward(torch.zeros(6, dtype=torch.float64))
    base = model.weight.grad.detach().double().flatten().clone()
    model.weight.grad = None
    balancer = MarbleBalancer({"a": 1.0, "b": 1.0}, refresh_every=2)
    balancer.update(grads)
    explicit = base + balancer.weights @ grads
    # Amortised: step 1 is no refresh, so one pass on the balanced advantage.
    stats = StatsAccumulator()
    balanced_backward(balancer, params, 1, advantages, backward, stats, StatsAccumulator)
    torch.testing.assert_close(model.weight.grad.double().flatten(), explicit, atol=1e-10, rtol=1e-8)
    assert not stats.scalars  # no refresh, no diagnostics
    # A refresh step measures (K + 1 passes into scratch statistics), logs, then takes the same update.
    model.weight.grad = None
    balanced_backward(balancer, params, 2, advantages, backward, stats, StatsAccumulator)
    torch.testing.assert_close(model.weight.grad.double().flatten(), base + balancer.weights @ grads,
                               atol=1e-10, rtol=1e-8)
    assert "marble/worst_cos_marble" in stats.scalars


SMOKE = "configs/smoke/sd3_tiny.yaml"
TWO_REWARDS = "rewards=[{name: brightness}, {name: 'tests.reward_fixtures:RedMinusBlue'}]"


def test_marble_with_one_trained_reward_warns_and_falls_back_to_weighted_when_the_run_starts(tmp_path):
    """Loading and validating change nothing (the config keeps marble, silently); start_run falls back, warns, and
    saves the combiner the run uses."""
    from flowrl.recipes.start import start_run

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cfg = load_config(Config, SMOKE, ["train.combine=marble", f"run_dir={tmp_path}", "log.progress=false",
                                          "rewards=[{name: brightness}, {name: 'tests.reward_fixtures:RedMinusBlue', "
                                          "weight: 0}]"])
    assert cfg.train.combine == "marble"
    with pytest.warns(UserWarning, match="only \\['brightness'\\] trains"):
        run = start_run(cfg)
    assert cfg.train.combine == "weighted" and "marble" not in run.extras
    assert load_config(Config, tmp_path / "config.yaml").train.combine == "weighted"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert load_config(Config, SMOKE, ["train.combine=marble", TWO_REWARDS]).train.combine == "marble"


@pytest.mark.parametrize("override, message", [
    ("train.credit=dense_cosine", "cannot combine with train.credit=dense_cosine"),
    ("train.loss=tmpo", "train.loss=tmpo"),
])
def test_marble_with_per_step_or_trajectory_targets_is_refused(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(Config, SMOKE, ["train.combine=marble", TWO_REWARDS, override])


def test_all_zero_reward_weights_are_refused():
    with pytest.raises(ConfigError, match="every reward has weight 0"):
        load_config(Config, SMOKE, ["rewards=[{name: brightness, weight: 0}]"])


@pytest.mark.parametrize("recipe", ["grpo", "nft"])
def test_marble_trains_both_recipes_and_resumes_exactly(tmp_path, recipe):
    common = [f"recipe={recipe}", TWO_REWARDS, "train.combine=marble", "train.marble.refresh_every=2",
              "train.optimizer_steps_per_epoch=2", "log.progress=false", "log.eval_every=0", "log.report_prompts=0",
              "train.export_lora=false", "train.learning_rate=1e-2", "train.checkpoint_every=1"]
    strip = lambda m: {k: v for k, v in m.items() if not k.startswith("perf/")}  # noqa: E731
    full = run_train(SMOKE, [f"run_dir={tmp_path / 'full'}", "train.epochs=3", *common])
    assert math.isfinite(full["loss/total"])
    assert {"marble/weight/brightness", "marble/weight/redness", "marble/alpha/brightness",
            "marble/worst_cos_marble"} <= set(full)
    run_train(SMOKE, [f"run_dir={tmp_path / 'resumed'}", "train.epochs=2", *common])
    resumed = run_train(SMOKE, [f"run_dir={tmp_path / 'resumed'}", "train.epochs=3", "train.resume=latest", *common])
    assert strip(resumed) == strip(full)


# ---------------------------------------------------------------------------------------------- GARDO

def test_win_rates_count_ties_as_half():
    rates = win_rates(torch.tensor([1.0, 1.0, 0.0, 5.0, float("nan")]), torch.tensor([0, 0, 0, 1, 1]))
    torch.testing.assert_close(rates[:4], torch.tensor([0.75, 0.75, 0.0, 0.5], dtype=torch.float64))
    assert math.isnan(rates[4])


def test_gardo_gate_picks_the_samples_the_proxy_overrates():
    # One group: the proxy ranks 0 > 1 > 2 > 3, the auxiliary the reverse; a second group where they agree.
    proxy = torch.tensor([4.0, 3.0, 2.0, 1.0, 1.0, 2.0, 3.0, 4.0])
    auxiliary = {"aux": torch.tensor([1.0, 2.0, 3.0, 4.0, 1.0, 2.0, 3.0, 4.0])}
    groups = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    scores = uncertainty(proxy, auxiliary, groups)
    # win-rates 1, 2/3, 1/3, 0 against 0, 1/3, 2/3, 1; the agreeing group scores 0 throughout.
    torch.testing.assert_close(scores, torch.tensor([1, 1 / 3, -1 / 3, -1, 0, 0, 0, 0], dtype=torch.float64))
    assert gated_rows(scores, 0.125).tolist() == [True] + [False] * 7
    assert gated_rows(scores, 0.25).tolist() == [True, True] + [False] * 6
    assert gated_rows(scores, 1.0).all()
    with pytest.raises(ValueError, match="auxiliary reward"):
        uncertainty(proxy, {}, groups)


def test_diversity_weighting_scales_positive_advantages_by_nearest_neighbour_distance_only():
    features = torch.tensor([[1.0, 0.0], [2.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    groups = torch.tensor([0, 0, 0, 1])
    distances = nearest_neighbour_distances(features, groups)
    torch.testing.assert_close(distances, torch.tensor([0.0, 0.0, 1.0, 0.0]))  # copies 0; alone 0
    advantages = torch.tensor([1.5, -1.0, 2.0, -0.5])
    weighted = diversity_weighted(advantages, distances)
    torch.testing.assert_close(weighted, torch.tensor([0.0, -1.0, 2.0, -0.5]))  # negatives untouched


GARDO_REWARDS = "rewards=[{name: brightness}, {name: 'tests.reward_fixtures:RedMinusBlue', weight: 0}]"


@pytest.mark.parametrize("overrides, message", [
    (["gardo.kl_fraction=0.1", "rewards=[{name: brightness}]"], "there are none: add a reward with weight 0"),
    (["gardo.kl_fraction=0.1", GARDO_REWARDS, "train.beta=0"], "train.beta's KL, which is 0"),
    (["gardo.diversity=true", "recipe=nft"], "a recipe grpo option; recipe nft has no such key"),
    (["gardo.auxiliary=[clip]", GARDO_REWARDS], r"\['clip'\] are not reward keys"),
])
def test_gardo_config_errors_name_the_keys(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(Config, SMOKE, overrides)


@pytest.mark.parametrize("key", ["gardo", "guard"])
def test_an_unknown_feature_space_is_one_line_naming_the_key(key):
    from flowrl.recipes.names import check_names

    with pytest.raises(ConfigError, match=f"config key '{key}.features': unknown feature space 'resnet'"):
        check_names(load_config(Config, SMOKE, [f"{key}.features=resnet"]))


@pytest.mark.parametrize("name, kwargs, message", [
    ("dino", {}, "bad gardo.feature_kwargs .*path"),
    ("no_such_module:Features", {}, "cannot be imported"),
    ("resnet", {}, "unknown gardo.features"),
])
def test_a_missing_gardo_feature_extractor_is_a_one_line_error(name, kwargs, message):
    with pytest.raises(ValueError, match=message):
        build_features(name, kwargs)


def test_gardo_and_the_guard_read_the_one_feature_network_registry():
    """A feature-space name is a network of flowrl.features, the same one eval.features builds: GARDO's "pixels" is
    PixelFeatures itself, and the toy world's conv net is a feature space the config accepts."""
    from flowrl.features import PixelFeatures, ToyFeatures
    from flowrl.recipes.names import check_names

    images, latents = torch.rand(5, 3, 32, 32), torch.randn(5, 4, 16, 16)
    torch.testing.assert_close(build_features("pixels", {})(images, latents), PixelFeatures()(images), rtol=0, atol=0)
    torch.testing.assert_close(build_features("toy", {"num_features": 8})(images, latents),
                               ToyFeatures(num_features=8)(images), rtol=0, atol=0)
    torch.testing.assert_close(build_features("latent", {})(images, latents), latents.flatten(1), rtol=0, atol=0)
    check_names(load_config(Config, SMOKE, ["gardo.features=toy", "guard.features=dino"]))


def test_gardo_trains_with_gate_and_diversity(tmp_path):
    common = ["train.epochs=2", GARDO_REWARDS, "gardo.diversity=true", "gardo.features=pixels", "log.progress=false",
              "log.eval_every=0", "log.report_prompts=0", "train.export_lora=false", "train.learning_rate=1e-2"]
    gated = run_train(SMOKE, [f"run_dir={tmp_path / 'gated'}", "gardo.kl_fraction=0.25", *common])
    assert math.isfinite(gated["loss/total"])
    assert gated["gardo/kl_gated_fraction"] == pytest.approx(0.25)  # 8 rows: 2 gated
    assert 0 < gated["gardo/nn_distance_mean"] <= 2
    # Epoch 0 starts at the reference (zero KL, zero KL gradient), so both runs sample the same epoch 1;
    # there the gate leaves the KL on a quarter of the rows only.
    full = run_train(SMOKE, [f"run_dir={tmp_path / 'full'}", *common])
    assert 0 < gated["loss/kl"] < 0.9 * full["loss/kl"]
    assert gated["reward/brightness_mean"] == full["reward/brightness_mean"]


def test_sub_scores_of_one_reward_train_as_separate_rewards_from_one_instance():
    from flowrl.rewards_api import build_rewards

    cfg = load_config(Config, SMOKE, ["rewards=[{name: toyeval, key: toyeval/count}, {name: toyeval, key: "
                                      "toyeval/color, weight: 0.5}]"])
    rewards, weights = build_rewards(cfg.rewards, None)
    assert len(rewards) == 1 and weights == {"toyeval/count": 1.0, "toyeval/color": 0.5}
    with pytest.raises(ConfigError, match="may appear once"):
        load_config(Config, SMOKE, ["rewards=[{name: toyeval}, {name: toyeval}]"])


def test_gardo_adaptive_reference_moves_to_the_policy_and_resumes_exactly(tmp_path):
    common = ["log.progress=false", "log.eval_every=0", "log.report_prompts=0", "train.export_lora=false",
              "train.learning_rate=1e-2", "train.checkpoint_every=1"]
    plain = run_train(SMOKE, [f"run_dir={tmp_path / 'plain'}", "train.epochs=2", *common])
    reset = run_train(SMOKE, [f"run_dir={tmp_path / 'reset'}", "train.epochs=2", "gardo.reset_every=1", *common])
    # One optimizer step per epoch: after epoch 0's reset the reference is the weights epoch 1 trains from,
    # so its KL is zero to rounding, where the base-model reference's is not.
    assert plain["loss/kl"] > 1e-6 and reset["loss/kl"] < 1e-9 * plain["loss/kl"] + 1e-12
    assert reset["gardo/reference_resets"] == 2
    kl_reset = run_train(SMOKE, [f"run_dir={tmp_path / 'kl'}", "train.epochs=2", "gardo.reset_kl=1e-30", *common])
    assert kl_reset["gardo/reference_resets"] == 1  # epoch 0 starts at the reference (KL 0); epoch 1 exceeds
    strip = lambda m: {k: v for k, v in m.items() if not k.startswith("perf/")}  # noqa: E731
    schedule = ["gardo.reset_every=2", "train.optimizer_steps_per_epoch=2", *common]
    full = run_train(SMOKE, [f"run_dir={tmp_path / 'full'}", "train.epochs=4", *schedule])
    run_train(SMOKE, [f"run_dir={tmp_path / 'resumed'}", "train.epochs=3", *schedule])
    resumed = run_train(SMOKE, [f"run_dir={tmp_path / 'resumed'}", "train.epochs=4", "train.resume=latest", *schedule])
    assert strip(resumed) == strip(full) and full["gardo/reference_resets"] == 2


# ------------------------------------------------------------------------------------------------ HRF

def test_hrf_anchor_holds_the_weights_to_the_phase_start_and_resumes_exactly(tmp_path):
    from safetensors.torch import load_file

    common = ["log.progress=false", "log.eval_every=0", "log.report_prompts=0", "train.learning_rate=1e-2",
              "train.checkpoint_every=1", "train.ema=false"]

    def moved(run_dir):  # how far the trained LoRA is from its initial (B = 0) weights
        weights = load_file(run_dir / "checkpoints" / "step_000002" / "lora.safetensors")
        return sum(float((w ** 2).sum()) for k, w in weights.items() if "lora_B" in k) ** 0.5

    run_train(SMOKE, [f"run_dir={tmp_path / 'free'}", "train.epochs=3", *common])
    held = run_train(SMOKE, [f"run_dir={tmp_path / 'held'}", "train.epochs=3", "hrf.anchor_weight=1e4",
                             "hrf.phase_epochs=100", *common])
    assert moved(tmp_path / "held") < 0.5 * moved(tmp_path / "free")
    assert held["hrf/anchor_distance"] > 0  # one phase: the anchor stays at the initial weights
    phases = run_train(SMOKE, [f"run_dir={tmp_path / 'phases'}", "train.epochs=3", "hrf.anchor_weight=1.0",
                               "hrf.phase_epochs=1", *common])
    assert phases["hrf/anchor_distance"] < 1e-6  # each epoch starts a phase: the anchor is the weights
    strip = lambda m: {k: v for k, v in m.items() if not k.startswith("perf/")}  # noqa: E731
    hrf = ["hrf.anchor_weight=10.0", "hrf.phase_epochs=2", *common]
    full = run_train(SMOKE, [f"run_dir={tmp_path / 'full'}", "train.epochs=4", *hrf])
    run_train(SMOKE, [f"run_dir={tmp_path / 'resumed'}", "train.epochs=3", *hrf])
    resumed = run_train(SMOKE, [f"run_dir={tmp_path / 'resumed'}", "train.epochs=4", "train.resume=latest", *hrf])
    assert strip(resumed) == strip(full)


def test_hrf_anchor_needs_phases():
    with pytest.raises(ConfigError, match="hrf.anchor_weight needs phases"):
        load_config(Config, SMOKE, ["hrf.anchor_weight=1.0"])
    assert load_config(Config, SMOKE, ["hrf.anchor_weight=1.0", "sampling.window.size=2",
                                       "sampling.window.mode=sliding"]).hrf.phase_length is not None
