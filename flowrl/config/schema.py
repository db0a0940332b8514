"""The typed configuration of a flowrl run. YAML files map onto these dataclasses one to one.

Every field carries a one-line doc (the string below it). Unknown keys, wrong types and
impossible combinations are rejected at load time with a one-line :class:`ConfigError` that names
the dotted key. Components never receive this object: recipes unpack it into arguments, and a registered loss
receives its own section (``train``) at most.
This module holds the sections every recipe reads and their :class:`Config`; each recipe's config class adds its
own sections on top (:mod:`flowrl.config.grpo`, :mod:`flowrl.config.nft`, whose ``nft.*`` section is recipe nft's).
The sampling sections live in :mod:`flowrl.config.sampling`, the logging and eval sections in
:mod:`flowrl.config.reporting` and the guards' in :mod:`flowrl.config.guards`; those are re-exported here.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from flowrl.config.loader import check
from flowrl.config.guards import GuardConfig, HeldOutGuardConfig  # noqa: F401
from flowrl.config.reporting import EvalConfig, LogConfig  # noqa: F401
from flowrl.config.sampling import (  # noqa: F401
    BetaScheduleConfig, PilotConfig, SamplingConfig, SelfGuidanceConfig, TreeConfig, WindowConfig,
)


@dataclass
class PreferenceConfig:
    """ParetoSlider: one policy conditioned on reward weights w (flowrl/models/preference.py), trained with
    per_prompt draws of w per prompt group (flowrl/algorithms/preference.py) and the advantage sum_k w_k z_k of the
    rewards' z-scores within each (prompt, w) subgroup (train.combine=preference)."""

    rewards: list[str] = field(default_factory=list)
    """The rewards the slider trades off, in the order of w's entries (their keys in `rewards:`); empty: off."""
    hidden: int = 64
    """Width of the embedding MLP's hidden layer (w [K] -> hidden -> the embedding's width)."""
    where: Literal["timestep", "pooled"] = "timestep"
    """Which embedding w's embedding is added to: timestep (every family) or pooled (the pooled text projection:
    sd3, flux, flux_kontext)."""
    blocks: bool = True
    """Also modulate the image stream of every transformer block by w (ParetoSlider's residual block modulation:
    sd3, flux, flux_kontext); false: the timestep embedding only (adapters trained before it existed)."""
    per_prompt: int = 3
    """Preferences drawn per prompt group: sampling.group_size is split into this many subgroups of consecutive
    rows, each rolled out, trained and normalised under its own w (the reference: 3 per 24 images)."""

    def validate(self):
        check(self.hidden >= 1, "hidden", "must be >= 1")
        check(self.per_prompt >= 1, "per_prompt", "must be >= 1")
        check(not self.rewards or len(self.rewards) >= 2, "rewards", "needs at least 2 rewards to trade off "
              "(empty: off)")
        check(len(set(self.rewards)) == len(self.rewards), "rewards", "names a reward twice")


DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16", "float16": "float16",
          "fp16": "float16"}  # names a dtype key takes -> the dtype

# Flow-GRPO's precision (yifan123/flow_grpo, scripts/train_sd3.py at ac4c86e8, with config/base.py's
# mixed_precision "fp16"): the transformer and its LoRA in float32 (loaded as stored, never cast), computed under
# the accelerator's autocast in sampling and in the training log-probs (accelerator.prepare wraps its forward;
# the SDE step and its log-prob are float32); the text encoders in the autocast dtype ("inference_dtype"); the VAE
# in float32 ("pipeline.vae.to(accelerator.device, dtype=torch.float32)"). Flow-GRPO keeps its rollout latents in
# its embeddings' dtype (float16); flowrl keeps them in the transformer's (float32), and recomputes each log-prob on
# the stored latents either way.
FLOW_GRPO_PRECISION = {"model.dtype": "float32", "model.text_encoder_dtype": "float16", "model.vae_dtype": None,
                       "train.mixed_precision": "fp16"}


@dataclass
class ModelConfig:
    family: Literal["sd3", "flux", "flux_kontext", "flux2_klein", "flux2_dev", "qwen_image", "qwen_image_edit",
                    "qwen_image_edit_plus", "z_image",
                    "wan", "wan22_ti2v", "wan22_t2v", "wan_i2v", "wan22_i2v", "ltx2",
                    "hunyuan_video15", "hunyuan_video15_i2v"] = "sd3"
    """Model family; picks the policy adapter (SD3/SD3.5, FLUX.1, FLUX.1 Kontext, FLUX.2 [klein], FLUX.2 [dev],
    Qwen-Image, Z-Image, Wan2.1 video, Wan2.2 TI2V-5B or Wan2.2 T2V A14B (two experts) text-to-video, Wan2.1 I2V-14B
    or Wan2.2 I2V A14B (two experts) image-to-video: wan_i2v, wan22_i2v; LTX-2 text-to-video with its audio stream
    denoised alongside: ltx2; HunyuanVideo-1.5 text-to-video or image-to-video: hunyuan_video15,
    hunyuan_video15_i2v)."""
    path: str = "tiny"
    """Hub id or local pipeline directory; 'tiny' builds the offline tiny pipeline of the family."""
    revision: str | None = None
    """Hub revision (branch, tag or commit) passed to from_pretrained (null: the default branch)."""
    variant: str | None = None
    """Weight-file variant passed to from_pretrained, e.g. fp16 for *.fp16.safetensors files (null: the plain files)."""
    dtype: str = "float32"
    """Weights dtype of the transformer, and of the text encoders and VAE unless the two keys below say otherwise:
    float32, bfloat16 or float16 (LoRA weights always stay float32). Two precisions: bfloat16 weights under
    train.mixed_precision bf16 (every weight rounded once, the least memory), or float32 master weights under
    fp16 or bf16 autocast, Flow-GRPO's (model.text_encoder_dtype float16 and train.mixed_precision fp16 complete
    it; see FLOW_GRPO_PRECISION in flowrl/config/schema.py)."""
    text_encoder_dtype: str | None = None
    """Dtype of the text encoders (null: model.dtype); their embeddings are cast to the transformer's dtype. Flow-GRPO
    keeps them in its autocast dtype (float16) beside a float32 transformer: T5-XXL alone is ~19 GB in float32."""
    vae_dtype: str | None = None
    """Dtype of the VAE, which decodes every rollout for the rewards (null: model.dtype). Flow-GRPO decodes in
    float32 whatever its autocast; float32 here beside bfloat16 weights keeps the images the rewards see exact."""
    height: int | None = None
    """Image height in pixels (default: the model's native size)."""
    width: int | None = None
    """Image width in pixels (default: the model's native size)."""
    max_sequence_length: int | None = None
    """Text token budget (default: the family's, e.g. 256 for SD3, 512 for FLUX)."""
    num_frames: int | None = None
    """Frames per clip, video families only (wan, wan22_ti2v: 4k + 1, default 5; Wan2.1's own is 81, TI2V-5B's 121)."""
    guidance_scale_2: float | None = None
    """CFG scale of the low-noise expert, two-expert families only (wan22_t2v, wan22_i2v: the pipeline's
    guidance_scale_2); null: the high-noise expert's scale, as WanPipeline. Applies wherever guidance does
    (sampling, training, eval)."""
    negative_prompt: str = ""
    """The negative prompt of classifier-free guidance, for every prompt (families that run CFG)."""
    gradient_checkpointing: bool = False
    """Recompute transformer activations in the backward pass to save memory."""
    quantize: Literal["none", "int8", "nf4", "fp8"] = "none"
    """Quantise the frozen transformer base under the LoRA (QLoRA): int8 (torchao weight-only, also on the CPU),
    nf4 (bitsandbytes 4-bit, CUDA) or fp8 (torchao, CUDA compute capability >= 8.9); the LoRA stays float32."""
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
    preference: PreferenceConfig = field(default_factory=PreferenceConfig)
    """ParetoSlider's preference conditioning (off unless preference.rewards is set)."""
    trainable: Literal["lora", "full"] = "lora"
    """What is trained: lora, an adapter on the frozen base (the lora section); full, the transformer's own weights
    (float32 master weights; the reference is a frozen copy of the base, sharded as they are)."""
    trainable_modules: list[str] = field(default_factory=list)
    """With trainable=full, regexes on module names (re.search) that pick the trained modules, e.g. [attn]; empty:
    every transformer weight."""

    def validate(self):
        for key in ("dtype", "text_encoder_dtype", "vae_dtype"):
            value = getattr(self, key)
            check(value in DTYPES or value is None and key != "dtype", key,
                  f"unknown dtype {value!r}; use float32, bfloat16 or float16" + ("" if key == "dtype" else
                                                                                  ", or null for model.dtype"))
        for key in ("revision", "variant"):
            check(self.path != "tiny" or getattr(self, key) is None, key,
                  "applies to hub or local pipelines, and model.path=tiny builds the offline tiny one: remove it")
        check(not self.free_text_encoders or self.text_cache == "disk", "free_text_encoders",
              "frees the encoders after caching every prompt: set model.text_cache=disk, or remove it")
        check(self.text_cache_path is None or self.text_cache == "disk", "text_cache_path",
              "names the cache of model.text_cache=disk: set that, or remove it")
        check(self.trainable == "lora" or self.quantize == "none", "quantize",
              "quantises the frozen base under a LoRA, and model.trainable=full trains the base itself: set "
              "model.trainable=lora, or model.quantize=none")
        check(not self.trainable_modules or self.trainable == "full", "trainable_modules",
              "picks the modules of full training (model.trainable=full); a LoRA's modules are lora.target_modules")
        for pattern in self.trainable_modules:
            try:
                re.compile(pattern)
            except re.error as error:
                check(False, "trainable_modules", f"{pattern!r} is not a regular expression: {error}")


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
    experts: list[str] | None = None
    """Two-expert families only (wan22_t2v, wan22_i2v): the experts that carry the LoRA, [high, low] by default
    (high: the high-noise `transformer`, low: `transformer_2`); only their LoRA parameters train."""

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
    """Optimisation settings that every recipe reads; a recipe's own (GRPO's clip ranges, losses and credit) live in
    its subclass, e.g. :class:`flowrl.config.grpo.GRPOTrainConfig`."""

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
    optimizer: Literal["adamw", "adamw8bit"] = "adamw"
    """adamw: torch's AdamW; adamw8bit: torchao's AdamW8bit, its two moments in 8 bits per value plus one scale per
    256 (block-wise; ~1/4 of AdamW's state), on the CPU as on CUDA (needs the quant extra)."""
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
    ema: bool = True
    """Keep an EMA of the LoRA weights for eval and export."""
    ema_decay: float = 0.9
    """EMA decay per optimizer step."""
    mixed_precision: Literal["no", "fp16", "bf16"] = "bf16"
    """Autocast of the transformer's passes on GPU (rollouts, training log-probs, the KL reference; the SDE step and
    its log-prob stay float32): bf16 beside model.dtype bfloat16, fp16 or bf16 beside float32 master weights
    (Flow-GRPO: fp16). CPU runs never autocast: they compute in the weights' own dtype (float32 unless model.dtype
    says otherwise), as accelerate has no float16 autocast on the CPU."""
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
    """Export the final (EMA) LoRA in diffusers format to RUN_DIR/lora at the end (model.trainable=full: the
    transformer as a diffusers folder, RUN_DIR/transformer)."""
    time_limit_s: float | None = None
    """Stop after the epoch in which sampling, scoring and training time (perf/train_wall_s) passes this
    many seconds; the run then checkpoints, exports and reports as at its last epoch (null: no limit)."""
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
        check(len(self.adam_betas) == 2 and all(0 <= b < 1 for b in self.adam_betas), "adam_betas",
              "must be [beta1, beta2], each in [0, 1)")
        check(self.beta >= 0, "beta", "must be >= 0")
        check(self.checkpoint_every >= 0, "checkpoint_every", "must be >= 0 (0: only at the end)")
        check(0 <= self.ema_decay < 1, "ema_decay", "must be in [0, 1)")
        check(self.time_limit_s is None or self.time_limit_s > 0, "time_limit_s", "must be > 0 or null")


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
class ContextParallelSection:
    ulysses: int = 1
    """Processes that split each row's attention sequence by Ulysses all-to-all (1: off); multiplies with ring."""
    ring: int = 1
    """Processes that split each row's attention sequence by ring attention (1: off)."""

    def validate(self):
        for key in ("ulysses", "ring"):
            check(1 <= getattr(self, key) <= 64, key, "must be in [1, 64] (1: off)")


@dataclass
class ParallelConfig:
    context: ContextParallelSection = field(default_factory=ContextParallelSection)
    """Sequence (context) parallelism through diffusers: ulysses x ring processes hold one row, so the world is
    data x ulysses x ring (docs/scaling.md)."""


@dataclass
class Config:
    """The sections every recipe reads. A run's config is its recipe's subclass (:class:`flowrl.config.grpo.GRPOConfig`,
    :class:`flowrl.config.nft.NFTConfig`), which adds the recipe's own sections and checks; the loader builds the
    one that ``recipe:`` names (``load_config(Config, ...)``), so a key of another recipe is an unknown key.

    ``validate`` only reads: the same file gives the same config on any machine. What depends on the machine (is
    CUDA there) or is decided for the run (MARBLE with one trained reward falls back to weighted) happens when the
    run starts, in :mod:`flowrl.recipes`."""

    variant_key: ClassVar[str] = "recipe"  # the loader builds variants[recipe]
    variants: ClassVar[dict[str, type[Config]]] = {}  # recipe name -> its config class, filled as they are defined

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
    hrf: HrfConfig = field(default_factory=HrfConfig)
    """HRF's per-phase parameter anchor (both recipes)."""
    guard: GuardConfig = field(default_factory=GuardConfig)
    """The diversity guard: in-group diversity of the rollouts against its start value (both recipes)."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """How processes split the work beyond data parallelism: parallel.context (sequence parallelism)."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Recipe-specific settings the recipe validates itself."""

    def __init_subclass__(cls, recipe: str | None = None, **kwargs):
        super().__init_subclass__(**kwargs)
        if recipe is not None:
            Config.variants[recipe] = cls

    def validate_preference(self):
        """model.preference and train.combine=preference go together; the slider's rewards are trained rewards."""
        names = self.model.preference.rewards
        check(bool(names) == (self.train.combine == "preference"), "train.combine",
              "preference (ParetoSlider's w . r) goes with model.preference.rewards: set both, or neither")
        trained = {r.key or r.name for r in self.rewards if r.weight != 0}
        missing = [n for n in names if n not in trained]
        check(not missing, "model.preference.rewards", f"{missing[0] if missing else ''!r} is not a trained reward: "
              "name rewards (their key) listed in `rewards:` with a non-zero weight, which w replaces")
        check(not names or not self.sampling.pilot.candidates, "sampling.pilot.candidates",
              "Pilot-Commit ranks candidates before a group has its w: not with model.preference")
        per_prompt, size = self.model.preference.per_prompt, self.sampling.group_size
        check(not names or size % per_prompt == 0 and size // per_prompt >= 2, "model.preference.per_prompt",
              f"{per_prompt} preferences do not split sampling.group_size={size} into equal subgroups of at least 2 "
              "rows: pick a divisor of the group size (the reference: 3 per group of 24)")

    def validate_precision(self):
        """Half-precision weights compute in their own dtype: under the other half's autocast every weight would be
        rounded twice (bfloat16 -> float16 overflows past 65504)."""
        weights, autocast = DTYPES.get(self.model.dtype), self.train.mixed_precision
        halves = {"bfloat16": "bf16", "float16": "fp16"}
        check(weights not in halves or autocast in ("no", halves[weights]), "train.mixed_precision",
              f"{autocast} autocast over model.dtype {weights} weights rounds each weight twice: use "
              f"train.mixed_precision={halves.get(weights)}, or model.dtype=float32 (float32 master weights, "
              "Flow-GRPO's precision)")

    def trained_rewards(self) -> list[str]:
        """The names of the rewards with a nonzero weight, the ones the run trains on."""
        return [r.name for r in self.rewards if r.weight != 0]

    def registry_names(self) -> dict[str, tuple[str, str]]:
        """{dotted key: (registry kind, name)}: the names this config gives to registries, which this layer cannot
        see; :mod:`flowrl.recipes.names` checks them when the run starts. A recipe's config adds its own."""
        return {"train.combine": ("reward combiner", self.train.combine),
                "guard.features": ("feature space", self.guard.features)}

    def scores_partial_groups(self) -> tuple[str, str] | None:
        """(key, why) where this config scores parts of a group apart, else None: a group-wise reward (it ranks or
        compares a group's images) is refused there when the run starts (:mod:`flowrl.recipes.names`, which can
        import the reward classes this layer may not). A recipe's config adds its own."""
        if self.sampling.pilot.candidates:
            return "sampling.pilot.candidates", "Pilot-Commit scores a group's pilot rows apart from its commit rows"
        return None

    def validate(self):
        keys = [r.key or r.name for r in self.rewards]
        check(len(set(keys)) == len(keys), "rewards", "each reward (or sub-score `key:`) may appear once; to train "
              "on several sub-scores of one reward, give each entry its own key")
        check(bool(self.trained_rewards()) or not self.rewards, "rewards", "every reward has weight 0, so nothing "
              "trains: give at least one a nonzero weight")
        check(self.hrf.anchor_weight == 0 or self.hrf.phase_epochs is not None or self.sampling.window.mode == "sliding"
              and self.sampling.window.size is not None, "hrf.phase_epochs",
              "hrf.anchor_weight needs phases: set hrf.phase_epochs, or a sliding SDE window (sampling.window.size and "
              "mode=sliding) whose shift_every sets them")
        check(self.sampling.group_size >= 2 or self.train.advantage == "mean", "sampling.group_size",
              "group advantages need at least 2 trajectories per prompt")
        check(not self.guard.enabled or self.sampling.group_size >= 2, "guard.enabled",
              "the guard measures diversity within a prompt's group: use sampling.group_size >= 2")
        held_out = self.guard.held_out
        if held_out.enabled:
            names = [r.name for r in self.rewards] + [r.key for r in self.rewards if r.key]
            check(held_out.reward in names, "guard.held_out.reward", f"{held_out.reward!r} is not a reward of "
                  f"`rewards` ({', '.join(dict.fromkeys(names))}): add it, with weight 0 for a gold reward")
            check(self.log.test_every > 0, "log.test_every", f"guard.held_out (policy {held_out.policy}) watches "
                  "the held-out curve, which log.test_every=0 never scores: set log.test_every, e.g. 5")
            check(held_out.policy != "rollback" or held_out.kl_factor == 1 or self.train.beta > 0,
                  "guard.held_out.kl_factor", "raises the KL beta, but train.beta is 0: set train.beta > 0, or "
                  "kl_factor=1 and lower lr_factor")
        self.validate_preference()
        check(self.model.trainable == "lora" or self.lora.target_modules is None, "lora.target_modules",
              "picks LoRA targets, and model.trainable=full trains no LoRA: pick the trained modules with "
              "model.trainable_modules (regexes), or remove it (lora.rank/alpha/dropout are simply unused)")
        check(self.model.trainable == "lora" or not self.model.preference.rewards, "model.preference",
              "ParetoSlider's embedding is trained beside a LoRA; with model.trainable=full use model.trainable=lora")
        self.validate_precision()
        check(self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:"), "device",
              "use auto, cpu, cuda or cuda:N")
        check(bool(self.rewards), "rewards", "is empty, so nothing trains: list at least one reward, e.g. "
              "rewards=[{name: brightness}]")
        if self.device.startswith("cuda"):  # whether this machine has it is checked when the run starts
            index = self.device.partition(":")[2]
            check(index == "" or index.isdigit(), "device", f"{self.device!r}: use cuda or cuda:N")
