"""The step plan each epoch and rollout batch samples with, from the sampling config: full SDE, an SDE window
(Flow-GRPO-Fast per batch and process, MixGRPO sliding, fixed), tree branch points (fixed, moving, or placed by
TMPO's reward-adaptive Beta scheduler), BranchGRPO's split noise and depth pruning, and TMPO's per-split noise
levels. Recipes call :func:`step_plan` once per epoch; :mod:`flowrl.recipes.rollouts` asks :func:`batch_plan`
for each rollout batch's. :mod:`flowrl.sampling.plan` is what a plan is; this module reads one off the config.
"""

from __future__ import annotations

from flowrl.config import SamplingConfig
from flowrl.sampling.plan import StepPlan, branch_schedule, depth_pruned_steps, window_start
from flowrl.sampling.split_schedule import BetaSplitScheduler


def step_plan(s: SamplingConfig, epoch: int, seed: int, split_scheduler: BetaSplitScheduler | None = None, *,
              batch: int = 0, rank: int = 0) -> StepPlan:
    """This epoch's plan: full SDE, a (random / sliding / fixed) window, tree branch points (fixed, moving
    per epoch, or drawn by TMPO's reward-adaptive ``split_scheduler``, called once per epoch), BranchGRPO's
    split noise and the steps its depth pruning leaves untrained. With per-split noise levels the SDE window
    spans the branch steps and is deterministic between them.

    ``window.mode: random`` (Flow-GRPO-Fast) draws its start per rollout ``batch`` of the epoch and per
    process ``rank``: :func:`sample_and_score` asks for each batch's plan with ``batch_windows``."""
    tree = s.tree
    split_levels = tuple(tree.split_noise_levels or ())
    if split_scheduler is not None:
        branch_steps, split_levels = split_scheduler.schedule(epoch, seed)
    else:
        schedule = "fixed" if tree.schedule == "beta" else tree.schedule  # beta before any reward: its first steps
        branch_steps = branch_schedule(epoch, num_steps=s.num_steps, steps=tuple(tree.branch_steps),
                                       schedule=schedule, shift_every=tree.shift_every, seed=seed,
                                       branch_range=tuple(tree.branch_range) if tree.branch_range else None)
    pruned = depth_pruned_steps(epoch, num_steps=s.num_steps, last_branch=max(branch_steps), size=tree.prune_depth,
                                shift_every=tree.prune_depth_shift_every) if branch_steps else ()
    branch = dict(branch_steps=branch_steps, branch_factor=tree.branch_factor if branch_steps else 1,
                  pruned_steps=pruned, split_noise_scale=tree.split_noise_scale if branch_steps else 1.0)
    if split_levels and branch_steps:
        levels = dict.fromkeys(range(branch_steps[0], branch_steps[-1] + 1), 0.0)  # ODE between the splits
        levels.update(zip(branch_steps, split_levels))
        return StepPlan(s.num_steps, sde_start=branch_steps[0], sde_size=branch_steps[-1] - branch_steps[0] + 1,
                        noise_levels=tuple(levels.items()), **branch)
    if s.window.size is None:
        return StepPlan(s.num_steps, **branch)
    start_range = tuple(s.window.start_range) if s.window.start_range else None
    start = window_start(epoch, num_steps=s.num_steps, size=s.window.size, mode=s.window.mode,
                         start_range=start_range, shift_every=s.window.shift_every, seed=seed, batch=batch,
                         rank=rank)
    return StepPlan(s.num_steps, sde_start=start, sde_size=s.window.size, **branch)


def batch_plan(plan: StepPlan, s: SamplingConfig, batch_windows: bool, *, seed: int, epoch: int, batch: int,
               rank: int) -> StepPlan:
    """The plan rollout batch ``batch`` of process ``rank`` samples with: its own draw of a random window
    (Flow-GRPO-Fast) when ``batch_windows``, else the epoch's ``plan``."""
    if not batch_windows or s.window.size is None or s.window.mode != "random":
        return plan
    return step_plan(s, epoch, seed, batch=batch, rank=rank)


def beta_split_scheduler(s: SamplingConfig) -> BetaSplitScheduler | None:
    """TMPO's reward-adaptive split scheduler for ``sampling.tree.schedule=beta``, else None."""
    tree = s.tree
    if tree.schedule != "beta":
        return None
    low, high = tree.branch_range or (0, s.num_steps - 1)
    b = tree.beta
    return BetaSplitScheduler(first_steps=tuple(tree.branch_steps), base_noise_levels=tuple(tree.split_noise_levels),
                              low=low, high=high, kappa=b.kappa, min_gap=b.min_gap,
                              reward_bounds=tuple(b.reward_bounds), bounds_decay=b.bounds_decay,
                              alpha_decay=b.alpha_decay, alpha_min=b.alpha_min)
