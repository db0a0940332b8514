"""The typed configuration of a flowrl run. YAML files map onto these dataclasses one to one.

Every field carries a one-line doc (the string below it). Unknown keys, wrong types and
impossible combinations are rejected at load time with a one-line :class:`ConfigError` that names
the dotted key. Components never receive this object: recipes unpack it into flat arguments.
The sampling sections live in :mod:`flowrl.config.sampling`, the forward-process section (``nft.*``) in
:mod:`flowrl.config.forward` and the logging, eval and guard sections in :mod:`flowrl.config.reporting`;
all are re-exported here.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any, Literal, Sequence

from flowrl.config.forward import LOSS_CHOICES, NFT_CHOICES, NFTConfig  # noqa: F401  (re-exported)
from flowrl.config.loader import check
from flowrl.config.reporting import EvalConfig, GuardConfig, LogConfig  # noqa: F401  (re-exported)
from flowrl.config.sampling import (  # noqa: F401
    BetaScheduleConfig, PilotConfig, SamplingConfig, TreeConfig, WindowConfig,
)


@dataclass
class ModelConfig:
    family: Literal["sd3", "flux", "flux_kontext", "flux2_klein", "qwen_image", "z_image", "wan"] = "sd3"
    """Model family; picks the policy adapter (SD3/SD3.5, FLUX.1, FLUX.1 Kontext, FLUX.2 [klein], Qwen-Image,
    Z-Image or Wan2.1 video)."""
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
    """Text token budget (default: the family's, e.g. 256 for SD3, 512 for FLUX)."""
    num_frames: int | None = None
    """Frames per clip, video families only (wan: 4k + 1, default 5; Wan2.1's own is 81)."""
    negative_prompt: str = ""
    """The negative prompt of classifier-free guidance, for every prompt (families that run CFG)."""
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
    """Policy loss (registry name): grpo-clip, or tmpo (TMPO's Softmax Trajectory Balance over whole paths under a
    path-level clipped ratio, as in its authors' release; recipe grpo, flowrl/algorithms/tmpo.py)."""
    tmpo_beta: float = 15.0
    """TMPO: inverse temperature of the reward's Boltzmann distribution softmax(tmpo_beta * R)."""
    tmpo_target: Literal["residual", "gradient"] = "residual"
    """TMPO's advantage: residual, log softmax(beta R) - log softmax(log P) (the release); gradient, the exact
    negative gradient of the squared Softmax-TB loss, residual - softmax(log P) * sum(residual)."""
    tmpo_clip_range: float = 0.2
    """TMPO: clip epsilon of the path-level ratio (centred by its group mean) and of the RatioNorm weights."""
    tmpo_ref_weight: float = 0.1
    """TMPO: weight of the reference term, the mean squared difference of length-normalised path log-probs."""
    tmpo_reference: Literal["rollout", "base"] = "rollout"
    """TMPO's reference path log-probs: rollout, those recorded at sampling (what the release computes); base,
    the base model's (adapter off; one more forward per trained edge and update)."""
    ratio_norm: Literal["none", "grpo_guard", "batch_sensitivity"] | bool = "none"
    """Per-step log-ratio normalisation (recipe grpo, flowrl/algorithms/ratio_norm.py): grpo_guard (or true) is
    GRPO-Guard's, s (logp - logp_old + ||mu - mu_old||^2 / (2 s^2)) = mean(eps dmu), with each step's policy loss
    divided by |dt| (SDE steps; its clip ranges are ~1e-6); batch_sensitivity centres the log-ratio on the step's
    batch and divides it by the step's relative velocity sensitivity; none (or false): the plain log-ratio."""
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
    skip_last_step: bool | None = None
    """Do not train the last, near-clean step. null: true for a full-SDE rollout (Flow-GRPO trains steps
    0..T-2), false with an SDE window (Flow-GRPO-Fast trains every window step, the last included)."""
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
    overwrite: bool = False
    """Start afresh in a run_dir that holds another run by moving the old run aside whole, to
    ``RUN_DIR.old-<timestamp>`` (never deleted). Without it such a start is refused: a run directory holds one run."""
    export_lora: bool = True
    """Export the final (EMA) LoRA in diffusers format to RUN_DIR/lora at the end."""
    time_limit_s: float | None = None
    """Stop after the epoch in which sampling, scoring and training time (perf/train_wall_s) passes this
    many seconds; the run then checkpoints, exports and reports as at its last epoch (null: no limit)."""
    credit: Literal["terminal", "dense_cosine", "dense_ode"] = "terminal"
    """Per-step credit (recipe grpo, see flowrl/algorithms/dense.py): terminal gives every trained step its
    row's advantage; dense_cosine splits it by how far each step moves the predicted x0 toward the final
    latent; dense_ode trains each step on its group-normalised reward gain from ODE look-ahead, DenseGRPO's
    dense reward (its reward-aware per-timestep noise calibration is not implemented: no published code)."""
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

    def __post_init__(self):
        if isinstance(self.ratio_norm, bool):  # true names the method the option was written for (not in validate:
            self.ratio_norm = "grpo_guard" if self.ratio_norm else "none"  # validation changes nothing)

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
        check(not (self.overwrite and self.resume), "overwrite",
              "moves the old run aside, and train.resume continues it: set one of them")
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
        check(self.tmpo_beta > 0, "tmpo_beta", "must be > 0")
        check(self.time_limit_s is None or self.time_limit_s > 0, "time_limit_s", "must be > 0 or null")
        check(self.combine != "marble" or (self.credit == "terminal" and self.loss == "grpo-clip"), "combine",
              f"marble balances one gradient per reward of the row advantages; it cannot combine with "
              f"train.credit={self.credit} or train.loss={self.loss}: use credit terminal and loss grpo-clip, or "
              "train.combine=gdpo")
        check(self.credit == "terminal" or self.loss != "tmpo", "credit",
              f"{self.credit} gives per-step advantages, but train.loss=tmpo trains on per-trajectory targets; "
              "use train.loss=grpo-clip or train.credit=terminal")
        check(0 < self.tmpo_clip_range < 1, "tmpo_clip_range", "must be in (0, 1)")
        check(self.tmpo_ref_weight >= 0, "tmpo_ref_weight", "must be >= 0")
        if self.dense_lookahead is not None:
            check(self.dense_lookahead >= 1, "dense_lookahead", "must be >= 1 model call, or null for the full ODE")
            check(self.credit == "dense_ode", "dense_lookahead",
                  f"only applies to train.credit=dense_ode (got {self.credit}); remove it or set the credit")


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

    def validate(self):  # the feature space's name is checked against its registry by flowrl.recipes.names
        check(0 < self.kl_fraction <= 1, "kl_fraction", "must be in (0, 1]")
        check(self.reset_every is None or self.reset_every >= 1, "reset_every", "must be >= 1 epoch, or null")
        check(self.reset_kl is None or self.reset_kl > 0, "reset_kl", "must be > 0, or null")


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


def check_credit(credit: str, *, recipe: str, branch_steps: Sequence[int]) -> None:
    """One-line :class:`~flowrl.config.ConfigError` for the other sections' settings dense credit
    (:mod:`flowrl.algorithms.dense`) cannot run with (``train.loss=tmpo`` is refused by
    ``TrainConfig.validate`` itself)."""
    if credit == "terminal":
        return
    check(recipe == "grpo", "train.credit", f"{credit} credit needs per-step log-prob ratios, which recipe "
          f"{recipe} has none of; use recipe grpo or train.credit=terminal")
    check(not branch_steps, "train.credit", f"{credit} is not defined on tree rollouts (sampling.tree."
          "branch_steps), whose edges take their advantage from the leaves below them; use train.credit=terminal")


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
        RECIPE_CHECKS[self.recipe](self)  # what the recipe needs of the shared sections
        self.validate_gardo()
        check(self.hrf.anchor_weight == 0 or self.hrf.phase_epochs is not None or self.sampling.window.mode == "sliding"
              and self.sampling.window.size is not None, "hrf.phase_epochs",
              "hrf.anchor_weight needs phases: set hrf.phase_epochs, or a sliding SDE window (sampling.window.size and "
              "mode=sliding) whose shift_every sets them")
        if self.train.combine == "marble" and len(trained) < 2:
            warnings.warn(f"train.combine=marble balances several rewards, but only {trained} trains (nonzero "
                          "weight); using train.combine=weighted", stacklevel=2)
            self.train.combine = "weighted"
        check(self.train.ratio_norm != "grpo_guard" or self.sampling.kind == "sde", "train.ratio_norm",
              f"grpo_guard's |dt| reweighting is defined for SDE steps, not sampling.kind={self.sampling.kind}: use "
              "sampling.kind=sde, or train.ratio_norm=batch_sensitivity")
        window = self.sampling.window
        batch_windows = window.size is not None and window.mode == "random"  # rows of an epoch: different windows
        check(not (batch_windows and self.train.ratio_norm == "batch_sensitivity"), "train.ratio_norm",
              "batch_sensitivity scales each stored column by its step's sensitivity, but sampling.window.mode=random draws a window per "
              "rollout batch, so a column holds different steps: use sampling.window.mode=random_per_epoch")
        check(self.sampling.group_size >= 2 or self.train.advantage == "mean", "sampling.group_size",
              "group advantages need at least 2 trajectories per prompt")
        check(not self.guard.enabled or self.sampling.group_size >= 2, "guard.enabled",
              "the guard measures diversity within a prompt's group: use sampling.group_size >= 2")
        check(self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:"), "device",
              "use auto, cpu, cuda or cuda:N")
        check(bool(self.rewards), "rewards", "is empty, so nothing trains: list at least one reward, e.g. "
              "rewards=[{name: brightness}]")
        if self.device.startswith("cuda"):  # whether this machine has it is checked when the run starts
            index = self.device.partition(":")[2]
            check(index == "" or index.isdigit(), "device", f"{self.device!r}: use cuda or cuda:N")


def check_grpo_recipe(cfg: Config) -> None:
    """Recipe grpo's constraints on the shared sections: TMPO's path loss and dense credit's limits."""
    t, tree, window = cfg.train, cfg.sampling.tree, cfg.sampling.window
    if t.loss == "tmpo":  # TMPO's path loss (algorithms.tmpo.PATH_LOSSES) trains over whole paths: no KL, no per-step normalisation, pruning or row weights
        check(t.beta == 0, "train.beta", "train.loss=tmpo regularises with train.tmpo_ref_weight, not the KL; "
              "set train.beta=0")
        check(t.ratio_norm == "none", "train.ratio_norm", "train.loss=tmpo has its own RatioNorm weights; "
              "set train.ratio_norm=none")
        check(not (tree.prune_width or tree.prune_depth), "sampling.tree.prune_width",
              "train.loss=tmpo trains whole paths; BranchGRPO's pruning does not apply: set it to 0")
        check(not cfg.gardo.diversity, "gardo.diversity",
              "train.loss=tmpo has no per-row advantage to weight; set gardo.diversity=false")
        check(not (window.size is not None and window.mode == "random"), "sampling.window.mode",
              "train.loss=tmpo scores each stored column at one step, but mode random draws a window per rollout "
              "batch: use sampling.window.mode=random_per_epoch")
    check_credit(t.credit, recipe=cfg.recipe, branch_steps=tree.branch_steps)


def check_nft_recipe(cfg: Config) -> None:
    """Recipe nft's constraints on the shared sections: no log-prob ratios (so no GARDO, TMPO, ratio_norm or dense
    credit), train.ema as its old adapter, and its timesteps and sampler against the sampling schedule."""
    g, n, t, s = cfg.gardo, cfg.nft, cfg.train, cfg.sampling
    check(not (g.kl_fraction < 1 or g.diversity or g.reset_every is not None or g.reset_kl is not None), "gardo",
          "gardo's options act on GRPO's advantages and KL: use recipe grpo")
    check(not (n.loss == "crd" and t.combine == "marble"), "train.combine",
          "marble balances advantage-weighted gradients, and nft.loss=crd weights each sample by its reward-"
          "matching residual instead: use train.combine=weighted or gdpo with crd")
    check((t.ema_start_step, t.ema_every, t.ema_warmup) == (1, 1, "none"), "train.ema_every",
          "recipe nft's train.ema is its old policy, stepped once per epoch on nft.old_decay (its eval EMA is "
          "nft.eval_ema_decay): leave train.ema_start_step, ema_every and ema_warmup at 1, 1, none")
    check(t.ema, "train.ema", "recipe nft keeps its old adapter as train.ema: set train.ema=true")
    check(n.choice("timestep_schedule") != "sampling" or n.timesteps_per_sample <= s.num_steps,
          "nft.timesteps_per_sample", f"exceeds the {s.num_steps} sigmas of the sampling schedule; lower it or set "
          "nft.timestep_schedule=uniform")
    check(n.choice("timestep_schedule") != "stratified" or int(s.num_steps * n.stratified_fraction) >= 2,
          "nft.stratified_fraction", f"leaves no sigma between the first and the last of sampling.num_steps="
          f"{s.num_steps}: raise it or the steps")
    check(n.choice("sampler") != "sa_solver" or s.num_steps >= 2, "sampling.num_steps",
          "SA-Solver rollouts need at least 2 steps (nft.sampler=sa_solver)")
    check(n.choice("sampler") != "sa_solver" or not s.pilot.candidates, "sampling.pilot.candidates",
          "Pilot-Commit rolls out with the Euler/SDE loop, not SA-Solver: set it to 0 or nft.sampler=ode")
    check(t.loss == "grpo-clip" and t.ratio_norm == "none", "train.loss",
          "train.loss=tmpo and train.ratio_norm act on log-prob ratios, which recipe nft has none of; use "
          "recipe grpo")
    check_credit(t.credit, recipe=cfg.recipe, branch_steps=s.tree.branch_steps)


# config.recipe -> its checks of the shared sections (Config.validate calls the one the run names).
RECIPE_CHECKS = {"grpo": check_grpo_recipe, "nft": check_nft_recipe}
