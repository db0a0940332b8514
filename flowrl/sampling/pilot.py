"""Pilot-Commit: spend a batch's rollouts on the prompts whose rewards still vary.

A prompt whose group rewards are all equal gets zero group-normalised advantages, so its rollouts
teach GRPO (and NFT) nothing, and which prompts have collapsed changes as the policy trains. So
each rollout batch first pilots more candidate prompts than it needs, a few rollouts each; the
spread of each candidate's pilot rewards estimates how informative it is; the batch's prompts are
the candidates with the highest pilot variance, and only they get the rest of their group. The
pilot rollouts of a committed prompt stay in its group: they come from the same policy in the same
epoch, so they are samples like the others. Uncommitted pilot rollouts are dropped.

Choices:
- informativeness is the population variance of a candidate's finite pilot rewards (the combined
  training signal; the recipe computes it with :func:`flowrl.algorithms.advantages.group_variances`,
  a candidate being a group); a candidate whose finite rewards are all equal, or that has none, has
  variance exactly 0, the same test as ``policy/zero_std_groups``;
- candidates are ranked by variance, ties in candidate order, so a zero-variance candidate is
  committed only when fewer than ``num_commit`` candidates vary (the batch shape stays fixed), and
  the choice is a pure function of the rewards;
- root-row layout: candidate ``c`` of a batch owns the ``group_size`` root rows
  ``first_row + c * group_size + [0, group_size)``; its pilot takes the first ``pilot_size`` of
  them and its commit the rest, so row seeds are unique across both passes and a committed group
  has exactly the seeds a full group of that candidate would have had.
"""

from __future__ import annotations

from typing import Sequence

import torch

from flowrl.sampling.rollout import root_seeds
from flowrl.sampling.trajectory import Trajectory


def commit_candidates(variances: torch.Tensor, num_commit: int) -> torch.Tensor:
    """[num_commit] long, ascending: the candidates with the highest ``variances [C]`` (ties in
    candidate order). Zero-variance candidates rank last, so they only fill a batch that has fewer
    than ``num_commit`` varying candidates."""
    if not 0 <= num_commit <= variances.numel():
        raise ValueError(f"cannot commit {num_commit} of {variances.numel()} candidates")
    order = torch.sort(variances.detach().cpu().double(), descending=True, stable=True).indices
    return order[:num_commit].sort().values


def slot_seeds(seed: int, first_row: int, candidates: Sequence[int], group_size: int, start: int,
               stop: int) -> list[int]:
    """Root seeds of rows ``[start, stop)`` of each candidate's group slot (see the module docstring),
    candidate by candidate."""
    return [s for c in candidates for s in root_seeds(seed, first_row + int(c) * group_size + start, stop - start)]


def join_committed(pilot: Trajectory, commit: Trajectory, committed: torch.Tensor,
                   group_ids: torch.Tensor) -> Trajectory:
    """One group per committed candidate: its pilot rows, then its commit rows; other pilot rows are
    dropped.

    ``pilot`` holds the candidates (prompt id = candidate index), ``commit`` the rest of the groups of
    the candidates ``committed [P]`` (prompt id ``j`` = ``committed[j]``), both scored and from the
    same step plan. ``group_ids [P]`` are the groups' globally unique ids. Prompts, metadata and
    conditioning are the commit's.
    """
    pilot_prompts, commit_prompts = pilot.prompt_ids.cpu(), commit.prompt_ids.cpu()
    order, prompt_ids = [], []  # rows of cat(pilot, commit) in group order; their prompt in the result
    for j, c in enumerate(committed.tolist()):
        rows = torch.cat([torch.nonzero(pilot_prompts == c).flatten(),
                          pilot.num_rows + torch.nonzero(commit_prompts == j).flatten()])
        order.append(rows)
        prompt_ids.append(torch.full((len(rows),), j, dtype=torch.long))
    order, prompt_ids = torch.cat(order), torch.cat(prompt_ids)  # [P * G]

    def take(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.cat([a, b.to(a.device)])[order.to(a.device)]

    # Tree edges and parents are per rollout call: shift the commit's past the pilot's, then map
    # parents to their new row (a dropped parent becomes -1; without trees every parent is -1).
    edges = take(pilot.edge_ids, commit.edge_ids + int(pilot.edge_ids.max()) + 1)
    parents = torch.cat([pilot.parent.cpu(), torch.where(commit.parent >= 0, commit.parent + pilot.num_rows,
                                                         commit.parent).cpu()])
    new_row = torch.full((len(parents),), -1, dtype=torch.long)
    new_row[order] = torch.arange(len(order))
    parents = parents[order]
    parents = torch.where(parents >= 0, new_row[parents.clamp(min=0)], parents).to(pilot.parent.device)
    keys = list(dict.fromkeys([*pilot.rewards, *commit.rewards]))
    nan = lambda t: torch.full((t.num_rows,), float("nan"))  # noqa: E731  (a reward that failed on one pass)
    rewards = {k: take(pilot.rewards.get(k, nan(pilot)).float().cpu(), commit.rewards.get(k, nan(commit)).float())
               for k in keys}
    optional = {name: None if getattr(pilot, name) is None or getattr(commit, name) is None
                else take(getattr(pilot, name), getattr(commit, name)) for name in ("images", "x0_preds", "means")}
    return Trajectory(
        latents=take(pilot.latents, commit.latents),
        log_probs=take(pilot.log_probs, commit.log_probs),
        row_sigmas=take(pilot.row_sigmas, commit.row_sigmas),
        row_timesteps=take(pilot.row_timesteps, commit.row_timesteps),
        row_step_indices=take(pilot.row_step_indices, commit.row_step_indices),
        final_latents=take(pilot.final_latents, commit.final_latents),
        prompt_ids=prompt_ids.to(commit.prompt_ids.device),
        group_ids=group_ids.to(commit.group_ids.device)[prompt_ids.to(commit.group_ids.device)],
        seeds=take(pilot.seeds, commit.seeds),
        edge_ids=edges,
        parent=parents,
        prompts=list(commit.prompts),
        metadata=list(commit.metadata),
        cond=commit.cond,
        rewards=rewards,
        **optional,
    )
