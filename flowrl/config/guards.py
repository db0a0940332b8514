"""The guards against collapse and reward hacking (``guard.*``: in-group diversity of the rollouts;
``guard.held_out.*``: a held-out score on the curve's points). What they do: flowrl/recipes/guard.py and
flowrl/recipes/held_out_guard.py.

Part of the typed configuration in :mod:`flowrl.config.schema`, which re-exports every class here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from flowrl.config.loader import check


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
    """Feature space of the diversity: latent (the rollout's VAE latents), a flowrl.features network (toy, pixels,
    clip, dino, inception: the same networks as eval.features) or 'package.module:Class', as gardo.features
    (flowrl/algorithms/gardo.py)."""
    feature_kwargs: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of the feature network's constructor (clip: model, pretrained, device; dino: path; ...)."""
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
