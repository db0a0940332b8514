"""Recipe nft's configuration (``recipe: nft``): :class:`NFTConfig`, the shared sections of
:class:`~flowrl.config.schema.Config` and the forward-process section :class:`NFTSection` (``nft.*``): DiffusionNFT's,
AWM's, CRD's and DPO's losses, their timesteps, samplers, old-policy decays and eval EMAs. Recipe nft has no log-prob
ratios, so GRPO's own keys (``train.clip_range``, ``train.loss``, ``gardo.*``, ...) are unknown keys here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from flowrl.config.loader import Requires, check, check_requirements
from flowrl.config.schema import Config


@dataclass
class NFTSection:
    """Forward-process RL (recipe: nft): ODE rollouts, flow-matching updates on their clean samples,
    with DiffusionNFT's loss, AWM's, CRD's or online DPO's."""

    loss: Literal["nft", "awm", "crd", "dpo"] = "nft"
    """'nft': DiffusionNFT's implicit positive/negative policies; 'awm': Advantage Weighted Matching, its
    (ghuber-weighted) flow-matching log-probability under a clipped ratio times the clipped advantage over
    train.advantage_clip, plus nft.awm_kl times ||v - v_old||^2 toward the old (EMA) adapter; 'crd': Centered
    Reward Distillation, the implicit log-ratio to the old adapter matched to the reward, both centred within
    the prompt's group; 'dpo': online Diffusion-DPO, each group's (winner, loser) pairs at a shared (t, noise), their
    flow-matching errors against the base model's (adapter off) through -log sigmoid(-dpo_beta / 2 * difference)."""
    dpo_beta: float = 100.0
    """DPO: beta of -log sigmoid(-beta / 2 * ((e_w - e_ref_w) - (e_l - e_ref_l))), e the per-element mean squared
    velocity error (Diffusion-DPO's beta_dpo, T folded in; Flow-GRPO's SD3.5-M DPO: 100)."""
    dpo_pairs: Literal["best_worst", "all"] = "best_worst"
    """DPO: a group's pairs, its best rollout against its worst (Flow-GRPO's) or every winner/loser pair; equal
    advantages give no pair. best_worst: better per second of training on the toy world (flowrl/algorithms/forward_losses.py,
    DpoLoss)."""
    dpo_ref_update_every: int | None = None
    """DPO: every this many epochs the reference becomes the adapter as it ends that epoch (Flow-GRPO's online DPO,
    its ref_update_step, counted there in optimizer steps); null: the reference stays the base model (adapter off),
    as Flow-GRPO's and Flow-Factory's defaults. train.beta's KL anchor is the same reference."""
    crd_beta: float = 1.0
    """CRD: the KL temperature beta of beta (log-ratio - group mean) ~ (r - group mean), r in [0, 1]
    (Flow-Factory's crd_beta, 1 in its SD3.5 OCR example)."""
    crd_kl_guidance: float | None = None
    """CRD: the CFG scale of train.beta's KL anchor, the base model (Flow-Factory's kl_cfg); null:
    sampling.guidance_scale, whether or not the policy itself trains with CFG (train.cfg)."""
    crd_reward_adaptive_kl: bool = True
    """CRD: weight each sample's KL by 1e-4 / train.beta + r (1 - 1e-4 / train.beta), r its optimality in
    [0, 1] (Flow-Factory's reward_adaptive_kl): the better a sample, the harder it is held to the base model."""
    awm_kl: float = 1.0
    """AWM: weight of ||v - v_old||^2 (AWM's published value). With ghuber weighting any awm_kl > 0 bounds a
    sample's loss below (its l^p grows slower than the pull); with uniform, while its advantage weight (in
    [-1, 1]) plus awm_kl is > 0, so 1 covers every weight above -1."""
    strength: float = 1.0
    """beta of the implicit policies v+ = beta v + (1 - beta) v_old, v- = (1 + beta) v_old - beta v (loss nft)."""
    loss_scale: float | None = None
    """Factor on the policy loss (not on train.beta's KL); null: the reference's train.advantage_clip / strength
    for loss nft (DiffusionNFT), train.advantage_clip / crd_beta for crd (Flow-Factory), 1 for awm. Its published
    KL betas and max_grad_norm assume that scale; 1 gives flowrl's earlier, unscaled loss."""
    timesteps_per_sample: int = 1
    """Fresh (t, noise) draws per clean sample in each pass: more lowers the gradient's variance."""
    adaptive_weighting: bool = True
    """Divide each squared error by its own detached mean absolute error: loss nft measures its terms in x0-space
    (DiffusionNFT's adaptive weighting, keeps training stable); loss crd its implicit log-ratio's two terms in
    velocity space (Flow-Factory's adaptive_logp)."""
    timestep_schedule: Literal["sampling", "uniform", "stratified", "logit_normal"] | None = None
    """Where training t comes from: 'sampling' draws, per sample and without repeats, from the sigmas of
    the (shifted) sampling schedule, as DiffusionNFT does; 'uniform' draws t ~ U(0, 1); 'stratified' is AWM's
    draw, one sigma per stratum of the schedule without its first (sigma 1) and last ones (see
    nft.stratified_fraction); 'logit_normal' is Flow-GRPO's online DPO draw, sigmoid(logit_mean + logit_std z)
    indexing the model's own shifted 1000-step schedule; null: the loss's own (awm: stratified, dpo: logit_normal,
    else sampling)."""
    logit_mean: float = 0.0
    """timestep_schedule logit_normal: the mean of the logit (Flow-GRPO's and Flow-Factory's DPO: 0)."""
    logit_std: float = 1.0
    """timestep_schedule logit_normal: the standard deviation of the logit (Flow-GRPO's and Flow-Factory's DPO: 1)."""
    stratified_fraction: float = 0.9
    """timestep_schedule stratified: the strata cover schedule indices 1 .. int(num_steps * this) - 1 (AWM: 0.9,
    which leaves out the last two of 14 sigmas)."""
    old_decay: int | list[float] | None = None
    """The old adapter's decay after each epoch, from the optimizer steps so far (flowrl/training/ema.py,
    decay_schedule): a DiffusionNFT decay_type (0: none; 1: min(0.001 s, 0.5); 2: 0 for 75 steps, then
    +0.0075 a step up to 0.999) or [start_step, start_value, slope, end_value]; null: the loss's reference,
    type 1 for nft, [0, 0, 0.001, 0.3] for awm (its kl_ema_decay), [0, 0.25, 0.005, 0.999] for crd
    (Flow-Factory's old_model_decay)."""
    sampler_decay: int | list[float] | None = None
    """Loss crd: the rollout adapter's own schedule, same format (Flow-Factory's sampling_model_decay); null:
    [75, 0, 0.0075, 0.999]. nft and awm roll out with the old or the trained adapter: leave it null."""
    awm_weighting: Literal["ghuber", "uniform"] = "ghuber"
    """AWM's log-probability of a sample from its flow-matching error l: ghuber, -(t / p)((l + 1e-10)^p - 1e-10^p)
    (AWM's default; each sample's gradient weighted by t l^(p - 1)), or uniform, -l (the plain advantage-weighted
    flow-matching loss, flowrl's earlier AWM)."""
    awm_ghuber_power: float = 0.25
    """AWM: the power p of the ghuber weighting (AWM: 0.25)."""
    awm_clip_range: float = 1.0
    """AWM: clip range c of its PPO surrogate max(-A rho, -A clip(rho, 1 - c, 1 + c)) on the ratio of
    log-probabilities (AWM: 1)."""
    sampler: Literal["ode", "sa_solver"] | None = None
    """Rollout sampler: ode (sampling.num_steps steps of sampling.ode_solver, no noise) or sa_solver (AWM's
    stochastic order-2 SA-Solver, flowrl/sampling/sa_solver.py); null: the loss's own (awm: sa_solver, else ode)."""
    sa_noise_level: float = 0.4
    """sampler sa_solver: its SDE noise tau inside nft.sa_noise_window (AWM: 0.4; 0 is its ODE)."""
    sa_noise_window: list[float] = field(default_factory=lambda: [0.3, 0.9])
    """sampler sa_solver: [low, high], the t-range of the steps that get noise tau (AWM: [0.3, 0.9])."""
    rollout_weights: Literal["old", "trained"] | None = None
    """Which adapter samples the rollouts: old (the EMA "old" adapter, DiffusionNFT; CRD's own sampler, see
    nft.sampler_decay) or trained (the live one, AWM); null: the loss's own (awm: trained, else old)."""
    eval_ema_decay: float | None = None
    """Decay of a separate EMA of the trained adapter that eval, the report, the export and checkpoints'
    ema.safetensors hold, from the initial weights at min(decay, (1 + s) / (10 + s)), s the optimizer steps so
    far; null: the loss's own (nft and crd: 0.9, DiffusionNFT's; awm: 0.99)."""
    eval_ema_every: Literal["step", "epoch"] | None = None
    """When the eval EMA folds the weights in: every optimizer step (DiffusionNFT) or once per epoch (AWM); null:
    the loss's own."""

    def choice(self, key: str):
        """The setting ``key`` in force: its own value, or the loss's reference choice where it is null."""
        value = getattr(self, key)
        return value if value is not None else LOSS_CHOICES.get(self.loss, {}).get(key, NFT_CHOICES[key])

    def validate(self):
        check(self.strength > 0, "strength", "must be > 0")
        check(self.crd_beta > 0, "crd_beta", "must be > 0")
        check(self.dpo_beta > 0, "dpo_beta", "must be > 0")
        check(self.dpo_ref_update_every is None or self.dpo_ref_update_every >= 1, "dpo_ref_update_every",
              "must be >= 1 epoch, or null (the reference stays the base model)")
        check(self.dpo_ref_update_every is None or self.loss == "dpo", "dpo_ref_update_every",
              f"moves DPO's reference, and loss {self.loss} has none: remove it or set nft.loss=dpo")
        check(self.logit_std > 0, "logit_std", "must be > 0")
        check(self.crd_kl_guidance is None or self.crd_kl_guidance >= 1, "crd_kl_guidance", "must be >= 1 or null")
        check(self.loss_scale is None or self.loss_scale > 0, "loss_scale", "must be > 0, or null")
        check(self.awm_kl >= 0, "awm_kl", "must be >= 0 (it pulls v toward the old adapter)")
        check(self.timesteps_per_sample >= 1, "timesteps_per_sample", "must be >= 1")
        for key in ("old_decay", "sampler_decay"):  # the types of flowrl.training.ema.NFT_DECAY_TYPES
            value = getattr(self, key)
            check(value is None or (value in (0, 1, 2) if isinstance(value, int) else
                                    len(value) == 4 and value[0] >= 0 and all(0 <= v <= 1 for v in (value[1], value[3]))
                                    and value[2] >= 0), key,
                  "must be a DiffusionNFT decay type (0, 1 or 2), [start_step >= 0, start_value in [0, 1], slope >= 0, "
                  "end_value in [0, 1]] or null")
        check(self.sampler_decay is None or self.sampler_schedule() is not None, "sampler_decay",
              f"only loss crd keeps a sampler apart from the old adapter (loss {self.loss}): remove it")
        check(0 < self.stratified_fraction <= 1, "stratified_fraction", "must be in (0, 1]")
        check(self.awm_ghuber_power > 0, "awm_ghuber_power", "must be > 0")
        check(self.awm_clip_range > 0, "awm_clip_range", "must be > 0 (the ratio is clipped to [1 - c, 1 + c])")
        check(self.sa_noise_level >= 0, "sa_noise_level", "must be >= 0")
        window = self.sa_noise_window
        check(len(window) == 2 and 0 <= window[0] <= window[1] <= 1, "sa_noise_window",
              "must be [low, high] with 0 <= low <= high <= 1")
        check(self.eval_ema_decay is None or 0 <= self.eval_ema_decay < 1, "eval_ema_decay",
              "must be in [0, 1), or null")

    def sampler_schedule(self) -> int | list[float] | None:
        """The rollout adapter's own schedule (loss crd), or None where the old adapter samples."""
        if self.loss != "crd":
            return None
        return self.sampler_decay if self.sampler_decay is not None else [75, 0.0, 0.0075, 0.999]

    def policy_loss_scale(self, advantage_clip: float) -> float:
        """nft.loss_scale, or the loss's reference factor."""
        if self.loss_scale is not None:
            return self.loss_scale
        return {"nft": advantage_clip / self.strength, "crd": advantage_clip / self.crd_beta}.get(self.loss, 1.0)


# The settings of NFTSection whose null means "the loss's own": DiffusionNFT's, and AWM's and CRD's reference ones.
NFT_CHOICES = {"timestep_schedule": "sampling", "sampler": "ode", "rollout_weights": "old", "eval_ema_decay": 0.9,
               "eval_ema_every": "step", "old_decay": 1}
LOSS_CHOICES = {"awm": {"timestep_schedule": "stratified", "sampler": "sa_solver", "rollout_weights": "trained",
                        "eval_ema_decay": 0.99, "eval_ema_every": "epoch", "old_decay": [0, 0.0, 0.001, 0.3]},
                "crd": {"old_decay": [0, 0.25, 0.005, 0.999]},
                "dpo": {"rollout_weights": "trained",  # online DPO samples from the policy it trains
                        "timestep_schedule": "logit_normal"}}  # logit-normal(0, 1): both DPO references' default


@dataclass
class NFTConfig(Config, recipe="nft"):
    """A run of recipe nft (:mod:`flowrl.recipes.nft`): forward-process training on ODE rollouts' clean samples."""

    recipe: Literal["nft"] = "nft"
    """Training loop: grpo (SDE rollouts, clipped log-prob ratios) or nft (DiffusionNFT)."""
    nft: NFTSection = field(default_factory=NFTSection)
    """DiffusionNFT settings: the loss (nft, awm or crd), its timesteps, sampler and adapters."""

    def validate(self):
        super().validate()
        n, t, s = self.nft, self.train, self.sampling
        check_requirements(self, NFT_REQUIREMENTS)
        check(t.ema, "train.ema", "recipe nft keeps its old adapter as train.ema: set train.ema=true")
        check(n.choice("timestep_schedule") != "sampling" or n.timesteps_per_sample <= s.num_steps,
              "nft.timesteps_per_sample", f"exceeds the {s.num_steps} sigmas of the sampling schedule; lower it or "
              "set nft.timestep_schedule=uniform")
        check(n.choice("timestep_schedule") != "stratified" or int(s.num_steps * n.stratified_fraction) >= 2,
              "nft.stratified_fraction", f"leaves no sigma between the first and the last of sampling.num_steps="
              f"{s.num_steps}: raise it or the steps")
        check(n.choice("sampler") != "sa_solver" or s.num_steps >= 2, "sampling.num_steps",
              "SA-Solver rollouts need at least 2 steps (nft.sampler=sa_solver)")
        check(n.choice("sampler") != "sa_solver" or not s.pilot.candidates, "sampling.pilot.candidates",
              "Pilot-Commit rolls out with the Euler/SDE loop, not SA-Solver: set it to 0 or nft.sampler=ode")


# What each forward loss needs of the other options, checked by NFTConfig.validate.
NFT_REQUIREMENTS = (
    Requires("nft.loss", ("crd",), "train.combine", lambda c: c.train.combine != "marble",
             "marble balances advantage-weighted gradients, and nft.loss=crd weights each sample by its reward-"
             "matching residual instead: use train.combine=weighted or gdpo with crd"),
    Requires("nft.loss", ("dpo",), "train.combine", lambda c: c.train.combine != "marble",
             "marble balances advantage-weighted gradients, and nft.loss=dpo trains on preference pairs instead: use "
             "train.combine=weighted or gdpo with dpo"),
    Requires("nft.loss", ("dpo",), "sampling.group_size", lambda c: c.sampling.group_size >= 2,
             "is {cfg.sampling.group_size}: nft.loss=dpo pairs rollouts of one prompt, so a group needs at least 2"),
)
