"""The typed configuration of a flowrl run. YAML files map onto these dataclasses one to one.

Every field carries a one-line doc (the string below it). Unknown keys, wrong types and
impossible combinations are rejected at load time with a one-line :class:`ConfigError` that names
the dotted key. Components never receive this object: recipes unpack it into flat arguments.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any, Literal

from flowrl.config.loader import check


@dataclass
class ModelConfig:
    family: Literal["sd3", "flux"] = "sd3"
    """Model family; picks the policy adapter (SD3/SD3.5 or FLUX.1)."""
    path: str = "tiny"
    """Hub id or local pipeline directory; 'tiny' builds the offline tiny pipeline of the family."""
    revision: str | None = None
    """Hub revision (branch, tag or commit) passed to from_pretrained (null: the default branch)."""
    variant: str | None = None
    """Weight-file variant passed to from_pretrained, e.g. fp16 for *.fp16.safetensors files (null: the plain files)."""
    dtype: str = "float32"
    """Weights dtype: float32, bfloat16 or float16 (LoRA weights always stay float32)."""
    height: int | None = None
    """Image height in pixels (default: the model's native size)."""
    width: int | None = None
    """Image width in pixels (default: the model's native size)."""
    max_sequence_length: int | None = None
    """T5 token budget (default: 256 for SD3, 512 for FLUX)."""
    gradient_checkpointing: bool = False
    """Recompute transformer activations in the backward pass to save memory."""
    text_encoder_device: Literal["gpu", "cpu"] = "gpu"
    """Where the text encoders live: gpu, the run's device; cpu, off the accelerator (T5-XXL alone is ~9.5 GB in
    bf16), encoding there and moving the embeddings over."""
    text_cache: Literal["none", "disk"] = "none"
    """disk: encode every prompt the run uses (train, held-out, eval and the empty negative) once at start, in
    safetensors keyed by the text encoders' hash, and look them up (the same bits as the live encoders)."""
    text_cache_path: str | None = None
    """The cache: a directory shared by runs (files of other encoders are ignored) or one .safetensors file
    (default RUN_DIR/text_cache)."""
    free_text_encoders: bool = False
    """After caching, delete the text encoders; an uncached prompt is then an error (needs text_cache=disk)."""

    def validate(self):
        check(self.dtype in ("float32", "fp32", "bfloat16", "bf16", "float16", "fp16"), "dtype",
              f"unknown dtype {self.dtype!r}; use float32, bfloat16 or float16")
        for key in ("revision", "variant"):
            check(self.path != "tiny" or getattr(self, key) is None, key,
                  "applies to hub or local pipelines, and model.path=tiny builds the offline tiny one: remove it")
        check(not self.free_text_encoders or self.text_cache == "disk", "free_text_encoders",
              "frees the encoders after caching every prompt: set model.text_cache=disk, or remove it")
        check(self.text_cache_path is None or self.text_cache == "disk", "text_cache_path",
              "names the cache of model.text_cache=disk: set that, or remove it")


@dataclass
class LoraConfig:
    rank: int = 32
    """LoRA rank r."""
    alpha: float = 64.0
    """LoRA alpha; the update is scaled by alpha / r."""
    target_modules: list[str] | None = None
    """Module name suffixes to adapt (default: the family's diffusers-training-script set)."""
    dropout: float = 0.0
    """LoRA dropout."""
    init_from: str | None = None
    """Start from an existing LoRA: a diffusers .safetensors file or a peft directory."""

    def validate(self):
        check(self.rank >= 1, "rank", "must be >= 1")
        check(self.alpha > 0, "alpha", "must be > 0 (the update is scaled by alpha / rank)")
        check(0 <= self.dropout < 1, "dropout", "must be in [0, 1)")


@dataclass
class WindowConfig:
    size: int | None = None
    """SDE window length k; None trains a full-SDE rollout (every step stochastic and stored)."""
    mode: Literal["random", "sliding", "fixed"] = "random"
    """Window placement: random start per iteration (Flow-GRPO-Fast) or sliding (MixGRPO)."""
    start_range: list[int] | None = None
    """Inclusive [low, high] range of window starts (default: every valid start)."""
    shift_every: int = 1
    """Sliding mode: move the window one step every this many iterations."""


@dataclass
class TreeConfig:
    branch_steps: list[int] = field(default_factory=list)
    """Steps before which every trajectory splits (empty: no tree)."""
    branch_factor: int = 2
    """Children per branch point; w branch steps give branch_factor**w leaves per root."""
    schedule: Literal["fixed", "random", "sliding"] = "fixed"
    """Branch points per epoch (TMPO's dynamic stochastic tree): fixed at branch_steps; random, a fresh draw of
    len(branch_steps) distinct steps from branch_range each epoch; sliding, branch_steps moved one step later
    every shift_every epochs (spacing kept), wrapping inside branch_range."""
    branch_range: list[int] | None = None
    """random / sliding: inclusive [low, high] range the branch steps move in (default: every step)."""
    shift_every: int = 1
    """sliding: move the branch steps one step every this many epochs."""
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
        check(self.schedule == "fixed" or bool(self.branch_steps), "schedule",
              f"{self.schedule} moves sampling.tree.branch_steps; set them (their count is the tree's depth)")
        if self.branch_range is not None:
            check(len(self.branch_range) == 2 and self.branch_range[0] <= self.branch_range[1], "branch_range",
                  "must be [low, high] with low <= high")
            check(self.schedule != "fixed", "branch_range",
                  "only applies to schedule random or sliding; remove it or set sampling.tree.schedule")
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
class SamplingConfig:
    num_steps: int = 10
    """Denoising steps per rollout."""
    guidance_scale: float = 4.5
    """CFG scale for SD3; the distilled-guidance embedding value for FLUX."""
    noise_level: float = 0.7
    """SDE noise level a (0.7 for SD3, 0.9 for FLUX in Flow-GRPO)."""
    kind: Literal["sde", "cps"] = "sde"
    """Stochastic step inside the window: Flow-GRPO SDE or coefficient-preserving sampling."""
    ode_solver: Literal["euler", "dpmpp_2m"] = "euler"
    """Deterministic steps outside the SDE window (never stored or trained): Euler, or DPM-Solver++(2M), the
    second-order multistep solver MixGRPO-Flash uses there (no extra model call per step)."""
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


@dataclass
class DataConfig:
    prompts: str = "assets/prompts/general.txt"
    """Prompt file: .txt (one per line) or .jsonl ({"prompt": ..., "metadata": {...}})."""
    test_prompts: str | None = None
    """Held-out prompt file; default: a deterministic split of `prompts`."""
    test_fraction: float = 0.1
    """Fraction held out when test_prompts is not given."""
    eval_prompts: list[str] = field(default_factory=list)
    """Fixed prompts rendered into image grids during training (default: first test prompts)."""
    balance_by: str | None = None
    """Metadata key to stratify each epoch's prompts by, e.g. 'task': every value gets an equal share of
    each batch (GenEval balances by task)."""

    def validate(self):
        check(0 <= self.test_fraction < 1, "test_fraction", "must be in [0, 1)")
        check(self.balance_by is None or bool(self.balance_by.strip()), "balance_by",
              "must be a metadata key or null")


@dataclass
class RewardSpec:
    name: str = "brightness"
    """Short reward name (see `flowrl rewards`) or a dotted path 'package.module:Class'."""
    weight: float = 1.0
    """Weight in the combined reward; 0 scores and logs the reward without training on it."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """Flat keyword arguments for the reward's constructor (device, batch_size, model path, ...)."""
    key: str | None = None
    """Which of the reward's outputs drives training (default: its main score), e.g. 'toyeval/partial'."""


@dataclass
class MarbleConfig:
    refresh_every: int = 4
    """Optimizer steps between MARBLE refreshes. A refresh measures one gradient per reward (K + 1
    backward passes over the step's chunk); the steps between take one pass on the balanced advantage,
    exact for losses affine in the advantage (nft, awm, the unclipped GRPO surrogate). 1: every step."""
    ema: float = 0.5
    """EMA of the balancing coefficients alpha across refreshes (0: each refresh's alone)."""

    def validate(self):
        check(self.refresh_every >= 1, "refresh_every", "must be >= 1 optimizer step")
        check(0 <= self.ema < 1, "ema", "must be in [0, 1)")


@dataclass
class TrainConfig:
    epochs: int = 100
    """Outer iterations: sample, score, compute advantages, optimise."""
    batches_per_epoch: int = 1
    """Rollout batches per epoch on each process (scoring of one overlaps sampling of the next)."""
    inner_epochs: int = 1
    """Passes over the epoch's stored transitions."""
    optimizer_steps_per_epoch: int = 1
    """Optimizer steps per inner pass; transitions are split into this many shuffled chunks."""
    micro_batch_size: int = 4
    """Trajectories per forward/backward (gradient accumulation fills the rest)."""
    learning_rate: float = 3e-4
    """AdamW learning rate."""
    lr_scheduler: Literal["constant", "constant_with_warmup", "cosine", "linear"] = "constant"
    """Learning-rate schedule over the run's optimizer steps (diffusers.optimization.get_scheduler), stepped
    once per optimizer step and restored on resume; cosine and linear decay to 0 at the last step."""
    lr_warmup_steps: int = 0
    """Optimizer steps of linear warm-up from 0 (diffusers' rule: step s uses learning_rate * s / warmup)."""
    adam_betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    """AdamW betas."""
    adam_eps: float = 1e-8
    """AdamW epsilon."""
    weight_decay: float = 1e-4
    """AdamW weight decay."""
    max_grad_norm: float = 1.0
    """Gradient clipping norm (0 disables)."""
    loss: str = "grpo-clip"
    """Policy loss (registry name): grpo-clip, or tmpo (TMPO's Softmax Trajectory Balance targets as
    advantages under the same clipped ratio; recipe grpo)."""
    tmpo_beta: float = 15.0
    """TMPO: inverse temperature of the reward's Boltzmann distribution softmax(tmpo_beta * R)."""
    ratio_norm: bool = False
    """GRPO-Guard: centre each step's log-ratio and divide it by the step's velocity sensitivity, so
    the clip binds evenly across steps (recipe grpo)."""
    clip_range: float = 1e-4
    """PPO ratio clip epsilon (1e-4 full SDE, 1e-5 window/CPS in Flow-GRPO)."""
    clip_range_high: float | None = None
    """Upper clip epsilon if different from the lower one (asymmetric clipping)."""
    advantage: Literal["grpo", "mean"] = "grpo"
    """Advantage estimator (registry name)."""
    std_scope: Literal["global", "group"] = "global"
    """Normalise advantages by the batch std (Flow-GRPO default) or each group's own std."""
    advantage_clip: float = 5.0
    """Clip advantages to +-this value."""
    combine: str = "weighted"
    """How several rewards become one advantage (flowrl/algorithms/combine.py): weighted (sum the rewards,
    then one advantage), gdpo (each reward z-scored in its group, weighted sum, batch-normalised),
    correlation (gdpo with weights raised for rewards that anti-correlate with the others) or marble (one
    advantage and gradient per reward, balanced by MARBLE's QP; see train.marble)."""
    marble: MarbleConfig = field(default_factory=MarbleConfig)
    """combine=marble: how often the per-reward gradients are measured, and the smoothing of alpha."""
    beta: float = 0.04
    """KL coefficient to the reference model (adapter off), Flow-GRPO's beta: GRPO's KL per step is
    ||mu - mu_ref||^2 / (2 std_t^2) with std_t = a sqrt(sigma / (1 - sigma)), without sqrt(-dt) (CPS: the
    step std); NFT adds beta ||v - v_ref||^2 instead. 0 disables the reference pass."""
    cfg: bool = True
    """Classifier-free guidance in sampling and training (SD3); off trains the conditional model alone."""
    skip_last_step: bool = True
    """Do not train the last, near-clean step."""
    timestep_fraction: float = 1.0
    """Train this fraction of the stored steps, drawn per epoch."""
    ema: bool = True
    """Keep an EMA of the LoRA weights for eval and export."""
    ema_decay: float = 0.9
    """EMA decay per optimizer step."""
    ema_start_step: int = 1
    """Optimizer steps through which the EMA copies the live weights, averaging from the next on (1: it starts
    from the first step's weights, diffusers' EMAModel rule; 0: from the initial weights, as Flow-GRPO; recipe grpo)."""
    ema_every: int = 1
    """Fold the weights into the EMA every this many optimizer steps (Flow-GRPO: 8 on its SD3.5 runs; recipe grpo)."""
    ema_warmup: Literal["none", "flow_grpo"] = "none"
    """none: the decay is ema_decay from the start; flow_grpo: Flow-GRPO's ramp min(ema_decay, (1 + s) / (10 + s)),
    s the optimizer steps since ema_start_step, so early updates average over fewer steps (recipe grpo)."""
    mixed_precision: Literal["no", "fp16", "bf16"] = "bf16"
    """Autocast precision on GPU (CPU always runs float32)."""
    async_rewards: bool = True
    """Score batch i in a worker thread while batch i+1 is sampled."""
    reward_errors: Literal["raise", "nan"] = "raise"
    """A reward that raises stops the run, or marks the batch NaN (excluded) and continues."""
    checkpoint_every: int = 10
    """Save a checkpoint every this many epochs, and at the end (0: only at the end)."""
    keep_checkpoints: int = 3
    """Checkpoints kept on disk."""
    resume: str | None = None
    """'latest' or a checkpoint directory to continue from."""
    export_lora: bool = True
    """Export the final (EMA) LoRA in diffusers format to RUN_DIR/lora at the end."""
    time_limit_s: float | None = None
    """Stop after the epoch in which sampling, scoring and training time (perf/train_wall_s) passes this
    many seconds; the run then checkpoints, exports and reports as at its last epoch (null: no limit)."""
    credit: Literal["terminal", "dense_cosine", "dense_ode"] = "terminal"
    """Per-step credit (recipe grpo, see flowrl/algorithms/dense.py): terminal gives every trained step its
    row's advantage; dense_cosine splits it by how far each step moves the predicted x0 toward the final
    latent; dense_ode (DenseGRPO) trains each step on its group-normalised reward gain from ODE look-ahead."""
    dense_lookahead: int | None = None
    """dense_ode: model calls per look-ahead (the last one steps straight to sigma 0); null runs the full
    remaining ODE, which DenseGRPO finds better than a short look-ahead."""
    max_skipped_steps: int = 3
    """Optimizer steps in a row whose gradient is non-finite (NaN/inf loss or gradient) that are skipped (grads
    zeroed, weights untouched, counted in faults/skipped_steps) before the run stops with an error; a lone spike
    is survived, 3 in a row means the weights or data diverged and every further step is wasted."""
    max_nan_epochs: int = 2
    """Epochs in a row in which every trained reward is NaN (nothing could be scored: a dead reward server under
    reward_errors=nan) before the run stops with an error; such an epoch trains on nothing (loss 0)."""

    def validate(self):
        for key in ("epochs", "batches_per_epoch", "inner_epochs", "optimizer_steps_per_epoch", "micro_batch_size"):
            check(getattr(self, key) >= 1, key, "must be >= 1")
        check(self.learning_rate > 0, "learning_rate", "must be > 0")
        check(self.advantage_clip > 0, "advantage_clip", "must be > 0 (advantages are clipped to +-this; 0 trains "
              "nothing)")
        check(self.clip_range > 0, "clip_range", "must be > 0 (the PPO ratio clip epsilon, e.g. 1e-4)")
        check(self.clip_range_high is None or self.clip_range_high > 0, "clip_range_high", "must be > 0, or null")
        check(self.max_grad_norm >= 0, "max_grad_norm", "must be >= 0 (0: no clipping)")
        check(self.adam_eps > 0, "adam_eps", "must be > 0")
        check(self.weight_decay >= 0, "weight_decay", "must be >= 0")
        check(self.keep_checkpoints >= 1, "keep_checkpoints", "must be >= 1 (the latest is needed to resume)")
        check(self.max_skipped_steps >= 1, "max_skipped_steps", "must be >= 1 step")
        check(self.max_nan_epochs >= 1, "max_nan_epochs", "must be >= 1 epoch")
        check(self.lr_warmup_steps >= 0, "lr_warmup_steps", "must be >= 0")
        check(self.lr_warmup_steps == 0 or self.lr_scheduler != "constant", "lr_warmup_steps",
              "train.lr_scheduler=constant has no warm-up: use constant_with_warmup, cosine or linear")
        check(self.ema_start_step >= 0, "ema_start_step", "must be >= 0")
        check(self.ema_every >= 1, "ema_every", "must be >= 1 optimizer step")
        check(len(self.adam_betas) == 2 and all(0 <= b < 1 for b in self.adam_betas), "adam_betas",
              "must be [beta1, beta2], each in [0, 1)")
        check(0 < self.timestep_fraction <= 1, "timestep_fraction", "must be in (0, 1]")
        check(self.beta >= 0, "beta", "must be >= 0")
        check(self.checkpoint_every >= 0, "checkpoint_every", "must be >= 0 (0: only at the end)")
        check(0 <= self.ema_decay < 1, "ema_decay", "must be in [0, 1)")
        from flowrl.algorithms.combine import COMBINERS
        from flowrl.algorithms.losses import POLICY_LOSSES

        check(self.loss in POLICY_LOSSES, "loss", f"unknown policy loss {self.loss!r}; choose one of "
              f"{sorted(POLICY_LOSSES)}")
        check(self.combine in COMBINERS, "combine", f"unknown reward combiner {self.combine!r}; choose one of "
              f"{sorted(COMBINERS)}")
        check(self.tmpo_beta > 0, "tmpo_beta", "must be > 0")
        check(self.time_limit_s is None or self.time_limit_s > 0, "time_limit_s", "must be > 0 or null")
        check(self.combine != "marble" or (self.credit == "terminal" and self.loss == "grpo-clip"), "combine",
              f"marble balances one gradient per reward of the row advantages; it cannot combine with "
              f"train.credit={self.credit} or train.loss={self.loss}: use credit terminal and loss grpo-clip, or "
              "train.combine=gdpo")
        check(self.credit == "terminal" or self.loss != "tmpo", "credit",
              f"{self.credit} gives per-step advantages, but train.loss=tmpo trains on per-trajectory targets; "
              "use train.loss=grpo-clip or train.credit=terminal")
        if self.dense_lookahead is not None:
            check(self.dense_lookahead >= 1, "dense_lookahead", "must be >= 1 model call, or null for the full ODE")
            check(self.credit == "dense_ode", "dense_lookahead",
                  f"only applies to train.credit=dense_ode (got {self.credit}); remove it or set the credit")


@dataclass
class NFTConfig:
    """Forward-process RL (recipe: nft): ODE rollouts, flow-matching updates on their clean samples,
    with DiffusionNFT's loss or AWM's."""

    loss: Literal["nft", "awm", "crd"] = "nft"
    """'nft': DiffusionNFT's implicit positive/negative policies; 'awm': Advantage Weighted Matching, the
    flow-matching loss weighted by the clipped advantage over train.advantage_clip, plus nft.awm_kl
    times ||v - v_old||^2 toward the old (EMA) adapter; 'crd': Centered Reward Distillation, the implicit
    log-ratio to the old adapter matched to the reward, both centred within the prompt's group."""
    crd_beta: float = 10.0
    """CRD: the KL temperature beta of beta (log-ratio - group mean) ~ (advantage - group mean); the
    log-ratio estimates are mean squared errors, so beta sets how far the policy may move per unit of
    advantage."""
    awm_kl: float = 1.0
    """AWM: weight of ||v - v_old||^2 (AWM's published value). A sample's loss is bounded below while its
    advantage weight (in [-1, 1]) plus awm_kl is > 0, so 1 covers every weight above -1."""
    strength: float = 1.0
    """beta of the implicit policies v+ = beta v + (1 - beta) v_old, v- = (1 + beta) v_old - beta v (loss nft)."""
    timesteps_per_sample: int = 1
    """Fresh (t, noise) draws per clean sample in each pass: more lowers the gradient's variance."""
    adaptive_weighting: bool = True
    """Measure each loss term in x0-space, divided by its own detached mean error (keeps training stable;
    loss nft)."""
    timestep_schedule: Literal["sampling", "uniform"] = "sampling"
    """Where training t comes from: 'sampling' draws, per sample and without repeats, from the sigmas of
    the (shifted) sampling schedule, as DiffusionNFT does; 'uniform' draws t ~ U(0, 1)."""
    old_decay_ramp: list[float] | None = None
    """[rate, max]: the old adapter's decay after optimizer step s is min(rate * s, max) (DiffusionNFT:
    [0.001, 0.5]); null keeps train.ema_decay."""

    def validate(self):
        check(self.strength > 0, "strength", "must be > 0")
        check(self.crd_beta > 0, "crd_beta", "must be > 0")
        check(self.awm_kl >= 0, "awm_kl", "must be >= 0 (it pulls v toward the old adapter)")
        check(self.timesteps_per_sample >= 1, "timesteps_per_sample", "must be >= 1")
        ramp = self.old_decay_ramp
        check(ramp is None or (len(ramp) == 2 and ramp[0] >= 0 and 0 <= ramp[1] < 1), "old_decay_ramp",
              "must be [rate >= 0, max in [0, 1)] or null")


@dataclass
class LogConfig:
    backend: Literal["none", "tensorboard", "wandb"] = "none"
    """Tracker besides the always-written metrics.jsonl."""
    project: str = "flowrl"
    """Tracker project name."""
    run_name: str | None = None
    """The run's name in the tracker (wandb's run name; null: the run directory's name)."""
    wandb_entity: str | None = None
    """wandb team or user the run is logged under (null: wandb's default entity)."""
    wandb_tags: list[str] = field(default_factory=list)
    """wandb tags of the run."""
    eval_every: int = 10
    """Render the fixed eval prompts into an image grid every this many epochs (0: never)."""
    eval_images_per_prompt: int = 4
    """Images per eval prompt in each grid."""
    eval_num_steps: int | None = None
    """ODE steps of the in-training evaluation (eval grids, test_every, the end-of-run report; null:
    sampling.num_steps). Flow-GRPO trains SD3.5 on 10-step rollouts and evaluates with 40 steps at CFG 4.5."""
    eval_guidance_scale: float | None = None
    """CFG scale (FLUX: guidance embedding) of the in-training evaluation (null: the training value)."""
    progress: bool = True
    """Show a progress bar with reward, loss and time per stage."""
    test_every: int = 0
    """Score the held-out prompts (ODE, fixed seeds, EMA weights) every this many epochs, and once
    before training; logged as test/* with the cumulative perf/rollouts and perf/train_wall_s (0: never)."""
    test_prompts: int = 32
    """Held-out prompts scored by test_every (an equal share per metadata "task", as the report's)."""
    report_prompts: int = 16
    """Held-out prompts rendered before/after training for the end-of-run report (0: no report); taken
    round-robin over metadata "task" values, scored per task and as the mean over tasks."""
    report_diversity: Literal["none", "toy"] = "none"
    """Add the toy world's ground-truth diversity (background, position, size) to the report."""

    def validate(self):
        check(self.eval_num_steps is None or self.eval_num_steps >= 1, "eval_num_steps", "must be >= 1 or null")
        check(self.eval_guidance_scale is None or self.eval_guidance_scale >= 0, "eval_guidance_scale",
              "must be >= 0 or null")
        check(self.run_name is None or bool(self.run_name.strip()), "run_name", "must be a name or null")


@dataclass
class EvalConfig:
    suite: str = "assets/benchmarks/divgen.jsonl"
    """Prompt suite of `flowrl eval` (.txt or .jsonl; metadata "axes" names the free axes, "task" splits tables)."""
    images_per_prompt: int = 8
    """Images per prompt, one seed each; the same seeds for every checkpoint."""
    num_steps: int | None = None
    """ODE steps of the eval samples (null: sampling.num_steps)."""
    guidance_scale: float | None = None
    """CFG scale of the eval samples (null: sampling.guidance_scale)."""
    seed: int = 4242
    """Seed of the eval images' noise."""
    batch_prompts: int = 4
    """Prompts rendered per batch (lower it to save memory)."""
    features: str = "clip"
    """Feature network of in-group diversity and Vendi: toy, pixels, clip, dino, inception."""
    feature_kwargs: dict[str, Any] = field(default_factory=dict)
    """Arguments of the feature network, e.g. {model: ViT-L-14, pretrained: /path/open_clip.bin}."""
    reference: str | None = None
    """Directory of reference images for FID/KID (null: no FID/KID)."""
    fid_features: str | None = None
    """Feature network of FID/KID (null: eval.features); inception needs torch-fidelity and weights_path."""
    fid_feature_kwargs: dict[str, Any] = field(default_factory=dict)
    """Arguments of the FID/KID feature network."""
    style_model: str | None = None
    """open_clip model of the style axis, e.g. ViT-B-32 (null: style not measured)."""
    style_pretrained: str | None = None
    """Its weights: a local checkpoint path or an open_clip tag."""
    identity_features: str | None = None
    """Feature network of the identity axis, e.g. dino with identity_feature_kwargs.path (null: not measured)."""
    identity_feature_kwargs: dict[str, Any] = field(default_factory=dict)
    """Arguments of the identity feature network."""
    toy_diversity: bool = False
    """Also measure the toy world's exact ground-truth diversity (background, position, size)."""
    grid_prompts: int = 12
    """Prompts shown as image grids in report.html (all are scored)."""

    def validate(self):
        check(self.images_per_prompt >= 2, "images_per_prompt", "diversity is measured within a prompt's images: "
              "use at least 2")
        check(self.num_steps is None or self.num_steps >= 1, "num_steps", "must be >= 1 or null")
        check(self.batch_prompts >= 1, "batch_prompts", "must be >= 1")
        check(self.grid_prompts >= 0, "grid_prompts", "must be >= 0")


@dataclass
class GardoConfig:
    kl_fraction: float = 1.0
    """GARDO's gated KL: train.beta's KL acts only on this most uncertain fraction of the batch (GARDO:
    about 0.1), uncertainty being a sample's win-rate in its group under the trained reward minus its
    mean win-rate under the auxiliary rewards. 1: every sample (plain GRPO)."""
    auxiliary: list[str] | None = None
    """Reward keys whose win-rates the uncertainty compares against (null: every reward with weight 0)."""
    diversity: bool = False
    """GARDO's diversity-aware advantage: a positive advantage times the sample's cosine distance to its
    nearest group neighbour in the gardo.features space; negative advantages unchanged."""
    reset_every: int | None = None
    """GARDO's adaptive reference: every this many epochs the KL reference becomes the current adapter
    (null: never on a schedule)."""
    reset_kl: float | None = None
    """GARDO's adaptive reference: reset it after an epoch whose mean KL (loss/kl) exceeds this (null: never)."""
    features: str = "latent"
    """Feature space of the diversity weighting: latent (the rollout's VAE latents), pixels (images pooled
    to 16x16), clip (needs feature_kwargs.model_id) or 'package.module:Class' (flowrl/algorithms/gardo.py)."""
    feature_kwargs: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of the feature extractor's constructor (model_id, device, batch_size, ...)."""

    def validate(self):
        from flowrl.algorithms.gardo import FEATURES

        check(0 < self.kl_fraction <= 1, "kl_fraction", "must be in (0, 1]")
        check(self.reset_every is None or self.reset_every >= 1, "reset_every", "must be >= 1 epoch, or null")
        check(self.reset_kl is None or self.reset_kl > 0, "reset_kl", "must be > 0, or null")
        check(self.features in FEATURES or ":" in self.features, "features",
              f"unknown feature space {self.features!r}; choose one of {sorted(FEATURES)} or 'package.module:Class'")


@dataclass
class HrfConfig:
    anchor_weight: float = 0.0
    """HRF's phase regulariser: anchor_weight * ||theta - theta_phase||^2 on the LoRA weights, theta_phase
    the adapter at the start of the current phase, so each phase refines the last instead of undoing it
    (0: off). Pair it with a sliding SDE window (sampling.window.mode=sliding), the hierarchical part:
    each phase trains its own band of denoising steps."""
    phase_epochs: int | None = None
    """Epochs per phase (null: sampling.window.shift_every, one phase per window position)."""

    def validate(self):
        check(self.anchor_weight >= 0, "anchor_weight", "must be >= 0 (0: off)")
        check(self.phase_epochs is None or self.phase_epochs >= 1, "phase_epochs", "must be >= 1, or null")

    def phase_length(self, sampling: "SamplingConfig") -> int:
        return self.phase_epochs or sampling.window.shift_every


@dataclass
class GuardConfig:
    enabled: bool = False
    """Watch the in-group diversity of each epoch's rollouts (no extra sampling) and act when it falls
    (flowrl/training/guard.py); off: nothing is measured or logged."""
    every: int = 1
    """Measure every this many epochs (the first warmup epochs are always measured)."""
    warmup: int = 2
    """Measurements whose mean is the start value the drop is taken from (the run's first epochs)."""
    max_drop: float = 0.3
    """Fire when diversity falls more than this fraction below its start value."""
    policy: Literal["warn", "raise_beta", "stop"] = "warn"
    """warn: one line saying what to do; raise_beta: train.beta times beta_factor (the KL of either recipe);
    stop: end the run and export and report the best reward-diversity weights seen (diversity/best_epoch)."""
    features: str = "latent"
    """Feature space of the diversity: latent, pixels, clip (needs feature_kwargs.model_id) or
    'package.module:Class', as gardo.features (flowrl/algorithms/gardo.py)."""
    feature_kwargs: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of the feature extractor's constructor (model_id, device, batch_size, ...)."""
    beta_factor: float = 2.0
    """raise_beta: the KL beta is multiplied by this each time the guard fires."""
    beta_floor: float = 0.04
    """raise_beta: the beta a run without KL (train.beta=0) gets when the guard fires (GRPO's units: Flow-GRPO's
    0.04; recipe nft's beta weighs ||v - v_ref||^2 instead)."""
    cooldown: int = 10
    """Epochs after a firing before the guard may fire again (warn, raise_beta)."""
    diversity_weight: float = 1.0
    """stop: the best weights maximise the epoch's mean trained reward plus this times its diversity."""

    def validate(self):
        from flowrl.algorithms.gardo import FEATURES

        check(self.every >= 1, "every", "must be >= 1 epoch")
        check(self.warmup >= 1, "warmup", "must be >= 1 measurement")
        check(0 < self.max_drop < 1, "max_drop", "must be a fraction in (0, 1)")
        check(self.features in FEATURES or ":" in self.features, "features",
              f"unknown feature space {self.features!r}; choose one of {sorted(FEATURES)} or 'package.module:Class'")
        check(self.beta_factor > 1, "beta_factor", "must be > 1 (it raises the KL beta)")
        check(self.beta_floor > 0, "beta_floor", "must be > 0")
        check(self.cooldown >= 1, "cooldown", "must be >= 1 epoch")
        check(self.diversity_weight >= 0, "diversity_weight", "must be >= 0")


@dataclass
class Config:
    seed: int = 0
    """Seed of everything: prompts order, noise, LoRA init."""
    device: str = "auto"
    """'auto' (CUDA when available), 'cpu' or 'cuda'."""
    run_dir: str = "runs/default"
    """Where logs, checkpoints, grids and the resolved config go."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """Base model and its loading."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """The trainable adapter."""
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    """Rollouts."""
    data: DataConfig = field(default_factory=DataConfig)
    """Prompt sets."""
    rewards: list[RewardSpec] = field(default_factory=lambda: [RewardSpec()])
    """Rewards, combined by weight."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """Optimisation."""
    log: LogConfig = field(default_factory=LogConfig)
    """Logging, eval grids, progress."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    """`flowrl eval`: the benchmark suite, its samples, diversity and FID/KID settings."""
    recipe: Literal["grpo", "nft"] = "grpo"
    """Training loop: grpo (SDE rollouts, clipped log-prob ratios) or nft (DiffusionNFT)."""
    nft: NFTConfig = field(default_factory=NFTConfig)
    """DiffusionNFT settings (recipe: nft)."""
    gardo: GardoConfig = field(default_factory=GardoConfig)
    """GARDO's gated KL, adaptive reference and diversity-aware advantage (recipe: grpo)."""
    hrf: HrfConfig = field(default_factory=HrfConfig)
    """HRF's per-phase parameter anchor (both recipes)."""
    guard: GuardConfig = field(default_factory=GuardConfig)
    """The diversity guard: in-group diversity of the rollouts against its start value (both recipes)."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Recipe-specific settings the recipe validates itself."""

    def validate_gardo(self):
        g, gated = self.gardo, self.gardo.kl_fraction < 1
        resets = g.reset_every is not None or g.reset_kl is not None
        check(self.recipe == "grpo" or not (gated or g.diversity or resets), "gardo",
              "gardo's options act on GRPO's advantages and KL: use recipe grpo")
        for key, used in (("kl_fraction", gated), ("reset_every", g.reset_every is not None),
                          ("reset_kl", g.reset_kl is not None)):
            check(not used or self.train.beta > 0, f"gardo.{key}", "acts on train.beta's KL, which is 0: set "
                  "train.beta > 0 or remove it")
        keys = {r.key or r.name: r.weight for r in self.rewards}
        auxiliary = [k for k, w in keys.items() if w == 0] if g.auxiliary is None else g.auxiliary
        unknown = [k for k in auxiliary if k not in keys]
        check(not unknown, "gardo.auxiliary", f"{unknown} are not reward keys of this config ({sorted(keys)})")
        check(not gated or bool(auxiliary), "gardo.kl_fraction",
              "the gate ranks samples by how far the trained reward outruns auxiliary rewards, and there are none: "
              "add a reward with weight 0 (or name one in gardo.auxiliary)")

    def validate(self):
        keys = [r.key or r.name for r in self.rewards]
        check(len(set(keys)) == len(keys), "rewards", "each reward (or sub-score `key:`) may appear once; to train "
              "on several sub-scores of one reward, give each entry its own key")
        trained = [r.name for r in self.rewards if r.weight != 0]
        check(bool(trained) or not self.rewards, "rewards", "every reward has weight 0, so nothing trains: give at "
              "least one a nonzero weight")
        self.validate_gardo()
        check(not (self.recipe == "nft" and self.nft.loss == "crd" and self.train.combine == "marble"), "train.combine",
              "marble balances advantage-weighted gradients, and nft.loss=crd weights each sample by its reward-"
              "matching residual instead: use train.combine=weighted or gdpo with crd")
        check(self.hrf.anchor_weight == 0 or self.hrf.phase_epochs is not None or self.sampling.window.mode == "sliding"
              and self.sampling.window.size is not None, "hrf.phase_epochs",
              "hrf.anchor_weight needs phases: set hrf.phase_epochs, or a sliding SDE window (sampling.window.size and "
              "mode=sliding) whose shift_every sets them")
        if self.train.combine == "marble" and len(trained) < 2:
            warnings.warn(f"train.combine=marble balances several rewards, but only {trained} trains (nonzero "
                          "weight); using train.combine=weighted", stacklevel=2)
            self.train.combine = "weighted"
        t = self.train
        check(self.recipe != "nft" or (t.ema_start_step, t.ema_every, t.ema_warmup) == (1, 1, "none"),
              "train.ema_every",
              "recipe nft's EMA is its old policy, stepped once per epoch: use nft.old_decay_ramp for its schedule and "
              "leave train.ema_start_step, ema_every and ema_warmup at 1, 1, none")
        check(self.recipe != "nft" or self.train.ema, "train.ema",
              "recipe nft samples with the EMA ('old') adapter: set train.ema=true (ema_decay 0 follows the live one)")
        check(self.recipe != "nft" or self.nft.timestep_schedule != "sampling"
              or self.nft.timesteps_per_sample <= self.sampling.num_steps, "nft.timesteps_per_sample",
              f"exceeds the {self.sampling.num_steps} sigmas of the sampling schedule; lower it or set "
              "nft.timestep_schedule=uniform")
        check(self.recipe != "nft" or (self.train.loss == "grpo-clip" and not self.train.ratio_norm), "train.loss",
              "train.loss=tmpo and train.ratio_norm act on log-prob ratios, which recipe nft has none of; use "
              "recipe grpo")
        from flowrl.algorithms.dense import check_credit

        check_credit(self.train.credit, recipe=self.recipe, branch_steps=self.sampling.tree.branch_steps)
        check(self.sampling.group_size >= 2 or self.train.advantage == "mean", "sampling.group_size",
              "group advantages need at least 2 trajectories per prompt")
        check(not self.guard.enabled or self.sampling.group_size >= 2, "guard.enabled",
              "the guard measures diversity within a prompt's group: use sampling.group_size >= 2")
        check(self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:"), "device",
              "use auto, cpu, cuda or cuda:N")
        check(bool(self.rewards), "rewards", "is empty, so nothing trains: list at least one reward, e.g. "
              "rewards=[{name: brightness}]")
        if self.device.startswith("cuda"):
            import torch

            index = self.device.partition(":")[2]
            check(index == "" or index.isdigit(), "device", f"{self.device!r}: use cuda or cuda:N")
            count = torch.cuda.device_count()
            check(count > int(index or 0), "device", f"{self.device} is not available: this machine has "
                  f"{count} CUDA device(s); use device=auto or cpu" + (f", or cuda:0..{count - 1}" if count else ""))
