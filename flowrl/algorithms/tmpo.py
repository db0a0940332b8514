"""TMPO (Trajectory Matching Policy Optimization): Softmax Trajectory Balance over whole paths.

Reference: the authors' release, github.com/MAIR-Lab-HUST/TMPO at commit af2fa6c300fd3a48068bfad064a786c7529ec553
(``tmpo/losses/softmax_tb.py``, ``ratio_norm.py``, ``reference.py``, ``total_loss.py``, ``tmpo/sampling/sde_step.py``,
``tmpo/train.py``). Over the K paths of one prompt (the leaves of its tree) it matches ``softmax(log P(tau))``
to ``softmax(beta R)``:

- Advantage (:func:`softmax_tb_advantages`): the detached residual ``log softmax(beta R)_i - log softmax(log P)_i``,
  recomputed from the current policy's path log-probs at every update (on the first one they are the rollout's).
- Ratio: path-level, ``log r_i = log P_i - log P_i_old`` summed over the stochastic (split) steps, centred by its
  detached mean over the group, clamped to +-10, exponentiated; the surrogate is PPO's
  ``max(-A r w, -A clip(r, 1 - c, 1 + c) w)`` with ``c`` = 0.2, averaged over the group's paths.
- ``w`` (:func:`ratio_norm_weights`): detached RatioNorm weights. Per split step, with ``s`` the step's std
  (CPS: ``sigma_next sin(eta pi / 2)``, the release's ``sqrt_dt`` being 1 there), ``(dlogp + |dmu|^2 / (2 s^2)) s``
  (``|dmu|^2`` the mean squared shift of the step's mean from the rollout's); averaged over the steps, ``exp``,
  clipped to [1 - c, 1 + c].
- Reference term (:func:`reference_term`): ``lambda ((log P - log P_ref) / S)^2`` averaged over the group,
  ``S`` the number of split steps, ``lambda`` = 0.1. In the release ``P_ref`` is the rollout's own path
  log-prob (its ``use_real_ref`` path falls back to it in every case), so that is the default here
  (``train.tmpo_reference: rollout``); ``base`` uses the base model (adapter off), as the paper describes.
- Log-probs: the release's CPS step scores a transition by ``-mean((x' - mu)^2)`` (no division by the
  variance, no normalising constant; :func:`cps_log_prob`), and a path sums them, so a shared edge counts
  once for every leaf below it. flowrl's SDE kind keeps its exact Gaussian log-density (the release's SDE
  step is Gaussian too).
- R: the reward the release feeds in is each reward model's z-score within the prompt's group, weighted
  and summed; the recipe passes its group advantage before clipping (``train.advantage: grpo`` with
  ``train.std_scope: group`` is that z-score for one reward).

Deliberate differences, one reason each:

- A shared edge is computed once and its gradient weighted by the leaves below it (the release recomputes it
  per leaf): the same gradient for fewer model calls (``flowrl/recipes/tmpo_paths.py``).
- Paths are centred and averaged per prompt group, and the groups of an optimizer step averaged over every
  process; the release's batch is one prompt per process, so the two agree there.
- The release's clamps of non-finite values (velocities to +-20, step log-probs to +-40, paths to +-80) are not
  copied: flowrl's guards skip non-finite steps instead.
- Its ``beta`` warm-up (``beta_target``, used by its FLUX configs only) is not implemented.
- With several rewards, ``train.combine: gdpo`` z-scores each in its group like the release, then also z-scores
  the weighted sum over the batch: flowrl has no combiner that stops after the sum.

``softmax_tb_gradient`` is flowrl's earlier target ``t - p sum(t)`` with ``t`` the residual above: the exact
negative gradient of the squared Softmax-TB loss ``1/2 sum_i (log p_i - log q_i)^2`` with respect to ``log P``,
which sums to zero over the group (``train.tmpo_target: gradient``); kept because it is the loss the paper
writes down, while the release trains on the residual itself.
"""

from __future__ import annotations

from typing import Callable

import torch


def _per_group(values: torch.Tensor, rewards: torch.Tensor, group_ids: torch.Tensor,
               fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``fn(values[rows], rewards[rows])`` per group over its finite-reward rows -> [N] float32, 0 elsewhere."""
    out = torch.zeros(rewards.shape, dtype=torch.float64)
    finite = torch.isfinite(rewards)
    for group in torch.unique(group_ids[finite]).tolist():
        rows = torch.nonzero(finite & (group_ids == group)).flatten()
        out[rows] = fn(values[rows].detach().double(), rewards[rows].detach().double())
    return out.float()


def softmax_tb_advantages(path_log_probs: torch.Tensor, rewards: torch.Tensor, group_ids: torch.Tensor, *,
                          beta: float) -> torch.Tensor:
    """[N] detached ``log softmax(beta R) - log softmax(log P)`` within each group (the release's advantage)."""
    def residual(log_p: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        return torch.log_softmax(beta * r, dim=0) - torch.log_softmax(log_p, dim=0)

    return _per_group(path_log_probs, rewards, group_ids, residual)


def softmax_tb_gradient(path_log_probs: torch.Tensor, rewards: torch.Tensor, group_ids: torch.Tensor, *,
                        beta: float) -> torch.Tensor:
    """[N] ``t - softmax(log P) sum(t)`` with ``t`` the residual: minus the Softmax-TB loss's gradient in log P."""
    def gradient(log_p: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        log_softmax_p = torch.log_softmax(log_p, dim=0)
        target = torch.log_softmax(beta * r, dim=0) - log_softmax_p
        return target - log_softmax_p.exp() * target.sum()

    return _per_group(path_log_probs, rewards, group_ids, gradient)


TMPO_TARGETS: dict[str, Callable[..., torch.Tensor]] = {"residual": softmax_tb_advantages,
                                                        "gradient": softmax_tb_gradient}


def cps_log_prob(sample: torch.Tensor, mean: torch.Tensor) -> torch.Tensor:
    """The release's CPS transition score ``-mean((x' - mu)^2)`` over non-batch dims -> [B] float32."""
    return -((sample.float() - mean.float()) ** 2).mean(dim=tuple(range(1, sample.ndim)))


def ratio_norm_weights(log_ratios: torch.Tensor, mean_shifts: torch.Tensor, stds: torch.Tensor, *,
                       clip: float) -> torch.Tensor:
    """RatioNorm importance weights [N] (detached) of paths from their steps' ``log_ratios`` [N, S] (current
    minus rollout log-prob), ``mean_shifts`` [N, S] (mean squared shift of the step's mean) and ``stds`` [S]."""
    stds = stds.double()
    normalised = (log_ratios.double() + mean_shifts.double() / (2 * stds**2)) * stds  # [N, S]
    return torch.exp(normalised.mean(dim=1)).clamp(1 - clip, 1 + clip).float().detach()


def path_surrogate(path_log_probs: torch.Tensor, old_path_log_probs: torch.Tensor, advantages: torch.Tensor,
                   weights: torch.Tensor, *, clip: float) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-path clipped surrogate [K] of one group, its log-ratio centred by the group's detached mean."""
    log_ratio = path_log_probs - old_path_log_probs  # [K]
    ratio = torch.exp((log_ratio - log_ratio.detach().mean()).clamp(-10.0, 10.0))
    clipped = ratio.clamp(1 - clip, 1 + clip)
    loss = torch.maximum(-advantages * ratio * weights, -advantages * clipped * weights)
    with torch.no_grad():
        stats = {"ratio": ratio.detach(), "clipped": (ratio.detach() - 1).abs().gt(clip).float(),
                 "approx_kl": 0.5 * log_ratio.detach() ** 2}  # the release's approx_kl
    return loss, stats


def reference_term(path_log_probs: torch.Tensor, reference_log_probs: torch.Tensor, num_steps: int) -> torch.Tensor:
    """``((log P - log P_ref) / S)^2`` per path [K]: the release's length-normalised reference constraint."""
    steps = max(num_steps, 1)
    return (path_log_probs / steps - reference_log_probs / steps) ** 2


# Path-level losses by train.loss name (the per-transition ones are flowrl.algorithms.losses.POLICY_LOSSES).
PATH_LOSSES: dict[str, Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]]] = {"tmpo": path_surrogate}
