"""Which steps of a rollout are stochastic, stored and branched.

A rollout of ``num_steps`` denoising steps is described by a :class:`StepPlan`:

- ``sde_steps``: a contiguous range of step indices that use the stochastic step (``kind``)
  and are stored for training. Every other step is a deterministic ODE step and is not stored.
  Full-SDE Flow-GRPO uses every step; Flow-GRPO-Fast / MixGRPO use a window of ``k`` steps.
- ``branch_steps``: tree rollouts (BranchGRPO / TreeGRPO / TMPO). Before each listed step every
  trajectory is split into ``branch_factor`` children that share everything computed so far and
  draw different noise from that step on. ``w`` branch steps give ``branch_factor ** w`` leaves.

Window placement follows the two published schedules: a random start drawn per iteration from a
range (Flow-GRPO-Fast), or a start that slides forward by one step every ``shift_every``
iterations and wraps around (MixGRPO). Both are deterministic functions of (seed, iteration).
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

    @property
    def sde_steps(self) -> range:
        size = self.num_steps - self.sde_start if self.sde_size is None else self.sde_size
        return range(self.sde_start, self.sde_start + size)

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
) -> int:
    """First step of the SDE window at ``iteration``.

    ``mode="random"`` draws uniformly from ``start_range`` (inclusive; default: every valid start).
    ``mode="sliding"`` starts at ``start_range[0]`` and moves one step every ``shift_every``
    iterations, wrapping to the beginning of the range once the window would leave it.
    ``mode="fixed"`` always returns ``start_range[0]``. Early-step focus = a range of high-noise starts.
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
        rng = np.random.default_rng([seed, iteration, 0x57A27])
        return int(rng.integers(low, high + 1))
    raise ValueError(f"unknown window mode {mode!r}; choose random, sliding or fixed")
