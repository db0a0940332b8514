"""GRPO's KL regulariser is Flow-GRPO's, held to its formula computed by hand in plain float math.

Flow-GRPO (scripts/train_sd3.py) uses ``||mu - mu_ref||^2 / (2 std_dev_t^2)``, mean over non-batch
dims, where its step function returns ``std_dev_t = a * sqrt(sigma / (1 - sigma))`` for SDE steps
(no ``sqrt(-dt)``; the denominator at sigma = 1 is evaluated at the next sigma) and the step std
``sigma_next * sin(a * pi / 2)`` for CPS steps.
"""

import math

import pytest
import torch

from flowrl.algorithms.losses import gaussian_mean_kl
from flowrl.sampling import sde_step, transition
from flowrl.sampling.steps import kl_std

A = 0.7
# Two rows of 1x2x2 latents: row 0 an interior step, row 1 the first step from sigma = 1 (the guard).
SIGMA = [0.6, 1.0]
SIGMA_NEXT = [0.4, 0.8]
X = [[0.5, -1.0, 0.25, 2.0], [1.0, 0.0, -0.5, 0.3]]
V = [[1.0, 0.5, -0.5, 0.0], [0.2, -0.4, 1.5, 0.1]]
V_REF = [[0.8, 0.5, -0.2, 0.4], [0.0, -0.4, 1.0, 0.6]]


def _tensor(rows):
    return torch.tensor(rows, dtype=torch.float64).reshape(len(rows), 1, 2, 2)


def _hand_sde_kl(row):
    s, s_next = SIGMA[row], SIGMA_NEXT[row]
    dt = s_next - s
    denominator = s_next if s == 1 else s  # Flow-GRPO's guard at sigma = 1
    std_t = A * math.sqrt(s / (1 - denominator))

    def mu(x, v):
        return x + (v + std_t**2 / (2 * s) * (x + (1 - s) * v)) * dt

    squared = [(mu(x, v) - mu(x, v_ref)) ** 2 for x, v, v_ref in zip(X[row], V[row], V_REF[row])]
    return sum(squared) / len(squared) / (2 * std_t**2), dt


def _hand_cps_kl(row):
    s, s_next = SIGMA[row], SIGMA_NEXT[row]
    std = s_next * math.sin(A * math.pi / 2)

    def mu(x, v):
        return (1 - s_next) * (x - s * v) + math.sqrt(s_next**2 - std**2) * (x + (1 - s) * v)

    squared = [(mu(x, v) - mu(x, v_ref)) ** 2 for x, v, v_ref in zip(X[row], V[row], V_REF[row])]
    return sum(squared) / len(squared) / (2 * std**2)


def _flowrl_kl(kind):
    x, v, v_ref = _tensor(X), _tensor(V), _tensor(V_REF)
    sigma, sigma_next = torch.tensor(SIGMA, dtype=torch.float64), torch.tensor(SIGMA_NEXT, dtype=torch.float64)
    step = sde_step(v, x, sigma, sigma_next, noise_level=A, kind=kind, prev_sample=x)
    ref_mean, _ = transition(v_ref, x, sigma, sigma_next, noise_level=A, kind=kind)
    new = gaussian_mean_kl(step.mean, ref_mean, kl_std(x, sigma, sigma_next, noise_level=A, kind=kind))
    old = gaussian_mean_kl(step.mean, ref_mean, step.std)  # the former full-transition-variance form
    return new, old, step


def test_sde_kl_is_flow_grpo_formula_by_hand_including_sigma_one_guard():
    new, old, _ = _flowrl_kl("sde")
    for row in range(2):
        expected, dt = _hand_sde_kl(row)
        assert expected > 0
        assert new[row].item() == pytest.approx(expected, rel=1e-12)
        # Dividing by the transition variance (std_t^2 |dt|), as flowrl did before, gave a KL 1/|dt| larger.
        assert (old[row] / new[row]).item() == pytest.approx(1 / abs(dt), rel=1e-12)


def test_cps_kl_divides_by_the_step_std_like_flow_grpo():
    new, old, _ = _flowrl_kl("cps")
    for row in range(2):
        assert new[row].item() == pytest.approx(_hand_cps_kl(row), rel=1e-12)
    torch.testing.assert_close(new, old, rtol=0, atol=0)  # for CPS the KL scale is the step std


def test_kl_std_leaves_the_step_std_contract_alone():
    x = _tensor(X)
    sigma, sigma_next = torch.tensor(SIGMA, dtype=torch.float64), torch.tensor(SIGMA_NEXT, dtype=torch.float64)
    _, _, step = _flowrl_kl("sde")
    scale = kl_std(x, sigma, sigma_next, noise_level=A, kind="sde")
    assert scale.shape == step.std.shape == (2, 1, 1, 1)
    expected_std_t = [A * math.sqrt(0.6 / 0.4), A * math.sqrt(1.0 / (1 - 0.8))]
    assert scale.flatten().tolist() == pytest.approx(expected_std_t, rel=1e-12)
    # StepOutput.std still includes sqrt(-dt).
    assert step.std.flatten().tolist() == pytest.approx(
        [expected_std_t[0] * math.sqrt(0.2), expected_std_t[1] * math.sqrt(0.2)], rel=1e-12)
    assert torch.all(kl_std(x, 0.6, 0.4, noise_level=A, kind="ode") == 0)
    assert kl_std(x.float(), 0.6, 0.4, noise_level=A, kind="sde").dtype == torch.float32
    with pytest.raises(ValueError):
        kl_std(x, 0.6, 0.4, noise_level=A, kind="euler")
