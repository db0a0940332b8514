"""The loss of stored transitions: recipe grpo's per-step objective on its rollouts' recorded log-probs.

For the rows of one micro-batch at one stored step ``k`` the policy recomputes the velocity at the stored state
(CFG inside), the SDE step's Gaussian log-density of the stored next state and, with ``beta > 0``, the mean of the
KL reference's step. The policy loss (``train.loss``, :data:`flowrl.algorithms.losses.POLICY_LOSSES`) acts on the
(normalised, ``train.ratio_norm``) log-ratio and the step's advantage; the KL is Flow-GRPO's,
``||mu - mu_ref||^2 / (2 std_t^2)`` with ``std_t`` from :func:`flowrl.sampling.steps.kl_std`, so its published
``beta`` carries over. What every transition of an update shares is one :class:`TransitionSettings`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from flowrl.algorithms.losses import gaussian_mean_kl
from flowrl.algorithms.ratio_norm import RATIO_NORMS
from flowrl.sampling.steps import kl_std, sde_step, transition


@dataclass(frozen=True)
class TransitionSettings:
    """What every stored transition of one update shares.

    ``policy_loss(log_probs [B], old_log_probs [B], advantages [B]) -> (loss [B], stats)``: the configured loss with
    its settings bound; ``ratio_norm``: grpo_guard uses GRPO-Guard's log-ratio (from ``traj.means``) and divides the
    policy loss by ``|dt|``, batch_sensitivity centres the log-ratio and divides it by ``sensitivity[k]``;
    ``kl_gate`` [N] (bool): the KL acts on the gated rows only (GARDO); ``reference()``: the KL reference's weights
    as a context (None: the base model, adapter off)."""

    policy_loss: Callable
    guidance: float
    kind: str = "sde"
    beta: float = 0.0
    ratio_norm: str = "none"
    sensitivity: dict[int, float] = field(default_factory=dict)
    kl_gate: torch.Tensor | None = None
    reference: Callable | None = None


def transition_loss(policy, traj, advantages: torch.Tensor, rows: torch.Tensor, k: int, mask: torch.Tensor, *,
                    settings: TransitionSettings, accelerator: Any, noise_level: float, stats, on_policy: bool,
                    sigmas: tuple[float, float] | None = None) -> torch.Tensor:
    """Summed (not averaged) loss of stored transitions ``rows`` at stored step ``k``, on ``advantages`` [N, K]
    and weighted by ``mask`` [N, K]; ``sigmas`` (sigma, sigma_next), when given, saves reading them here (the rows
    share step ``k``)."""
    device = accelerator.device
    x = traj.latents[rows, k].to(device)  # [B, C, h, w]
    x_next = traj.latents[rows, k + 1].to(device)
    sigma, sigma_next = sigmas or (traj.row_sigmas[rows[0], k].item(), traj.row_sigmas[rows[0], k + 1].item())
    cond = traj.cond.select(traj.prompt_ids[rows])
    kind, guidance = settings.kind, settings.guidance
    with accelerator.autocast():
        velocity = policy.velocity(x, sigma, cond, guidance)
    step = sde_step(velocity, x, sigma, sigma_next, noise_level=noise_level, kind=kind, prev_sample=x_next)
    norm = RATIO_NORMS[settings.ratio_norm]  # none: the plain log-ratio; else normalised, against a zero baseline
    log_probs, old_log_probs = norm.log_ratio(step.log_prob, traj.log_probs[rows, k].to(device), mean=step.mean,
                                              old_mean=lambda: traj.means[rows, k].to(device), prev_sample=x_next,
                                              std=step.std, sensitivity=settings.sensitivity.get(k))
    loss, loss_stats = settings.policy_loss(log_probs, old_log_probs, advantages[rows, k].to(device))
    loss = loss * norm.loss_scale(sigma, sigma_next)  # grpo_guard: 1 / |dt|; the others 1 (exact)
    weights = mask[rows, k].to(device).float()  # [B]
    kl = torch.zeros_like(loss)
    if settings.beta > 0:
        with torch.no_grad(), (settings.reference or policy.reference)(), accelerator.autocast():
            ref_velocity = policy.velocity(x, sigma, cond, guidance)
        ref_mean, _ = transition(ref_velocity, x, sigma, sigma_next, noise_level=noise_level, kind=kind)
        # Flow-GRPO's scale, not step.std: for SDE steps it leaves out sqrt(-dt) (see kl_std).
        kl = gaussian_mean_kl(step.mean, ref_mean, kl_std(x, sigma, sigma_next, noise_level=noise_level, kind=kind))
        if settings.kl_gate is not None:
            kl = kl * settings.kl_gate[rows].to(kl)
    total = loss + settings.beta * kl
    stats.add("loss/policy", loss, weights)
    stats.add("loss/kl", kl, weights)
    stats.add("loss/total", total, weights)
    stats.add("policy/ratio", loss_stats["ratio"], weights)
    stats.add("policy/clipfrac", loss_stats["clipped"], weights)
    stats.add("policy/approx_kl", loss_stats["approx_kl"], weights)
    if on_policy:
        deviation = ((loss_stats["ratio"] - 1).abs() * weights).max()
        stats.add_scalar("policy/onpolicy_ratio_maxdev", deviation, reduce="max")
    return (total * weights).sum()
