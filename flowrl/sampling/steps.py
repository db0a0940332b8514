"""One reverse step of a flow-matching sampler, with its exact Gaussian log-density.

Convention (rectified flow): ``x_sigma = (1 - sigma) * x0 + sigma * eps`` and the model
predicts ``v ~= eps - x0``; sampling walks sigma from 1 down to 0, so ``dt = sigma_next - sigma``
is negative.

Four kinds of step share one signature so the rollout can mix them freely:

- ``"ode"``: the Euler step ``x' = x + dt * v``. Deterministic.
- ``"sde"``: Flow-GRPO's reverse SDE. ``std_t = a * sqrt(sigma / (1 - sigma))`` and
  ``mu = x + [v + std_t^2 / (2 sigma) * (x + (1 - sigma) v)] * dt``,
  ``x' = mu + std_t * sqrt(-dt) * eps``. At sigma = 1 the ratio blows up; like Flow-GRPO we
  evaluate the denominator at the next sigma of the schedule (``sigma_next``).
- ``"dance"``: DanceGRPO's reverse SDE, the sampler BranchGRPO's script runs (``flux_step_with_split`` in
  ``Fredreic1849/BranchGRPO`` ``fastvideo/train_branchgrpo_flux.py``): the same mean with a constant
  ``std_t = a`` (its ``eta``, 0.3 there), so ``x' = mu + a * sqrt(-dt) * eps``. Its noise does not grow
  near sigma = 1 as Flow-GRPO's does (there ``std_t`` is several times ``a``), which is what lets
  BranchGRPO draw 4x noise at its split steps.
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

:class:`ScheduleSteps` is :func:`sde_step` for a rollout that knows its whole sigma schedule: the
sigma-only arithmetic is done once for every step, with bit-identical results.

:func:`kl_std` is the std Flow-GRPO's KL regulariser divides by: ``std_t`` without ``sqrt(-dt)``
for ``"sde"``, the step std for ``"cps"`` (see its docstring).

:data:`ODE_SOLVERS` are the deterministic steps a rollout takes outside its SDE window (``sampling.ode_solver``):
Euler (the ``"ode"`` kind above), MixGRPO-Flash's ``mixgrpo_flash`` (Euler before and inside the window,
DPM-Solver++(2M) -- ``dpmsolver++``, order 2, midpoint form -- only after it, its history seeded with the window
steps' clean-latent predictions), or ``dpmpp_2m`` (DPM-Solver++(2M) on every deterministic step, before
the window too, restarting after it). Those steps are never stored or trained, so the solver changes which states
the window starts from and how the clean sample is reached, never a log-probability.

MixGRPO-Flash's reference is Tencent-Hunyuan/MixGRPO @ e5cdd6a, ``fastvideo/utils/sampling_utils.py``
(``run_sample_step`` with ``dpm_apply_strategy="post"`` and ``flow_grpo_sampling``, ``dpm_step``,
``multistep_dpm_solver_second_order_update``) as its ``finetune_flux_grpo_MixGRPO_Flash.sh`` runs it: up to the
window's last step every step pushes ``x - sigma v`` into a ``DPMState`` of order 2 and takes the Euler (or SDE)
step; after it ``dpm_step`` runs DPM-Solver++ (midpoint), second order wherever a previous prediction exists,
first order on the final step. Left out: its ``dpm_post_compress_ratio``, which re-spaces the steps after the
window onto fewer of them (flowrl keeps the schedule's steps, which the trained policy's sigmas come from).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Literal, Sequence

import torch
from diffusers.utils.torch_utils import randn_tensor

StepKind = Literal["sde", "cps", "ode", "dance"]
STEP_KINDS: tuple[str, ...] = ("sde", "cps", "ode", "dance")
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
    safe_std = torch.where(deterministic, 1.0, std)
    return _mean_log_density(sample, mean, deterministic, -2 * safe_std**2, torch.log(safe_std))


def _mean_log_density(sample, mean, deterministic, neg_two_var, log_std) -> torch.Tensor:
    """The tensor-sized half of :func:`gaussian_log_prob`, given its std-only terms.

    ``(d^2) / (-2 std^2)`` is bit-identical to ``-(d^2) / (2 std^2)`` (IEEE rounding is symmetric in
    sign), one full-size op fewer.
    """
    log_density = (sample - mean) ** 2 / neg_two_var - log_std - _LOG_SQRT_2PI
    log_density = torch.where(deterministic, 0.0, log_density)
    return log_density.mean(dim=tuple(range(1, sample.ndim)))


def _scaled(noise: torch.Tensor, scale: float) -> torch.Tensor:
    """``scale * noise``; at 1 the noise itself, one full-size multiply fewer on every plain step."""
    return noise if scale == 1 else noise * scale


def _sde_std_t(s: torch.Tensor, s_next: torch.Tensor, noise_level: float) -> torch.Tensor:
    """Flow-GRPO's ``std_t = a * sqrt(sigma / (1 - sigma))``, the SDE's diffusion coefficient before ``sqrt(-dt)``.

    At sigma = 1 the ratio blows up; like Flow-GRPO the denominator is evaluated at ``sigma_next``.
    """
    denominator_sigma = torch.where(s == 1, s_next, s)  # Flow-GRPO's guard at sigma = 1
    return noise_level * torch.sqrt(s / (1 - denominator_sigma))


def _cps_std(s_next: torch.Tensor, noise_level: float) -> torch.Tensor:
    """The CPS step's std ``sigma_next * sin(a * pi / 2)`` (no ``dt`` in it: CPS is not an SDE discretisation)."""
    return s_next * math.sin(noise_level * math.pi / 2)


def _coefficients(s: torch.Tensor, s_next: torch.Tensor, noise_level: float, kind: StepKind):
    """The sigma-only part of a step: (coefficients of the mean, std), elementwise in ``s``/``s_next``.

    Only exactly rounded IEEE ops (no transcendental function of a tensor), so the values do not depend
    on the shape the sigmas come in: a [B, 1, ...] column per step or one vector over a whole schedule.
    """
    if kind not in STEP_KINDS:
        raise ValueError(f"unknown step kind {kind!r}; choose one of {STEP_KINDS}")
    dt = s_next - s
    if kind == "ode":
        return (dt,), torch.zeros_like(s)
    if kind in ("sde", "dance"):
        std_t = _sde_std_t(s, s_next, noise_level) if kind == "sde" else torch.full_like(s, noise_level)
        return (dt, std_t**2 / (2 * s), 1 - s), std_t * torch.sqrt(-dt)
    # cps
    std = _cps_std(s_next, noise_level)
    return (s, 1 - s, 1 - s_next, torch.sqrt(torch.clamp(s_next**2 - std**2, min=0))), std


def _mean(x: torch.Tensor, v: torch.Tensor, coefficients, kind: StepKind) -> torch.Tensor:
    """The tensor-sized half of :func:`transition`: the mean of the step from its coefficients."""
    if kind == "ode":
        (dt,) = coefficients
        return x + dt * v
    if kind in ("sde", "dance"):
        dt, drift, one_minus_s = coefficients
        return x + (v + drift * (x + one_minus_s * v)) * dt
    s, one_minus_s, one_minus_s_next, root = coefficients  # cps: x0_hat = x - s v, x1_hat = x + (1 - s) v
    return one_minus_s_next * (x - s * v) + root * (x + one_minus_s * v)


def transition(velocity, sample, sigma, sigma_next, *, noise_level: float, kind: StepKind):
    """Mean [B, ...] and std [B, 1, ...] of the Gaussian step x -> x', in compute precision."""
    dtype = torch.promote_types(sample.dtype, torch.float32)
    x = sample.to(dtype)
    v = velocity.to(dtype)
    s = _as_batch_column(sigma, x, dtype)
    s_next = _as_batch_column(sigma_next, x, dtype)
    coefficients, std = _coefficients(s, s_next, noise_level, kind)
    return _mean(x, v, coefficients, kind), std


def velocity_sensitivity(sigma: float, sigma_next: float, *, noise_level: float, kind: StepKind) -> float:
    """How far a unit change of the velocity moves the step's mean, in units of the step's std.

    The mean is affine in the velocity, so one difference of two transitions gives the slope. The
    log-ratio of a transition whose velocity moved by ``dv`` has a spread of about this times
    ``|dv|``: on the SD3 schedule it is several times larger at the last, low-noise steps than at
    the first ones, which is why they dominate GRPO's gradient (GRPO-Guard's observation).
    """
    x = torch.zeros(1, 1, dtype=torch.float64)
    moved, std = transition(torch.ones_like(x), x, sigma, sigma_next, noise_level=noise_level, kind=kind)
    still, _ = transition(torch.zeros_like(x), x, sigma, sigma_next, noise_level=noise_level, kind=kind)
    return float((moved - still).abs().item() / std.clamp(min=1e-12).item())


def kl_std(sample, sigma, sigma_next, *, noise_level: float, kind: StepKind) -> torch.Tensor:
    """The std [B, 1, ...] that Flow-GRPO's KL regulariser divides by, in compute precision.

    Flow-GRPO's KL per step is ``||mu_theta - mu_ref||^2 / (2 s^2)`` (mean over non-batch dims) with
    ``s`` the ``std_dev_t`` its step function returns, and its published ``beta`` values are tuned
    against that scale. That ``s`` is not always the std of the transition:

    - ``"sde"``: ``s = std_t = a * sqrt(sigma / (1 - sigma))`` (guard at sigma = 1 as in the step),
      WITHOUT the ``sqrt(-dt)`` of the transition std ``std_t * sqrt(-dt)``. Flow-GRPO's KL is
      therefore ``|dt|`` times the exact KL between the two transitions; we follow Flow-GRPO so
      its ``beta`` carries over.
    - ``"cps"``: Flow-GRPO's CPS variant returns its step std ``sigma_next * sin(a * pi / 2)`` and
      divides by it, so here ``s`` is the transition std itself and the KL is the true Gaussian KL.
    - ``"dance"``: ``s = a``, its ``std_t`` without ``sqrt(-dt)``, as for ``"sde"`` (DanceGRPO and
      BranchGRPO train without a KL, so there is no published scale to follow).
    - ``"ode"``: zero, like the step's std (a deterministic step has no KL; it is never trained).

    ``sample`` [B, ...] fixes the batch shape, device and dtype; ``sigma``/``sigma_next`` are floats
    or [B] tensors. The step's own std (:class:`StepOutput` ``std``) is unchanged by this.
    """
    if kind not in STEP_KINDS:
        raise ValueError(f"unknown step kind {kind!r}; choose one of {STEP_KINDS}")
    dtype = torch.promote_types(sample.dtype, torch.float32)
    s = _as_batch_column(sigma, sample, dtype)
    s_next = _as_batch_column(sigma_next, sample, dtype)
    if kind == "sde":
        return _sde_std_t(s, s_next, noise_level)
    if kind == "cps":
        return _cps_std(s_next, noise_level)
    if kind == "dance":
        return torch.full_like(s, noise_level)
    return torch.zeros_like(s)


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
    noise_scale: float = 1.0,
) -> StepOutput:
    """Take one step (or, given ``prev_sample``, score it) and return its exact log-density.

    ``velocity`` and ``sample`` are [B, ...]; ``sigma``/``sigma_next`` are floats or [B] tensors.
    ``generator`` may be one generator or one per batch row (per-sample determinism).
    ``noise_scale`` multiplies the drawn noise only (BranchGRPO's split steps draw 4x): the sample is
    ``mean + noise_scale * std * eps`` while ``log_prob`` and ``std`` stay those of the unscaled Gaussian,
    the one the loss recomputes, so a recomputed log-prob equals the recorded one.
    """
    mean, std = transition(velocity, sample, sigma, sigma_next, noise_level=noise_level, kind=kind)
    if prev_sample is None and (kind == "ode" or noise_level == 0):
        prev_sample = mean.to(sample.dtype)  # deterministic: draw no noise, leave every RNG untouched
    elif prev_sample is None:
        noise = randn_tensor(mean.shape, generator=generator, device=mean.device, dtype=mean.dtype)
        prev_sample = (mean + std * _scaled(noise, noise_scale)).to(sample.dtype)
    log_prob = gaussian_log_prob(prev_sample.to(mean.dtype), mean, std)
    return StepOutput(prev_sample=prev_sample, log_prob=log_prob, mean=mean, std=std)


class ScheduleSteps:
    """:func:`sde_step` along one sigma schedule, with the sigma-only work done once for all its steps.

    A rollout knows every sigma before its first step. Per step, :func:`transition` and
    :func:`gaussian_log_prob` spend most of their ops (and, on a GPU, a host-to-device copy of each
    sigma) on [B, 1, ...] columns that depend on the sigmas alone; here they are computed once, as
    vectors over the schedule, with the same exactly rounded ops. :meth:`step` then does only the
    full-size work, in the same order as :func:`sde_step`, so its outputs are bit-identical to
    ``sde_step(velocity, sample, sigmas[i], sigmas[i + 1], noise_level=..., kind=..., generator=...)``
    (the log of the std is still taken per step, on a [B, 1, ...] column as :func:`sde_step` does,
    because a vectorised ``log`` may round differently from a scalar one).
    """

    def __init__(self, sigmas: torch.Tensor, *, noise_level: float, kind: StepKind = "sde",
                 dtype: torch.dtype = torch.float32, device=None):
        self.kind, self.noise_level = kind, noise_level
        self.dtype = torch.promote_types(dtype, torch.float32)  # the compute precision of transition
        sigmas = torch.as_tensor(sigmas).to(device=device, dtype=self.dtype)
        coefficients, std = _coefficients(sigmas[:-1], sigmas[1:], noise_level, kind)
        deterministic = std == 0
        safe_std = torch.where(deterministic, 1.0, std)
        per_step = zip(zip(*(c.unbind() for c in coefficients)), std.unbind(), deterministic.unbind(),
                       safe_std.unbind(), (-2 * safe_std**2).unbind())
        # [num_steps] x (mean coefficients, std, deterministic, safe std, -2 std^2), each 0-d
        self._steps = [tuple(step) for step in per_step]

    def step(self, i: int, velocity: torch.Tensor, sample: torch.Tensor, *,
             generator: torch.Generator | Sequence[torch.Generator] | None = None,
             noise_scale: float = 1.0) -> StepOutput:
        """Step ``i`` of the schedule (``sigmas[i] -> sigmas[i + 1]``) from ``sample``; see :func:`sde_step`."""
        if torch.promote_types(sample.dtype, torch.float32) != self.dtype:
            raise ValueError(f"sample dtype {sample.dtype} needs a {torch.promote_types(sample.dtype, torch.float32)}"
                             f" schedule, this one computes in {self.dtype}")
        coefficients, std, deterministic, safe_std, neg_two_var = self._steps[i]
        x = sample.to(self.dtype)
        mean = _mean(x, velocity.to(self.dtype), coefficients, self.kind)
        column = (x.shape[0],) + (1,) * (x.ndim - 1)
        std = std.expand(column).contiguous()  # [B, 1, ...], the layout transition returns
        # The log sees the same contiguous [B, 1, ...] input as in gaussian_log_prob, so it rounds the same way.
        log_std = torch.log(safe_std.expand(column).contiguous())
        noise = randn_tensor(mean.shape, generator=generator, device=mean.device, dtype=mean.dtype)
        prev_sample = (mean + std * _scaled(noise, noise_scale)).to(sample.dtype)
        log_prob = _mean_log_density(prev_sample.to(mean.dtype), mean, deterministic, neg_two_var, log_std)
        return StepOutput(prev_sample=prev_sample, log_prob=log_prob, mean=mean, std=std)



# -- deterministic steps outside the SDE window ---------------------------------------------------------------
#
# The steps a rollout takes outside its SDE window are neither stored nor trained, so any accurate solver of the
# probability-flow ODE may take them (MixGRPO-Flash's observation). Each solver step is a plain function
#   (velocity, sample, sigma, sigma_next, history) -> (prev_sample, history)
# where ``history`` is whatever the solver carries from one step to the next (None for the first one).


def clean_prediction(velocity, sample, sigma) -> torch.Tensor:
    """The data prediction ``x0 = x - sigma v`` [B, ...] in compute precision (float32 or higher)."""
    dtype = torch.promote_types(sample.dtype, torch.float32)
    x = sample.to(dtype)
    return x - _as_batch_column(sigma, x, dtype) * velocity.to(dtype)


def euler_ode_step(velocity, sample, sigma, sigma_next, history=None):
    """Euler, ``x' = x + (sigma' - sigma) v``: first order, one model call per step, no history.

    Exactly the ``"ode"`` kind of :func:`sde_step`, so a rollout with this solver is the one without a choice.
    """
    return sde_step(velocity, sample, sigma, sigma_next, noise_level=0.0, kind="ode").prev_sample, None


def dpmpp_2m_ode_step(velocity, sample, sigma, sigma_next, history=None):
    """DPM-Solver++(2M), midpoint form: second order from the last two clean-latent predictions, one model call.

    In flow matching ``alpha = 1 - sigma`` and the data prediction is ``x0 = x - sigma v``. With the half
    log-SNR ``lambda = log(alpha / sigma)`` and ``h = lambda' - lambda``, the first-order (DDIM) step is
    ``x' = (sigma' / sigma) x + alpha' (1 - e^-h) x0`` with ``alpha' (1 - e^-h) = alpha' - sigma' alpha / sigma``
    (algebraically the Euler step). The multistep form replaces ``x0`` by
    ``D = x0 + h / (2 h_prev) (x0 - x0_prev)``, ``h_prev = lambda - lambda_prev``: a finite-difference estimate
    of how ``x0`` moves in ``lambda``, which costs no extra model call. Where ``h / h_prev`` is not finite, the
    step is first order: after a step from sigma = 1 (``lambda_prev = -inf``) and on the last step to
    sigma' = 0 (``lambda' = +inf``, where the step returns ``D``; DPM-Solver++ lowers its order there too).

    ``history`` is ``(x0_prev [B, ...] compute dtype, sigma_prev)`` of the previous step, or None.
    """
    dtype = torch.promote_types(sample.dtype, torch.float32)
    x = sample.to(dtype)
    s = _as_batch_column(sigma, x, dtype)  # [B, 1, ...]
    s_next = _as_batch_column(sigma_next, x, dtype)
    x0 = clean_prediction(velocity, sample, sigma)  # [B, ...] data prediction
    ratio = s_next / s
    data_weight = (1 - s_next) - ratio * (1 - s)  # alpha' (1 - e^-h)
    target = x0
    if history is not None:
        x0_prev, sigma_prev = history
        s_prev = _as_batch_column(sigma_prev, x, dtype)
        lam, lam_next, lam_prev = (torch.log((1 - v) / v) for v in (s, s_next, s_prev))
        correction = (lam_next - lam) / (2 * (lam - lam_prev))  # [B, 1, ...] h / (2 h_prev)
        correction = torch.where(torch.isfinite(correction), correction, 0.0)
        target = x0 + correction * (x0 - x0_prev)
    prev_sample = (ratio * x + data_weight * target).to(sample.dtype)
    return prev_sample, (x0, sigma)


@dataclass(frozen=True)
class OdeSolver:
    """How a rollout takes its deterministic (unstored) steps."""

    step: Callable  # (velocity, sample, sigma, sigma_next, history) -> (prev_sample, history)
    after_window: bool = False
    """True: Euler before and inside the SDE window, ``step`` only after it, its history starting from the window
    steps' clean-latent predictions (MixGRPO-Flash's "post" placement). False: ``step`` on every deterministic
    step, its history dropped after every SDE step."""


# Solver name -> how the rollout solves its deterministic steps; ``sampling.ode_solver`` names one. Closed set:
# add a solver here and in the schema's Literal.
ODE_SOLVERS = {
    "euler": OdeSolver(euler_ode_step),
    # MixGRPO-Flash (Tencent-Hunyuan/MixGRPO, fastvideo/utils/sampling_utils.py, dpm_apply_strategy "post").
    "mixgrpo_flash": OdeSolver(dpmpp_2m_ode_step, after_window=True),
    # Second order on every deterministic step, restarting after each SDE step: DiffusionNFT's "dpm2" rollouts
    # (all ODE), and before a GRPO window a more accurate start state than Flash's Euler.
    "dpmpp_2m": OdeSolver(dpmpp_2m_ode_step),
}
