"""The denoising loop, written out: N = prompts x group_size trajectories -> :class:`Trajectory`.

How to sample is one :class:`~flowrl.sampling.settings.RolloutSettings` (steps, guidance, noise, plan, solver,
what to store); what differs per call (prompts, group size, seeds, metadata, conditioning) are parameters.
Steps inside the plan's SDE window are stochastic (``kind``: sde or cps, at ``noise_level`` or the plan's
per-step level) and stored with their log-probabilities; every other step is a deterministic ODE step of
``ode_solver`` (Euler; or MixGRPO-Flash's ``mixgrpo_flash``: Euler up to the end of the window, DPM-Solver++(2M)
after it, its history holding the window's clean-latent predictions; see ``flowrl.sampling.steps.ODE_SOLVERS``).
Tree rollouts split each row into ``branch_factor`` children right before every branch step: children share
the parent's computed prefix (computed once) and differ from that step on because each child draws its own
noise (times ``plan.split_noise_scale`` at the branch step itself, BranchGRPO's split noise; the
recorded log-probability is that of the unscaled step).

Randomness is per row: the initial noise of a row comes from a generator seeded with the row's
seed, exactly as diffusers draws it from a list of generators, so an ODE rollout reproduces the
diffusers pipeline; the noise of step ``i`` comes from ``derive_seed(row_seed, i + 1)``; a child
row's seed is ``derive_seed(parent_seed, branch_step, child)``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from flowrl.models.base import Policy, TextCond
from flowrl.sampling.plan import StepPlan
from flowrl.sampling.self_guidance import ONE_IMAGE_ERROR, installed
from flowrl.sampling.settings import RolloutSettings
from flowrl.sampling.steps import ODE_SOLVERS, ScheduleSteps, clean_prediction, euler_ode_step
from flowrl.sampling.trajectory import Trajectory, concat_trajectories
from flowrl.core.seeding import derive_seed, generators


def root_seeds(seed: int, first_row: int, count: int) -> list[int]:
    """Seeds of root rows ``first_row .. first_row + count - 1`` of a run (global row indices)."""
    return [derive_seed(seed, row) for row in range(first_row, first_row + count)]


@dataclass
class _TreeRows:
    """Who each row is: its prompt, its seed, the tree edge it is on and the row it split from. A rollout without
    branch steps keeps one row per root; a branch step splits every row into ``k`` children."""

    prompt_ids: torch.Tensor  # [rows] index into the rollout's prompts
    seeds: torch.Tensor  # [rows] a root's seed, or a child's derived from its parent's
    edges: torch.Tensor  # [rows] id of the tree edge each row is on; a branch rebinds it, never writes it
    parent: torch.Tensor  # [rows] the row this row branched from at its last branch point (child 0), or -1
    next_edge: int  # the first edge id not used yet

    @classmethod
    def roots(cls, prompt_ids: torch.Tensor, seeds: torch.Tensor) -> _TreeRows:
        rows = len(seeds)
        return cls(prompt_ids, seeds, torch.arange(rows), torch.full((rows,), -1, dtype=torch.long), rows)

    def branch(self, step: int, k: int) -> None:
        """Split every row into ``k`` children at ``step``: child ``c``'s seed is ``derive_seed(seed, step, c)``,
        children 1 .. k-1 branch from child 0 (which carries the parent's line on), and every child is on a new
        edge."""
        rows = len(self.seeds)
        child = torch.arange(k).repeat(rows)  # [rows * k]
        self.prompt_ids = self.prompt_ids.repeat_interleave(k)
        self.seeds = torch.tensor([derive_seed(s, step, c) for s, c in zip(self.seeds.repeat_interleave(k).tolist(),
                                                                           child.tolist())])
        parent = torch.where(self.parent >= 0, self.parent * k, self.parent).repeat_interleave(k)
        first_child = torch.arange(rows) * k
        self.parent = torch.where(child > 0, first_child.repeat_interleave(k), parent)
        self.edges = torch.arange(self.next_edge, self.next_edge + rows * k)
        self.next_edge += rows * k


@dataclass
class _StoredWindow:
    """What the loop keeps of the plan's SDE window, one entry per stored state or step, rows in row order."""

    latents: list[torch.Tensor] = field(default_factory=list)  # K+1 x [rows, C, (F,) h, w]; F: video frames
    log_probs: list[torch.Tensor] = field(default_factory=list)  # K x [rows]
    edges: list[torch.Tensor] = field(default_factory=list)  # K x [rows]
    x0_preds: list[torch.Tensor] = field(default_factory=list)  # K+1 x [rows, C, (F,) h, w] float32, store_x0_preds
    means: list[torch.Tensor] = field(default_factory=list)  # K x [rows, C, (F,) h, w] float32, store_means

    def repeat_rows(self, k: int) -> None:
        """At a branch step: every child carries its parent's stored prefix."""
        self.latents = [t.repeat_interleave(k, dim=0) for t in self.latents]
        self.log_probs = [t.repeat_interleave(k) for t in self.log_probs]
        self.edges = [t.repeat_interleave(k) for t in self.edges]
        self.x0_preds = [t.repeat_interleave(k, dim=0) for t in self.x0_preds]
        self.means = [t.repeat_interleave(k, dim=0) for t in self.means]


def _roots_per_group(settings: RolloutSettings, plan: StepPlan, group_size: int, num_prompts: int,
                     seeds: Sequence[int]) -> int:
    """Root rows per group (``group_size`` over the tree's leaves per root), once the arguments are checked."""
    if settings.ode_solver not in ODE_SOLVERS:
        raise ValueError(f"unknown ode_solver {settings.ode_solver!r}; choose one of {sorted(ODE_SOLVERS)}")
    if plan.num_steps != settings.num_steps:
        raise ValueError(f"plan has {plan.num_steps} steps but num_steps={settings.num_steps}")
    if group_size % plan.leaves_per_root:
        raise ValueError(f"group_size {group_size} is not a multiple of the tree's {plan.leaves_per_root} leaves")
    roots_per_group = group_size // plan.leaves_per_root
    if len(seeds) != num_prompts * roots_per_group:
        raise ValueError(f"need {num_prompts * roots_per_group} root seeds, got {len(seeds)}")
    if settings.self_guidance is not None and group_size < 2:
        raise ValueError(ONE_IMAGE_ERROR)
    return roots_per_group


def _initial_noise_seeds(settings: RolloutSettings, row_seeds: torch.Tensor, roots_per_group: int,
                         group_size: int) -> torch.Tensor:
    """The seed each root row draws its initial noise from ``[R]``: its own, or with ``same_noise_in_group`` the
    group's first row's, or with ``same_noise_in_pairs`` the pair's first row's."""
    init_seeds = row_seeds.clone()
    if settings.same_noise_in_pairs and roots_per_group % 2:
        raise ValueError(f"same_noise_in_pairs pairs the rows of a group: group_size {group_size} must be even")
    if settings.same_noise_in_group:
        init_seeds = row_seeds[::roots_per_group].repeat_interleave(roots_per_group)
    elif settings.same_noise_in_pairs:
        init_seeds = row_seeds[::2].repeat_interleave(2)
    return init_seeds


@torch.no_grad()
def rollout(policy: Policy, prompts: Sequence[str], settings: RolloutSettings, *, group_size: int,
            seeds: Sequence[int], metadata: Sequence[dict] | None = None, cond: TextCond | None = None) -> Trajectory:
    """Sample ``len(prompts) * group_size`` trajectories as ``settings`` says; only the plan's SDE steps are stored.

    ``seeds`` holds one seed per root row (``len(prompts) * group_size // plan.leaves_per_root``). ``metadata``
    (one dict per prompt) goes to the text encoder and into the trajectory; ``cond``, the prompts' text
    conditioning where the caller has it already (None: encoded here, once per prompt).
    """
    plan = settings.step_plan
    roots_per_group = _roots_per_group(settings, plan, group_size, len(prompts), seeds)
    num_steps, self_guidance = settings.num_steps, settings.self_guidance
    solver, ode_history = ODE_SOLVERS[settings.ode_solver], None
    guided = policy.transformer if self_guidance is not None else None  # the blocks self-guidance hooks

    # 1. Text conditioning once per prompt; rows index into it.
    if cond is None:
        cond = policy.encode(list(prompts), metadata=metadata)
    device = policy.device
    row_seeds = torch.tensor([int(s) for s in seeds], dtype=torch.long)  # [R]
    rows = _TreeRows.roots(torch.arange(len(prompts)).repeat_interleave(roots_per_group), row_seeds)  # R roots
    init_seeds = _initial_noise_seeds(settings, row_seeds, roots_per_group, group_size)  # [R]

    # 2. Initial noise, drawn per row like diffusers does with a list of generators.
    x = policy.init_noise(len(row_seeds), generator=generators(init_seeds.tolist()))  # [R, C, (F,) h, w]
    sigmas = policy.sigmas(num_steps)  # [num_steps + 1]
    # Everything that depends on the schedule alone is prepared once, on the latents' device: no per-step
    # host-to-device copy of a sigma (each one a blocking sync on a GPU) and no per-step coefficient math.
    step_sigmas = sigmas.to(x.device)
    sde_steps, branch_steps = plan.sde_steps, set(plan.branch_steps)
    schedules: dict[float, ScheduleSteps] = {}  # one per noise level in use (plan.noise_levels may vary it)

    def schedule_at(step: int) -> ScheduleSteps:
        level = plan.noise_level_at(step, settings.noise_level)
        if level not in schedules:
            schedules[level] = ScheduleSteps(sigmas, noise_level=level, kind=settings.kind, dtype=x.dtype,
                                             device=x.device)
        return schedules[level]

    stored = _StoredWindow()
    # Per-row state that only changes at a branch step: conditioning rows, seeds, noise generators
    # (re-seeded every step; manual_seed resets a generator completely, so this equals a fresh one).
    row_cond = cond.select(rows.prompt_ids)
    seed_list = rows.seeds.tolist()
    step_generators = [torch.Generator(device=x.device) for _ in seed_list]

    # 3. The loop.
    for i in range(num_steps):
        if i in branch_steps:
            x = x.repeat_interleave(plan.branch_factor, dim=0)  # [rows * k, C, (F,) h, w]
            rows.branch(i, plan.branch_factor)
            stored.repeat_rows(plan.branch_factor)
            row_cond = cond.select(rows.prompt_ids)
            seed_list = rows.seeds.tolist()
            step_generators = [torch.Generator(device=x.device) for _ in seed_list]

        with installed(self_guidance, guided, i, rows.prompt_ids):
            velocity = policy.velocity(x, step_sigmas[i], row_cond, settings.guidance_scale)
        if settings.store_x0_preds and i in range(sde_steps.start, sde_steps.stop + 1):  # stored states only
            stored.x0_preds.append(x.float() - step_sigmas[i].float() * velocity.float())
        if i in sde_steps:
            if not stored.latents:
                stored.latents.append(x)
            for generator, row_seed in zip(step_generators, seed_list):
                generator.manual_seed(derive_seed(row_seed, i + 1))
            out = schedule_at(i).step(i, velocity, x, generator=step_generators,
                                      noise_scale=plan.split_noise_scale if i in branch_steps else 1.0)
            stored.latents.append(out.prev_sample)
            stored.log_probs.append(out.log_prob)
            stored.edges.append(rows.edges)
            if settings.store_means:
                stored.means.append(out.mean)
            # MixGRPO-Flash seeds the solver after the window with the window steps' x0 predictions (from the
            # states before their noise); a restarting solver drops its history: the noise left the ODE path.
            ode_history = (clean_prediction(velocity, x, step_sigmas[i]), step_sigmas[i]) if solver.after_window \
                else None
            x = out.prev_sample
        elif solver.after_window and i < sde_steps.stop:  # MixGRPO-Flash: Euler up to the window's end
            x, _ = euler_ode_step(velocity, x, step_sigmas[i], step_sigmas[i + 1])
        else:
            x, ode_history = solver.step(velocity, x, step_sigmas[i], step_sigmas[i + 1], ode_history)

    if settings.store_x0_preds and sde_steps.stop == num_steps:  # the window reaches the end: x_K is clean
        stored.x0_preds.append(x.float())

    # 4. Decode the clean latents in chunks (the VAE is the memory peak at high resolution).
    images = None
    if settings.decode:
        images = torch.cat([policy.decode(chunk) for chunk in x.split(settings.decode_batch_size)])

    num_rows = len(rows.seeds)
    window = torch.tensor(list(plan.sde_steps), dtype=torch.long).repeat(num_rows, 1)  # [N, K]
    window_sigmas = sigmas[plan.sde_steps.start: plan.sde_steps.stop + 1].repeat(num_rows, 1)  # [N, K+1]
    return Trajectory(
        latents=torch.stack(stored.latents, dim=1),
        log_probs=torch.stack(stored.log_probs, dim=1).float(),
        row_sigmas=window_sigmas,
        row_timesteps=window_sigmas[:, :-1] * 1000,
        row_step_indices=window,
        final_latents=x,
        prompt_ids=rows.prompt_ids.to(device),
        group_ids=rows.prompt_ids.to(device).clone(),
        seeds=rows.seeds,
        edge_ids=torch.stack(stored.edges, dim=1),
        parent=rows.parent,
        prompts=list(prompts),
        metadata=list(metadata) if metadata is not None else [],
        images=images,
        cond=cond,
        x0_preds=torch.stack(stored.x0_preds, dim=1) if settings.store_x0_preds else None,
        means=torch.stack(stored.means, dim=1) if settings.store_means else None,
    )


def chunked_rollout(policy: Policy, prompts: Sequence[str], settings: RolloutSettings, *, group_size: int,
                    seeds: Sequence[int], chunk: int | None = None, metadata: Sequence[dict] | None = None,
                    cond: TextCond | None = None, rollout_fn=None) -> Trajectory:
    """:func:`rollout` ``chunk`` trajectories at a time (whole groups, or equal parts of each group), joined:
    the same trajectories as one call, since every row's noise comes from its own seed; only memory differs,
    and the float rounding of kernels that a backend picks by batch size (bit-identical where it does not).

    ``chunk`` must be a multiple or a divisor of ``group_size`` and a multiple of the tree's leaves per root;
    None (or a chunk holding the whole batch) is one call. Tree edge ids are numbered per chunk. ``rollout_fn``
    replaces :func:`rollout` by a loop with its signature (SA-Solver's, :mod:`flowrl.sampling.sa_solver`)."""
    rollout_fn = rollout_fn or rollout
    if not chunk or chunk >= len(prompts) * group_size:
        return rollout_fn(policy, prompts, settings, group_size=group_size, seeds=seeds, metadata=metadata, cond=cond)
    leaves = settings.plan.leaves_per_root if settings.plan is not None else 1
    if (chunk % group_size and group_size % chunk) or chunk % leaves:
        raise ValueError(f"rollout chunk {chunk} must be a multiple or a divisor of group_size {group_size} "
                         f"and a multiple of the tree's {leaves} leaves per root")
    if settings.same_noise_in_group and chunk < group_size:
        raise ValueError("same_noise_in_group needs whole groups per rollout chunk")
    if settings.same_noise_in_pairs and min(chunk, group_size) % 2:
        raise ValueError("same_noise_in_pairs needs whole pairs per rollout chunk: use an even rollout_chunk")
    cond = policy.encode(list(prompts), metadata=metadata) if cond is None else cond
    per_chunk, size = max(chunk // group_size, 1), min(chunk, group_size)  # prompts per chunk, rows per group part
    roots, group_roots = size // leaves, group_size // leaves
    parts, prompt_ids = [], []
    for first in range(0, len(prompts), per_chunk):
        index = list(range(first, min(first + per_chunk, len(prompts))))
        for offset in range(0, group_roots, roots):
            part = rollout_fn(policy, [prompts[p] for p in index], settings, group_size=size, cond=cond.select(index),
                              seeds=[seeds[p * group_roots + offset + j] for p in index for j in range(roots)],
                              metadata=[metadata[p] for p in index] if metadata is not None else None)
            prompt_ids.append(part.prompt_ids + first)
            parts.append(part)
    traj = concat_trajectories(parts)
    # One entry per prompt, as one call gives: a group split over chunks keeps one prompt id and group id.
    traj.prompt_ids = torch.cat(prompt_ids)
    traj.group_ids = traj.prompt_ids.clone()
    traj.prompts, traj.metadata, traj.cond = list(prompts), list(metadata) if metadata is not None else [], cond
    return traj
