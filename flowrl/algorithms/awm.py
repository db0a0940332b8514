"""Advantage Weighted Matching (AWM): its per-sample matching "log-probability", clipped ratio loss and timesteps.

Reference: github.com/scxue/advantage_weighted_matching at be5137232e33a21b449ed65a533211d0deb97ed8,
``advantage_weighted_matching/scripts/train_sd3_awm.py`` (``compute_log_prob_awm``, the ``exp_first`` loss,
``time_type='discrete_wo_init'``) with the GenEval / OCR / PickScore settings of ``config/dgx_awm.py``.

AWM treats the negative flow-matching error of a clean rollout ``x0`` at fresh ``(t, eps)`` as its
log-likelihood. With ``l = mean((v - (eps - x0))^2)`` over the non-batch dims, the ``ghuber`` weighting
(AWM's default, ``p = 0.25``) makes it

    log_prob = -(t / p) ((l + e)^p - e^p),   e = 1e-10,

whose gradient is ``-t (l + e)^(p - 1) grad l``: each sample is weighted by ``t l^-0.75``, so samples the
model already fits (small ``l``) and high-noise timesteps count more. ``uniform`` is ``-l`` (AWM's
``Uniform``; flowrl's earlier AWM): the plain advantage-weighted flow-matching loss.

The policy loss is PPO's pessimistic surrogate on that log-probability, per (sample, t) pair,
``max(-A rho, -A clip(rho, 1 - c, 1 + c))``, ``rho = exp(log_prob - old_log_prob)``, with AWM's ``c = 1``.
AWM takes one optimizer step per epoch on fresh (t, eps), where the old log-prob is the current one
detached, so ``rho = 1`` in value and the gradient is ``-A grad log_prob``.
"""

from __future__ import annotations

import numpy as np
import torch

GHUBER_EPS = 1e-10  # AWM's offset inside the power (keeps the gradient finite at l = 0)
WEIGHTINGS = ("ghuber", "uniform")


def matching_log_prob(velocity: torch.Tensor, target: torch.Tensor, sigma: torch.Tensor, *, weighting: str = "ghuber",
                      power: float = 0.25) -> torch.Tensor:
    """[B] AWM's log-probability of each sample from its flow-matching error (see the module docstring).

    ``velocity``/``target`` [B, ...] (target ``eps - x0``), ``sigma`` [B] the noise level ``t``."""
    error = ((velocity - target) ** 2).mean(dim=tuple(range(1, velocity.ndim)))  # [B] l
    if weighting == "uniform":
        return -error
    if weighting == "ghuber":
        return -(torch.pow(error + GHUBER_EPS, power) - GHUBER_EPS ** power) * sigma.to(error.dtype) / power
    raise ValueError(f"unknown AWM weighting {weighting!r}; choose one of {WEIGHTINGS}")


def awm_policy_loss(log_prob: torch.Tensor, old_log_prob: torch.Tensor, advantages: torch.Tensor, *,
                    clip_range: float) -> torch.Tensor:
    """[B] ``max(-A rho, -A clip(rho, 1 - clip_range, 1 + clip_range))`` with ``rho = exp(log_prob - old_log_prob)``
    (``old_log_prob`` detached here)."""
    ratio = torch.exp(log_prob - old_log_prob.detach())
    return torch.maximum(-advantages * ratio, -advantages * ratio.clamp(1.0 - clip_range, 1.0 + clip_range))


def stratified_indices(num_steps: int, count: int, fraction: float, rng: np.random.Generator,
                       rows: int = 1) -> np.ndarray:
    """[rows, count] schedule indices, AWM's ``discrete_wo_init`` draw: the edges
    ``linspace(1, int(num_steps * fraction), count + 1)`` truncated to integers cut indices ``1 ..
    int(num_steps * fraction) - 1`` into ``count`` strata, and each row takes one index per stratum
    uniformly. Index 0 (sigma = 1) is never drawn, nor the last ones (14 steps at 0.9: the last two)."""
    edges = np.linspace(1, int(num_steps * fraction), count + 1).astype(np.int64)  # torch's .long() truncation
    low, high = edges[:-1], edges[1:]
    return low + (rng.random((rows, count)) * (high - low)).astype(np.int64)


def stratified_timesteps(schedule: torch.Tensor, num_rows: int, count: int, fraction: float, *,
                         seed: list[int]) -> torch.Tensor:
    """[num_rows, count] sigmas of ``schedule`` [num_steps] at :func:`stratified_indices` (seeded). AWM shares one
    draw among the 3 samples of a micro-batch; each sample takes its own here (the same marginal per pair)."""
    indices = stratified_indices(len(schedule), count, fraction, np.random.default_rng(seed), rows=num_rows)
    return schedule[torch.as_tensor(indices)]


def awm_loss(velocity: torch.Tensor, old_velocity: torch.Tensor, target: torch.Tensor, advantages: torch.Tensor,
             sigma: torch.Tensor, *, kl_weight: float, weighting: str = "ghuber", power: float = 0.25,
             clip_range: float = 1.0, old_log_prob: torch.Tensor | None = None) -> torch.Tensor:
    """[B] AWM's loss on noised clean samples: :func:`awm_policy_loss` on :func:`matching_log_prob` plus
    ``kl_weight * mean((v - v_old)^2)``, the pull toward AWM's EMA policy (its ``ema_beta`` term; ``v_old`` is
    computed without grad).

    ``advantages`` [B] are the clipped advantages over the clip (AWM: clip 5, ``advantage_max`` 1, so in
    [-1, 1]); ``old_log_prob`` [B] defaults to the current one detached (ratio 1, AWM's one step per epoch).
    At ratio 1 the surrogate's value is ``-A`` and its gradient ``-A grad log_prob``: with ``weighting="uniform"``
    that of ``A l + kl_weight mean((v - v_old)^2)``, flowrl's earlier AWM loss.
    """
    log_prob = matching_log_prob(velocity, target, sigma, weighting=weighting, power=power)  # [B]
    old = log_prob.detach() if old_log_prob is None else old_log_prob
    regulariser = ((velocity - old_velocity) ** 2).mean(dim=tuple(range(1, velocity.ndim)))  # [B]
    return awm_policy_loss(log_prob, old, advantages, clip_range=clip_range) + kl_weight * regulariser
