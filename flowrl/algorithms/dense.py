"""Dense (per-step) credit for trajectory RL: which denoising steps earned a trajectory's reward.

Plain GRPO gives every trained step of a row the row's one advantage ``A_n``. Two ways to tell the
steps apart (``train.credit``, recipe grpo):

- ``dense_cosine`` (cheap: no extra reward call; no extra model call either when the rollout stored
  its predictions, ``RolloutSettings(..., store_x0_preds=True)``, else one batched no-grad pass over the stored
  states recomputes them, :func:`predict_x0`). The prediction of the clean latent at stored state ``k`` is
  ``x0_hat_k = x_k - sigma_k v_k``; step ``k`` (``x_k -> x_{k+1}``) gains
  ``g_k = cos(x0_hat_{k+1}, x0) - cos(x0_hat_k, x0)`` toward the final latent ``x0``. The gains are
  clamped at 0 and normalised to sum 1 over the row's trained steps (uniform when every gain is 0),
  and ``A[n, k] = A_n * K * w[n, k]`` with ``K`` the number of trained steps, so the row's total
  credit (and the loss's scale) is the terminal one; only its split differs. A row with ``A_n < 0``
  puts most blame on the steps that moved most toward its (bad) image, which is where it was made.
  After the last stored state ``x_K`` the rollout runs no stochastic step: when ``x_K`` is the end of
  the schedule ``x0_hat_K = x0`` (cos 1); when a window ends earlier, ``x0_hat_K`` is the prediction at
  ``x_K`` (the velocity of the first ODE step after the window), so the deterministic ODE tail's own
  progress toward ``x0``, which the schedule rather than any trained step makes, is credited to no step
  instead of swelling the last window step's share.
- ``dense_ode`` (DenseGRPO). From each stored state ``x_k`` the current policy runs the deterministic
  ODE to the end (no grad, same guidance), the image is decoded and scored with the run's rewards,
  giving ``R_k``; ``R_K`` is the rollout's own final reward (the states after the last stored step are
  an ODE, so the look-ahead from ``x_K`` would reproduce it). Step ``k`` earns ``dR_k = R_{k+1} - R_k``,
  normalised per step across the group by the run's combiner and estimator (same step ``k``, same
  group: ``(dR - mean) / (std + 1e-4)`` for grpo, ``std_scope`` as configured) and clipped like GRPO
  advantages. ``train.dense_lookahead = L`` caps a look-ahead at ``L`` model calls: ``L - 1`` ODE
  steps, then the ``L``-th steps straight to sigma 0 (the Euler step to 0 is the prediction
  ``x - sigma v``); ``L = 1`` is the one-step look-ahead, which DenseGRPO finds worse than plain GRPO.

  What of DenseGRPO this is: its first component only, the step-wise reward gain from an ODE look-ahead
  used as each step's dense reward, derived from the paper's abstract (no code has been published to
  compare against; the group normalisation per step and the clip are flowrl's GRPO choices). Its second
  component is left out: the reward-aware calibration of the exploration space, which adjusts a
  timestep-specific noise level of the SDE sampler from the estimated dense rewards. The abstract does
  not give the rule (which statistic of the gains sets a step's noise, how it is updated), and with no
  reference code there is nothing to hold an implementation to; ``sampling.noise_level`` stays one value
  for every step. Rows of one epoch may hold different SDE windows (Flow-GRPO-Fast draws one per rollout
  batch): each row's look-ahead starts at its own stored steps, and a group, sampled in one batch, shares
  its window, so the per-step normalisation still compares the same step.

Every function takes flat arguments (tensors, a policy, a reward callable), never the config.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from flowrl.sampling.steps import sde_step


# --- dense_cosine ----------------------------------------------------------------------------------------

def cosine_gain_weights(x0_preds: torch.Tensor, final: torch.Tensor,
                        columns: Sequence[int] | torch.Tensor) -> torch.Tensor:
    """Per-step shares [N, K] of each row's credit; 0 off ``columns``, each row sums to 1 over them.

    ``x0_preds`` [N, K+1, ...] are the clean-latent predictions at the stored states (the rollout's
    ``x0_preds``), ``final`` [N, ...] the rollout's clean latent, ``columns`` the trained steps: a list
    shared by every row, or a [N, K] bool mask of each row's own.
    """
    n, states = x0_preds.shape[:2]
    preds = x0_preds.reshape(n, states, -1).double()
    target = final.reshape(n, 1, -1).double().to(preds.device)
    cosine = torch.nn.functional.cosine_similarity(preds, target, dim=-1)  # [N, K+1]
    gains = (cosine[:, 1:] - cosine[:, :-1]).clamp(min=0)  # [N, K]
    if isinstance(columns, torch.Tensor):
        keep = columns.to(device=gains.device, dtype=torch.bool)
    else:
        keep = torch.zeros_like(gains, dtype=torch.bool)
        keep[:, list(columns)] = True
    gains = torch.where(keep, gains, torch.zeros_like(gains))
    total = gains.sum(1, keepdim=True)  # [N, 1]
    uniform = keep.double() / keep.sum(1, keepdim=True).clamp(min=1)
    return torch.where(total > 0, gains / total.clamp(min=1e-300), uniform).float()


def cosine_advantages(row_advantages: torch.Tensor, weights: torch.Tensor,
                      num_trained: int | torch.Tensor) -> torch.Tensor:
    """``A[n, k] = A_n * K * w[n, k]`` [N, K]: the row's credit split over its ``K`` trained steps (an int, or
    [N] per row)."""
    if isinstance(num_trained, torch.Tensor):
        num_trained = num_trained.to(weights)[:, None]  # [N, 1]
    return row_advantages[:, None].to(weights) * num_trained * weights


@torch.no_grad()
def predict_x0(policy, latents: torch.Tensor, sigmas: torch.Tensor, cond, guidance: float, *,
               batch_size: int = 16) -> torch.Tensor:
    """Clean-latent predictions ``x - sigma v`` [N, K+1, ...] float32 at stored states [N, K+1, ...]
    with noise levels ``sigmas`` ([N, K+1] per row, or [K+1] shared; a clean state, sigma 0, is its own
    prediction); ``cond`` holds the N rows' conditioning. The recomputing twin of
    ``RolloutSettings(..., store_x0_preds=True)``."""
    out = torch.empty(latents.shape, dtype=torch.float32, device=latents.device)
    sigmas = sigmas.expand(latents.shape[0], -1)  # [N, K+1]
    for k in range(latents.shape[1]):
        column = sigmas[:, k].cpu()
        for value in dict.fromkeys(column.tolist()):  # rows of different windows sit at different sigmas
            same = (column == value).nonzero()[:, 0]
            for rows in same.split(batch_size):
                x = latents[rows, k].to(policy.device)
                if value == 0:
                    out[rows, k] = x.float().to(out.device)
                    continue
                sigma = sigmas[rows[0], k]
                velocity = policy.velocity(x, sigma, cond.select(rows), guidance)
                out[rows, k] = (x.float() - sigma.to(x.device).float() * velocity.float()).to(out.device)
    return out


def top_step_share(advantages: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's largest share of its total |advantage| over its trained steps [N] (1/K: spread evenly,
    1: one step takes it all), and which rows have any [N] bool. The mean |advantage| cannot show this:
    dense_cosine keeps it equal to the terminal one by construction."""
    size = advantages.abs() * mask  # [N, K]
    total = size.sum(1)
    return size.max(1).values / total.clamp(min=1e-12), total > 0


# --- dense_ode ---------------------------------------------------------------------------------------------

@torch.no_grad()
def ode_lookahead(policy, latents: torch.Tensor, sigmas: torch.Tensor, cond, guidance: float, *,
                  steps: int | None = None) -> torch.Tensor:
    """Clean latents [B, ...]: the deterministic ODE from ``latents`` [B, ...] at ``sigmas[0]`` along the
    remaining schedule ``sigmas`` [M+1] (ending at 0), Euler steps exactly as the rollout takes them.

    ``steps`` caps the model calls: after ``steps - 1`` steps the last one goes straight to sigma 0.
    """
    remaining = len(sigmas) - 1
    steps = remaining if steps is None else min(steps, remaining)
    sigmas = sigmas.to(latents.device)
    x = latents
    for j in range(steps):
        target = sigmas[j + 1] if j < steps - 1 else sigmas[-1]
        velocity = policy.velocity(x, sigmas[j], cond, guidance)
        x = sde_step(velocity, x, sigmas[j], target, noise_level=0.0, kind="ode").prev_sample
    return x


def lookahead_states(columns: Sequence[int], num_stored: int) -> list[int]:
    """Stored states whose look-ahead reward the gains of steps ``columns`` need (``R_k`` and
    ``R_{k+1}``; ``R_K`` is the rollout's own reward)."""
    return sorted({s for k in columns for s in (k, k + 1) if s < num_stored})


@torch.no_grad()
def lookahead_rewards(policy, latents: torch.Tensor, schedule: torch.Tensor, step_indices: torch.Tensor, cond,
                      guidance: float, reward_fn: Callable[[torch.Tensor], dict[str, torch.Tensor]], *,
                      states: Sequence[int], steps: int | None = None, batch_size: int = 16,
                      decode_batch_size: int = 16) -> dict[str, torch.Tensor]:
    """Look-ahead rewards {key: [N, K]} (NaN at states not in ``states``) of stored states ``latents``
    [N, K+1, ...], state ``k`` of row ``n`` lying at position ``step_indices[n, k]`` of the full ``schedule``
    [T+1] (``step_indices`` [N, K], or [K] shared by every row).

    ``cond`` holds the N rows' conditioning; ``reward_fn(images [N, 3, H, W]) -> {key: [N]}`` scores
    one look-ahead image per row and is called once per state, on all rows together.
    """
    n, num_stored = latents.shape[0], latents.shape[1] - 1
    step_indices = step_indices.cpu().expand(n, -1)  # [N, K]
    out: dict[str, torch.Tensor] = {}
    for k in states:
        starts = step_indices[:, k]  # [N] rows of different windows run the ODE from different steps
        order, images = [], []
        for start in dict.fromkeys(starts.tolist()):
            for rows in (starts == start).nonzero()[:, 0].split(batch_size):
                clean = ode_lookahead(policy, latents[rows, k].to(policy.device), schedule[start:],
                                      cond.select(rows), guidance, steps=steps)
                images.extend(policy.decode(chunk) for chunk in clean.split(decode_batch_size))
                order.append(rows)
        images = torch.cat(images)[torch.argsort(torch.cat(order))]  # back to row order
        for key, values in reward_fn(images).items():
            column = out.setdefault(key, torch.full((n, num_stored), float("nan")))
            column[:, k] = values.float().cpu()
    return out


def reward_gains(step_rewards: torch.Tensor, final_rewards: torch.Tensor) -> torch.Tensor:
    """``dR_k = R_{k+1} - R_k`` [N, K] from look-ahead rewards [N, K] and the final reward ``R_K`` [N]."""
    after = torch.cat([step_rewards[:, 1:], final_rewards[:, None].to(step_rewards)], dim=1)
    return after - step_rewards


def stepwise_advantages(gains: dict[str, torch.Tensor], weights: dict[str, float], group_ids: torch.Tensor,
                        combine: Callable, estimator: Callable, *, clip: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-step advantages [N, K] and combined gains [N, K] from per-reward gains {key: [N, K]}.

    Each step is its own advantage problem: ``combine`` (a reward combiner, weighted sum by default)
    and ``estimator(r, group_ids)`` normalise step ``k``'s gains across its group; NaN gains (a reward
    that could not score, a state not looked ahead from) get advantage 0, as NaN rewards do.
    """
    num_stored = next(iter(gains.values())).shape[1]
    advantages, combined = [], []
    for k in range(num_stored):
        adv, comb = combine({key: gains[key][:, k] for key in weights}, weights, group_ids, estimator)
        advantages.append(adv.clamp(-clip, clip))
        combined.append(comb)
    return torch.stack(advantages, dim=1), torch.stack(combined, dim=1)
