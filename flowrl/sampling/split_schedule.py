"""TMPO's reward-adaptive split scheduler: where a tree branches, and how much noise each split gets.

Dynamic Stochastic Tree Sampling moves a tree's split steps with training progress. The authors' release
(github.com/MAIR-Lab-HUST/TMPO, ``tmpo/sampling/scheduler.py`` ``AdaptiveScheduler``, commit af2fa6c) does
it from the rewards:

- It keeps EMA bounds of the reward, ``r_min <- d r_min + (1 - d) min(R)`` and likewise ``r_max`` with the
  batch max (``d`` = ``bounds_decay``, 0.99; start 0.2 and 0.35), updated after every rollout.
- From the last rollout's mean reward it forms ``alpha = clip((mean - r_min) / (r_max - r_min), alpha_min, 1)``
  (0.5 when the bounds meet), smoothed by an EMA ``alpha <- c alpha + (1 - c) alpha_raw`` (``c`` =
  ``alpha_decay``, 0.85; the first value is taken as is).
- The splits are ``n`` sorted draws ``f ~ Beta(1 + (1 - alpha) kappa, 1 + alpha kappa)`` placed at
  ``floor(low + f (high - low))``, then pushed apart to at least ``min_gap`` steps. A low reward
  (small alpha) puts them late, a high one early; ``kappa = 0`` keeps the first steps.
- Each split's noise level is its base level times ``1 + 0.3 (1 - alpha) - 0.2 alpha``, clipped to [0.2, 1].
- The first rollout, with no reward seen yet, uses the configured steps and base levels.

The release's ``get_schedule`` smooths alpha three times per call (the splits use the first value, the noise
levels the second); this keeps that, so its alpha follows the same sequence. Two deliberate differences:
the Beta draws come from a generator seeded by (seed, epoch) instead of torch's global one, so a resumed run
draws what the uninterrupted one drew; and where the release's final clamp to ``high`` would leave two splits
closer than ``min_gap`` (even merge them, shrinking its tree), the later ones are pulled back to keep the gap,
since a group here has a fixed number of leaves. The state (bounds, alpha, last mean reward) is saved in
checkpoints (:meth:`state_dict`).
"""

from __future__ import annotations

import math

import numpy as np
import torch


class BetaSplitScheduler:
    """Split steps and per-split noise levels per epoch from the rewards seen so far (see the module doc)."""

    def __init__(self, *, first_steps: tuple[int, ...], base_noise_levels: tuple[float, ...], low: int, high: int,
                 kappa: float = 4.0, min_gap: int = 3, reward_bounds: tuple[float, float] = (0.2, 0.35),
                 bounds_decay: float = 0.99, alpha_decay: float = 0.85, alpha_min: float = 0.1):
        if len(first_steps) != len(base_noise_levels):
            raise ValueError(f"{len(first_steps)} split steps but {len(base_noise_levels)} noise levels")
        if (len(first_steps) - 1) * min_gap > high - low:
            raise ValueError(f"{len(first_steps)} splits {min_gap} steps apart do not fit in [{low}, {high}]")
        self.first_steps, self.base_noise_levels = tuple(first_steps), tuple(base_noise_levels)
        self.low, self.high, self.kappa, self.min_gap = low, high, kappa, min_gap
        self.bounds_decay, self.alpha_decay, self.alpha_min = bounds_decay, alpha_decay, alpha_min
        self.r_min, self.r_max = map(float, reward_bounds)
        self.alpha: float | None = None  # the smoothed reward level; None before the first smoothing
        self.mean_reward: float | None = None  # the last rollout's mean reward; None before the first

    def observe(self, rewards: torch.Tensor) -> None:
        """After a rollout: move the reward bounds toward its min and max, remember its mean (finite rewards)."""
        finite = rewards[torch.isfinite(rewards)].double()
        if not finite.numel():
            return
        d = self.bounds_decay
        self.r_min = d * self.r_min + (1 - d) * float(finite.min())
        self.r_max = d * self.r_max + (1 - d) * float(finite.max())
        self.mean_reward = float(finite.mean())

    def _smoothed_alpha(self) -> float:
        span = self.r_max - self.r_min
        raw = 0.5 if span < 1e-8 else max(self.alpha_min, min(1.0, (self.mean_reward - self.r_min) / span))
        self.alpha = raw if self.alpha is None else self.alpha_decay * self.alpha + (1 - self.alpha_decay) * raw
        return self.alpha

    def schedule(self, epoch: int, seed: int) -> tuple[tuple[int, ...], tuple[float, ...]]:
        """This epoch's (sorted distinct split steps, their noise levels); call once per epoch."""
        if self.mean_reward is None:
            return self.first_steps, self.base_noise_levels
        steps = self.first_steps
        alpha = self._smoothed_alpha()
        if self.kappa > 0:
            rng = np.random.default_rng([seed, epoch, 0xBE7A])
            fractions = np.sort(rng.beta(1 + (1 - alpha) * self.kappa, 1 + alpha * self.kappa, size=len(steps)))
            steps = self._spread([math.floor(f * (self.high - self.low) + self.low) for f in fractions.tolist()])
        alpha = self._smoothed_alpha()
        scale = 1 + (1 - alpha) * 0.3 - alpha * 0.2
        levels = tuple(max(0.2, min(level * scale, 1.0)) for level in self.base_noise_levels)
        self._smoothed_alpha()  # the release's get_schedule smooths once more for the alpha it reports
        return steps, levels

    def _spread(self, steps: list[int]) -> tuple[int, ...]:
        for i in range(1, len(steps)):  # the release's rule: at least min_gap after the previous split
            steps[i] = max(steps[i], steps[i - 1] + self.min_gap)
        steps[-1] = min(steps[-1], self.high)
        for i in range(len(steps) - 2, -1, -1):  # keep the gap where the clamp to high would break it
            steps[i] = min(steps[i], steps[i + 1] - self.min_gap)
        return tuple(steps)

    def metrics(self) -> dict[str, float]:
        return {} if self.alpha is None else {"tree/alpha": self.alpha, "tree/reward_min": self.r_min,
                                              "tree/reward_max": self.r_max}

    def state_dict(self) -> dict:
        return {"r_min": self.r_min, "r_max": self.r_max, "alpha": self.alpha, "mean_reward": self.mean_reward}

    def load_state_dict(self, state: dict) -> None:
        self.r_min, self.r_max = float(state["r_min"]), float(state["r_max"])
        self.alpha, self.mean_reward = state["alpha"], state["mean_reward"]
