"""Forward-process RL on a flow model: DiffusionNFT, AWM (Advantage Weighted Matching), CRD and online DPO.

GRPO needs stochastic rollouts and per-step log-probabilities, and its gradient is a noisy score
function. The forward-process losses need neither: they sample clean images with the plain ODE,
score them, and train with the flow-matching loss itself on freshly noised copies of those images,
pulling the velocity toward good samples and away from bad ones. ``nft.loss`` picks the loss
(:data:`FORWARD_LOSSES`); everything else in this file is shared.

- ``nft`` (default): DiffusionNFT's implicit positive and negative policies
  (:func:`flowrl.algorithms.losses.nft_loss`), times its ``advantage_clip / strength``
  (``nft.loss_scale``), the scale its published KL betas and ``max_grad_norm`` assume. Reference:
  NVlabs/DiffusionNFT ``scripts/train_nft_sd3.py`` and ``config/nft.py`` at 24af555 (its rollouts are
  DPM-Solver 2nd order: ``sampling.ode_solver: dpmpp_2m``, the same steps). Its gradient is a
  supervised one: on the toy world, 12 epochs on four training prompts take strict ToyEval from 0.31 to 0.51 where full-SDE GRPO
  reaches 0.41, and on the whole prompt set it raises the held-out task mean while GRPO stays flat
  (assets/toy/README.md, tests/toy/test_toy_rl.py). Remaining differences: the reference feeds its sampler's
  transformer the timestep truncated to an integer (``long(1000 sigma)``) and trains ``int(0.99 K)`` of the K
  sigmas per sample per epoch (``nft.timesteps_per_sample`` sets the count here).
- ``awm``: Advantage Weighted Matching (:mod:`flowrl.algorithms.awm`; reference: github.com/scxue/
  advantage_weighted_matching at be51372, ``scripts/train_sd3_awm.py``). The flow-matching error ``l`` of a
  rollout at fresh (t, eps) is its log-probability, ``-(t / p)((l + 1e-10)^p - 1e-10^p)`` with AWM's ``ghuber``
  weighting (``nft.awm_weighting``, ``p = 0.25``: each sample's gradient weighted by ``t l^-0.75``), under PPO's
  clipped surrogate with the group advantage clipped to ``train.advantage_clip`` over it (AWM: 5, so in
  [-1, 1]), clip range ``nft.awm_clip_range`` 1, plus ``nft.awm_kl * ||v - v_old||^2`` toward the old adapter
  (AWM's EMA policy, weight 1, decay ramp ``min(0.001 s, 0.3)``, ``nft.old_decay``) and ``train.beta * ||v -
  v_ref||^2`` toward the base model. With null ``nft.timestep_schedule``, ``sampler``, ``rollout_weights`` and
  ``eval_ema_decay`` it takes AWM's: stratified timesteps without sigma 1 and the last sigmas, rollouts from
  the trained adapter by SA-Solver (:mod:`flowrl.sampling.sa_solver`, noise 0.4 for t in [0.3, 0.9]), and a
  separate 0.99 EMA for eval and export. Deliberate differences: the old log-prob of the ratio is the current
  one detached, so the ratio is 1 (AWM's, at its one optimizer step per epoch; with more steps per epoch AWM
  measures it against the policy the epoch started with); each sample draws its own stratified timesteps (AWM
  shares one draw among a micro-batch's 3 samples). ``nft.strength`` and ``nft.adaptive_weighting`` do not
  act on loss ``awm``.
- ``crd``: Centered Reward Distillation (:mod:`flowrl.algorithms.crd`, after Flow-Factory's port, which follows
  the paper's Table 3). KL-regularised reward maximisation makes ``beta log(pi / pi_old)`` equal the reward up
  to a per-prompt constant; centring both within the prompt's group removes that constant, and the loss
  ``mean (beta (l - lbar) - (r - rbar))^2`` matches the centred implicit log-ratio ``l`` (one (t, noise)
  estimate from the flow-matching errors of the trained and the old adapter, each over its own mean absolute
  error: ``nft.adaptive_weighting``) to the centred optimality ``r`` in [0, 1], times ``advantage_clip /
  crd_beta``. Each chunk first measures the log-ratios without gradients (at the noise its update then uses),
  so every optimizer step costs one more forward pair. Rollouts come from a sampler adapter with its own decay
  schedule (``nft.sampler_decay``), decoupled from the old one (``nft.old_decay``); ``train.beta``'s KL anchors
  to the base model with CFG (``nft.crd_kl_guidance``, default ``sampling.guidance_scale``), each sample's KL
  weighted by its reward (``nft.crd_reward_adaptive_kl``).
- ``dpo``: online Diffusion-DPO in the flow-matching form (:mod:`flowrl.algorithms.dpo`; reference:
  SalesforceAIResearch/DiffusionDPO ``train.py`` at 8d3ee5c, and Flow-GRPO's ``scripts/train_sd3_dpo.py``). Each
  group's rollouts become (winner, loser) pairs by advantage (``nft.dpo_pairs``: best vs worst, or every pair;
  ties give none); both are noised at one shared (t, eps), and ``-log sigmoid(-nft.dpo_beta / 2 * diff)`` with
  ``diff`` the winner's flow-matching error minus the base model's (adapter off) on it, less the same for the
  loser. Rollouts come from the trained adapter (on-policy, the "online" of online DPO); the old adapter plays no
  part in the loss. Deviations: Flow-GRPO pairs a tied group's rows 1 and 0 anyway, and can move its reference to
  the policy every ``ref_update_step`` steps; here ties give no pair and the reference stays the base model.

One epoch:
1. ODE rollouts of ``group_size`` images per prompt, sampled with the "old" adapter (AWM: SA-Solver with the
   trained one, ``nft.sampler``, ``nft.rollout_weights``; CRD: its own sampler adapter). The old adapter is a
   copy of the trained one that follows it once per epoch: ``old = d old + (1 - d) theta`` with ``d`` from
   ``nft.old_decay`` on the optimizer steps so far (DiffusionNFT's decay types; type 2 holds ``d = 0`` for 75
   steps, then adds 0.0075 a step up to 0.999). Only clean latents are kept. A separate eval/export EMA of the
   trained adapter (``nft.eval_ema_decay``, DiffusionNFT: 0.9 every optimizer step with its ramp
   ``min(0.9, (1 + s) / (10 + s))``) is what eval grids, held-out scores, the report, the exported LoRA and
   ``export-lora --ema`` use.
2. Rewards -> group advantages (the same estimators and combiners as GRPO) -> ``a = clip(A) /
   advantage_clip`` in [-1, 1]; loss ``nft`` turns it into the optimality ``r = (1 + a) / 2``
   (DiffusionNFT: clip 5, so ``r = 1/2 + A/10``), loss ``awm`` weights by ``a`` itself.
3. For each sample and each of ``nft.timesteps_per_sample`` timesteps: a sigma of the sampling
   schedule (``nft.timestep_schedule: sampling``, DiffusionNFT's shifted timesteps; each sample takes its own
   random order of them, no sigma twice), one per stratum of the schedule (``stratified``, AWM's) or
   ``t ~ U(0, 1)`` (``uniform``), fresh noise, ``x_t = (1 - t) x0 + t eps``, target
   ``eps - x0``; the loss compares the trained velocity and the old one (old weights swapped in, no
   grad). DiffusionNFT takes one or two optimizer steps per epoch over every (sample, t) pair
   (``train.inner_epochs: 1``, ``train.optimizer_steps_per_epoch``: 1, 2 for OCR).
   The old adapter stays fixed within the epoch: then each sample's loss has a bounded minimum
   (for ``nft``: ``v = v_old + (2r - 1) / strength * (target - v_old)``). An old adapter that trailed
   every optimizer step would move that minimum with the weights, and the toy model drifts off and
   collapses. ``nft.adaptive_weighting`` (default) measures each NFT term in x0-space over its own
   detached mean error: without it the push away from bad samples grows with the error, and a
   90-epoch toy run diverged (loss 0.43 -> 187, held-out partial ToyEval 0.45 -> 0.19).
   ``train.beta > 0`` adds ``beta * ||v - v_ref||^2`` toward the base model (adapter off).

With ``train.cfg`` the policy is the guided velocity (rollouts and loss alike); without it the
conditional model is trained alone (DiffusionNFT's guidance-free setting; AWM's too).

Run: ``flowrl train configs/toy/nft.yaml``, ``configs/toy/awm.yaml``, ``configs/toy/crd.yaml`` or
``configs/toy/dpo.yaml`` (CPU, minutes).
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass

import numpy as np
import torch
from accelerate import Accelerator
from tqdm.auto import tqdm

from flowrl.algorithms.advantages import ADVANTAGE_ESTIMATORS
from flowrl.algorithms.combine import reward_advantages
from flowrl.algorithms.awm import awm_loss
from flowrl.algorithms.dpo import PAIRINGS, dpo_loss, matching_error
from flowrl.algorithms.crd import crd_surrogate, crd_weights, implicit_reward, reward_adaptive_kl_weights
from flowrl.algorithms.losses import nft_loss
from flowrl.algorithms.marble import balanced_backward
from flowrl.algorithms.timesteps import TIMESTEP_SCHEDULES
from flowrl.config import NFTConfig
from flowrl.recipes.common import (
    StatsAccumulator, end_epoch, finish_run, group_advantages, log_base_model, optimizer_step, out_of_time,
    sample_and_score, start_run,
)
from flowrl.recipes.guard import exported_weights, finite_mean, in_group_diversity
from flowrl.recipes.run import AdapterCopies, Run
from flowrl.rewards_api import AsyncScorer
from flowrl.sampling import StepPlan
from flowrl.sampling.sa_solver import sa_solver_rollout
from flowrl.algorithms.gardo import build_features
from flowrl.training.accumulate import micro_batch
from flowrl.training.ema import LoraEMA, decay_schedule, ema_weights


def train(cfg: NFTConfig, *, accelerator: Accelerator | None = None) -> dict[str, float]:
    """Run the forward-process loop (DiffusionNFT, AWM, CRD or DPO) described by ``cfg``; returns the last epoch's
    metrics as a flat dict."""
    n = cfg.nft
    run = start_run(cfg, accelerator, extras={"adapters": adapter_copies},
                    eval_ema_decay=n.choice("eval_ema_decay"))
    accelerator, policy, ema = run.accelerator, run.policy, run.ema  # ema: the old adapter (run.eval_ema: eval's)
    rank, world = accelerator.process_index, accelerator.num_processes
    s, t = cfg.sampling, cfg.train
    scale = n.policy_loss_scale(t.advantage_clip)  # DiffusionNFT's and CRD's advantage_clip / beta
    forward_loss = FORWARD_LOSSES[n.loss].from_config(cfg)
    kl_guidance = forward_loss.kl_guidance(run.guidance)  # CRD: a guided anchor
    estimator = ADVANTAGE_ESTIMATORS[t.advantage]
    timestep_schedule = TIMESTEP_SCHEDULES[n.choice("timestep_schedule")]  # how each pass draws its t
    schedule = policy.sigmas(s.num_steps)[:-1]  # [num_steps] the sampling schedule's sigmas (uniform: unused)
    # AWM samples with the trained adapter and SA-Solver (nft.sampler, nft.rollout_weights; null: the loss's own).
    sa_solver = n.choice("sampler") == "sa_solver"
    rollout_fn = functools.partial(sa_solver_rollout, noise_window=tuple(n.sa_noise_window)) if sa_solver else None
    rollout_noise = n.sa_noise_level if sa_solver else 0.0  # the ODE's is 0
    sampler = run.extras["adapters"].copies.get("sampler")  # CRD's rollout adapter
    rollout_ema = (sampler or ema) if n.choice("rollout_weights") == "old" else None  # CRD: its own
    eval_every_step = n.choice("eval_ema_every") == "step"  # DiffusionNFT's; AWM folds once per epoch
    # Deterministic rollouts: noise 0 everywhere; the plan stores only the last step, the least memory.
    plan = StepPlan(s.num_steps, sde_start=s.num_steps - 1)
    scorer = AsyncScorer(run.rewards, on_error=t.reward_errors, asynchronous=t.async_rewards)
    bar = tqdm(range(run.start_epoch, t.epochs), disable=not (cfg.log.progress and accelerator.is_main_process),
               desc="nft", dynamic_ncols=True)
    marble, guard = run.extras.get("marble"), run.extras.get("guard")
    guard_features = build_features(cfg.guard.features, cfg.guard.feature_kwargs) if guard else None
    metrics: dict[str, float] = {}
    log_base_model(run)
    for epoch in bar:
        epoch_start = time.perf_counter()
        phase_metrics = run.begin_epoch(epoch)  # HRF: a new phase re-anchors the weights

        # 1. Rollouts (ODE with the old adapter or CRD's sampler; AWM: SA-Solver with the trained one), scored
        #    while the next batch samples.
        with ema_weights(rollout_ema):
            traj, sample_done, reward_done = sample_and_score(run, scorer, epoch, plan=plan, noise_level=rollout_noise,
                                                              rollout_fn=rollout_fn)

        # 2. Advantages over whole groups -> clipped, over the clip, in [-1, 1] (the loss's weight, or
        #    NFT's optimality 2r - 1); unscored (NaN) rows are left out.
        gathered, advantages, combined, local, all_groups = group_advantages(run, traj, estimator)
        clipped = advantages[local].clamp(-t.advantage_clip, t.advantage_clip) / t.advantage_clip  # [N]
        keep = torch.isfinite(combined[local])  # [N]
        # Diversity guard: these rollouts' in-group diversity against its start; past guard.max_drop it warns,
        # raises the live KL beta toward the base model (run.beta) or stops the run after this epoch.
        guard_metrics = {} if guard is None or not guard.due(epoch) else guard.observe(
            epoch, in_group_diversity(guard_features(traj.images, traj.final_latents), traj.group_ids, accelerator),
            reward=finite_mean(combined), weights=lambda: exported_weights(policy, run.exported_ema))
        # MARBLE: each weighted reward's own advantage, clipped the same way, balanced per optimizer step.
        # Advantages are per (sample, t) pair from here: pair p has sample p % N's ([pairs] = tiled [N]).
        per_reward = None if marble is None else {
            name: (adv[local].clamp(-t.advantage_clip, t.advantage_clip) / t.advantage_clip).repeat(
                n.timesteps_per_sample)
            for name, adv in reward_advantages({key: gathered[key] for key in run.weights}, run.weights, all_groups,
                                               lambda r, g: estimator(r, g, std_scope=t.std_scope)).items()}

        # 3. Passes over (unit, fresh t and noise) pairs: shuffled chunks -> one optimizer step each. A unit is
        #    one sample, or for loss dpo a preference pair (winner, loser) of one group. Pair p trains unit p % U
        #    at its first row's (p // U)-th timestep: with the sampling schedule, the sample's own random order of
        #    the schedule's sigmas (no sigma twice for one sample).
        stats = StatsAccumulator()
        unit_rows, unit_keep = forward_loss.units(advantages[local], traj.group_ids, keep, accelerator)  # [U, R], [U]
        units, rows_per_unit = unit_rows.shape
        unit_advantage = clipped[unit_rows[:, 0]]  # [U]
        pairs = units * n.timesteps_per_sample
        for inner in range(t.inner_epochs):
            order = np.random.default_rng([cfg.seed, epoch, inner, rank, 0x4F7]).permutation(pairs)
            # sampling: [N, num_steps]; stratified (AWM's): [N, timesteps_per_sample]; uniform: None, t ~ U(0, 1)
            # drawn with the noise
            timesteps = timestep_schedule(schedule, traj.num_rows, n, [cfg.seed, epoch, inner, rank, 0x7153])
            for chunk_index, chunk in enumerate(np.array_split(order, t.optimizer_steps_per_epoch)):
                chunk = torch.as_tensor(chunk, dtype=torch.long)
                weight = accelerator.reduce(unit_keep[chunk % units].sum().to(accelerator.device), "sum").item()
                micro_batches = list(chunk.split(t.micro_batch_size))

                def micro_inputs(i: int, micro: torch.Tensor):
                    rows = unit_rows[micro % units]  # [B, R]
                    sigma = None if timesteps is None else timesteps[rows[:, 0], micro // units]
                    return rows, sigma, [cfg.seed, epoch, inner, chunk_index, i, rank, 0x4F7]  # noise seed

                def chunk_backward(advantage: torch.Tensor, chunk_stats: StatsAccumulator) -> None:
                    advantage = forward_loss.update_weights(advantage)  # [pairs]
                    for i, micro in enumerate(micro_batches):
                        rows, sigma, noise_seed = micro_inputs(i, micro)
                        flat = rows.flatten()  # [B * R]
                        with micro_batch(accelerator, policy.forward_module, last=i == len(micro_batches) - 1):
                            loss_sum = forward_process_loss(
                                policy, ema, traj.final_latents[flat], traj.cond.select(traj.prompt_ids[flat]),
                                advantage[micro], unit_keep[micro % units], loss=forward_loss, guidance=run.guidance,
                                beta=run.beta, noise_seed=noise_seed, stats=chunk_stats, sigma=sigma, scale=scale,
                                kl_guidance=kl_guidance, rows_per_unit=rows_per_unit,
                                kl_weights=forward_loss.kl_weights(clipped[rows[:, 0]], run.beta))
                            accelerator.backward(loss_sum * world / max(weight, 1.0))

                def log_ratios() -> torch.Tensor:
                    """[pairs] the chunk's implicit log-ratios to the old adapter, at the noise its update uses."""
                    ratios = torch.zeros(pairs)
                    for i, micro in enumerate(micro_batches):
                        rows, sigma, noise_seed = micro_inputs(i, micro)
                        rows = rows[:, 0]  # CRD's units are single samples
                        ratios[micro] = implicit_log_ratio(policy, ema, traj.final_latents[rows],
                                                           traj.cond.select(traj.prompt_ids[rows]), guidance=run.guidance,
                                                           noise_seed=noise_seed, sigma=sigma,
                                                           adaptive=n.adaptive_weighting).cpu()
                    return ratios

                measured = forward_loss.chunk_weights(log_ratios, chunk, clipped, keep, traj, stats)  # CRD's
                if measured is not None:
                    chunk_backward(measured, stats)
                elif per_reward is None:
                    chunk_backward(unit_advantage.repeat(n.timesteps_per_sample), stats)
                else:
                    step = (epoch * t.inner_epochs + inner) * t.optimizer_steps_per_epoch + chunk_index
                    balanced_backward(marble, run.params, step, per_reward, chunk_backward, stats,
                                      StatsAccumulator)
                optimizer_step(run, stats)
                if run.eval_ema is not None and eval_every_step:  # DiffusionNFT's eval EMA: every optimizer step
                    done = (epoch * t.inner_epochs + inner) * t.optimizer_steps_per_epoch + chunk_index + 1
                    run.eval_ema.scheduled_step(done, start=0, warmup="flow_grpo")
        # The old adapter (and CRD's sampler) follows the trained one once per epoch, on its decay schedule
        # of the optimizer steps so far.
        steps_so_far = (epoch + 1) * t.inner_epochs * t.optimizer_steps_per_epoch
        ema.blend(decay_schedule(steps_so_far, n.choice("old_decay")))
        if sampler is not None:
            sampler.blend(decay_schedule(steps_so_far, n.sampler_schedule()))
        if run.eval_ema is not None and not eval_every_step:  # AWM's: min(decay, (1 + s) / (10 + s)), once an epoch
            run.eval_ema.scheduled_step(steps_so_far, start=0, warmup="flow_grpo")
        update_metrics = run.after_epoch(epoch, traj)  # trainable rewards learn from these rollouts
        train_done = time.perf_counter()

        # 4. Log, render eval grids, checkpoint.
        metrics = end_epoch(run, epoch, gathered=gathered, combined=combined, group_ids=all_groups, stats=stats,
                            extra={**forward_loss.metrics(clipped), **phase_metrics, **guard_metrics, **update_metrics,
                                   **traj.sampling_metrics},
                            rollouts=traj.rollouts_sampled, times=(epoch_start, sample_done, reward_done, train_done),
                            bar=bar)
        if out_of_time(run) or run.stopped:
            break

    scorer.close()
    return finish_run(run, metrics)


def adapter_copies(run: Run) -> AdapterCopies:
    """The adapter copies checkpoints keep besides ema.safetensors (which holds the eval EMA): the old adapter
    (``run.ema``) as "old", and loss crd's own rollout adapter as "sampler", starting as the initial weights."""
    copies = {"old": run.ema} if run.ema is not None and run.eval_ema is not None else {}
    if run.cfg.nft.sampler_schedule() is not None:
        copies["sampler"] = LoraEMA(run.policy.named_trainable_parameters(), decay=0.0)  # blended on its schedule
    return AdapterCopies(copies)


class ForwardLoss:
    """A forward-process loss, built from the config with its own options, and what the recipe does around it.

    ``loss(velocity, old_velocity, target, advantage, sigma, ref_velocity=None) -> [U]``: velocities and target
    [B, ...] (``old_velocity`` None unless ``needs_old``, ``ref_velocity`` the base model's, None unless
    ``needs_reference`` or train.beta > 0), the update weight ``advantage`` [U] and the noise level ``sigma`` [B],
    for U units of ``rows_per_unit`` rows each (:meth:`units`). The hooks' defaults are DiffusionNFT's and AWM's:
    one unit per sample, the clipped advantage over the clip is the weight, the KL anchor is the policy's guidance,
    unweighted."""

    name = ""
    needs_old = True  # compares with the old adapter's velocity
    needs_reference = False  # compares with the base model's velocity even at train.beta 0

    @classmethod
    def from_config(cls, cfg: NFTConfig) -> ForwardLoss:
        raise NotImplementedError

    def __call__(self, velocity, old_velocity, target, advantage, sigma, ref_velocity=None) -> torch.Tensor:
        raise NotImplementedError

    def units(self, scores: torch.Tensor, group_ids: torch.Tensor, keep: torch.Tensor,
              accelerator: Accelerator) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows [U, R], weights [U]): what one term of the loss trains on, R rows of this process's rollouts at one
        shared (t, noise), from the rows' ``scores`` [N] (advantages), ``group_ids`` [N] and ``keep`` [N] (scored).
        Every process must get the same U (its optimizer steps take the same micro-batches). Default: each sample
        alone, weighted by whether it was scored."""
        return torch.arange(len(keep)).unsqueeze(1), keep.float()

    def update_weights(self, advantage: torch.Tensor) -> torch.Tensor:
        """[pairs] the weights the update trains on. A MARBLE-balanced sum can leave [-1, 1], where NFT's optimality
        r = (1 + a) / 2 would leave [0, 1] and its loss lose its bounded minimum: clamped (the measuring passes are
        inside already, so only the update is affected, and only where it binds)."""
        return advantage.clamp(-1.0, 1.0)

    def kl_guidance(self, guidance: float) -> float:
        """The CFG scale of train.beta's KL anchor (the base model), given the policy's."""
        return guidance

    def kl_weights(self, clipped: torch.Tensor, beta: float) -> torch.Tensor | None:
        """[B] per-sample factors on the KL, from the rows' clipped advantages over the clip; None: 1."""
        return None

    def chunk_weights(self, log_ratios, chunk, clipped, keep, traj, stats) -> torch.Tensor | None:
        """[pairs] weights measured for one optimizer step's ``chunk`` (``log_ratios()`` gives its implicit
        log-ratios), in place of the clipped advantages; None: the clipped advantages (MARBLE-balanced where on)."""
        return None

    def metrics(self, clipped: torch.Tensor) -> dict[str, float]:
        """The epoch's size of the update weights ``clipped`` [N]."""
        return {f"{self.name}/advantage_abs": float(clipped.abs().mean())}


@dataclass
class NftLoss(ForwardLoss):
    """DiffusionNFT with optimality ``r = (1 + advantage) / 2``; ``adaptive``: its adaptive weighting."""

    strength: float = 1.0
    adaptive: bool = True
    name = "nft"

    @classmethod
    def from_config(cls, cfg: NFTConfig) -> NftLoss:
        return cls(strength=cfg.nft.strength, adaptive=cfg.nft.adaptive_weighting)

    def __call__(self, velocity, old_velocity, target, advantage, sigma, ref_velocity=None) -> torch.Tensor:
        return nft_loss(velocity, old_velocity, target, 0.5 + 0.5 * advantage, strength=self.strength,
                        sigma=sigma if self.adaptive else None)

    def metrics(self, clipped: torch.Tensor) -> dict[str, float]:
        return {"nft/optimality_abs_dev": float(0.5 * clipped.abs().mean())}


@dataclass
class AwmLoss(ForwardLoss):
    """AWM's clipped surrogate on its matching log-probability, with ``kl * ||v - v_old||^2`` toward the old
    adapter (:func:`flowrl.algorithms.awm.awm_loss`)."""

    kl: float = 1.0
    weighting: str = "ghuber"
    power: float = 0.25
    clip_range: float = 1.0
    name = "awm"

    @classmethod
    def from_config(cls, cfg: NFTConfig) -> AwmLoss:
        n = cfg.nft
        return cls(kl=n.awm_kl, weighting=n.awm_weighting, power=n.awm_ghuber_power, clip_range=n.awm_clip_range)

    def __call__(self, velocity, old_velocity, target, advantage, sigma, ref_velocity=None) -> torch.Tensor:
        return awm_loss(velocity, old_velocity, target, advantage, sigma, kl_weight=self.kl, weighting=self.weighting,
                        power=self.power, clip_range=self.clip_range)


@dataclass
class CrdLoss(ForwardLoss):
    """CRD's surrogate ``c err(v)`` with ``advantage`` the detached weight ``c`` of
    :func:`flowrl.algorithms.crd.crd_weights`: its gradient is the reward-matching loss's. Each chunk's weights
    are measured first (its implicit log-ratios, centred per group and timestep slot); they are unbounded by
    construction and pass unclamped. The KL anchors to the base model with CFG, weighted by the reward."""

    adaptive: bool = True
    beta: float = 1.0
    timesteps_per_sample: int = 1
    anchor_guidance: float | None = None
    reward_adaptive_kl: bool = True
    name = "crd"

    @classmethod
    def from_config(cls, cfg: NFTConfig) -> CrdLoss:
        n = cfg.nft
        return cls(adaptive=n.adaptive_weighting, beta=n.crd_beta, timesteps_per_sample=n.timesteps_per_sample,
                   anchor_guidance=n.crd_kl_guidance if n.crd_kl_guidance is not None else cfg.sampling.guidance_scale,
                   reward_adaptive_kl=n.crd_reward_adaptive_kl)

    def __call__(self, velocity, old_velocity, target, advantage, sigma, ref_velocity=None) -> torch.Tensor:
        return crd_surrogate(velocity, target, advantage, adaptive=self.adaptive)

    def update_weights(self, advantage: torch.Tensor) -> torch.Tensor:
        return advantage

    def kl_guidance(self, guidance: float) -> float:
        return guidance if self.anchor_guidance is None else self.anchor_guidance

    def kl_weights(self, clipped: torch.Tensor, beta: float) -> torch.Tensor | None:
        return reward_adaptive_kl_weights(clipped, beta) if self.reward_adaptive_kl else None

    def chunk_weights(self, log_ratios, chunk, clipped, keep, traj, stats) -> torch.Tensor:
        k = self.timesteps_per_sample
        return crd_weights(log_ratios(), clipped.repeat(k), chunk, traj.group_ids.repeat(k), keep.repeat(k),
                           num_rows=traj.num_rows, beta=self.beta, stats=stats)


@dataclass
class DpoLoss(ForwardLoss):
    """Online DPO (:mod:`flowrl.algorithms.dpo`): each unit is a preference pair of one group, winner and loser at
    one shared (t, noise), scored by their flow-matching errors against the base model's (adapter off). The old
    adapter plays no part; the advantages only rank a group's rollouts.

    ``pairing`` (``nft.dpo_pairs``): ``best_worst`` (one pair per group, Flow-GRPO's; the default) or ``all`` (every
    winner/loser pair, up to g^2 / 4 per group of g on a binary reward, each two trained and two reference rows).
    The default by measurement: configs/toy/dpo.yaml at lr 3e-4, seed 0, 420 s of training wall-clock each (both
    runs side by side on 2 busy cores), held-out strict ToyEval task mean from 0.105: ``best_worst`` ran 19 epochs
    (5-8 pairs an epoch) and ended at 0.117 (0.129 at its best point); ``all`` paired 247-336 rows an epoch, took
    4-13x as long per epoch, ran 3 epochs and stayed at 0.105. Per second of training, one pair per group is the
    better buy; ``all`` is there for rewards where a group's middle carries signal."""

    beta: float = 100.0
    pairing: str = "best_worst"
    name = "dpo"
    needs_old = False
    needs_reference = True
    pairs = 0.0  # this epoch's preference pairs over every process

    @classmethod
    def from_config(cls, cfg: NFTConfig) -> DpoLoss:
        return cls(beta=cfg.nft.dpo_beta, pairing=cfg.nft.dpo_pairs)

    def __call__(self, velocity, old_velocity, target, advantage, sigma, ref_velocity=None) -> torch.Tensor:
        error = matching_error(velocity, target).reshape(-1, 2)  # [U, 2] (winner, loser)
        ref_error = matching_error(ref_velocity, target).reshape(-1, 2)  # [U, 2]
        return dpo_loss(error[:, 0], error[:, 1], ref_error[:, 0], ref_error[:, 1], beta=self.beta)

    def units(self, scores, group_ids, keep, accelerator):
        pairs = PAIRINGS[self.pairing](scores.masked_fill(~keep, float("nan")), group_ids)  # [P, 2]
        # Every process trains on as many units as the one with the most pairs: the rest are weight-0 fillers.
        most = int(accelerator.gather(torch.tensor([len(pairs)], device=accelerator.device)).max())
        self.pairs = accelerator.reduce(torch.tensor(float(len(pairs)), device=accelerator.device), "sum").item()
        filler = pairs[:1] if len(pairs) else torch.zeros(1, 2, dtype=torch.long)
        weights = torch.cat([torch.ones(len(pairs)), torch.zeros(max(most, 1) - len(pairs))])  # [U]
        return torch.cat([pairs, filler.expand(len(weights) - len(pairs), 2)]), weights

    def metrics(self, clipped: torch.Tensor) -> dict[str, float]:
        return {"dpo/pairs": self.pairs}


FORWARD_LOSSES: dict[str, type[ForwardLoss]] = {"nft": NftLoss, "awm": AwmLoss, "crd": CrdLoss, "dpo": DpoLoss}


@torch.no_grad()
def implicit_log_ratio(policy, old, x0, cond, *, guidance: float, noise_seed: list[int],
                       sigma: torch.Tensor | None, adaptive: bool) -> torch.Tensor:
    """[B] one (t, noise) estimate of log pi_theta(x0) - log pi_old(x0) from the flow-matching errors of the
    trained and the ``old`` adapter (:func:`flowrl.algorithms.crd.implicit_reward`), at the same noise
    :func:`forward_process_loss` draws for ``noise_seed``."""
    noised, target, sigma = noised_sample(x0, noise_seed, sigma, policy)
    with policy.local_forward():
        velocity = policy.velocity(noised, sigma, cond, guidance).float()
        with ema_weights(old):
            old_velocity = policy.velocity(noised, sigma, cond, guidance).float()
    return implicit_reward(velocity, old_velocity, target, adaptive=adaptive)


def noised_sample(x0, noise_seed: list[int], sigma: torch.Tensor | None, policy, *, rows_per_unit: int = 1):
    """(x_t [B, ...] in the policy's dtype, target eps - x0, sigma [B]) for clean latents ``x0`` at fresh
    noise, and ``t ~ U(0, 1)`` when ``sigma`` [B / rows_per_unit] is not given, from a generator seeded by
    ``noise_seed`` (reproducible on any device). Each run of ``rows_per_unit`` consecutive rows (a preference pair's
    winner and loser) shares one (t, noise), as Diffusion-DPO's pairs do."""
    device = policy.device
    generator = torch.Generator().manual_seed(int(np.random.SeedSequence(noise_seed).generate_state(1)[0]))
    units = x0.shape[0] // rows_per_unit
    drawn = torch.rand(units, generator=generator)  # [U], drawn either way: one noise stream per seed
    sigma = drawn if sigma is None else sigma.float()
    noise = torch.randn((units, *x0.shape[1:]), generator=generator, dtype=torch.float32)
    sigma = sigma.repeat_interleave(rows_per_unit)  # [B]
    noise = noise.repeat_interleave(rows_per_unit, dim=0)  # [B, ...]
    x0 = x0.to(device=device, dtype=torch.float32)
    noise, sigma = noise.to(device), sigma.to(device)
    column = sigma.reshape(-1, 1, 1, 1)
    noised = ((1 - column) * x0 + column * noise).to(policy.dtype)  # x_t = (1 - t) x0 + t eps
    return noised, noise - x0, sigma


def forward_process_loss(policy, old, x0, cond, advantage, weights, *, guidance: float, beta: float,
                         noise_seed: list[int], stats: StatsAccumulator, sigma: torch.Tensor | None = None,
                         loss: ForwardLoss | None = None, scale: float = 1.0, kl_guidance: float | None = None,
                         kl_weights: torch.Tensor | None = None, strength: float = 1.0,
                         adaptive: bool = True, rows_per_unit: int = 1) -> torch.Tensor:
    """Summed (not averaged) forward-process loss ``scale * loss + beta * KL`` of clean latents
    ``x0`` [B, C, h, w] at (t, fresh noise), with ``advantage`` [B] the clipped advantage over the clip
    (``2r - 1`` for DiffusionNFT's optimality ``r``: 1 trains toward the samples like plain flow matching)
    and ``old`` the old adapter (a :class:`~flowrl.training.ema.LoraEMA`). ``loss``: a :class:`ForwardLoss`
    (default: DiffusionNFT's at ``strength``, ``adaptive``).

    A unit is ``rows_per_unit`` consecutive rows of ``x0`` at one shared (t, noise): one sample (1), or a
    preference pair's winner and loser (2, loss dpo). ``advantage``, ``weights``, ``sigma`` and ``kl_weights`` are
    per unit [U]; the loss returns [U], and the KL is each unit's mean over its rows.

    The KL is ``||v - v_ref||^2`` to the base model (adapter off) at guidance ``kl_guidance`` (default: the
    policy's ``guidance``), times ``kl_weights`` [B] when given; ``scale`` does not act on it, as in
    DiffusionNFT and Flow-Factory's CRD. The noise, and ``t ~ U(0, 1)`` when ``sigma`` [B] is not given, come
    from a generator seeded by ``noise_seed`` (reproducible on any device).
    """
    device = policy.device
    loss = loss if loss is not None else NftLoss(strength=strength, adaptive=adaptive)
    noised, target, sigma = noised_sample(x0, noise_seed, sigma, policy, rows_per_unit=rows_per_unit)
    old_velocity = None  # [B, ...] the old adapter's, for the losses that compare with it
    if loss.needs_old:
        with torch.no_grad(), ema_weights(old), policy.local_forward():
            old_velocity = policy.velocity(noised, sigma, cond, guidance).float()
    velocity = policy.velocity(noised, sigma, cond, guidance).float()
    ref_velocity = None  # [B, ...] the base model's (adapter off): train.beta's anchor, DPO's reference
    if beta > 0 or loss.needs_reference:
        with torch.no_grad(), policy.reference():
            anchor_guidance = guidance if kl_guidance is None else kl_guidance
            ref_velocity = policy.velocity(noised, sigma, cond, anchor_guidance).float()
    value = loss(velocity, old_velocity, target, advantage.to(device), sigma, ref_velocity=ref_velocity)  # [U]
    weights = weights.to(device)
    kl = torch.zeros_like(value)
    if beta > 0:
        kl = ((velocity - ref_velocity) ** 2).mean(dim=tuple(range(1, velocity.ndim)))  # [B]
        kl = kl.reshape(-1, rows_per_unit).mean(1)  # [U]
    kl_factor = 1.0 if kl_weights is None else kl_weights.to(device)
    total = scale * value + beta * kl_factor * kl
    stats.add(f"loss/{loss.name}", value, weights)
    stats.add("loss/kl", kl, weights)
    if old_velocity is not None:  # how far the trained velocity is from the old adapter's (AWM's regulariser)
        stats.add("loss/ema_kl", ((velocity.detach() - old_velocity) ** 2).mean(dim=tuple(range(1, velocity.ndim))),
                  weights)
    stats.add("loss/total", total, weights)
    return (total * weights).sum()
