"""SDPO (Stepwise Diffusion Policy Optimization) for few-step models: the math on tensors.

Reference: github.com/ZiyiZhang27/sdpo at commit fcee34db05c0beead0d76b58b09f843af821c68e,
``scripts/train_sdpo.py`` (dense rewards, returns, advantages, the loss), ``sdpo_pytorch/diffusers_patch/
pipeline_with_logprob_sdpo.py`` (the anchor and the latent similarities) and ``sdpo_pytorch/stat_tracking.py``.

Two trajectories of one prompt start from the same noise (``train_sdpo.py`` L479-498: the second rollout is given
the first one's initial latents). Every step keeps its noisy state and the predicted clean latent x̂0 (dual state).
Step k's dense reward is that of the x̂0 predicted at the state step k starts from: the reference's DDIM step returns
the x̂0 of the ``sample`` it is given (``ddim_with_logprob_sdpo.py`` L81, L139), the pipeline stacks one per step
(``pipeline_with_logprob_sdpo.py`` L206-211) and decodes the first and the last of them (L213-215), the state
before the first step and the state before the last. So both rows of a pair get the same reward at step 0. The
reward is queried on a few x̂0s only (the first, the last and an anchor, the state least similar to both,
L225-241); every other step's dense reward is the mix of the queried ones weighted by the cosine similarity of its
x̂0 to theirs (raw similarities, normalised by their sum; queried steps keep their own score, the anchor's last,
``train_sdpo.py`` L555-562). Returns are discounted over steps, ``G_k = r_k + gamma G_(k+1)`` with no bootstrap
past the last step and the rewards themselves at ``gamma = 0`` (L631-635); advantages are per (prompt, step)
(L637-644), and the loss of step ``k`` matches the difference of the pair's log-ratios, weighted by
``lam**k / log_scale`` (temporal importance: early steps of a few-step schedule weigh more; L249-252, L785), to
the difference of their advantages, PPO-style: the larger of the squared error with the log-ratios as they are and
clamped to ``+-clip_range`` (L787-806).

Where flowrl differs, named:

- the last step. The reference's last DDIM step lands on ``alphas_cumprod[0]`` (about 0.999, nearly no noise), so
  the x̂0 before it is nearly the sample; a flow SDE's last step to sigma 0 adds noise of its own, which no
  step-start reward sees. ``train.sdpo_reward_at: step_end`` rewards each step by the x̂0 of the state it leads to
  instead (the last one is the sample, whose reward the rollout has; a pair's step-0 rewards then differ).
- the advantage is the recipe's estimator per step over the prompt's group (the reference keeps a
  per-(prompt, step) buffer of 32 across epochs, ``stat_tracking.py``, falling back to the batch's per-step
  statistics below 16 entries).
- the cosine similarities are taken in float64 (the reference's, under autocast, in the sampling dtype).
"""

from __future__ import annotations

import torch


def cosine_similarities(x0_preds: torch.Tensor, queried: torch.Tensor) -> torch.Tensor:
    """[N, S, Q] cosine similarity of every state's x̂0 (``x0_preds`` [N, S, ...]) to each queried state's
    (``queried`` [N, Q] state indices), on the flattened latents in float64."""
    flat = torch.nn.functional.normalize(x0_preds.reshape(*x0_preds.shape[:2], -1).double(), dim=-1)  # [N, S, D]
    anchors = torch.gather(flat, 1, queried[:, :, None].expand(-1, -1, flat.shape[-1]))  # [N, Q, D]
    return torch.einsum("nsd,nqd->nsq", flat, anchors)  # [N, S, Q], no [N, S, Q, D] intermediate


def least_similar_anchors(x0_preds: torch.Tensor, count: int) -> torch.Tensor:
    """[N, count] anchor states, each the one whose x̂0 has the smallest summed cosine similarity to the states
    queried so far (first, last, earlier anchors). With ``count=1`` this is the reference's
    ``argmin(sim_first + sim_last)`` (ties to the earliest); a state may repeat one already queried, as there."""
    n, states = x0_preds.shape[:2]
    queried = torch.tensor([0, states - 1]).repeat(n, 1)  # [N, 2]
    anchors = []
    for _ in range(count):
        total = cosine_similarities(x0_preds, queried).sum(-1)  # [N, S]
        anchor = total.argmin(dim=1)  # [N]
        anchors.append(anchor)
        queried = torch.cat([queried, anchor[:, None]], dim=1)
    return torch.stack(anchors, dim=1) if anchors else torch.zeros(n, 0, dtype=torch.long)


def predicted_rewards(queried_rewards: torch.Tensor, similarities: torch.Tensor,
                      queried: torch.Tensor) -> torch.Tensor:
    """Dense rewards [N, S]: ``sum_q r_q s_q / sum_q s_q`` from the queried rewards [N, Q], the similarities
    [N, S, Q] of each state to the queried ones, and the queried states [N, Q]; a queried state keeps its own
    reward (where two queries name one state, the later one's)."""
    rewards = queried_rewards.double()
    dense = (similarities * rewards[:, None]).sum(-1) / similarities.sum(-1)  # [N, S]
    rows = torch.arange(len(queried))
    for q in range(queried.shape[1]):
        dense[rows, queried[:, q]] = rewards[:, q]
    return dense


def discounted_returns(rewards: torch.Tensor, gamma: float) -> torch.Tensor:
    """``G_j = r_j + gamma G_{j+1}`` [N, S] from per-step rewards [N, S]; ``gamma=0``: the rewards themselves."""
    returns = rewards.clone()
    for j in reversed(range(rewards.shape[1] - 1)):
        returns[:, j] = rewards[:, j] + gamma * returns[:, j + 1]
    return returns


def temporal_weights(num_steps: int, lam: float, log_scale: float) -> torch.Tensor:
    """[num_steps] the weight ``lam**j / log_scale`` of step ``j``'s log-ratio difference (j from the first,
    noisiest step)."""
    return lam ** torch.arange(num_steps, dtype=torch.float64) / log_scale


def pair_difference_loss(log_probs: torch.Tensor, old_log_probs: torch.Tensor, advantages: torch.Tensor,
                         weights: torch.Tensor, *, clip_range: float) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-pair loss [P] of one step: ``max((w d - dA)^2, (w d_clip - dA)^2)``, with ``d`` the difference of the
    two members' log-ratios (``log_probs``, ``old_log_probs`` [P, 2]), ``d_clip`` that of the log-ratios clamped to
    ``+-clip_range``, ``dA`` the difference of their (already clipped) advantages [P, 2] and ``w`` [P] the step's
    temporal weight. Stats: ``clipped`` [P] (the clamped term is the larger), ``ratio`` [P, 2] (each member's) and
    ``approx_kl`` [P] (the members' mean k3 estimate, as the per-transition loss reports it)."""
    log_ratio = log_probs - old_log_probs  # [P, 2]
    clipped_ratio = log_ratio.clamp(-clip_range, clip_range)
    target = advantages[:, 0] - advantages[:, 1]  # [P]
    unclipped = (weights * (log_ratio[:, 0] - log_ratio[:, 1]) - target) ** 2
    clipped = (weights * (clipped_ratio[:, 0] - clipped_ratio[:, 1]) - target) ** 2
    loss = torch.maximum(unclipped, clipped)
    detached = log_ratio.detach()
    return loss, {"clipped": (clipped > unclipped).float().detach(), "ratio": detached.exp(),
                  "approx_kl": (torch.exp(-detached) - 1 + detached).mean(1)}


# train.loss: SDPO's loss on pairs of trajectories (recipe grpo's objective "sdpo" runs it).
PAIR_LOSSES = {"sdpo": pair_difference_loss}
