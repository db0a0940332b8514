"""Rollout settings: the step schedule, the SDE window, trees and Pilot-Commit (``sampling.*``).

Part of the typed configuration in :mod:`flowrl.config.schema`, which re-exports every class here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from flowrl.config.loader import check


@dataclass
class WindowConfig:
    size: int | None = None
    """SDE window length k; None trains a full-SDE rollout (every step stochastic and stored)."""
    mode: Literal["random", "random_per_epoch", "sliding", "fixed"] = "random"
    """Window placement. random: Flow-GRPO-Fast, a fresh start for every rollout batch on every process (rows of
    one epoch then hold different windows; each row records its own steps); random_per_epoch: one start per epoch
    for every batch and process (flowrl's earlier draw: N processes then reproduce one, and
    train.ratio_norm=batch_sensitivity, which needs one window per epoch, applies); sliding: MixGRPO; fixed: start_range[0]."""
    start_range: list[int] | None = None
    """Inclusive [low, high] range of window starts (default: every valid start). Flow-GRPO-Fast's
    sde_window_range (r0, r1) bounds the whole window: it is start_range [r0, r1 - size]."""
    shift_every: int = 1
    """Sliding mode: move the window one step every this many iterations."""


@dataclass
class BetaScheduleConfig:
    """TMPO's reward-adaptive split scheduler (sampling.tree.schedule=beta; flowrl/sampling/split_schedule.py)."""

    kappa: float = 4.0
    """Concentration of the Beta draw of split positions (0: keep tree.branch_steps)."""
    min_gap: int = 3
    """Least number of steps between two splits."""
    reward_bounds: list[float] = field(default_factory=lambda: [0.2, 0.35])
    """Initial [r_min, r_max] of the reward bounds that normalise the mean reward into alpha."""
    bounds_decay: float = 0.99
    """EMA decay of the reward bounds toward each rollout's min and max reward."""
    alpha_decay: float = 0.85
    """EMA decay of the normalised reward level alpha."""
    alpha_min: float = 0.1
    """Floor of the raw alpha."""

    def validate(self):
        check(self.kappa >= 0, "kappa", "must be >= 0 (0: the splits stay at tree.branch_steps)")
        check(self.min_gap >= 1, "min_gap", "must be >= 1 (splits are distinct steps)")
        check(len(self.reward_bounds) == 2, "reward_bounds", "must be [r_min, r_max]")
        for key in ("bounds_decay", "alpha_decay"):
            check(0 <= getattr(self, key) < 1, key, "must be in [0, 1)")


@dataclass
class TreeConfig:
    branch_steps: list[int] = field(default_factory=list)
    """Steps before which every trajectory splits (empty: no tree)."""
    branch_factor: int = 2
    """Children per branch point; w branch steps give branch_factor**w leaves per root."""
    schedule: Literal["fixed", "random", "sliding", "beta"] = "fixed"
    """Branch points per epoch: fixed at branch_steps; random, a fresh draw of len(branch_steps) distinct steps
    from branch_range each epoch; sliding, branch_steps moved one step later every shift_every epochs (spacing
    kept), wrapping inside branch_range; beta, TMPO's reward-adaptive Beta draw in branch_range (tree.beta),
    starting from branch_steps, which also scales split_noise_levels (its state is saved in checkpoints)."""
    branch_range: list[int] | None = None
    """random / sliding / beta: inclusive [low, high] range the branch steps move in (default: every step)."""
    split_noise_levels: list[float] | None = None
    """Noise level of each branch step, in order (TMPO: [0.4, 0.7, 1.0]); with it the rollout is stochastic at
    the branch steps only, ODE between them (null: sampling.noise_level on every step of the SDE window)."""
    beta: BetaScheduleConfig = field(default_factory=BetaScheduleConfig)
    """schedule=beta: the reward-adaptive split scheduler's parameters."""
    shift_every: int = 1
    """sliding: move the branch steps one step every this many epochs."""
    split_noise_scale: float = 4.0
    """BranchGRPO's split noise: at a branch step each child's noise is drawn this many times larger, while its
    log-prob stays the unscaled step's (4.0 in BranchGRPO's script; 1: plain). GRPO only: train.loss=tmpo ignores it."""
    backup: Literal["depth_standardised", "leaf_mean"] = "depth_standardised"
    """Tree edge advantages under GRPO: depth_standardised (BranchGRPO) z-scores, per tree and per step, the mean
    leaf reward under each edge; leaf_mean gives each edge the mean of its leaves' group-normalised advantages,
    which keeps a shared edge's size tied to how much its subtrees differ. train.loss=tmpo ignores it."""
    prune_width: int | None = None
    """BranchGRPO width pruning: train only this many leaves per group, the highest- and lowest-reward halves;
    the others' own edges (from the last branch point on) go untrained, shared edges still train (0 or null: off)."""
    prune_depth: int = 0
    """BranchGRPO depth pruning: leave this many consecutive late steps untrained (sampled and scored all the
    same), the window ending at step num_steps - 2, just before the final one (0: off)."""
    prune_depth_shift_every: int = 0
    """Depth pruning: move the untrained window one step earlier every this many epochs, until it reaches the
    last branch step (0: it stays)."""

    def validate(self):
        check(self.shift_every >= 1, "shift_every", "must be >= 1")
        check(self.split_noise_scale > 0, "split_noise_scale", "must be > 0 (1: the step's own noise)")
        check(self.schedule == "fixed" or bool(self.branch_steps), "schedule",
              f"{self.schedule} moves sampling.tree.branch_steps; set them (their count is the tree's depth)")
        if self.branch_range is not None:
            check(len(self.branch_range) == 2 and self.branch_range[0] <= self.branch_range[1], "branch_range",
                  "must be [low, high] with low <= high")
            check(self.schedule != "fixed", "branch_range",
                  "only applies to schedule random, sliding or beta; remove it or set sampling.tree.schedule")
        if self.split_noise_levels is not None:
            check(len(self.split_noise_levels) == len(self.branch_steps), "split_noise_levels",
                  f"needs one level per branch step ({len(self.branch_steps)}), got {len(self.split_noise_levels)}")
            check(all(level > 0 for level in self.split_noise_levels), "split_noise_levels", "levels must be > 0")
        check(self.schedule != "beta" or self.split_noise_levels is not None, "split_noise_levels",
              "schedule beta scales each split's noise level; set sampling.tree.split_noise_levels")
        check(self.prune_width is None or self.prune_width == 0 or self.prune_width >= 2, "prune_width",
              "must be >= 2 (the best and the worst leaf), or 0 / null (off)")
        check(self.prune_depth >= 0, "prune_depth", "must be >= 0 (0: off)")
        check(self.prune_depth_shift_every >= 0, "prune_depth_shift_every", "must be >= 0 (0: the window stays)")
        check(not self.prune_depth_shift_every or self.prune_depth > 0, "prune_depth_shift_every",
              "only applies with sampling.tree.prune_depth > 0")
        for key in ("prune_width", "prune_depth"):
            check(not getattr(self, key) or bool(self.branch_steps), key,
                  "prunes tree rollouts; set sampling.tree.branch_steps or remove it")


@dataclass
class PilotConfig:
    candidates: int | None = 0
    """Pilot-Commit: candidate prompts piloted per rollout batch on each process (>= prompts_per_batch); the
    prompts_per_batch with the highest pilot reward variance get the rest of their group. 0 or null: off."""
    group_size: int = 4
    """Pilot rollouts per candidate (>= 2, < sampling.group_size); they stay in a committed prompt's group."""


@dataclass
class SelfGuidanceConfig:
    """Feature self-guidance (flowrl/sampling/self_guidance.py): at the chosen steps and blocks, push apart the
    transformer's image-token features of the images of one prompt, then pass them through the block again."""

    scale: float = 0.0
    """Step size of the dispersal on feature directions (0: off, and sampling is bit-identical to no guidance)."""
    blocks: list[int] = field(default_factory=lambda: [1])
    """Transformer blocks whose output is dispersed, indexed per family as in
    flowrl.sampling.self_guidance.GUIDED_BLOCKS (FLUX.1: transformer_blocks then single_transformer_blocks, as one
    list; Wan: blocks; Z-Image: noise_refiner); checked against the model when it loads."""
    steps: list[int] = field(default_factory=lambda: [0, 1])
    """Denoising steps (indices of the schedule, 0 = the noisiest) at which the blocks are guided."""
    iterations: int = 30
    """Gradient steps of the dispersal per guided block call."""
    temperature: float = 1.0
    """Temperature of the log-mean-exp of pairwise cosine similarities."""
    manifold_mix: float = 0.4
    """Weight of the block's second pass over the dispersed features (0: dispersal only)."""
    in_rollouts: bool = False
    """Also guide training rollouts (recipe nft only; flowrl sample and flowrl eval guide whenever scale > 0)."""

    def settings(self) -> dict:
        """The method's arguments (flowrl.sampling.self_guidance.SelfGuidance.maybe)."""
        return dict(scale=self.scale, blocks=self.blocks, steps=self.steps, iterations=self.iterations,
                    temperature=self.temperature, manifold_mix=self.manifold_mix)

    def validate(self):
        check(self.scale >= 0, "scale", "must be >= 0 (0: off)")
        check(bool(self.blocks) and all(b >= 0 for b in self.blocks), "blocks", "must be a non-empty list of block "
              "indices >= 0")
        check(bool(self.steps) and all(s >= 0 for s in self.steps), "steps", "must be a non-empty list of step "
              "indices >= 0")
        check(self.iterations >= 1, "iterations", "must be >= 1")
        check(self.temperature > 0, "temperature", "must be > 0")
        check(0 <= self.manifold_mix <= 1, "manifold_mix", "must be in [0, 1]")


@dataclass
class SamplingConfig:
    num_steps: int = 10
    """Denoising steps per rollout."""
    guidance_scale: float = 4.5
    """CFG scale for SD3; the distilled-guidance embedding value for FLUX."""
    noise_level: float = 0.7
    """SDE noise level a (0.7 for SD3, 0.9 for FLUX in Flow-GRPO)."""
    kind: Literal["sde", "cps", "dance"] = "sde"
    """Stochastic step inside the window: Flow-GRPO SDE, coefficient-preserving sampling, or DanceGRPO's SDE (the
    same mean with a constant std_t = noise_level; BranchGRPO's sampler, noise_level 0.3 there)."""
    ode_solver: Literal["euler", "mixgrpo_flash", "dpmpp_2m"] = "euler"
    """Deterministic steps outside the SDE window (never stored or trained): euler; mixgrpo_flash, MixGRPO-Flash's
    sampler: Euler before and inside the window, DPM-Solver++(2M) (no extra model call per step) only after it,
    its history seeded with the window steps' clean-latent predictions; dpmpp_2m, DPM-Solver++(2M) on
    every deterministic step, before the window too, restarting after it (DiffusionNFT's all-ODE rollouts)."""
    group_size: int = 24
    """Trajectories per prompt (the GRPO group)."""
    prompts_per_batch: int = 2
    """Distinct prompts per rollout batch on each process (derived from groups_per_epoch when that is set)."""
    groups_per_epoch: int | None = None
    """Prompt groups per epoch over all processes, whatever their number: each process rolls out
    groups_per_epoch / world_size of them in train.batches_per_epoch batches, so prompts_per_batch becomes
    groups_per_epoch / (world_size * batches_per_epoch), checked at start (null: prompts_per_batch per process)."""
    rollout_chunk: int | None = None
    """Trajectories sampled per model batch: a rollout batch is generated this many at a time and joined,
    the same trajectories as in one go (per-row seeds; up to kernels' batch-size rounding); a multiple or a divisor
    of group_size (null: the whole batch)."""
    same_noise_in_group: bool = False
    """Start every trajectory of a group from the same initial noise."""
    window: WindowConfig = field(default_factory=WindowConfig)
    """SDE window (Flow-GRPO-Fast / MixGRPO)."""
    tree: TreeConfig = field(default_factory=TreeConfig)
    """Tree rollouts (BranchGRPO / TreeGRPO / TMPO)."""
    pilot: PilotConfig = field(default_factory=PilotConfig)
    """Pilot-Commit rollout allocation: skip candidate prompts whose pilot rewards do not vary."""
    self_guidance: SelfGuidanceConfig = field(default_factory=SelfGuidanceConfig)
    """Training-free diversity at sampling time (flowrl sample, flowrl eval; rollouts with in_rollouts)."""

    def validate(self):
        check(self.num_steps >= 1, "num_steps", "must be >= 1")
        check(self.group_size >= 1, "group_size", "must be >= 1")
        check(self.prompts_per_batch >= 1, "prompts_per_batch", "must be >= 1 prompt per rollout batch")
        check(self.noise_level >= 0, "noise_level", "must be >= 0")
        check(self.guidance_scale >= 0, "guidance_scale", "must be >= 0")
        size = self.window.size
        if size is not None:
            check(1 <= size <= self.num_steps, "window.size",
                  f"window of {size} steps does not fit in sampling.num_steps={self.num_steps}")
            if self.window.start_range is not None:
                low, high = (self.window.start_range + [None, None])[:2]
                check(len(self.window.start_range) == 2 and 0 <= low <= high <= self.num_steps - size,
                      "window.start_range",
                      f"must be [low, high] with 0 <= low <= high <= {self.num_steps - size}")
        tree = self.tree
        if tree.branch_steps:
            check(tree.branch_factor >= 2, "tree.branch_factor", "must be >= 2 for a tree")
            check(all(0 <= s < self.num_steps for s in tree.branch_steps), "tree.branch_steps",
                  f"every branch step must lie in [0, {self.num_steps})")
            check(len(set(tree.branch_steps)) == len(tree.branch_steps), "tree.branch_steps",
                  "branch steps must be distinct")
            leaves = tree.branch_factor ** len(tree.branch_steps)
            check(self.group_size % leaves == 0, "group_size",
                  f"must be a multiple of the tree's {leaves} leaves per root")
            check(size is None or self.window.mode == "fixed", "tree.branch_steps",
                  "a tree needs a full-SDE rollout or a fixed window containing every branch step")
            check(size is None or tree.split_noise_levels is None, "tree.split_noise_levels",
                  "makes the SDE window span the branch steps itself; remove sampling.window.size")
            # Where branches can fall: the fixed steps, or the range a dynamic schedule moves them in.
            if tree.branch_range is not None:
                check(0 <= tree.branch_range[0] <= tree.branch_range[1] < self.num_steps, "tree.branch_range",
                      f"must be [low, high] with 0 <= low <= high < sampling.num_steps={self.num_steps}")
            low, high = tree.branch_range or [0, self.num_steps - 1]
            if tree.schedule != "fixed":
                check(len(tree.branch_steps) <= high - low + 1, "tree.branch_steps",
                      f"{len(tree.branch_steps)} distinct branch steps do not fit in the range [{low}, {high}]")
            else:
                low, high = min(tree.branch_steps), max(tree.branch_steps)
            if tree.schedule == "beta":
                check((len(tree.branch_steps) - 1) * tree.beta.min_gap <= high - low, "tree.beta.min_gap",
                      f"{len(tree.branch_steps)} splits {tree.beta.min_gap} steps apart do not fit in [{low}, {high}]")
            if tree.schedule == "sliding":
                check(all(low <= s <= high for s in tree.branch_steps), "tree.branch_steps",
                      f"sliding starts from the branch steps, so they must lie in tree.branch_range [{low}, {high}]")
            if size is not None:
                start = self.window.start_range[0] if self.window.start_range else 0
                check(start <= low and high < start + size, "tree.branch_steps",
                      f"branches can fall in [{low}, {high}], outside the fixed SDE window [{start}, {start + size})")
            check(not tree.prune_width or tree.prune_width <= self.group_size, "tree.prune_width",
                  f"keeps more leaves than a group has (sampling.group_size={self.group_size})")
            check(tree.prune_depth <= self.num_steps - 1 - high, "tree.prune_depth",
                  f"at most {self.num_steps - 1 - high}: the untrained window must fit between the last branch step "
                  f"({high}) and step {self.num_steps - 2}")
        guide = self.self_guidance
        # off (scale 0), its steps are never read: a 1-step config must not trip over the default [0, 1]
        check(guide.scale == 0 or all(s < self.num_steps for s in guide.steps), "self_guidance.steps",
              f"every step must lie in [0, {self.num_steps}) (sampling.num_steps={self.num_steps})")
        if guide.scale > 0 and guide.in_rollouts:
            check(self.group_size >= 2, "self_guidance.in_rollouts", "self-guidance needs at least 2 images per "
                  f"prompt (sampling.group_size={self.group_size})")
            check(self.rollout_chunk is None or self.rollout_chunk >= self.group_size, "self_guidance.in_rollouts",
                  "disperses the images of a whole group: sampling.rollout_chunk must hold whole groups")
            check(not self.pilot.candidates, "self_guidance.in_rollouts",
                  "Pilot-Commit samples a group in two passes; turn one of them off")
        pilot = self.pilot
        check(pilot.candidates is None or pilot.candidates >= 0, "pilot.candidates", "must be >= 0 (0 or null: off)")
        if pilot.candidates:
            check(pilot.candidates >= self.prompts_per_batch, "pilot.candidates",
                  f"must be >= sampling.prompts_per_batch={self.prompts_per_batch} (the prompts committed)")
            check(2 <= pilot.group_size < self.group_size, "pilot.group_size",
                  f"must be >= 2 (a variance) and < sampling.group_size={self.group_size}")
            check(not tree.branch_steps, "pilot.candidates",
                  "Pilot-Commit needs flat groups; set it to 0 or drop sampling.tree.branch_steps")
            check(not self.same_noise_in_group, "pilot.candidates",
                  "Pilot-Commit draws a group in two passes; set it to 0 or sampling.same_noise_in_group=false")
            check(self.rollout_chunk is None, "rollout_chunk", "is not supported with Pilot-Commit "
                  "(sampling.pilot.candidates); remove one of them")
        check(self.groups_per_epoch is None or self.groups_per_epoch >= 1, "groups_per_epoch", "must be >= 1, or null")
        chunk, leaves = self.rollout_chunk, self.tree.branch_factor ** len(self.tree.branch_steps)
        if chunk is not None:
            check(chunk >= 1 and (chunk % self.group_size == 0 or self.group_size % chunk == 0), "rollout_chunk",
                  f"must be a multiple or a divisor of sampling.group_size={self.group_size} (got {chunk}), or null")
            check(chunk % leaves == 0, "rollout_chunk", f"must be a multiple of the tree's {leaves} leaves per root")
            check(chunk >= self.group_size or not self.same_noise_in_group, "rollout_chunk",
                  "same_noise_in_group needs whole groups per chunk: use a multiple of sampling.group_size")
