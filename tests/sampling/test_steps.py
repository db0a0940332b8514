"""The step math of flowrl.sampling.steps, held to hand-computed numbers and to torch.distributions."""

import math

import pytest
import torch

from flowrl.sampling import gaussian_log_prob, sde_step
from flowrl.core.seeding import generators


def _inputs(batch=3, shape=(4, 8, 8), seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, *shape, generator=g).to(dtype)
    v = torch.randn(batch, *shape, generator=g).to(dtype)
    return x, v


def test_sde_with_zero_noise_is_the_euler_step():
    x, v = _inputs()
    out = sde_step(v, x, 0.8, 0.6, noise_level=0.0, kind="sde", generator=torch.Generator().manual_seed(1))
    euler = x + (0.6 - 0.8) * v
    torch.testing.assert_close(out.prev_sample, euler, rtol=0, atol=1e-6)
    torch.testing.assert_close(out.mean, euler, rtol=0, atol=1e-6)
    assert torch.all(out.std == 0) and torch.all(out.log_prob == 0)


def test_cps_with_zero_noise_is_the_euler_step():
    x, v = _inputs()
    out = sde_step(v, x, 0.8, 0.6, noise_level=0.0, kind="cps")
    torch.testing.assert_close(out.prev_sample, x + (0.6 - 0.8) * v, rtol=0, atol=1e-6)


def test_ode_kind_matches_euler_and_ignores_noise_level():
    x, v = _inputs()
    out = sde_step(v, x, torch.tensor([0.9, 0.5, 0.3]), torch.tensor([0.7, 0.4, 0.0]), noise_level=0.9, kind="ode")
    dt = torch.tensor([-0.2, -0.1, -0.3]).view(3, 1, 1, 1)
    torch.testing.assert_close(out.prev_sample, x + dt * v, rtol=0, atol=1e-6)


def test_sde_hand_computed_scalar_case():
    # x=1, v=0.5, sigma=0.5, sigma'=0.25, a=0.7:
    # std_t = 0.7 * sqrt(0.5 / 0.5) = 0.7; dt = -0.25
    # mean = 1 + (0.5 + 0.49 / (2 * 0.5) * (1 + 0.5 * 0.5)) * -0.25 = 1 - 0.278125 = 0.721875
    # std = 0.7 * sqrt(0.25) = 0.35; log N(0.8; 0.721875, 0.35^2)
    x = torch.ones(1, 1)
    v = torch.full((1, 1), 0.5)
    prev = torch.full((1, 1), 0.8)
    out = sde_step(v, x, 0.5, 0.25, noise_level=0.7, kind="sde", prev_sample=prev)
    assert out.mean.item() == pytest.approx(0.721875, abs=1e-6)
    assert out.std.item() == pytest.approx(0.35, abs=1e-7)
    expected = -((0.8 - 0.721875) ** 2) / (2 * 0.35**2) - math.log(0.35) - 0.5 * math.log(2 * math.pi)
    assert out.log_prob.item() == pytest.approx(expected, abs=1e-6)


def test_cps_hand_computed_scalar_case():
    # x=1, v=0.5, sigma=0.5, sigma'=0.25, a=0.5: std = 0.25 * sin(pi/4)
    # x0_hat = 1 - 0.25 = 0.75, x1_hat = 1 + 0.25 = 1.25
    # mean = 0.75 * 0.75 + sqrt(0.0625 - std^2) * 1.25
    std = 0.25 * math.sin(math.pi / 4)
    mean = 0.75 * 0.75 + math.sqrt(0.0625 - std**2) * 1.25
    out = sde_step(torch.full((1, 1), 0.5), torch.ones(1, 1), 0.5, 0.25, noise_level=0.5, kind="cps",
                   prev_sample=torch.full((1, 1), 0.9))
    assert out.mean.item() == pytest.approx(mean, abs=1e-6)
    assert out.std.item() == pytest.approx(std, abs=1e-7)
    expected = torch.distributions.Normal(mean, std).log_prob(torch.tensor(0.9)).item()
    assert out.log_prob.item() == pytest.approx(expected, abs=1e-5)


@pytest.mark.parametrize("kind", ["sde", "cps", "dance"])
def test_log_prob_agrees_with_torch_distributions(kind):
    x, v = _inputs(batch=2, shape=(3, 5))
    out = sde_step(v, x, 0.7, 0.55, noise_level=0.8, kind=kind, generator=torch.Generator().manual_seed(3))
    reference = torch.distributions.Normal(out.mean, out.std.expand_as(out.mean)).log_prob(out.prev_sample)
    torch.testing.assert_close(out.log_prob, reference.mean(dim=(1, 2)), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["sde", "cps", "dance"])
def test_draws_follow_the_stated_mean_and_std(kind):
    x, v = _inputs(batch=2, shape=(64, 64, 16))  # 65k draws per row
    out = sde_step(v, x, 0.6, 0.45, noise_level=0.7, kind=kind, generator=torch.Generator().manual_seed(4))
    z = (out.prev_sample - out.mean) / out.std  # must be standard normal
    assert abs(z.mean().item()) < 0.01
    assert abs(z.var().item() - 1) < 0.02


@pytest.mark.parametrize("kind", ["sde", "cps", "dance"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_recomputed_log_prob_equals_recorded(kind, dtype):
    x, v = _inputs(dtype=dtype)
    first = sde_step(v, x, 0.9, 0.8, noise_level=0.7, kind=kind, generator=generators([1, 2, 3]))
    assert first.prev_sample.dtype == dtype
    again = sde_step(v, x, 0.9, 0.8, noise_level=0.7, kind=kind, prev_sample=first.prev_sample)
    assert torch.equal(first.log_prob, again.log_prob)
    assert first.log_prob.dtype == torch.float32


def test_sigma_one_is_guarded_like_flow_grpo():
    x, v = _inputs()
    out = sde_step(v, x, 1.0, 0.9, noise_level=0.7, kind="sde", generator=torch.Generator().manual_seed(0))
    # denominator uses sigma_next at sigma = 1: std_t = 0.7 * sqrt(1 / (1 - 0.9))
    assert out.std.flatten()[0].item() == pytest.approx(0.7 * math.sqrt(1 / 0.1) * math.sqrt(0.1), rel=1e-6)
    assert torch.isfinite(out.prev_sample).all() and torch.isfinite(out.log_prob).all()


def test_per_row_generators_make_rows_independent_of_the_batch():
    x, v = _inputs(batch=3)
    full = sde_step(v, x, 0.7, 0.6, noise_level=0.7, generator=generators([10, 11, 12]))
    alone = sde_step(v[1:2], x[1:2], 0.7, 0.6, noise_level=0.7, generator=generators([11]))
    assert torch.equal(full.prev_sample[1:2], alone.prev_sample)


def test_float64_inputs_are_computed_in_float64():
    x, v = _inputs(dtype=torch.float64)
    out = sde_step(v, x, 0.7, 0.6, noise_level=0.7, generator=torch.Generator().manual_seed(0))
    assert out.mean.dtype == torch.float64 and out.prev_sample.dtype == torch.float64


def test_gaussian_log_prob_is_zero_for_point_masses():
    sample = torch.randn(2, 3)
    assert torch.equal(gaussian_log_prob(sample, sample, torch.zeros(2, 1)), torch.zeros(2))


def test_unknown_kind_is_rejected():
    x, v = _inputs()
    with pytest.raises(ValueError, match="unknown step kind"):
        sde_step(v, x, 0.5, 0.4, noise_level=0.7, kind="euler")
