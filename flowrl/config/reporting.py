"""What a run logs and measures: tracking and in-training evaluation (``log.*``), ``flowrl eval``
(``eval.*``) and the guards (``guard.*``: diversity; ``guard.held_out.*``: the held-out curve).

Part of the typed configuration in :mod:`flowrl.config.schema`, which re-exports every class here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from flowrl.config.loader import check


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
    height: int | None = None
    """Height of every evaluation image: `flowrl eval`, the held-out curve (log.test_every), the eval grids and the
    end-of-run report (null: model.height; train small, evaluate large)."""
    width: int | None = None
    """Width of every evaluation image (null: model.width)."""
    num_frames: int | None = None
    """Clip length of every evaluation video (video families; null: model.num_frames)."""
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
        for key in ("height", "width", "num_frames"):
            check(getattr(self, key) is None or getattr(self, key) >= 1, key, "must be >= 1 or null (the training size)")


@dataclass
class HeldOutGuardConfig:
    reward: str | None = None
    """The held-out score watched (flowrl/recipes/held_out_guard.py): a reward of ``rewards`` by name or key,
    scored on the held-out points of log.test_every; a gold reward (weight 0, never trained on) or the trained
    one on held-out prompts. Null: the held-out guard is off."""
    margin: float = 0.02
    """Fire when the held-out score falls more than this below its best point, beyond z standard errors."""
    z: float = 2.0
    """Noise allowance: standard errors of the paired per-prompt difference to the best point."""
    patience: int = 2
    """Held-out points in a row that must show the fall (with the training reward rising) before it fires."""
    policy: Literal["warn", "stop", "rollback"] = "warn"
    """warn: one line and guard/held_out_fired; stop: end the run and export the best held-out snapshot;
    rollback: restore the best snapshot (LoRA, EMA, optimizer moments), lower the LR by lr_factor and raise
    the KL beta by kl_factor, and go on; the firing after max_rollbacks stops the run."""
    lr_factor: float = 0.5
    """rollback: the learning rate (every later step of train.lr_scheduler) is multiplied by this."""
    kl_factor: float = 1.0
    """rollback: the KL beta in force is multiplied by this (1: unchanged; needs train.beta > 0)."""
    max_rollbacks: int = 2
    """rollback: at most this many; the next firing stops the run with the best snapshot."""

    @property
    def enabled(self) -> bool:
        return self.reward is not None

    def validate(self):
        check(self.margin >= 0, "margin", "must be >= 0")
        check(self.z >= 0, "z", "must be >= 0")
        check(self.patience >= 1, "patience", "must be >= 1 held-out point")
        check(0 < self.lr_factor <= 1, "lr_factor", "must be in (0, 1] (it lowers the learning rate)")
        check(self.kl_factor >= 1, "kl_factor", "must be >= 1 (it raises the KL beta)")
        check(self.max_rollbacks >= 1, "max_rollbacks", "must be >= 1")
        check(self.enabled or self.policy == "warn", "policy", f"{self.policy} needs a held-out score to watch: "
              "set guard.held_out.reward to a reward of `rewards` (a gold one with weight 0, or the trained one)")
        check(self.policy != "rollback" or self.lr_factor < 1 or self.kl_factor > 1, "policy",
              "rollback with lr_factor=1 and kl_factor=1 would train on as before: lower lr_factor or raise kl_factor")


@dataclass
class GuardConfig:
    enabled: bool = False
    """Watch the in-group diversity of each epoch's rollouts (no extra sampling) and act when it falls
    (flowrl/recipes/guard.py); off: nothing is measured or logged."""
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
    held_out: HeldOutGuardConfig = field(default_factory=HeldOutGuardConfig)
    """The held-out guard: the log.test_every curve of one reward against the training reward (apart from
    guard.enabled, which turns on the diversity guard only)."""

    def validate(self):  # the feature space's name is checked against its registry by flowrl.recipes.names
        check(self.every >= 1, "every", "must be >= 1 epoch")
        check(self.warmup >= 1, "warmup", "must be >= 1 measurement")
        check(0 < self.max_drop < 1, "max_drop", "must be a fraction in (0, 1)")
        check(self.beta_factor > 1, "beta_factor", "must be > 1 (it raises the KL beta)")
        check(self.beta_floor > 0, "beta_floor", "must be > 0")
        check(self.cooldown >= 1, "cooldown", "must be >= 1 epoch")
        check(self.diversity_weight >= 0, "diversity_weight", "must be >= 0")
