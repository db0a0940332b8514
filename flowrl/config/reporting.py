"""What a run logs and measures: tracking and in-training evaluation (``log.*``) and ``flowrl eval``
(``eval.*``). The guards that act on these measurements are :mod:`flowrl.config.guards`.

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
