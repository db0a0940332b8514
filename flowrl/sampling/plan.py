"""Which steps of a rollout are stochastic, stored and branched.

A rollout of ``num_steps`` denoising steps is described by a :class:`StepPlan`:

- ``sde_steps``: a contiguous range of step indices that use the stochastic step (``kind``)
  and are stored for training. Every other step is a deterministic ODE step and is not stored.
  Full-SDE Flow-GRPO uses every step; Flow-GRPO-Fast / MixGRPO use a window of ``k`` steps.
- ``branch_steps``: tree rollouts (BranchGRPO / TreeGRPO / TMPO). Before each listed step every
  trajectory is split into ``branch_factor`` children that share everything computed so far and
  draw different noise from that step on. ``w`` branch steps give ``branch_factor ** w`` leaves.
- ``noise_levels``: per-step noise levels of the stochastic kind, ``(step, level)`` pairs overriding the
  rollout's single ``noise_level`` at those steps (TMPO's per-split eta). A level of 0 makes a step inside
  the window deterministic: it is stored (the stored latents stay one contiguous chain) with log-prob 0 and
  never trained, which is how a plan runs the SDE at its branch steps only and the ODE between them.
- ``split_noise_scale``: BranchGRPO's split noise. At a branch step each child draws its noise times
  this factor (4 in its script) so that siblings part further, while its log-probability stays that of
  the step's unscaled Gaussian (:func:`flowrl.sampling.steps.sde_step`, ``noise_scale``).
- ``pruned_steps``: BranchGRPO's depth pruning. These steps are sampled and stored as usual (the
  rollout and its exploration are unchanged) but not trained: the recipe drops them from the loss mask
  (:func:`flowrl.algorithms.tree.prune_mask`).

Window placement follows the two published schedules: a random start drawn from a range for every
rollout batch on every process (Flow-GRPO-Fast draws it in each sampling call), or a start that slides
forward by one step every ``shift_every`` iterations and wraps around (MixGRPO). Both are
deterministic functions of integers: (seed, iteration, batch, process) and (iteration) respectively,
so a run reproduces and resumes exactly. ``random_per_epoch`` is flowrl's earlier draw, one start per
iteration shared by every batch and process.

Flow-GRPO-Fast's reference is yifan123/flow_grpo ``scripts/train_sd3_fast.py`` @ 74db691 with its
``flow_grpo/diffusers_patch/sd3_pipeline_with_logprob_fast.py`` (read in the zhtmike/flow_grpo copy @
3d02fd9) and the Fast recipes of ``config/grpo.py`` @ 31c71b9: every pipeline call draws
``random.randint(r0, r1 - size)`` from ``sde_window_range = (r0, r1)``, keeps the window's states, log-probs
and timesteps per row, and trains every window step at the row's own timestep, the last schedule step
included when the window reaches it. Deliberate differences:

- the draw comes from a seeded ``numpy`` generator keyed on (seed, epoch, batch, process), not from Python's
  global ``random`` seeded with seed + process index, so it reproduces and resumes exactly (the same
  uniform law, other numbers);
- ``start_range`` lists the starts, ``[r0, r1 - size]``, where Flow-GRPO's range bounds the whole window;
- a prompt's group is sampled in one rollout batch, so its rows share a window; Flow-GRPO spreads a group's
  images over several sampling calls and processes, each with its own window. flowrl keeps the group in one
  call so the group-normalised advantage compares trajectories explored at the same steps;
- with ``random``, N processes draw N windows per batch where one process with N times the prompts draws one:
  a multi-process run no longer reproduces a single-process one (``random_per_epoch`` still does).

Branch points can move the same two ways, see :func:`branch_schedule`: a fresh draw of distinct steps per
iteration inside a range, or the configured pattern sliding forward one step every ``shift_every``
iterations and wrapping inside the range. BranchGRPO itself branches at fixed steps, the default. TMPO's
release moves them from the rewards instead (a Beta draw whose mean follows the reward level), which needs
state across iterations: :class:`flowrl.sampling.split_schedule.BetaSplitScheduler`.

Depth pruning (:func:`depth_pruned_steps`) follows BranchGRPO's definition: "depth" is the
denoising depth (one level per step, not per branch point), the pruned depths are a contiguous
window of late steps, and the window may slide one step earlier every ``shift_every`` iterations
until it reaches the last branch point, so it only ever removes the leaves' own transitions, the
most numerous ones, and never a shared prefix.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class StepPlan:
    num_steps: int
    sde_start: int = 0
    sde_size: int | None = None  # None: every step from sde_start on
    branch_steps: tuple[int, ...] = ()
    branch_factor: int = 1
    pruned_steps: tuple[int, ...] = ()  # stored but not trained (BranchGRPO depth pruning)
    noise_levels: tuple[tuple[int, float], ...] = ()  # (step, level): per-step noise overrides; 0 = deterministic
    split_noise_scale: float = 1.0  # noise factor of the branch steps' draws (BranchGRPO: 4)

    def __post_init__(self):
        if self.num_steps < 1:
            raise ValueError(f"num_steps must be >= 1, got {self.num_steps}")
        size = self.num_steps - self.sde_start if self.sde_size is None else self.sde_size
        if not 0 <= self.sde_start < self.num_steps or size < 1 or self.sde_start + size > self.num_steps:
            raise ValueError(
                f"window [{self.sde_start}, {self.sde_start + size}) does not fit in {self.num_steps} steps"
            )
        for step in self.branch_steps:
            if step not in range(self.sde_start, self.sde_start + size):
                raise ValueError(f"branch step {step} must lie inside the SDE window {list(self.sde_steps)}")
        if self.branch_steps and self.branch_factor < 2:
            raise ValueError("branch_factor must be >= 2 when branch_steps are given")
        for step, level in self.noise_levels:
            if step not in self.sde_steps or level < 0:
                raise ValueError(f"noise level {level} at step {step}: needs a step of the SDE window "
                                 f"{list(self.sde_steps)} and a level >= 0")
        if self.split_noise_scale <= 0:
            raise ValueError(f"split_noise_scale must be > 0, got {self.split_noise_scale}")
        if any(not 0 <= step < self.num_steps for step in self.pruned_steps):
            raise ValueError(f"pruned steps {list(self.pruned_steps)} must lie in [0, {self.num_steps})")

    @property
    def sde_steps(self) -> range:
        size = self.num_steps - self.sde_start if self.sde_size is None else self.sde_size
        return range(self.sde_start, self.sde_start + size)

    def noise_level_at(self, step: int, default: float) -> float:
        """The noise level of ``step``: its entry in ``noise_levels``, else the rollout's ``default``."""
        return dict(self.noise_levels).get(step, default)

    @property
    def leaves_per_root(self) -> int:
        return self.branch_factor ** len(self.branch_steps)


def window_start(
    iteration: int,
    *,
    num_steps: int,
    size: int,
    mode: str = "random",
    start_range: tuple[int, int] | None = None,
    shift_every: int = 1,
    seed: int = 0,
    batch: int = 0,
    rank: int = 0,
) -> int:
    """First step of the SDE window at ``iteration``.

    ``mode="random"`` draws uniformly from ``start_range`` (inclusive; default: every valid start), a
    fresh draw for each rollout ``batch`` of the iteration on each process ``rank``, as Flow-GRPO-Fast
    draws one per sampling call on each process. ``mode="random_per_epoch"`` draws one start per
    iteration, the same for every batch and process. ``mode="sliding"`` starts at ``start_range[0]``
    and moves one step every ``shift_every`` iterations, wrapping to the beginning of the range once
    the window would leave it. ``mode="fixed"`` always returns ``start_range[0]``. Early-step focus =
    a range of high-noise starts.
    """
    last_valid = num_steps - size
    low, high = start_range if start_range is not None else (0, last_valid)
    if not 0 <= low <= high <= last_valid:
        raise ValueError(f"window start range [{low}, {high}] invalid for size {size} in {num_steps} steps")
    if mode == "fixed":
        return low
    if mode == "sliding":
        return low + (iteration // max(shift_every, 1)) % (high - low + 1)
    if mode == "random":
        rng = np.random.default_rng([seed, iteration, batch, rank, 0xFA57])
        return int(rng.integers(low, high + 1))
    if mode == "random_per_epoch":
        rng = np.random.default_rng([seed, iteration, 0x57A27])
        return int(rng.integers(low, high + 1))
    raise ValueError(f"unknown window mode {mode!r}; choose random, random_per_epoch, sliding or fixed")


def branch_schedule(
    iteration: int,
    *,
    num_steps: int,
    steps: tuple[int, ...],
    schedule: str = "fixed",
    branch_range: tuple[int, int] | None = None,
    shift_every: int = 1,
    seed: int = 0,
) -> tuple[int, ...]:
    """Sorted branch steps at ``iteration``; always ``len(steps)`` distinct steps, so the tree keeps
    its size (``branch_factor ** len(steps)`` leaves) and only moves.

    ``schedule="fixed"`` returns ``steps``. ``"random"`` draws ``len(steps)`` distinct steps uniformly
    from ``branch_range`` (inclusive; default: every step), a fresh draw per iteration. ``"sliding"``
    starts at ``steps`` and moves the whole pattern (its spacing kept) one step later every
    ``shift_every`` iterations, wrapping to the start of the range once its last step would leave it.
    Deterministic in (seed, iteration), like :func:`window_start`.
    """
    low, high = branch_range if branch_range is not None else (0, num_steps - 1)
    if not 0 <= low <= high < num_steps:
        raise ValueError(f"branch range [{low}, {high}] invalid for {num_steps} steps")
    pattern = sorted(steps)
    if len(set(pattern)) != len(pattern):
        raise ValueError(f"branch steps {list(steps)} must be distinct")
    if schedule == "fixed" or not pattern:
        return tuple(pattern)
    if len(pattern) > high - low + 1:
        raise ValueError(f"{len(pattern)} branch steps do not fit in the range [{low}, {high}]")
    if schedule == "random":
        rng = np.random.default_rng([seed, iteration, 0xB2A4C])
        return tuple(sorted(int(s) + low for s in rng.choice(high - low + 1, size=len(pattern), replace=False)))
    if schedule == "sliding":
        if pattern[0] < low or pattern[-1] > high:
            raise ValueError(f"sliding branch steps {pattern} must start inside the range [{low}, {high}]")
        extent = pattern[-1] - pattern[0]
        starts = high - extent - low + 1  # positions of the pattern's first step that keep it in range
        start = low + (pattern[0] - low + iteration // max(shift_every, 1)) % starts
        return tuple(start + s - pattern[0] for s in pattern)
    raise ValueError(f"unknown branch schedule {schedule!r}; choose fixed, random or sliding")


def depth_pruned_steps(
    iteration: int,
    *,
    num_steps: int,
    last_branch: int,
    size: int,
    shift_every: int = 0,
) -> tuple[int, ...]:
    """The ``size`` consecutive steps BranchGRPO's depth pruning leaves untrained at ``iteration``.

    The window ends at step ``num_steps - 2``, the deepest step before the final near-clean one (which
    ``train.skip_last_step`` governs on its own), and with ``shift_every`` > 0 moves one step earlier
    every ``shift_every`` iterations until its first step reaches ``last_branch``, where it stays: the
    steps from the last branch point on are the leaves' own, so no shared prefix is ever pruned.
    """
    if size <= 0:
        return ()
    first = num_steps - 1 - size  # window [first, num_steps - 2]
    if first < last_branch:
        raise ValueError(f"a depth-pruning window of {size} steps does not fit between the last branch step "
                         f"{last_branch} and step {num_steps - 2}")
    if shift_every > 0:
        first = max(first - iteration // shift_every, last_branch)
    return tuple(range(first, first + size))
