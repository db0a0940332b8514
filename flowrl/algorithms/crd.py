"""Centered Reward Distillation (CRD): the pieces of its loss, as plain functions on velocities and weights.

KL-regularised reward maximisation has the optimum ``beta log(pi / pi_old) = r - beta log Z(prompt)``. Centring
both sides over samples of one prompt cancels ``log Z``, which leaves a regression of the centred implicit reward
onto the centred external one: ``mean_i (beta (l_i - lbar) - (r_i - rbar))^2``. Here ``l`` is one (t, noise)
estimate of the log-ratio from flow-matching errors (:func:`implicit_reward`) and ``r`` the optimality in
[0, 1], ``clip(A) / clip / 2 + 1/2``, DiffusionNFT's. The recipe scales the loss by ``advantage_clip / beta`` and
adds a KL to the base model whose per-sample weight grows with ``r`` (:func:`reward_adaptive_kl_weights`).

Reference: CRD has no official release; flowrl follows Flow-Factory's port (X-GenGroup/Flow-Factory,
``src/flow_factory/trainers/crd.py`` and ``examples/crd/lora/sd3_5/default.yaml`` at a0b2bc5), its MSE loss
with uniform centring (``weight_temp < 0``). Deliberate differences:

- The centring set is a prompt's group at one timestep slot of the optimizer step's chunk (the paper's per-prompt
  centring). Flow-Factory centres over the micro-batch gathered from every process, whose prompts depend on its
  sampler's layout.
- The gradient comes from a surrogate ``c ||v - target||^2`` with detached weights ``c`` measured in a no-grad
  pass first (:func:`crd_weights`), because centring needs the whole group's log-ratios before the backward.
  Its gradient is the loss's (Flow-Factory's centring means are detached too).
- Its BCE loss and the softmax-weighted two-direction centring (``weight_temp >= 0``) are not offered.
"""

from __future__ import annotations

import torch


def _squared_error(velocity: torch.Tensor, target: torch.Tensor, adaptive: bool) -> torch.Tensor:
    """[B] mean squared error over non-batch dims; with ``adaptive`` each one over its own detached mean
    absolute error, clipped at 1e-5 (Flow-Factory's ``adaptive_logp``)."""
    dims = tuple(range(1, velocity.ndim))
    squared = ((velocity - target) ** 2).mean(dim=dims)
    if not adaptive:
        return squared
    return squared / (velocity - target).detach().abs().mean(dim=dims).clamp(min=1e-5)


def implicit_reward(velocity: torch.Tensor, old_velocity: torch.Tensor, target: torch.Tensor, *,
                    adaptive: bool) -> torch.Tensor:
    """[B] the implicit log-ratio estimate ``l = err(v_old) - err(v_theta)`` at one (t, noise): a velocity that
    fits the sample better than the old adapter's has a higher likelihood than the old policy gives it."""
    return _squared_error(old_velocity, target, adaptive) - _squared_error(velocity, target, adaptive)


def crd_surrogate(velocity: torch.Tensor, target: torch.Tensor, weights: torch.Tensor, *,
                  adaptive: bool) -> torch.Tensor:
    """[B] ``c err(v_theta)`` with ``c`` = ``weights`` [B] from :func:`crd_weights`: since ``l`` falls by
    ``err(v_theta)``, its gradient is the CRD loss's."""
    return weights * _squared_error(velocity, target, adaptive)


def crd_weights(ratios: torch.Tensor, advantages: torch.Tensor, chunk: torch.Tensor, group_ids: torch.Tensor,
                keep: torch.Tensor, *, num_rows: int, beta: float, stats=None) -> torch.Tensor:
    """[pairs] the surrogate weights ``c_i = -2 beta e_i`` of the pairs in ``chunk`` (0 elsewhere): the derivative
    of ``e_i^2`` in ``err(v_theta)``, with ``e_i = beta (l_i - lbar) - (r_i - rbar)`` the residual of the CRD loss.

    ``ratios`` [pairs] are :func:`implicit_reward`'s, ``advantages`` [pairs] the clipped advantages over the clip,
    in [-1, 1] (``r = (1 + a) / 2``). A centring set is one group's kept pairs of one timestep slot (pair p's slot
    is p // num_rows) within the chunk; the means ``lbar`` and ``rbar`` are taken over it (detached), and a set of
    fewer than two pairs teaches nothing and gets 0. The recipe averages the surrogate over the chunk's pairs, so
    the loss is the mean of ``e_i^2`` over them, Flow-Factory's per-batch mean. ``stats``: a
    :class:`flowrl.training.stats.StatsAccumulator` for ``crd/residual_abs`` and ``crd/log_ratio_abs``.
    """
    out = torch.zeros(ratios.shape)
    slots = torch.arange(len(ratios)) // num_rows
    key = group_ids * (int(slots.max()) + 1) + slots  # [pairs] one id per (group, slot)
    for k in torch.unique(key[chunk]).tolist():
        members = chunk[(key[chunk] == k) & keep[chunk]]
        if len(members) < 2:
            continue
        optimality = 0.5 + 0.5 * advantages[members]  # [n] r in [0, 1]
        centred_ratio = ratios[members] - ratios[members].mean()
        residual = beta * centred_ratio - (optimality - optimality.mean())
        out[members] = -2 * beta * residual  # d e^2 / d err(v_theta), err falling as l rises
        if stats is not None:
            stats.add("crd/residual_abs", residual.abs(), torch.ones_like(residual))
            stats.add("crd/log_ratio_abs", centred_ratio.abs(), torch.ones_like(residual))
    return out


def reward_adaptive_kl_weights(advantages: torch.Tensor, beta: float, *, floor: float = 1e-4) -> torch.Tensor:
    """[B] per-sample factors on the KL ``beta ||v - v_ref||^2``: ``m + r (1 - m)`` with ``m = floor / beta`` and
    ``r = (1 + a) / 2`` (Flow-Factory's ``reward_adaptive_kl``), so the KL coefficient runs from ``floor`` on the
    worst sample to ``beta`` on the best."""
    minimum = floor / max(beta, 1e-8)
    return minimum + (0.5 + 0.5 * advantages) * (1 - minimum)
