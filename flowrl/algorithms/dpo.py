"""Online DPO for flow models: Diffusion-DPO's loss in the flow-matching form, on preference pairs from each group.

Each prompt's group of rollouts yields pairs (winner w, loser l) by score (the group advantage): the best against
the worst (``best_worst``) or every pair whose scores differ (``all``) (:data:`PAIRINGS`). Equal scores give no
pair, so a group whose rewards all tie (zero advantages) gives none. Both samples of a pair are noised at one
shared (t, eps): ``x_t = (1 - t) x0 + t eps``, with the flow-matching target ``u = eps - x0`` (flowrl's
convention, ``flowrl.algorithms.forward_losses.noised_sample``). With ``e(x) = mean((v(x_t, t) - u)^2)`` over the non-batch
dims, under the trained model (``e``) and the reference (``e_ref``, the adapter off):

    diff = (e(w) - e_ref(w)) - (e(l) - e_ref(l))
    loss = -log sigmoid(-beta / 2 * diff)

The loss falls as the trained model fits the winner better and the loser worse than the reference does. Its
gradient is ``beta / 2 * sigmoid(beta / 2 * diff) * grad diff``: pairs the model already ranks right count less.

Units of ``beta``: ``e`` is the per-element mean squared velocity error, exactly as Diffusion-DPO's
``model_losses = (model_pred - target).pow(2).mean(dim=[1,2,3])`` (SalesforceAIResearch/DiffusionDPO ``train.py`` at
8d3ee5c, ``scale_term = -0.5 * args.beta_dpo``; its launchers use ``beta_dpo`` 5000 on SD1.5/SDXL's epsilon
errors). The paper's factor ``T`` (the number of diffusion steps) is not multiplied in: like Diffusion-DPO's code,
flowrl folds it into ``beta``. Flow-GRPO's online DPO for SD3.5-M writes the same loss on velocity errors with
target ``noise - x0`` and a shared (t, noise) per pair (``scripts/train_sd3_dpo.py``, read at
yifan123/flow_grpo_refactor 7be03dc), ``beta`` 100 (``config/dpo.py`` ``pickscore_sd3``, read in the mirror
ltt0716/flow_grpo_official at a646ae3), and pairs each group's argmax with its argmin (its per-prompt stat
tracker's ``dpo`` type).

What the recipe feeds this loss, against the references (yifan123/flow_grpo ``scripts/train_sd3_dpo.py`` at ac4c86e;
X-GenGroup/Flow-Factory ``src/flow_factory/trainers/dpo.py`` at a0b2bc5):

- Timesteps. Both references draw ``t`` logit-normal with mean 0 and std 1 by default: Flow-GRPO hard-codes diffusers'
  ``compute_density_for_timestep_sampling('logit_normal', logit_mean=0, logit_std=1)`` and indexes its 1000-step
  shifted training scheduler with it (L890-898), so SD3.5's shift 3 applies (P(sigma < 0.3) = 2.6%); Flow-Factory's
  ``DPOTrainingArguments`` default ``weighting_scheme='logit_normal'``, ``logit_mean=0``, ``logit_std=1``
  (``hparams/training_args.py`` L656-667) with ``time_shift=1`` (no shift, L674-677) over ``timestep_range`` 0.99.
  flowrl's default for loss dpo is therefore ``nft.timestep_schedule: logit_normal``
  (:func:`flowrl.algorithms.timesteps.logit_normal_timesteps`: Flow-GRPO's draw on the model's own shifted
  1000-step schedule, the model's shift acting as SD3.5's does there); ``sampling`` (the shifted sampling grid,
  DiffusionNFT's; on the toy's 10-step grid 1 sigma in 10 is below 0.3) stays available. Left as it is:
  Flow-Factory draws one t per timestep slot for its whole batch, flowrl and Flow-GRPO one per pair.
- Guidance. With ``train.cfg: true`` (the config default) ``e`` and ``e_ref`` are the errors of the guided velocity
  ``v_u + w (v_c - v_u)``, ``w`` the guidance scale, against the flow-matching target. A change of the adapter
  moves it by ``(1 - w) dv_u + w dv_c``: a change of the conditional branch alone counts ``w`` times, and the
  margin beta multiplies, a difference of squared errors, grows by ``w`` (its linear term) up to ``w^2``. So a beta
  set for the conditional velocity acts several to ``w^2`` times as strongly under CFG, and the references' beta
  values do not carry over. Both references train the conditional velocity: Flow-GRPO's learner and reference
  passes take the prompt embeddings alone (L905-922), Flow-Factory's SD3.5 DPO example trains at
  ``guidance_scale: 1.0`` ("no CFG; aligns with DPO train forward", ``examples/dpo/lora/sd3_5/default.yaml`` L7,
  L96-97). ``train.cfg: false`` is theirs.
- Reference. By default the base model (adapter off) for the whole run, as both references' defaults (Flow-GRPO's
  ``ref_update_step`` 10^7, ``config/dpo.py`` L47-48; Flow-Factory keeps a frozen copy). ``nft.dpo_ref_update_every:
  N`` makes the adapter the reference at the end of every N-th epoch, Flow-GRPO's online variant
  (``copy_learner_to_ref``, L134-139, called every ``ref_update_step`` optimizer steps at L614-615; here counted in
  epochs): :mod:`flowrl.recipes.dpo_reference`.
- Rollouts. flowrl's come from the trained adapter by the ODE; Flow-GRPO samples its reference adapter with SDE
  noise, so its online variant is on-policy only as often as the reference moves.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def matching_error(velocity: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """[B] the flow-matching error ``mean((v - u)^2)`` over the non-batch dims (``u = eps - x0``)."""
    return ((velocity - target) ** 2).mean(dim=tuple(range(1, velocity.ndim)))


def dpo_loss(error_w: torch.Tensor, error_l: torch.Tensor, ref_error_w: torch.Tensor, ref_error_l: torch.Tensor, *,
             beta: float) -> torch.Tensor:
    """[P] ``-log sigmoid(-beta / 2 * ((e_w - e_ref_w) - (e_l - e_ref_l)))`` per pair, all inputs [P] (the
    reference's errors are detached here)."""
    diff = (error_w - ref_error_w.detach()) - (error_l - ref_error_l.detach())  # [P]
    return -F.logsigmoid(-0.5 * beta * diff)


def best_worst_pairs(scores: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """[P, 2] (winner, loser) row indices: each group's highest score against its lowest (the first row of each on
    ties), where they differ. Non-finite scores take no part."""
    pairs = []
    for group in torch.unique(group_ids).tolist():
        rows = torch.nonzero((group_ids == group) & torch.isfinite(scores)).flatten()  # [g]
        if len(rows) < 2:
            continue
        group_scores = scores[rows]
        best, worst = rows[group_scores.argmax()], rows[group_scores.argmin()]
        if scores[best] > scores[worst]:
            pairs.append((int(best), int(worst)))
    return torch.tensor(pairs, dtype=torch.long).reshape(-1, 2)


def all_pairs(scores: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """[P, 2] (winner, loser) row indices: every ordered pair of one group whose scores differ, the winner the higher
    (a group of g distinct scores gives g (g - 1) / 2). Non-finite scores take no part (their comparisons are
    false)."""
    better = (group_ids[:, None] == group_ids[None, :]) & (scores[:, None] > scores[None, :])  # [N, N]
    return torch.nonzero(better).reshape(-1, 2)


# nft.dpo_pairs: how a group's rollouts become (winner, loser) pairs; (scores [N], group_ids [N]) -> [P, 2] rows.
PAIRINGS = {"best_worst": best_worst_pairs, "all": all_pairs}
