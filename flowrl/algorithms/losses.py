"""Policy losses on stored transitions, registered by ``train.loss`` name with :func:`register_policy_loss`.

A registered loss is ``fn(log_probs [B], old_log_probs [B], advantages [B], config) -> (loss [B], stats)`` with
``config`` the recipe's ``train`` section, from which it reads its own settings: a new loss is its function, its
config fields and its registration, and no caller changes. ``stats`` holds ``ratio``, ``clipped`` and
``approx_kl`` [B].

``grpo-clip`` is PPO's pessimistic clipped surrogate with separate lower/upper ranges:
``max(-A * rho, -A * clip(rho, 1 - clip_low, 1 + clip_high))`` with ``rho = exp(logp - logp_old)``.
``nft_loss`` is DiffusionNFT's forward-process loss (see its docstring); it needs no log-probs.

The KL regulariser is Flow-GRPO's: per step ``||mu - mu_ref||^2 / (2 s^2)``, averaged over the
non-batch dimensions like the log-probs, with ``s`` from :func:`flowrl.sampling.steps.kl_std`. For
SDE steps ``s = std_t = a * sqrt(sigma / (1 - sigma))`` WITHOUT the transition's ``sqrt(-dt)``, so
the value is ``|dt|`` times the exact KL between the two Gaussian transitions; that is the scale
Flow-GRPO's published ``beta`` values (0.04 OCR/GenEval, 0.01 PickScore) were tuned on. For CPS
steps ``s`` is the step std, as in Flow-GRPO's CPS variant.
"""

from __future__ import annotations

from typing import Callable

import torch


PolicyLoss = Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]]

# Per-transition losses by train.loss name. TMPO's path-level loss (flowrl.algorithms.tmpo.PATH_LOSSES) and SDPO's
# pair loss (flowrl.algorithms.sdpo.PAIR_LOSSES) are the other kinds of train.loss: recipe grpo trains them over
# whole paths or pairs (its OBJECTIVES).
POLICY_LOSSES: dict[str, PolicyLoss] = {}


def register_policy_loss(name: str) -> Callable[[PolicyLoss], PolicyLoss]:
    """Register the decorated loss as ``train.loss: name``."""
    def register(loss: PolicyLoss) -> PolicyLoss:
        if name in POLICY_LOSSES:
            raise ValueError(f"policy loss {name!r} is registered twice")
        POLICY_LOSSES[name] = loss
        return loss
    return register


def grpo_clip_loss(log_probs, old_log_probs, advantages, *, clip_low: float, clip_high: float):
    ratio = torch.exp(log_probs - old_log_probs)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    loss = torch.maximum(unclipped, clipped)
    with torch.no_grad():
        stats = {
            "ratio": ratio.detach(),
            "clipped": ((ratio < 1.0 - clip_low) | (ratio > 1.0 + clip_high)).float(),
            # k3 estimator of KL(old || new): non-negative, low variance
            "approx_kl": (torch.exp(old_log_probs - log_probs) - 1 - (old_log_probs - log_probs)).detach(),
        }
    return loss, stats


@register_policy_loss("grpo-clip")
def grpo_clip(log_probs, old_log_probs, advantages, config):
    """grpo-clip with ``train.clip_range`` below and ``train.clip_range_high`` (default: the same) above."""
    high = config.clip_range if config.clip_range_high is None else config.clip_range_high
    return grpo_clip_loss(log_probs, old_log_probs, advantages, clip_low=config.clip_range, clip_high=high)


def gaussian_mean_kl(mean: torch.Tensor, ref_mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """``||mean - ref_mean||^2 / (2 std^2)``, averaged over non-batch dims -> [B].

    With ``std`` the transition std this is the KL between N(mean, std^2) and N(ref_mean, std^2).
    The GRPO recipe passes :func:`flowrl.sampling.steps.kl_std` instead (``std_t`` without
    ``sqrt(-dt)`` for SDE steps), which makes it Flow-GRPO's KL so its ``beta`` values carry over.
    """
    dims = tuple(range(1, mean.ndim))
    return ((mean - ref_mean) ** 2).mean(dim=dims) / (2 * std.reshape(-1) ** 2)


def nft_loss(velocity: torch.Tensor, old_velocity: torch.Tensor, target: torch.Tensor, optimality: torch.Tensor, *,
             strength: float, sigma: torch.Tensor | None = None) -> torch.Tensor:
    """DiffusionNFT's loss on noised clean samples -> [B] (mean over non-batch dims).

    Two implicit policies are built from the trained velocity ``v`` and the sampling ("old") one:
    ``v+ = s v + (1 - s) v_old`` and ``v- = (1 + s) v_old - s v`` with ``s = strength``, and the
    loss is ``r ||v+ - target||^2 + (1 - r) ||v- - target||^2``. A sample with optimality
    ``r = 1`` pulls ``v`` toward its flow-matching target, ``r = 0`` pushes it away, ``r = 1/2``
    only holds ``v`` near ``v_old``. At ``v = v_old`` the gradient is ``2 s (2r - 1) (v_old - target)``:
    reward-weighted flow matching, signed by the advantage. The loss is affine in ``r``.

    Given ``sigma`` [B] (the noise level of each sample), each term is measured in x0-space and
    divided by its own detached mean absolute error (DiffusionNFT's adaptive weighting): with
    ``x0_hat - x0 = sigma (v - target)`` a term becomes ``sigma ||e||^2 / mean|e|``. Its gradient
    no longer grows with the error, so pushing away from bad samples cannot run away.

    DiffusionNFT (NVlabs/DiffusionNFT ``scripts/train_nft_sd3.py`` at 24af555) multiplies this loss by
    ``adv_clip_max / strength``; the nft recipe applies that factor (``nft.loss_scale``), outside this function.
    """
    dims = tuple(range(1, velocity.ndim))
    positive = strength * velocity + (1 - strength) * old_velocity - target  # [B, ...] errors
    negative = (1 + strength) * old_velocity - strength * velocity - target

    def term(error: torch.Tensor) -> torch.Tensor:
        squared = (error ** 2).mean(dim=dims)
        if sigma is None:
            return squared
        scale = (sigma * error.detach().abs().mean(dim=dims)).clamp(min=1e-5)  # mean |x0_hat - x0|, clipped there
        return sigma ** 2 * squared / scale

    return optimality * term(positive) + (1 - optimality) * term(negative)
