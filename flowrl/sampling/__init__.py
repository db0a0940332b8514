"""Sampling: the step math, the step plan (window, tree) and the written-out rollout loop."""

from flowrl.sampling.plan import StepPlan, window_start
from flowrl.sampling.rollout import chunked_rollout, rollout, root_seeds
from flowrl.sampling.settings import RolloutSettings
from flowrl.sampling.steps import STEP_KINDS, StepOutput, gaussian_log_prob, sde_step, transition
from flowrl.sampling.trajectory import Trajectory, concat_trajectories
from flowrl.core.seeding import derive_seed

__all__ = [
    "RolloutSettings", "STEP_KINDS", "StepOutput", "StepPlan", "Trajectory", "concat_trajectories", "derive_seed",
    "gaussian_log_prob", "chunked_rollout", "rollout", "root_seeds", "sde_step", "transition", "window_start",
]
