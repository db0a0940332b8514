"""Per-step normalisation of GRPO's importance ratio (``train.ratio_norm``, recipe grpo).

With ``s`` the std of a Gaussian step, ``eps = (x' - mu_old) / s`` its noise and ``dmu = mu_theta - mu_old``,
the log-ratio of a stored transition is, per dimension, ``eps . dmu / s - |dmu|^2 / (2 s^2)``. Its mean is
below 0 as soon as the policy moves (a negative bias that grows as ``s`` shrinks at the low-noise steps, so the
upper clip rarely binds on positive advantages), and its spread differs from step to step.

- ``grpo_guard``: GRPO-Guard's RatioNorm and gradient reweighting, as its authors' code computes them
  (yifan123/flow_grpo, ``scripts/train_sd3_GRPO_Guard.py`` with ``config.rationorm``, at commit 9745241, the
  merge of pull request #175). The log-ratio is ``s * (logp - logp_old + ||mu_theta - mu_old||^2 / (2 s^2))``,
  the squared norm averaged over the non-batch dimensions like the log-probs, ``s = std_t * sqrt(-dt)``; that is
  exactly ``mean(eps * dmu)`` (:func:`grpo_guard_log_ratio`). The bias term is removed for each sample and
  from the gradient too, which becomes ``mean(eps * d mu_theta)``: the restoring pull ``-(mu_theta - mu_old)`` of
  the plain log-ratio is gone. Each step's clipped policy loss is then divided by ``|dt|``
  (:func:`grpo_guard_loss_scale`); a KL term is not. As the SDE mean's slope in the velocity is
  ``(1 + a^2 / 2) dt`` below sigma = 1, every step's log-ratio gradient in ``v`` is then
  ``-eps (1 + a^2 / 2) / D``, whatever its size or noise level (the plain log-ratio's is
  ``-eps (1 + a^2 / 2) sqrt(|dt|) / (std_t D)`` plus the restoring term, largest at the low-noise steps where
  ``std_t`` is small). The rollout keeps each stored step's mean ``mu_old`` (``Trajectory.means``) for it, as
  the reference keeps ``prev_sample_mean``.
  Deliberate differences from that code:

  - the log-ratio is evaluated as ``mean((x' - mu_old) * dmu) / s``, algebraically the reference's expression
    (same value, same gradient) but without the difference of two O(1) float32 log-densities, whose rounding
    (~1e-7) is not small against the 2e-6 clip range the method runs at;
  - ``s`` and ``|dt|`` come from the step's own sigmas; the reference takes the batch means of ``std_t`` and
    ``sqrt(-dt)``, which are the same numbers because every row of a batch sits at the same step;
  - SDE steps only, like the reference: its ``|dt|`` reweighting assumes the SDE mean, whose velocity slope is
    proportional to ``dt``; ``validate()`` rejects it with ``sampling.kind=cps``.

- ``batch_sensitivity``: flowrl's earlier, reference-free variant, kept because it needs no stored rollout means
  (no extra memory) and covers CPS steps. It subtracts the detached mean of the step's batch and divides by
  the step's velocity sensitivity relative to the mean over trained steps (:func:`batch_sensitivity_log_ratio`);
  its gradient keeps the restoring term off-policy, and its clip ranges are not GRPO-Guard's.

- ``none``: the plain log-ratio ``logp - logp_old``.

Both variants hand the policy loss the normalised log-ratio against a zero baseline (``log_probs = r``,
``old_log_probs = 0``), so ``rho = exp(r)`` carries no cancellation error.

``RATIO_NORMS`` maps each ``train.ratio_norm`` name to a :class:`RatioNorm`, which says what the recipe must keep
for it (the rollout's step means, the trained steps' sensitivities) and applies it to a step's log-probs and loss,
so the recipe looks the name up once and never branches on it.
"""

from __future__ import annotations

from typing import Callable

import torch

from flowrl.sampling.steps import velocity_sensitivity


def grpo_guard_log_ratio(mean: torch.Tensor, old_mean: torch.Tensor, prev_sample: torch.Tensor,
                         std: torch.Tensor) -> torch.Tensor:
    """GRPO-Guard's normalised log-ratio of transitions to ``prev_sample`` -> [B].

    ``mean`` [B, ...] is the trained policy's step mean (with grad), ``old_mean`` [B, ...] the sampling
    policy's (stored by the rollout), ``std`` [B, 1, ...] the step's std ``s``. Returns
    ``mean_d((x' - mu_old) * (mu_theta - mu_old)) / s``, which is the reference's
    ``s * (logp - logp_old + mean_d((mu_theta - mu_old)^2) / (2 s^2))`` for the Gaussian log-densities of
    ``prev_sample`` (expand both squares: the ``(mu_theta - mu_old)^2`` terms cancel).
    """
    old_mean = old_mean.to(mean.dtype)
    noise_times_std = prev_sample.to(mean.dtype) - old_mean  # [B, ...] s * eps, fixed data
    dims = tuple(range(1, mean.ndim))
    return (noise_times_std * (mean - old_mean)).mean(dim=dims) / std.reshape(-1)


def grpo_guard_loss_scale(sigma: float, sigma_next: float) -> float:
    """GRPO-Guard's weight ``1 / |dt|`` of a step's policy loss (the reference divides by ``sqrt(-dt)^2``)."""
    return 1.0 / (sigma - sigma_next)


def batch_sensitivity_log_ratio(log_ratio: torch.Tensor, sensitivity: float) -> torch.Tensor:
    """flowrl's batch-centred, sensitivity-scaled log-ratio of one step's transitions [B] -> [B].

    Subtracting the (detached) mean over the step's batch and dividing by the step's velocity sensitivity
    ``|d mu / d v| / s`` (:func:`flowrl.sampling.steps.velocity_sensitivity`), relative to the mean over
    trained steps, gives every step about the same spread, so the clip binds evenly across steps.
    """
    return (log_ratio - log_ratio.detach().mean()) / sensitivity


def step_sensitivities(sigmas: torch.Tensor, columns: list[int], *, noise_level: float,
                       kind: str) -> dict[int, float]:
    """{stored column: its step's velocity sensitivity over the mean of the trained ones} for
    :func:`batch_sensitivity_log_ratio`."""
    raw = {k: velocity_sensitivity(float(sigmas[k]), float(sigmas[k + 1]), noise_level=noise_level, kind=kind)
           for k in columns}
    mean = sum(raw.values()) / len(raw)
    return {k: value / mean for k, value in raw.items()}


class RatioNorm:
    """``train.ratio_norm: none``, and the interface every entry of :data:`RATIO_NORMS` keeps: the plain log-ratio
    ``logp - logp_old``, the policy loss unscaled."""

    store_means = False
    """Whether the rollout must keep each stored step's mean ``mu_old`` (``Trajectory.means``)."""

    def sensitivities(self, sigmas: torch.Tensor, columns: list[int], *, noise_level: float,
                      kind: str) -> dict[int, float]:
        """{stored column: the sensitivity :meth:`log_ratio` takes for it} from the stored steps' sigmas [K + 1] and
        the trained ``columns``; empty where none is needed."""
        return {}

    def log_ratio(self, log_probs: torch.Tensor, old_log_probs: torch.Tensor, *, mean: torch.Tensor,
                  old_mean: Callable[[], torch.Tensor], prev_sample: torch.Tensor, std: torch.Tensor,
                  sensitivity: float | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(log_probs [B], old_log_probs [B]) for the policy loss, from the step's own ``log_probs`` [B] under the
        trained policy and ``old_log_probs`` [B] stored by the rollout; ``mean`` [B, ...] (with grad) and ``std``
        [B, 1, ...] are the trained step's, ``old_mean()`` the stored rollout mean (called only by a norm that
        stores means), ``prev_sample`` [B, ...] the stored next state. none: unchanged."""
        return log_probs, old_log_probs

    def loss_scale(self, sigma: float, sigma_next: float) -> float:
        """The factor on the step's policy loss (not on a KL term)."""
        return 1.0


class GrpoGuard(RatioNorm):
    """``grpo_guard``: :func:`grpo_guard_log_ratio` against a zero baseline, the loss times
    :func:`grpo_guard_loss_scale`."""

    store_means = True

    def log_ratio(self, log_probs, old_log_probs, *, mean, old_mean, prev_sample, std, sensitivity):
        log_probs = grpo_guard_log_ratio(mean, old_mean(), prev_sample, std)  # [B]
        return log_probs, torch.zeros_like(log_probs)

    def loss_scale(self, sigma: float, sigma_next: float) -> float:
        return grpo_guard_loss_scale(sigma, sigma_next)


class BatchSensitivity(RatioNorm):
    """``batch_sensitivity``: :func:`batch_sensitivity_log_ratio` against a zero baseline, with each trained step's
    :func:`step_sensitivities`."""

    def sensitivities(self, sigmas, columns, *, noise_level, kind):
        return step_sensitivities(sigmas, columns, noise_level=noise_level, kind=kind)

    def log_ratio(self, log_probs, old_log_probs, *, mean, old_mean, prev_sample, std, sensitivity):
        log_probs = batch_sensitivity_log_ratio(log_probs - old_log_probs, sensitivity)  # [B]
        return log_probs, torch.zeros_like(log_probs)


# train.ratio_norm -> its RatioNorm (the config's Literal lists the same names; tests hold them equal).
RATIO_NORMS: dict[str, RatioNorm] = {"none": RatioNorm(), "grpo_guard": GrpoGuard(),
                                     "batch_sensitivity": BatchSensitivity()}
