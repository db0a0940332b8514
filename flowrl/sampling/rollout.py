"""The denoising loop, written out: N = prompts x group_size trajectories -> :class:`Trajectory`.

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

from typing import Sequence

import torch

from flowrl.models.base import Policy, TextCond
from flowrl.sampling.plan import StepPlan
from flowrl.sampling.self_guidance import ONE_IMAGE_ERROR, SelfGuidance, installed
from flowrl.sampling.steps import ODE_SOLVERS, ScheduleSteps, StepKind, clean_prediction, euler_ode_step
from flowrl.sampling.trajectory import Trajectory, concat_trajectories
from flowrl.seeding import derive_seed, generators


def root_seeds(seed: int, first_row: int, count: int) -> list[int]:
    """Seeds of root rows ``first_row .. first_row + count - 1`` of a run (global row indices)."""
    return [derive_seed(seed, row) for row in range(first_row, first_row + count)]


@torch.no_grad()
def rollout(
    policy: Policy,
    prompts: Sequence[str],
    *,
    group_size: int,
    num_steps: int,
    guidance_scale: float,
    noise_level: float,
    seeds: Sequence[int],
    kind: StepKind = "sde",
    plan: StepPlan | None = None,
    same_noise_in_group: bool = False,
    same_noise_in_pairs: bool = False,
    metadata: Sequence[dict] | None = None,
    cond: TextCond | None = None,
    decode: bool = True,
    decode_batch_size: int = 16,
    store_x0_preds: bool = False,
    ode_solver: str = "euler",
    store_means: bool = False,
    self_guidance: SelfGuidance | None = None,
) -> Trajectory:
    """Sample ``len(prompts) * group_size`` trajectories; only the plan's SDE steps are stored.

    ``seeds`` holds one seed per root row (``len(prompts) * group_size // plan.leaves_per_root``).
    With ``same_noise_in_group`` every row of a group starts from the first row's initial noise; with
    ``same_noise_in_pairs`` rows 2i and 2i + 1 of a group share row 2i's (SDPO's pairs; an even group).
    With ``store_x0_preds`` the trajectory also keeps the clean-latent prediction ``x - sigma v`` at
    every stored state from the velocities the loop computes anyway (no extra model call). With
    ``store_means`` it keeps the float32 mean of every stored step (GRPO-Guard's ratio needs the sampling
    policy's mean). ``self_guidance`` disperses the transformer features of each group's rows at its steps
    (:mod:`flowrl.sampling.self_guidance`; None: off).
    ``ode_solver`` names the solver of the unstored deterministic steps (:data:`ODE_SOLVERS`): where it
    acts (after the window only, or on every deterministic step) and whether its history carries the
    window's clean-latent predictions or restarts after every SDE step.
    """
    plan = plan or StepPlan(num_steps)
    if ode_solver not in ODE_SOLVERS:
        raise ValueError(f"unknown ode_solver {ode_solver!r}; choose one of {sorted(ODE_SOLVERS)}")
    solver, ode_history = ODE_SOLVERS[ode_solver], None
    if plan.num_steps != num_steps:
        raise ValueError(f"plan has {plan.num_steps} steps but num_steps={num_steps}")
    if group_size % plan.leaves_per_root:
        raise ValueError(f"group_size {group_size} is not a multiple of the tree's {plan.leaves_per_root} leaves")
    roots_per_group = group_size // plan.leaves_per_root
    num_prompts = len(prompts)
    if len(seeds) != num_prompts * roots_per_group:
        raise ValueError(f"need {num_prompts * roots_per_group} root seeds, got {len(seeds)}")
    if self_guidance is not None and group_size < 2:
        raise ValueError(ONE_IMAGE_ERROR)
    guided = policy.transformer if self_guidance is not None else None  # the blocks self-guidance hooks

    # 1. Text conditioning once per prompt; rows index into it.
    if cond is None:
        cond = policy.encode(list(prompts), metadata=metadata)
    device = policy.device
    prompt_ids = torch.arange(num_prompts).repeat_interleave(roots_per_group)  # [R]
    row_seeds = torch.tensor([int(s) for s in seeds], dtype=torch.long)  # [R]
    init_seeds = row_seeds.clone()
    if same_noise_in_pairs and roots_per_group % 2:
        raise ValueError(f"same_noise_in_pairs pairs the rows of a group: group_size {group_size} must be even")
    if same_noise_in_group:
        init_seeds = row_seeds[::roots_per_group].repeat_interleave(roots_per_group)
    elif same_noise_in_pairs:
        init_seeds = row_seeds[::2].repeat_interleave(2)

    # 2. Initial noise, drawn per row like diffusers does with a list of generators.
    x = policy.init_noise(len(row_seeds), generator=generators(init_seeds.tolist()))  # [R, C, (F,) h, w]
    sigmas = policy.sigmas(num_steps)  # [num_steps + 1]
    # Everything that depends on the schedule alone is prepared once, on the latents' device: no per-step
    # host-to-device copy of a sigma (each one a blocking sync on a GPU) and no per-step coefficient math.
    step_sigmas = sigmas.to(x.device)
    sde_steps, branch_steps = plan.sde_steps, set(plan.branch_steps)
    schedules: dict[float, ScheduleSteps] = {}  # one per noise level in use (plan.noise_levels may vary it)

    def schedule_at(step: int) -> ScheduleSteps:
        level = plan.noise_level_at(step, noise_level)
        if level not in schedules:
            schedules[level] = ScheduleSteps(sigmas, noise_level=level, kind=kind, dtype=x.dtype, device=x.device)
        return schedules[level]

    lineage = torch.arange(len(row_seeds))  # [rows] id of the tree edge each row is on
    next_lineage = len(row_seeds)
    parent = torch.full((len(row_seeds),), -1, dtype=torch.long)
    stored_latents: list[torch.Tensor] = []  # K+1 x [rows, C, (F,) h, w]; F: video frames
    stored_log_probs: list[torch.Tensor] = []  # K x [rows]
    stored_edges: list[torch.Tensor] = []  # K x [rows]
    stored_x0: list[torch.Tensor] = []  # K+1 x [rows, C, h, w] float32, with store_x0_preds
    stored_means: list[torch.Tensor] = []  # K x [rows, C, (F,) h, w] float32, with store_means
    # Per-row state that only changes at a branch step: conditioning rows, seeds, noise generators
    # (re-seeded every step; manual_seed resets a generator completely, so this equals a fresh one).
    row_cond = cond.select(prompt_ids)
    seed_list = row_seeds.tolist()
    step_generators = [torch.Generator(device=x.device) for _ in seed_list]

    # 3. The loop.
    for i in range(num_steps):
        if i in branch_steps:
            k = plan.branch_factor
            rows = len(row_seeds)
            child = torch.arange(k).repeat(rows)  # [rows * k]
            x = x.repeat_interleave(k, dim=0)
            prompt_ids = prompt_ids.repeat_interleave(k)
            row_seeds = torch.tensor([derive_seed(s, i, c) for s, c in zip(row_seeds.repeat_interleave(k).tolist(),
                                                                              child.tolist())])
            stored_latents = [t.repeat_interleave(k, dim=0) for t in stored_latents]
            stored_log_probs = [t.repeat_interleave(k) for t in stored_log_probs]
            stored_edges = [t.repeat_interleave(k) for t in stored_edges]
            stored_x0 = [t.repeat_interleave(k, dim=0) for t in stored_x0]
            stored_means = [t.repeat_interleave(k, dim=0) for t in stored_means]
            parent = torch.where(parent >= 0, parent * k, parent).repeat_interleave(k)
            first_child = torch.arange(rows) * k
            parent = torch.where(child > 0, first_child.repeat_interleave(k), parent)
            lineage = torch.arange(next_lineage, next_lineage + rows * k)
            next_lineage += rows * k
            row_cond = cond.select(prompt_ids)
            seed_list = row_seeds.tolist()
            step_generators = [torch.Generator(device=x.device) for _ in seed_list]

        with installed(self_guidance, guided, i, prompt_ids):
            velocity = policy.velocity(x, step_sigmas[i], row_cond, guidance_scale)
        if store_x0_preds and i in range(sde_steps.start, sde_steps.stop + 1):  # stored states only
            stored_x0.append(x.float() - step_sigmas[i].float() * velocity.float())
        if i in sde_steps:
            if not stored_latents:
                stored_latents.append(x)
            for generator, row_seed in zip(step_generators, seed_list):
                generator.manual_seed(derive_seed(row_seed, i + 1))
            out = schedule_at(i).step(i, velocity, x, generator=step_generators,
                                      noise_scale=plan.split_noise_scale if i in branch_steps else 1.0)
            stored_latents.append(out.prev_sample)
            stored_log_probs.append(out.log_prob)
            stored_edges.append(lineage)  # never modified in place: a branch rebinds it
            if store_means:
                stored_means.append(out.mean)
            # MixGRPO-Flash seeds the solver after the window with the window steps' x0 predictions (from the
            # states before their noise); a restarting solver drops its history: the noise left the ODE path.
            ode_history = (clean_prediction(velocity, x, step_sigmas[i]), step_sigmas[i]) if solver.after_window \
                else None
            x = out.prev_sample
        elif solver.after_window and i < sde_steps.stop:  # MixGRPO-Flash: Euler up to the window's end
            x, _ = euler_ode_step(velocity, x, step_sigmas[i], step_sigmas[i + 1])
        else:
            x, ode_history = solver.step(velocity, x, step_sigmas[i], step_sigmas[i + 1], ode_history)

    if store_x0_preds and sde_steps.stop == num_steps:  # the window reaches the end: x_K is clean
        stored_x0.append(x.float())

    # 4. Decode the clean latents in chunks (the VAE is the memory peak at high resolution).
    images = None
    if decode:
        images = torch.cat([policy.decode(chunk) for chunk in x.split(decode_batch_size)])

    rows = len(row_seeds)
    window = torch.tensor(list(plan.sde_steps), dtype=torch.long).repeat(rows, 1)  # [N, K]
    window_sigmas = sigmas[plan.sde_steps.start: plan.sde_steps.stop + 1].repeat(rows, 1)  # [N, K+1]
    return Trajectory(
        latents=torch.stack(stored_latents, dim=1),
        log_probs=torch.stack(stored_log_probs, dim=1).float(),
        row_sigmas=window_sigmas,
        row_timesteps=window_sigmas[:, :-1] * 1000,
        row_step_indices=window,
        final_latents=x,
        prompt_ids=prompt_ids.to(device),
        group_ids=prompt_ids.to(device).clone(),
        seeds=row_seeds,
        edge_ids=torch.stack(stored_edges, dim=1),
        parent=parent,
        prompts=list(prompts),
        metadata=list(metadata) if metadata is not None else [],
        images=images,
        cond=cond,
        x0_preds=torch.stack(stored_x0, dim=1) if store_x0_preds else None,
        means=torch.stack(stored_means, dim=1) if store_means else None,
    )


def chunked_rollout(policy: Policy, prompts: Sequence[str], *, group_size: int, seeds: Sequence[int],
                    chunk: int | None = None, plan: StepPlan | None = None, metadata: Sequence[dict] | None = None,
                    cond: TextCond | None = None, rollout_fn=None, **kwargs) -> Trajectory:
    """:func:`rollout` ``chunk`` trajectories at a time (whole groups, or equal parts of each group), joined:
    the same trajectories as one call, since every row's noise comes from its own seed; only memory differs,
    and the float rounding of kernels that a backend picks by batch size (bit-identical where it does not).

    ``chunk`` must be a multiple or a divisor of ``group_size`` and a multiple of the tree's leaves per root;
    None (or a chunk holding the whole batch) is one call. Tree edge ids are numbered per chunk. ``rollout_fn``
    replaces :func:`rollout` by a loop with its signature (SA-Solver's, :mod:`flowrl.sampling.sa_solver`)."""
    rollout_fn = rollout_fn or rollout
    if not chunk or chunk >= len(prompts) * group_size:
        return rollout_fn(policy, prompts, group_size=group_size, seeds=seeds, plan=plan, metadata=metadata, cond=cond,
                          **kwargs)
    leaves = plan.leaves_per_root if plan is not None else 1
    if (chunk % group_size and group_size % chunk) or chunk % leaves:
        raise ValueError(f"rollout chunk {chunk} must be a multiple or a divisor of group_size {group_size} "
                         f"and a multiple of the tree's {leaves} leaves per root")
    if kwargs.get("same_noise_in_group") and chunk < group_size:
        raise ValueError("same_noise_in_group needs whole groups per rollout chunk")
    if kwargs.get("same_noise_in_pairs") and min(chunk, group_size) % 2:
        raise ValueError("same_noise_in_pairs needs whole pairs per rollout chunk: use an even rollout_chunk")
    cond = policy.encode(list(prompts), metadata=metadata) if cond is None else cond
    per_chunk, size = max(chunk // group_size, 1), min(chunk, group_size)  # prompts per chunk, rows per group part
    roots, group_roots = size // leaves, group_size // leaves
    parts, prompt_ids = [], []
    for first in range(0, len(prompts), per_chunk):
        index = list(range(first, min(first + per_chunk, len(prompts))))
        for offset in range(0, group_roots, roots):
            part = rollout_fn(policy, [prompts[p] for p in index], group_size=size, plan=plan, cond=cond.select(index),
                              seeds=[seeds[p * group_roots + offset + j] for p in index for j in range(roots)],
                              metadata=[metadata[p] for p in index] if metadata is not None else None, **kwargs)
            prompt_ids.append(part.prompt_ids + first)
            parts.append(part)
    traj = concat_trajectories(parts)
    # One entry per prompt, as one call gives: a group split over chunks keeps one prompt id and group id.
    traj.prompt_ids = torch.cat(prompt_ids)
    traj.group_ids = traj.prompt_ids.clone()
    traj.prompts, traj.metadata, traj.cond = list(prompts), list(metadata) if metadata is not None else [], cond
    return traj
