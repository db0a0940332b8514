"""Recipe grpo's configuration (``recipe: grpo``, the default): :class:`GRPOConfig`, the shared sections of
:class:`~flowrl.config.schema.Config` with GRPO's own training options (clip ranges, TMPO's path loss, per-step
log-ratio normalisation and credit, the EMA's schedule, which steps train) and GARDO's section. Recipe nft has none
of these keys, so the loader refuses them in its configs as unknown keys naming recipe grpo.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from flowrl.config.loader import Requires, check, check_requirements
from flowrl.config.schema import Config, TrainConfig


@dataclass
class GRPOTrainConfig(TrainConfig):
    """``train.*`` of recipe grpo: the shared optimisation settings and GRPO's own, which act on its per-step
    log-prob ratios and stored transitions."""

    loss: str = "grpo-clip"
    """Policy loss (registry name): grpo-clip, tmpo (TMPO's Softmax Trajectory Balance over whole paths under a
    path-level clipped ratio, as in its authors' release; recipe grpo, flowrl/algorithms/tmpo.py), or sdpo (SDPO's
    dense reward difference loss on pairs of a group that share initial noise, steps shuffled per pair;
    flowrl/algorithms/sdpo.py)."""
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
    """PPO ratio clip epsilon (1e-4 full SDE, 1e-5 window/CPS in Flow-GRPO); train.loss sdpo clamps each log-ratio
    to +-this (the reference's clip_range, 1e-4)."""
    clip_range_high: float | None = None
    """Upper clip epsilon if different from the lower one (asymmetric clipping)."""
    skip_last_step: bool | None = None
    """Do not train the last, near-clean step. null: true for a full-SDE rollout (Flow-GRPO trains steps
    0..T-2), false with an SDE window (Flow-GRPO-Fast trains every window step, the last included) or with
    train.loss sdpo (its reference trains every step)."""
    timestep_fraction: float = 1.0
    """Train this fraction of the stored steps, drawn per epoch."""
    ema_start_step: int = 1
    """Optimizer steps through which the EMA copies the live weights, averaging from the next on (1: it starts
    from the first step's weights, diffusers' EMAModel rule; 0: from the initial weights, as Flow-GRPO; recipe grpo)."""
    ema_every: int = 1
    """Fold the weights into the EMA every this many optimizer steps (recipe grpo). Flow-GRPO: 8 on its SD3.5 runs
    (EMAModuleWrapper(decay=0.9, update_step_interval=8)); it folds after steps 7, 15, ... and calls the EMA after
    every training batch, so one fold repeats per accumulated batch; flowrl folds once, after steps 8, 16, ..."""
    ema_warmup: Literal["none", "flow_grpo"] = "none"
    """none: the decay is ema_decay from the start; flow_grpo: Flow-GRPO's ramp min(ema_decay, (1 + s) / (10 + s)),
    s the optimizer steps since ema_start_step, so early updates average over fewer steps (recipe grpo)."""
    credit: Literal["terminal", "dense_cosine", "dense_ode", "sdpo"] = "terminal"
    """Per-step credit (recipe grpo, see flowrl/algorithms/dense.py): terminal gives every trained step its
    row's advantage; dense_cosine splits it by how far each step moves the predicted x0 toward the final
    latent; dense_ode trains each step on its group-normalised reward gain from ODE look-ahead, DenseGRPO's
    dense reward (its reward-aware per-timestep noise calibration is not implemented: no published code); sdpo
    trains each step on its group-normalised discounted return of SDPO's dense rewards, queried on a few steps'
    clean predictions and predicted by latent similarity on the others (the sdpo_* keys)."""
    drop_zero_advantage: bool = False
    """Flow-GRPO's filter (yifan123/flow_grpo, scripts/train_sd3.py at ac4c86e8): after the advantages, before the
    inner passes, each process drops its rows whose advantage is exactly 0 on every trained step (a saturated group,
    all rewards equal), so they carry neither the policy loss nor the KL and cost no pass; the loss averages over
    the kept transitions of all processes, an optimizer step with none kept anywhere is skipped (the LR schedule
    advances), and a process with none kept runs zero-weighted passes so that the collectives match. Logged as
    policy/dropped_rows. Flow-GRPO also re-admits random dropped rows until the kept count divides its batches per
    epoch (its reshape needs equal batches); flowrl's chunks take any count, so none is re-admitted. Per-transition
    losses only (not tmpo or sdpo, nor train.combine=marble)."""
    dense_lookahead: int | None = None
    """dense_ode: model calls per look-ahead (the last one steps straight to sigma 0); null runs the full
    remaining ODE, which DenseGRPO finds better than a short look-ahead."""

    sdpo_gamma: float = 0.99
    """SDPO: discount of the dense rewards' returns over steps, G_j = r_j + gamma G_(j+1) (reference 0.99)."""
    sdpo_lam: float = 0.99
    """SDPO: temporal importance, step j's log-ratio difference weighs lam**j (j = 0 the noisiest; reference 0.99)."""
    sdpo_log_scale: float = 1.0
    """SDPO: the log-ratio difference is divided by this before it is matched to the advantage difference."""
    sdpo_queries: int = 3
    """SDPO: states scored per trajectory: the first, the last and sdpo_queries - 2 anchors; the others are
    predicted by latent similarity (reference 3; >= num_steps: all). With sdpo_reward_at step_end the last is the
    sample, whose reward the rollout already has."""
    sdpo_reward_at: Literal["step_start", "step_end"] = "step_start"
    """SDPO: which state's clean prediction x0 = x - sigma v gives step k's dense reward: step_start, the state step k
    starts from (the reference's, so both rows of a pair, one initial noise, share step 0's reward), or step_end, the
    state it leads to (the last: the sample itself, so the last step's own noise is rewarded)."""
    sdpo_anchor: Literal["least_similar", "random"] = "least_similar"
    """SDPO: the anchors, least_similar (the reference: the state least cosine-similar to those queried so far) or
    random middle states drawn from the row's seed."""

    def __post_init__(self):
        if isinstance(self.ratio_norm, bool):  # true names the method the option was written for (parsing, so
            self.ratio_norm = "grpo_guard" if self.ratio_norm else "none"  # here: validation changes nothing)

    def validate(self):
        super().validate()
        check(self.clip_range > 0, "clip_range", "must be > 0 (the PPO ratio clip epsilon, e.g. 1e-4)")
        check(self.clip_range_high is None or self.clip_range_high > 0, "clip_range_high", "must be > 0, or null")
        check(self.ema_start_step >= 0, "ema_start_step", "must be >= 0")
        check(self.ema_every >= 1, "ema_every", "must be >= 1 optimizer step")
        check(0 < self.timestep_fraction <= 1, "timestep_fraction", "must be in (0, 1]")
        check(self.tmpo_beta > 0, "tmpo_beta", "must be > 0")
        check(0 < self.tmpo_clip_range < 1, "tmpo_clip_range", "must be in (0, 1)")
        check(0 <= self.sdpo_gamma <= 1, "sdpo_gamma", "must be in [0, 1]")
        check(0 < self.sdpo_lam <= 1, "sdpo_lam", "must be in (0, 1]")
        check(self.sdpo_log_scale > 0, "sdpo_log_scale", "must be > 0")
        check(self.sdpo_queries >= 2, "sdpo_queries", "must be >= 2 (the first and the last step are always scored)")
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
    """Feature space of the diversity weighting: latent (the rollout's VAE latents), a flowrl.features network
    (toy, pixels, clip, dino, inception: the same networks as eval.features) or 'package.module:Class'
    (flowrl/algorithms/gardo.py)."""
    feature_kwargs: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of the feature network's constructor (clip: model, pretrained, device; dino: path; ...)."""

    def validate(self):  # the feature space's name is checked against its registry by flowrl.recipes.names
        check(0 < self.kl_fraction <= 1, "kl_fraction", "must be in (0, 1]")
        check(self.reset_every is None or self.reset_every >= 1, "reset_every", "must be >= 1 epoch, or null")
        check(self.reset_kl is None or self.reset_kl > 0, "reset_kl", "must be > 0, or null")


@dataclass
class GRPOConfig(Config, recipe="grpo"):
    """A run of recipe grpo (:mod:`flowrl.recipes.grpo`): online trajectory RL on SDE rollouts."""

    train: GRPOTrainConfig = field(default_factory=GRPOTrainConfig)
    """Optimisation, with GRPO's clip ranges, policy loss and credit."""
    recipe: Literal["grpo"] = "grpo"
    """Training loop: grpo (SDE rollouts, clipped log-prob ratios) or nft (DiffusionNFT)."""
    gardo: GardoConfig = field(default_factory=GardoConfig)
    """GARDO's gated KL, adaptive reference and diversity-aware advantage."""

    def registry_names(self) -> dict[str, tuple[str, str]]:
        return {"train.loss": ("policy loss", self.train.loss), **super().registry_names(),
                "gardo.features": ("feature space", self.gardo.features)}

    def scores_partial_groups(self) -> tuple[str, str] | None:
        if self.train.credit == "sdpo":
            return "train.credit", "train.credit=sdpo scores a few queried states of each row, not whole groups"
        return super().scores_partial_groups()

    def validate(self):
        super().validate()
        check_requirements(self, GRPO_REQUIREMENTS)
        self.validate_gardo()
        guide = self.sampling.self_guidance
        check(not (guide.scale > 0 and guide.in_rollouts), "sampling.self_guidance.in_rollouts",
              "recipe grpo recomputes each row's log-prob alone, but self-guidance makes a row's velocity depend on "
              "its group's other rows: set it to false (recipe nft accepts it)")

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


def _random_windows(cfg: GRPOConfig) -> bool:
    """Whether every rollout batch draws its own window (``sampling.window.mode: random``)."""
    return cfg.sampling.window.size is not None and cfg.sampling.window.mode == "random"


_TREE_CREDIT = ("dense_cosine", "dense_ode", "sdpo")  # train.credit values that give per-step advantages

# What each value of recipe grpo's options needs of the others, checked in this order by GRPOConfig.validate. A new
# per-transition loss needs no row: only the losses that train other targets (TMPO's paths, SDPO's pairs) refuse
# options here.
GRPO_REQUIREMENTS = (
    # Checked first, as the train section: what each value of train.loss, combine and drop_zero_advantage refuses.
    Requires("train.combine", ("marble",), "train.combine",
             lambda c: c.train.credit == "terminal" and c.train.loss == "grpo-clip",
             "marble balances one gradient per reward of the row advantages; it cannot combine with "
             "train.credit={cfg.train.credit} or train.loss={cfg.train.loss}: use credit terminal and loss grpo-clip, "
             "or train.combine=gdpo"),
    Requires("train.loss", ("tmpo",), "train.credit", lambda c: c.train.credit == "terminal",
             "{cfg.train.credit} gives per-step advantages, but train.loss=tmpo trains on per-trajectory targets; "
             "use train.loss=grpo-clip or train.credit=terminal"),
    Requires("train.drop_zero_advantage", (True,), "train.drop_zero_advantage",
             lambda c: c.train.loss not in ("tmpo", "sdpo") and c.train.combine != "marble",
             "drops rows of zero advantage from the per-transition loss; not with train.loss={cfg.train.loss} / "
             "train.combine={cfg.train.combine}, which train on other targets: use train.loss=grpo-clip and a "
             "combine other than marble, or remove it"),    Requires("train.credit", ("dense_ode",), "train.credit", lambda c: not c.model.preference.rewards,
             "dense_ode scores its look-ahead states by the configured weights, not each group's w: not with "
             "model.preference (use terminal or dense_cosine)"),
    # TMPO's path loss (algorithms.tmpo.PATH_LOSSES) trains over whole paths: no KL, no per-step normalisation,
    # pruning or row weights.
    Requires("train.loss", ("tmpo",), "train.beta", lambda c: c.train.beta == 0,
             "train.loss=tmpo regularises with train.tmpo_ref_weight, not the KL; set train.beta=0"),
    Requires("train.loss", ("tmpo",), "train.ratio_norm", lambda c: c.train.ratio_norm == "none",
             "train.loss=tmpo has its own RatioNorm weights; set train.ratio_norm=none"),
    Requires("train.loss", ("tmpo",), "sampling.tree.prune_width",
             lambda c: not (c.sampling.tree.prune_width or c.sampling.tree.prune_depth),
             "train.loss=tmpo trains whole paths; BranchGRPO's pruning does not apply: set it to 0"),
    Requires("train.loss", ("tmpo",), "gardo.diversity", lambda c: not c.gardo.diversity,
             "train.loss=tmpo has no per-row advantage to weight; set gardo.diversity=false"),
    Requires("train.loss", ("tmpo",), "sampling.window.mode", lambda c: not _random_windows(c),
             "train.loss=tmpo scores each stored column at one step, but mode random draws a window per rollout "
             "batch: use sampling.window.mode=random_per_epoch"),
    # SDPO pairs the rows of a group on one shared noise and trains every step of a full-SDE rollout, with no KL or
    # per-step ratio normalisation (its reference has neither).
    Requires("train.loss", ("sdpo",), "sampling.group_size", lambda c: c.sampling.group_size % 2 == 0,
             "train.loss=sdpo pairs the rows of a group on one initial noise: use an even group size (got "
             "{cfg.sampling.group_size})"),
    Requires("train.loss", ("sdpo",), "sampling.rollout_chunk",
             lambda c: not c.sampling.rollout_chunk or min(c.sampling.rollout_chunk, c.sampling.group_size) % 2 == 0,
             "train.loss=sdpo needs whole pairs per rollout chunk: use an even chunk"),
    Requires("train.loss", ("sdpo",), "train.beta", lambda c: c.train.beta == 0,
             "train.loss=sdpo has no KL term (as its reference): set train.beta=0"),
    Requires("train.loss", ("sdpo",), "train.ratio_norm", lambda c: c.train.ratio_norm == "none",
             "train.loss=sdpo matches plain log-ratio differences: set train.ratio_norm=none"),
    Requires("train.loss", ("sdpo",), "gardo.diversity", lambda c: not c.gardo.diversity,
             "train.loss=sdpo trains per-step advantage differences, not row advantages: set gardo.diversity=false"),
    Requires("train.loss", ("sdpo",), "sampling.pilot.candidates", lambda c: not c.sampling.pilot.candidates,
             "train.loss=sdpo pairs rows that share initial noise, and Pilot-Commit draws a group in two passes: set "
             "it to 0"),
    Requires("train.loss", ("sdpo",), "sampling.tree.branch_steps", lambda c: not c.sampling.tree.branch_steps,
             "train.loss=sdpo trains the steps of flat groups, not tree rollouts: remove the branch steps"),
    Requires("train.loss", ("sdpo",), "sampling.window.size", lambda c: c.sampling.window.size is None,
             "train.loss=sdpo rewards and trains every step of a full-SDE rollout (few-step schedules): set the "
             "window to null"),
    Requires("train.credit", ("sdpo",), "sampling.tree.branch_steps", lambda c: not c.sampling.tree.branch_steps,
             "train.credit=sdpo trains the steps of flat groups, not tree rollouts: remove the branch steps"),
    Requires("train.credit", ("sdpo",), "sampling.window.size", lambda c: c.sampling.window.size is None,
             "train.credit=sdpo rewards and trains every step of a full-SDE rollout (few-step schedules): set the "
             "window to null"),
    Requires("train.sdpo_reward_at", ("step_start",), "sampling.num_steps",
             lambda c: c.sampling.num_steps >= 2 or (c.train.loss, c.train.credit) != ("sdpo", "sdpo"),
             "is 1: train.sdpo_reward_at=step_start scores the state a step starts from, and a 1-step pair shares "
             "its only one (the initial noise), so no pair could differ; use 2+ steps or "
             "train.sdpo_reward_at=step_end"),
    Requires("train.credit", _TREE_CREDIT, "train.credit", lambda c: not c.sampling.tree.branch_steps,
             "{cfg.train.credit} is not defined on tree rollouts (sampling.tree.branch_steps), whose edges take their "
             "advantage from the leaves below them; use train.credit=terminal"),
    Requires("train.ratio_norm", ("grpo_guard",), "train.ratio_norm", lambda c: c.sampling.kind == "sde",
             "grpo_guard's |dt| reweighting is defined for SDE steps, not sampling.kind={cfg.sampling.kind}: use "
             "sampling.kind=sde, or train.ratio_norm=batch_sensitivity"),
    Requires("train.ratio_norm", ("batch_sensitivity",), "train.ratio_norm", lambda c: not _random_windows(c),
             "batch_sensitivity scales each stored column by its step's sensitivity, but sampling.window.mode=random "
             "draws a window per rollout batch, so a column holds different steps: use "
             "sampling.window.mode=random_per_epoch"),

)
