"""GRPO-Guard (``train.ratio_norm: grpo_guard``) held to its authors' code: yifan123/flow_grpo,
scripts/train_sd3_GRPO_Guard.py at commit 9745241 (the merge of pull request #175).

The reference, for one denoising step j of a batch (all rows at the same step), written out:

    std_dev_t = noise_level * sqrt(sigma / (1 - (sigma_max if sigma == 1 else sigma)))   # sigma_max: 2nd sigma
    sqrt_dt   = sqrt(-(sigma_next - sigma))
    mean      = x * (1 + std_dev_t^2 / (2 sigma) * dt) + v * (1 + std_dev_t^2 (1 - sigma) / (2 sigma)) * dt
    log_prob  = mean_d[ -(x' - mean)^2 / (2 (std_dev_t sqrt_dt)^2) - log(std_dev_t sqrt_dt) - log sqrt(2 pi) ]
    bias      = mean_d[ (mean - old_mean)^2 ] / (2 (sqrt_dt std_dev_t)^2)
    ratio     = exp((log_prob - old_log_prob + bias) * (sqrt_dt std_dev_t))
    loss      = mean_B[ max(-A ratio, -A clip(ratio, 1 - eps, 1 + eps)) ] / sqrt_dt^2   (+ beta KL, not divided)

The numpy functions below are that text, evaluated in float64 independently of flowrl's code.
"""

import math
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
from functools import partial

import pytest
import torch

from flowrl.algorithms.losses import grpo_clip_loss
from flowrl.algorithms.ratio_norm import grpo_guard_log_ratio, grpo_guard_loss_scale
from flowrl.config import Config, ConfigError, load_config
from flowrl.models import build_policy
from flowrl.training.stats import StatsAccumulator
from flowrl.recipes.build import make_accelerator
from flowrl.algorithms.transition import TransitionSettings, transition_loss
from flowrl.sampling import RolloutSettings, rollout, sde_step

A = 0.7  # noise_level
SIGMAS = [1.0, 0.8, 0.5]  # two steps; the first sits at sigma = 1, where the reference's guard applies


def reference_std_dev_t(sigma, sigma_max):
    return A * math.sqrt(sigma / (1 - (sigma_max if sigma == 1 else sigma)))


def reference_mean(x, v, sigma, sigma_next, sigma_max):
    dt = sigma_next - sigma
    std = reference_std_dev_t(sigma, sigma_max)
    return x * (1 + std**2 / (2 * sigma) * dt) + v * (1 + std**2 * (1 - sigma) / (2 * sigma)) * dt


def reference_log_prob(x_next, mean, sigma, sigma_next, sigma_max):
    s = reference_std_dev_t(sigma, sigma_max) * math.sqrt(-(sigma_next - sigma))
    return (-((x_next - mean) ** 2) / (2 * s**2) - math.log(s) - math.log(math.sqrt(2 * math.pi))).mean(axis=(1, 2, 3))


def reference_guard_log_ratio(x, x_next, v, v_old, sigma, sigma_next, sigma_max):
    """log(ratio) of the reference's rationorm branch, per sample: [B]."""
    mean = reference_mean(x, v, sigma, sigma_next, sigma_max)
    old_mean = reference_mean(x, v_old, sigma, sigma_next, sigma_max)
    std_dev_t, sqrt_dt = reference_std_dev_t(sigma, sigma_max), math.sqrt(sigma - sigma_next)
    log_prob = reference_log_prob(x_next, mean, sigma, sigma_next, sigma_max)
    old_log_prob = reference_log_prob(x_next, old_mean, sigma, sigma_next, sigma_max)
    bias = ((mean - old_mean) ** 2).mean(axis=(1, 2, 3)) / (2 * (sqrt_dt * std_dev_t) ** 2)
    return (log_prob - old_log_prob + bias) * (sqrt_dt * std_dev_t)


def three_by_two_batch():
    """3 samples [3, 2, 2, 2] through 2 SDE steps: states, velocities of the sampling ("old") policy and of a
    moved one, and the sampled next states, float64. The next states are drawn by flowrl's SDE step
    from the old velocity, as the rollout does."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 2, 2, 2, generator=g, dtype=torch.float64)
    states, old_v, new_v, noise = [x], [], [], []
    for k in range(2):
        v_old = torch.randn(x.shape, generator=g, dtype=torch.float64)
        eps = torch.randn(x.shape, generator=g, dtype=torch.float64)
        out = sde_step(v_old, x, SIGMAS[k], SIGMAS[k + 1], noise_level=A)
        x = out.mean + out.std * eps
        states.append(x)
        old_v.append(v_old)
        new_v.append(v_old + 0.05 * torch.randn(x.shape, generator=g, dtype=torch.float64))
        noise.append(eps)
    return states, old_v, new_v, noise


def flowrl_guard_log_ratio(states, old_v, new_v, k, *, requires_grad=False):
    """What the grpo recipe computes: the rollout's stored mean, the trained step's mean and std."""
    old = sde_step(old_v[k], states[k], SIGMAS[k], SIGMAS[k + 1], noise_level=A, prev_sample=states[k + 1])
    v = new_v[k].clone().requires_grad_(requires_grad)
    new = sde_step(v, states[k], SIGMAS[k], SIGMAS[k + 1], noise_level=A, prev_sample=states[k + 1])
    return grpo_guard_log_ratio(new.mean, old.mean, states[k + 1], new.std), v, new, old


def test_guard_log_ratio_matches_the_reference_formula_on_a_three_sample_two_step_batch():
    states, old_v, new_v, _ = three_by_two_batch()
    for k in range(2):
        ours, *_ = flowrl_guard_log_ratio(states, old_v, new_v, k)
        expected = reference_guard_log_ratio(*(t.numpy() for t in (states[k], states[k + 1], new_v[k], old_v[k])),
                                             SIGMAS[k], SIGMAS[k + 1], sigma_max=SIGMAS[1])
        assert ours.tolist() == pytest.approx(expected.tolist(), rel=1e-9, abs=1e-13)
        assert np.abs(expected).max() > 1e-3  # the batch moved: the numbers are not all zero


def test_guard_log_ratio_is_mean_noise_times_mean_shift_and_the_plain_one_is_biased_below():
    # With x' = mu_old + s eps exactly (float64), s (dlogp + |dmu|^2 / (2 s^2)) = mean(eps * dmu).
    states, old_v, new_v, noise = three_by_two_batch()
    for k in range(2):
        ours, _, new, old = flowrl_guard_log_ratio(states, old_v, new_v, k)
        shift = new.mean - old.mean  # [3, 2, 2, 2] dmu
        torch.testing.assert_close(ours, (noise[k] * shift).mean(dim=(1, 2, 3)), rtol=1e-10, atol=1e-14)
        s = float(new.std.flatten()[0])
        plain = s * (new.log_prob - old.log_prob)  # the plain log-ratio in the same units
        bias = (shift**2).mean(dim=(1, 2, 3)) / (2 * s)
        torch.testing.assert_close(plain, ours - bias, rtol=1e-9, atol=1e-14)
        assert (bias > 0).all()


def test_the_bias_is_removed_from_the_gradient_per_sample():
    # d log_rho / d v = mean_d(eps * d mu / d v): no -(mu_theta - mu_old) restoring term, so it is the same
    # wherever the trained velocity sits; the plain log-ratio's gradient carries that term.
    states, old_v, new_v, noise = three_by_two_batch()
    k, sigma, sigma_next = 1, SIGMAS[1], SIGMAS[2]
    std_t = reference_std_dev_t(sigma, SIGMAS[1])
    slope = (1 + std_t**2 * (1 - sigma) / (2 * sigma)) * (sigma_next - sigma)  # d mu / d v of the reference's mean
    dims = noise[k][0].numel()
    gradients = []
    for moved in (new_v, [v + 0.3 for v in new_v]):
        ours, v, new, old = flowrl_guard_log_ratio(states, old_v, moved, k, requires_grad=True)
        ours.sum().backward()
        torch.testing.assert_close(v.grad, noise[k] * slope / dims, rtol=1e-10, atol=1e-15)
        gradients.append(v.grad)
        plain_v = moved[k].clone().requires_grad_(True)
        plain = sde_step(plain_v, states[k], sigma, sigma_next, noise_level=A, prev_sample=states[k + 1]).log_prob
        (plain * new.std.flatten()).sum().backward()
        restoring = -(new.mean - old.mean).detach() * slope / (dims * float(new.std.flatten()[0]))
        torch.testing.assert_close(plain_v.grad, v.grad + restoring, rtol=1e-9, atol=1e-14)
    torch.testing.assert_close(gradients[0], gradients[1], rtol=0, atol=0)


def test_guard_loss_scale_is_one_over_dt_and_evens_the_steps_gradients():
    assert grpo_guard_loss_scale(0.8, 0.5) == pytest.approx(1 / 0.3, rel=1e-12)
    assert grpo_guard_loss_scale(1.0, 0.8) == pytest.approx(5.0, rel=1e-12)
    # Why |dt|: d mu / d v = (1 + std_t^2 (1 - sigma) / (2 sigma)) dt = (1 + a^2 / 2) dt below sigma = 1
    # (std_t^2 = a^2 sigma / (1 - sigma)), and dt at sigma = 1 (where 1 - sigma = 0). Over |dt| the log-ratio's
    # gradient in v is -eps (1 + a^2 / 2) / D on every step but the first, -eps / D there: whatever the step's
    # size or noise level.
    states, old_v, new_v, noise = three_by_two_batch()
    for k, weight in ((0, 1.0), (1, 1 + A**2 / 2)):
        ours, v, *_ = flowrl_guard_log_ratio(states, old_v, new_v, k, requires_grad=True)
        (ours * grpo_guard_loss_scale(SIGMAS[k], SIGMAS[k + 1])).sum().backward()
        torch.testing.assert_close(v.grad, -noise[k] * weight / noise[k][0].numel(), rtol=1e-10, atol=1e-15)


SMOKE = "configs/smoke/sd3_tiny.yaml"


@pytest.fixture(scope="module")
def moved_policy_and_rollout():
    """The tiny SD3 policy, a 3-row rollout that kept its means, then the LoRA moved off the sampling policy."""
    policy = build_policy("sd3", "tiny", seed=0)
    policy.add_lora(rank=4, alpha=8, init_seed=0)
    traj = rollout(policy, ["a red circle"],
                   RolloutSettings(num_steps=3, guidance_scale=4.5, noise_level=A, store_means=True), group_size=3,
                   seeds=[1, 2, 3])
    on_policy = []
    for k in range(traj.num_stored_steps):  # before the move: the stored means are the policy's own
        x, x_next = traj.latents[:, k], traj.latents[:, k + 1]
        with torch.no_grad():
            v = policy.velocity(x, float(traj.sigmas[k]), traj.cond.select(traj.prompt_ids), 4.5)
        step = sde_step(v, x, float(traj.sigmas[k]), float(traj.sigmas[k + 1]), noise_level=A, prev_sample=x_next)
        on_policy.append((step.mean, grpo_guard_log_ratio(step.mean, traj.means[:, k], x_next, step.std)))
    with torch.no_grad():
        for p in policy.trainable_parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    return policy, traj, on_policy


def test_the_rollout_keeps_each_stored_steps_mean(moved_policy_and_rollout):
    _, traj, on_policy = moved_policy_and_rollout
    assert traj.means.shape == traj.latents[:, 1:].shape and traj.means.dtype == torch.float32
    for k, (mean, log_ratio) in enumerate(on_policy):
        torch.testing.assert_close(traj.means[:, k], mean, rtol=0, atol=1e-6)
        assert log_ratio.abs().max() < 1e-9


def test_the_recipe_loss_is_the_references_per_step_loss_divided_by_dt_and_the_kl_is_not(moved_policy_and_rollout):
    policy, traj, _ = moved_policy_and_rollout
    accelerator = make_accelerator(load_config(Config, SMOKE, ["device=cpu"]))
    rows, k, clip = torch.arange(3), 1, 1e-3
    advantages = torch.tensor([[1.5], [-0.5], [2.0]]).expand(3, traj.num_stored_steps).clone()  # [N, K]
    mask = torch.ones(3, traj.num_stored_steps, dtype=torch.bool)

    def loss(ratio_norm, beta=0.0):
        settings = TransitionSettings(policy_loss=partial(grpo_clip_loss, clip_low=clip, clip_high=clip),
                                      guidance=4.5, kind="sde", beta=beta, ratio_norm=ratio_norm)
        return transition_loss(policy, traj, advantages, rows, k, mask, settings=settings, accelerator=accelerator,
                               noise_level=A, stats=StatsAccumulator(), on_policy=False).item()

    # The reference by hand: its log-ratio from the moved policy's velocity, PPO's max, over |dt|.
    sigma, sigma_next = float(traj.sigmas[k]), float(traj.sigmas[k + 1])
    x, x_next = traj.latents[:, k], traj.latents[:, k + 1]
    with torch.no_grad():
        v = policy.velocity(x, sigma, traj.cond.select(traj.prompt_ids), 4.5)
    mean = reference_mean(x.double().numpy(), v.double().numpy(), sigma, sigma_next, sigma_max=float(traj.sigmas[1]))
    old_mean = traj.means[:, k].double().numpy()
    s = reference_std_dev_t(sigma, float(traj.sigmas[1])) * math.sqrt(sigma - sigma_next)
    log_prob = reference_log_prob(x_next.double().numpy(), mean, sigma, sigma_next, float(traj.sigmas[1]))
    old_log_prob = reference_log_prob(x_next.double().numpy(), old_mean, sigma, sigma_next, float(traj.sigmas[1]))
    bias = ((mean - old_mean) ** 2).mean(axis=(1, 2, 3)) / (2 * s**2)
    ratio = np.exp((log_prob - old_log_prob + bias) * s)
    adv = advantages[:, k].double().numpy()
    per_row = np.maximum(-adv * ratio, -adv * np.clip(ratio, 1 - clip, 1 + clip)) / (sigma - sigma_next)
    outside = np.abs(ratio - 1) > clip
    assert outside.any() and not outside.all(), "the fixture must exercise both PPO branches"
    # float32 against float64: the log-ratios (~1e-3) are checked to ~1e-3 of their size
    assert loss("grpo_guard") == pytest.approx(per_row.sum(), rel=0, abs=2e-6)
    # The KL term is added as it is without the method: beta * KL, not divided by |dt|.
    kl_guard = loss("grpo_guard", beta=0.3) - loss("grpo_guard")
    kl_plain = loss("none", beta=0.3) - loss("none")
    # Each side is a difference of two float32 losses, so it carries their rounding (measured 2.4e-4 relative);
    # dividing by |dt| (about 0.1 here) would change it tenfold.
    assert kl_guard == pytest.approx(kl_plain, rel=1e-3) and kl_plain > 0


@pytest.mark.parametrize("value, method", [("true", "grpo_guard"), ("false", "none"), ("grpo_guard", "grpo_guard"),
                                           ("batch_sensitivity", "batch_sensitivity"), ("none", "none")])
def test_ratio_norm_accepts_the_old_bool(value, method):
    assert load_config(Config, SMOKE, [f"train.ratio_norm={value}"]).train.ratio_norm == method


def test_grpo_guard_refuses_cps_steps_with_one_line_naming_the_key():
    with pytest.raises(ConfigError) as error:
        load_config(Config, SMOKE, ["train.ratio_norm=grpo_guard", "sampling.kind=cps"])
    assert "\n" not in str(error.value) and "train.ratio_norm" in str(error.value)
    assert load_config(Config, SMOKE, ["train.ratio_norm=batch_sensitivity", "sampling.kind=cps"])


def test_the_sd35_preset_carries_the_references_hyperparameters():
    cfg = load_config(Config, "configs/sd35_medium/grpo_guard.yaml")
    t, s = cfg.train, cfg.sampling
    assert (t.ratio_norm, t.clip_range, t.learning_rate, t.std_scope, t.beta) == ("grpo_guard", 2e-6, 1e-4, "group", 0)
    assert (s.num_steps, s.noise_level, s.guidance_scale, s.group_size, s.kind) == (10, 0.7, 4.5, 24, "sde")
    toy = load_config(Config, "configs/toy/grpo_guard.yaml").train
    assert (toy.ratio_norm, toy.std_scope, toy.beta) == ("grpo_guard", "group", 0)


@pytest.mark.parametrize("overrides", [
    ["sampling.tree.branch_steps=[1]", "sampling.tree.branch_factor=2"],  # means copied to the children
    ["sampling.pilot.candidates=4", "sampling.pilot.group_size=2"],  # means of pilot and commit rows joined
])
def test_grpo_guard_trains_on_trees_and_pilot_commit_with_the_right_stored_means(tmp_path, overrides):
    from flowrl.recipes.grpo import train

    cfg = load_config(Config, SMOKE, [f"run_dir={tmp_path}", "train.epochs=1", "log.progress=false",
                                      "log.eval_every=0", "log.report_prompts=0", "train.ratio_norm=grpo_guard",
                                      *overrides])
    metrics = train(cfg)
    assert math.isfinite(metrics["loss/total"])
    # On the first, on-policy pass every row's stored mean is its own: the guard's log-ratio is 0.
    assert metrics["policy/onpolicy_ratio_maxdev"] < 1e-6
