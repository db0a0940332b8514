"""SA-Solver for flow-matching models, the stochastic sampler AWM draws its rollouts with, loop written out.

SA-Solver (Xue et al., 2023, "SA-Solver: Stochastic Adams Solver for Fast Sampling of Diffusion Models")
integrates the reverse SDE whose noise is scaled by ``tau`` (0: the probability-flow ODE) in the half
log-SNR ``lambda = log(alpha / sigma)``; in flow matching ``alpha = 1 - t``, ``sigma = t`` and the data
prediction is ``x0 = x - t v``. One step from ``s`` to ``t`` (``h = lambda_t - lambda_s``, ``c = 1 + tau^2``):

    x_t = e^(-tau^2 h) (t / s) x_s + sum_i w_i x0_i + t sqrt(1 - e^(-2 tau^2 h)) xi,
    w_i = c t e^(-tau^2 lambda_t) int_{lambda_s}^{lambda_t} e^(c l) L_i(l) dl

with ``L_i`` the Lagrange basis through the nodes of the x0 predictions used (one node: first order; two:
second). The predictor interpolates the last predictions; the corrector re-takes the same step with the
prediction at the predicted point added, and the same noise ``xi``. At second order both add the O(h^3) term
of SA-Solver's few-step variant (:func:`step_weights`), as diffusers' ``SASolverScheduler`` does.

AWM's call (``pipeline_with_logprob(use_sa_solver=True)``, ``flow_grpo/diffusers_patch/sa_solver.py`` of
github.com/scxue/advantage_weighted_matching at be5137232e33a21b449ed65a533211d0deb97ed8), which
:func:`sa_solver_sample` reproduces:

- the time grid is the scheduler's sigmas with the first set to ``1 - 1e-3`` (``lambda(1) = -inf``) and the
  last nonzero one replaced by half the one before (:func:`sa_solver_grid`);
- predictor and corrector of order 2 in PEC mode: one model call per step, at the predicted point; the
  first step is first order with no corrector;
- ``tau(t) = noise_level`` for ``t`` (the step's target) in ``[0.3, 0.9]``, else 0 (AWM: 0.4);
- the last step returns the x0 prediction of the last model call instead of stepping to ``t = 0``.

Deliberate differences: the grid and the step coefficients are computed in float64 (the reference: float32
tensors), and each row draws its noise from its own seeded generator (see :mod:`flowrl.sampling.rollout`).
The rollout keeps only clean samples: AWM never trains through it, so no log-probability is computed.
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

import torch
from diffusers.utils.torch_utils import randn_tensor

from flowrl.models.base import Policy, TextCond
from flowrl.sampling.settings import RolloutSettings
from flowrl.sampling.trajectory import Trajectory
from flowrl.core.seeding import derive_seed, generators

NOISE_WINDOW = (0.3, 0.9)  # AWM's t-range of the SDE noise


def sa_solver_grid(sigmas: Sequence[float]) -> list[float]:
    """AWM's time grid from a schedule ``sigmas`` [num_steps + 1] that ends at 0: the first point moved to
    ``1 - 1e-3`` (the half log-SNR is infinite at 1) and the last nonzero one set to half the one before."""
    grid = [float(s) for s in sigmas]
    if len(grid) < 3 or grid[-1] != 0:
        raise ValueError(f"SA-Solver needs a schedule of >= 2 steps ending at 0, got {grid}")
    grid[0] = 1 - 1e-3
    grid[-2] = grid[-3] / 2
    return grid


def noise_schedule(grid: Sequence[float], noise_level: float, window: Sequence[float] = NOISE_WINDOW) -> list[float]:
    """``tau`` of each step, indexed by the step's target point (``tau[0]`` unused): ``noise_level`` where the
    target lies in ``window`` (inclusive), else 0."""
    low, high = window
    return [noise_level if low <= t <= high else 0.0 for t in grid]


def half_log_snr(t: float) -> float:
    """``lambda(t) = log((1 - t) / t)`` of flow matching (``alpha = 1 - t``, ``sigma = t``)."""
    return math.log((1 - t) / t)


def _exp_moment(order: int, a: float, b: float, c: float) -> float:
    """``int_a^b e^(c l) l^order dl`` for order 0 or 1."""
    if order == 0:
        return (math.exp(c * b) - math.exp(c * a)) / c
    return (math.exp(c * b) * (c * b - 1) - math.exp(c * a) * (c * a - 1)) / c ** 2


def step_weights(nodes: Sequence[float], lam_s: float, lam_t: float, tau: float) -> list[float]:
    """The weights ``w_i`` of the x0 predictions at half log-SNRs ``nodes`` (newest first; one node: first
    order, two: second) in a step from ``lam_s`` to ``lam_t`` (the module docstring's formula).

    A predictor's nodes are the previous points (``nodes[0] == lam_s``); a corrector's are ``(lam_t, lam_s)``.
    At second order SA-Solver's few-step variant adds ``d = e^(c lam_t) (h^2 / 2 - (c h - 1 + e^(-c h)) / c^2)
    / (nodes[0] - nodes[1])`` to the newest node's integral and subtracts it from the other's: an O(h^3)
    change that keeps the order and, its authors find, improves few-step samples."""
    c, h = 1 + tau ** 2, lam_t - lam_s
    e0, e1 = _exp_moment(0, lam_s, lam_t, c), _exp_moment(1, lam_s, lam_t, c)
    if len(nodes) == 1:
        integrals = [e0]
    elif len(nodes) == 2:
        n0, n1 = nodes
        integrals = [(e1 - n1 * e0) / (n0 - n1), (e1 - n0 * e0) / (n1 - n0)]  # int e^(c l) L_i(l) dl
        extra = math.exp(c * lam_t) * (h ** 2 / 2 - (c * h - 1 + math.exp(-c * h)) / c ** 2) / (n0 - n1)
        integrals = [integrals[0] + extra, integrals[1] - extra]
    else:
        raise ValueError(f"SA-Solver steps here are of order 1 or 2, got {len(nodes)} nodes")
    sigma_t = 1 / (1 + math.exp(lam_t))  # t from lambda
    return [c * sigma_t * math.exp(-tau ** 2 * lam_t) * integral for integral in integrals]


def sa_step(x: torch.Tensor, x0_preds: Sequence[torch.Tensor], nodes: Sequence[float], s: float, t: float, tau: float,
            noise: torch.Tensor) -> torch.Tensor:
    """One SA-Solver update of ``x`` [B, ...] at time ``s`` to time ``t`` from the x0 predictions ``x0_preds``
    (newest first) at times ``nodes``; ``noise`` [B, ...] standard normal. Float32 or wider, as ``x``."""
    lam_s, lam_t = half_log_snr(s), half_log_snr(t)
    h = lam_t - lam_s
    weights = step_weights([half_log_snr(n) for n in nodes], lam_s, lam_t, tau)
    out = math.exp(-tau ** 2 * h) * (t / s) * x
    for weight, x0 in zip(weights, x0_preds):
        out = out + weight * x0
    if tau > 0:
        out = out + t * math.sqrt(-math.expm1(-2 * tau ** 2 * h)) * noise
    return out


@torch.no_grad()
def sa_solver_sample(velocity: Callable[[torch.Tensor, float], torch.Tensor], x: torch.Tensor, grid: Sequence[float],
                     taus: Sequence[float], noise: Callable[[int], torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Run AWM's SA-Solver (order-2 predictor and corrector, PEC) from ``x`` [B, ...] at ``grid[0]`` down the
    ``grid`` (:func:`sa_solver_grid`; it ends at 0) with ``taus`` (:func:`noise_schedule`).

    ``velocity(x, t)`` is the model; ``noise(step)`` the standard normal draw of step ``step`` (1 ..
    len(grid) - 2), shared by its predictor and corrector. Returns (the clean sample: the x0 prediction of the
    last model call, the predicted state that call saw, at ``grid[-2]``), both float32 or wider."""
    x = x.to(torch.promote_types(x.dtype, torch.float32))
    steps = len(grid) - 1
    x0_preds = [x - grid[0] * velocity(x, grid[0]).to(x.dtype)]  # newest last
    predicted = x
    for step in range(1, steps):
        s, t = grid[step - 1], grid[step]
        xi = noise(step).to(x.dtype)
        history = x0_preds[-2:][::-1]  # first order at the first step, second after
        predicted = sa_step(x, history, grid[step - len(history):step][::-1], s, t, taus[step], xi)
        x0_t = predicted - t * velocity(predicted, t).to(x.dtype)
        if step > 1:  # the first corrector is skipped, as in the reference
            x = sa_step(x, [x0_t, x0_preds[-1]], [t, s], s, t, taus[step], xi)
        else:
            x = predicted
        x0_preds = [x0_preds[-1], x0_t]
    return x0_preds[-1], predicted


@torch.no_grad()
def sa_solver_rollout(policy: Policy, prompts: Sequence[str], settings: RolloutSettings, *, group_size: int,
                      seeds: Sequence[int], metadata: Sequence[dict] | None = None, cond: TextCond | None = None,
                      noise_window: Sequence[float] = NOISE_WINDOW) -> Trajectory:
    """``len(prompts) * group_size`` clean samples by :func:`sa_solver_sample` on ``policy.sigmas(num_steps)``
    with ``tau = settings.noise_level`` inside ``noise_window``: :func:`flowrl.sampling.rollout.rollout`'s signature
    (the settings' ``kind``, ``ode_solver`` and ``same_noise_in_pairs`` do not apply and are ignored) and seeds (a
    row's initial noise from its seed, step ``i``'s noise from ``derive_seed(row_seed, i)``).

    The trajectory stores one step, the last (the predicted state -> the clean sample), with log-prob 0,
    as a deterministic rollout's plan does: only ``final_latents`` and ``images`` are meant to be used."""
    num_steps, plan = settings.num_steps, settings.plan
    if plan is not None and (plan.branch_steps or plan.num_steps != num_steps):
        raise ValueError("SA-Solver rollouts have no tree and take their steps from num_steps")
    if settings.self_guidance is not None:
        raise ValueError("self-guidance is not wired into SA-Solver rollouts: set nft.sampler=ode or "
                         "sampling.self_guidance.in_rollouts=false")
    if settings.store_x0_preds or settings.store_means:
        raise ValueError("SA-Solver rollouts keep clean samples only (store_x0_preds and store_means do not apply)")
    if cond is None:
        cond = policy.encode(list(prompts), metadata=metadata)
    num_prompts = len(prompts)
    if len(seeds) != num_prompts * group_size:
        raise ValueError(f"need {num_prompts * group_size} root seeds, got {len(seeds)}")
    device = policy.device
    prompt_ids = torch.arange(num_prompts).repeat_interleave(group_size)  # [N]
    row_seeds = [int(s) for s in seeds]
    init_seeds = [row_seeds[(i // group_size) * group_size] for i in range(len(row_seeds))] \
        if settings.same_noise_in_group else row_seeds
    x = policy.init_noise(len(row_seeds), generator=generators(init_seeds))  # [N, C, (F,) h, w]
    model_dtype, row_cond = x.dtype, cond.select(prompt_ids)
    grid = sa_solver_grid(policy.sigmas(num_steps).double().tolist())
    taus = noise_schedule(grid, settings.noise_level, noise_window)

    def model(state: torch.Tensor, t: float) -> torch.Tensor:
        return policy.velocity(state.to(model_dtype), torch.tensor(t, dtype=torch.float32, device=state.device),
                               row_cond, settings.guidance_scale)

    def step_noise(step: int) -> torch.Tensor:
        rngs = generators([derive_seed(s, step) for s in row_seeds], device=x.device)
        return randn_tensor(x.shape, generator=rngs, device=x.device, dtype=torch.float32)

    clean, before = sa_solver_sample(model, x, grid, taus, step_noise)
    final = clean.to(model_dtype)  # [N, C, (F,) h, w]
    images = torch.cat([policy.decode(chunk) for chunk in final.split(settings.decode_batch_size)]) \
        if settings.decode else None
    rows = len(row_seeds)
    last = torch.tensor([[grid[-2], 0.0]]).repeat(rows, 1)  # [N, 2] the stored step's noise levels
    return Trajectory(
        latents=torch.stack([before.to(model_dtype), final], dim=1), log_probs=torch.zeros(rows, 1),
        row_sigmas=last, row_timesteps=last[:, :-1] * 1000,
        row_step_indices=torch.full((rows, 1), num_steps - 1, dtype=torch.long), final_latents=final,
        prompt_ids=prompt_ids.to(device), group_ids=prompt_ids.to(device).clone(),
        seeds=torch.tensor(row_seeds, dtype=torch.long), edge_ids=torch.arange(len(row_seeds)).unsqueeze(1),
        parent=torch.full((len(row_seeds),), -1, dtype=torch.long), prompts=list(prompts),
        metadata=list(metadata) if metadata is not None else [], images=images, cond=cond,
    )
