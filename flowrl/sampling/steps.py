"""One reverse step of a flow-matching sampler, with its exact Gaussian log-density.

Convention (rectified flow): ``x_sigma = (1 - sigma) * x0 + sigma * eps`` and the model
predicts ``v ~= eps - x0``; sampling walks sigma from 1 down to 0, so ``dt = sigma_next - sigma``
is negative.

Three kinds of step share one signature so the rollout can mix them freely:

- ``"ode"``: the Euler step ``x' = x + dt * v``. Deterministic.
- ``"sde"``: Flow-GRPO's reverse SDE. ``std_t = a * sqrt(sigma / (1 - sigma))`` and
  ``mu = x + [v + std_t^2 / (2 sigma) * (x + (1 - sigma) v)] * dt``,
  ``x' = mu + std_t * sqrt(-dt) * eps``. At sigma = 1 the ratio blows up; like Flow-GRPO we
  evaluate the denominator at the next sigma of the schedule (``sigma_next``).
- ``"cps"``: coefficient-preserving sampling. ``std = sigma_next * sin(a * pi / 2)``,
  ``mu = (1 - sigma_next) * x0_hat + sqrt(sigma_next^2 - std^2) * x1_hat`` with
  ``x0_hat = x - sigma v`` and ``x1_hat = x + (1 - sigma) v``.

The log-probability is the exact Gaussian log-density of ``prev_sample``, averaged over the
non-batch dimensions (Flow-GRPO's convention, which keeps PPO clip ranges meaningful). Unlike
Flow-GRPO's CPS variant we keep the normalising constants, so ``log_prob`` is a true density for
every kind. A deterministic step (ODE, ``noise_level=0`` or ``sigma_next=0`` under CPS) has no
density; its ``log_prob`` is defined as 0.

All arithmetic runs in float32 (or float64 if the inputs are float64) whatever the model dtype;
``prev_sample`` is returned in the input dtype, and its log-prob is evaluated on that rounded
value, so recomputing the log-prob from a stored sample reproduces the recorded one exactly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, Sequence

import torch
from diffusers.utils.torch_utils import randn_tensor

StepKind = Literal["sde", "cps", "ode"]
STEP_KINDS: tuple[str, ...] = ("sde", "cps", "ode")
_LOG_SQRT_2PI = 0.5 * math.log(2 * math.pi)


@dataclass
class StepOutput:
    prev_sample: torch.Tensor  # [B, ...] input dtype
    log_prob: torch.Tensor  # [B] float32, mean over non-batch dims
    mean: torch.Tensor  # [B, ...] float32, mean of the Gaussian transition
    std: torch.Tensor  # [B, 1, ...] float32, std of the transition, sqrt(-dt) included


def _as_batch_column(value, like: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Turn a float or a [B] tensor into a [B, 1, 1, ...] tensor that broadcasts against ``like``."""
    t = torch.as_tensor(value, dtype=dtype, device=like.device)
    if t.ndim == 0:
        t = t.expand(like.shape[0])
    return t.reshape(-1, *([1] * (like.ndim - 1)))


def gaussian_log_prob(sample: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """Exact log N(sample; mean, std^2), averaged over non-batch dims -> [B]. Zero where std == 0."""
    deterministic = std == 0
    safe_std = torch.where(deterministic, torch.ones_like(std), std)
    log_density = -((sample - mean) ** 2) / (2 * safe_std**2) - torch.log(safe_std) - _LOG_SQRT_2PI
    log_density = torch.where(deterministic, torch.zeros_like(log_density), log_density)
    return log_density.mean(dim=tuple(range(1, sample.ndim)))


def transition(velocity, sample, sigma, sigma_next, *, noise_level: float, kind: StepKind):
    """Mean [B, ...] and std [B, 1, ...] of the Gaussian step x -> x', in compute precision."""
    if kind not in STEP_KINDS:
        raise ValueError(f"unknown step kind {kind!r}; choose one of {STEP_KINDS}")
    dtype = torch.promote_types(sample.dtype, torch.float32)
    x = sample.to(dtype)
    v = velocity.to(dtype)
    s = _as_batch_column(sigma, x, dtype)
    s_next = _as_batch_column(sigma_next, x, dtype)
    dt = s_next - s
    if kind == "ode":
        return x + dt * v, torch.zeros_like(s)
    if kind == "sde":
        denominator_sigma = torch.where(s == 1, s_next, s)  # Flow-GRPO's guard at sigma = 1
        std_t = noise_level * torch.sqrt(s / (1 - denominator_sigma))
        mean = x + (v + std_t**2 / (2 * s) * (x + (1 - s) * v)) * dt
        return mean, std_t * torch.sqrt(-dt)
    # cps
    std = s_next * math.sin(noise_level * math.pi / 2)
    x0_hat = x - s * v
    x1_hat = x + (1 - s) * v
    mean = (1 - s_next) * x0_hat + torch.sqrt(torch.clamp(s_next**2 - std**2, min=0)) * x1_hat
    return mean, std


def sde_step(
    velocity: torch.Tensor,
    sample: torch.Tensor,
    sigma,
    sigma_next,
    *,
    noise_level: float,
    kind: StepKind = "sde",
    prev_sample: torch.Tensor | None = None,
    generator: torch.Generator | Sequence[torch.Generator] | None = None,
) -> StepOutput:
    """Take one step (or, given ``prev_sample``, score it) and return its exact log-density.

    ``velocity`` and ``sample`` are [B, ...]; ``sigma``/``sigma_next`` are floats or [B] tensors.
    ``generator`` may be one generator or one per batch row (per-sample determinism).
    """
    mean, std = transition(velocity, sample, sigma, sigma_next, noise_level=noise_level, kind=kind)
    if prev_sample is None:
        noise = randn_tensor(mean.shape, generator=generator, device=mean.device, dtype=mean.dtype)
        prev_sample = (mean + std * noise).to(sample.dtype)
    log_prob = gaussian_log_prob(prev_sample.to(mean.dtype), mean, std)
    return StepOutput(prev_sample=prev_sample, log_prob=log_prob, mean=mean, std=std)
