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
  part in the loss. Training t is logit-normal on the model's shifted schedule by default
  (``nft.timestep_schedule``, the references'). ``nft.dpo_ref_update_every`` makes the adapter the reference every
  N epochs (Flow-GRPO's ``ref_update_step``; the extra :mod:`flowrl.recipes.dpo_reference`), else it stays the base
  model. Deviation: Flow-GRPO pairs a tied group's rows 1 and 0 anyway; here ties give no pair.

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
   random order of them, no sigma twice), one per stratum of the schedule (``stratified``, AWM's), a
   logit-normal draw on the model's shifted schedule (``logit_normal``, online DPO's) or
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
from typing import Callable

import numpy as np
import torch
from accelerate import Accelerator

from flowrl.algorithms.advantages import ADVANTAGE_ESTIMATORS
from flowrl.algorithms.forward_losses import FORWARD_LOSSES, forward_process_loss, implicit_log_ratio
from flowrl.algorithms.timesteps import TIMESTEP_SCHEDULES
from flowrl.config import NFTConfig
from flowrl.recipes.epoch_end import end_epoch, log_base_model, optimizer_step, out_of_time, progress_bar
from flowrl.recipes.dpo_reference import dpo_reference
from flowrl.recipes.finish import finish_run
from flowrl.recipes.rollouts import (
    GroupAdvantages, each_reward_advantages, group_advantages, sample_and_score,
)
from flowrl.recipes.start import start_run
from flowrl.training.stats import StatsAccumulator
from flowrl.recipes.run import AdapterCopies, Run
from flowrl.rewards_api import AsyncScorer
from flowrl.sampling import StepPlan
from flowrl.sampling.sa_solver import sa_solver_rollout
from flowrl.training.accumulate import micro_batch
from flowrl.training.ema import LoraEMA, decay_schedule, ema_weights


def train(cfg: NFTConfig, *, accelerator: Accelerator | None = None) -> dict[str, float]:
    """Run the forward-process loop (DiffusionNFT, AWM, CRD or DPO) described by ``cfg``; returns the last epoch's
    metrics as a flat dict."""
    n, t = cfg.nft, cfg.train
    run = start_run(cfg, accelerator, extras=NFT_EXTRAS,  # processes, run dir, model, resume
                    eval_ema_decay=n.choice("eval_ema_decay"))
    forward_loss = FORWARD_LOSSES[n.loss].from_config(cfg)
    estimator = ADVANTAGE_ESTIMATORS[t.advantage]
    sampler = RolloutSampler.of(run)  # ODE with the old adapter; AWM: SA-Solver with the trained one; CRD: its own
    scorer = AsyncScorer(run.rewards, on_error=t.reward_errors, asynchronous=t.async_rewards)
    metrics: dict[str, float] = {}
    log_base_model(run)
    bar = progress_bar(run, "nft")
    for epoch in bar:
        epoch_start = time.perf_counter()
        phase_metrics = run.begin_epoch(epoch)  # HRF: a new phase re-anchors the weights

        # 1. Sample and score: clean samples of each prompt's group, batch b scored while b+1 samples.
        with ema_weights(sampler.weights):
            traj, sample_done, reward_done = sample_and_score(run, scorer, epoch, plan=sampler.plan,
                                                              noise_level=sampler.noise_level,
                                                              rollout_fn=sampler.rollout_fn)

        # 2. Advantages over whole groups -> clipped, over the clip, in [-1, 1] (the loss's weight, or NFT's
        #    optimality 2r - 1); unscored (NaN) rows are left out.
        groups = group_advantages(run, traj, estimator)
        clipped = groups.advantages[groups.local].clamp(-t.advantage_clip, t.advantage_clip) / t.advantage_clip  # [N]
        keep = torch.isfinite(groups.combined[groups.local])  # [N]
        scoring_metrics = run.after_scoring(epoch, traj, groups.combined)  # the diversity guard: may raise the KL

        # 3. Update: passes over (unit, fresh t and noise) pairs in shuffled chunks, one optimizer step each.
        stats = StatsAccumulator()
        if run.updates_policy(epoch):  # unless the epoch trains only a trainable reward (Adv-GRPO's schedule)
            update_forward(run, epoch, forward_loss, traj, groups, clipped, keep,
                           reward_pair_advantages(run, groups, estimator), stats)

            # 4. The old adapter (and CRD's sampler) follows the trained one; the extras after the update.
            follow_trained_adapter(run, epoch)
        update_metrics = run.after_update(epoch, traj, stats)  # trainable rewards learn from these rollouts
        train_done = time.perf_counter()

        # 5. End of epoch: log, held-out points, eval grids, checkpoint.
        metrics = end_epoch(run, epoch, gathered=groups.gathered, combined=groups.combined,
                            group_ids=groups.all_groups, stats=stats,
                            extra={**forward_loss.metrics(clipped), **phase_metrics, **scoring_metrics, **update_metrics,
                                   **traj.sampling_metrics},
                            rollouts=traj.rollouts_sampled, times=(epoch_start, sample_done, reward_done, train_done),
                            bar=bar, idle=forward_loss.idle())
        if out_of_time(run) or run.stopped:
            break

    # 6. Export the final adapter (the eval EMA) and report before/after on held-out prompts.
    scorer.close()
    return finish_run(run, metrics)


@dataclass(frozen=True)
class RolloutSampler:
    """How recipe nft samples its rollouts: the plain ODE (noise 0; the plan stores only the last step, the least
    memory) with the old adapter, or AWM's SA-Solver with the trained one (``nft.sampler``,
    ``nft.rollout_weights``; null: the loss's own), or CRD's sampler adapter."""

    plan: StepPlan
    noise_level: float
    rollout_fn: Callable | None  # None: the recipe's ODE rollout
    weights: LoraEMA | None  # the adapter copy swapped in while sampling; None: the trained weights

    @classmethod
    def of(cls, run: Run) -> RolloutSampler:
        n, s = run.cfg.nft, run.cfg.sampling
        sa_solver = n.choice("sampler") == "sa_solver"
        own = run.extras["adapters"].copies.get("sampler")  # CRD's rollout adapter
        return cls(plan=StepPlan(s.num_steps, sde_start=s.num_steps - 1),
                   noise_level=n.sa_noise_level if sa_solver else 0.0,
                   rollout_fn=functools.partial(sa_solver_rollout, noise_window=tuple(n.sa_noise_window))
                   if sa_solver else None,
                   weights=(own or run.ema) if n.choice("rollout_weights") == "old" else None)


def reward_pair_advantages(run: Run, groups: GroupAdvantages, estimator) -> dict[str, torch.Tensor] | None:
    """Where an extra balances the rewards' gradients (MARBLE): each weighted reward's own advantage, clipped like
    the combined one and tiled over the (sample, t) pairs ``{name: [pairs]}``; None otherwise."""
    per_reward, clip = each_reward_advantages(run, groups, estimator), run.cfg.train.advantage_clip
    return None if per_reward is None else {
        name: (advantages.clamp(-clip, clip) / clip).repeat(run.cfg.nft.timesteps_per_sample)
        for name, advantages in per_reward.items()}


def update_forward(run: Run, epoch: int, forward_loss, traj, groups: GroupAdvantages, clipped: torch.Tensor,
                   keep: torch.Tensor, per_reward: dict[str, torch.Tensor] | None, stats: StatsAccumulator) -> None:
    """``train.inner_epochs`` passes over (unit, fresh t and noise) pairs, shuffled, in chunks of one optimizer step
    each. A unit is one sample, or for loss dpo a preference pair (winner, loser) of one group. Pair p trains unit
    p % U at its first row's (p // U)-th timestep: with the sampling schedule, the sample's own random order of the
    schedule's sigmas (no sigma twice for one sample). The eval EMA follows every optimizer step where DiffusionNFT's
    does (``nft.eval_ema_every: step``)."""
    cfg, n, t, accelerator, policy = run.cfg, run.cfg.nft, run.cfg.train, run.accelerator, run.policy
    shards = run.shards
    rank = shards.process_index  # the data rank: a context group draws the same order, timesteps and noise
    scale = n.policy_loss_scale(t.advantage_clip)  # DiffusionNFT's and CRD's advantage_clip / beta
    kl_guidance = forward_loss.kl_guidance(run.guidance)  # CRD: a guided anchor
    timestep_schedule = TIMESTEP_SCHEDULES[n.choice("timestep_schedule")]  # how each pass draws its t
    schedule = policy.sigmas(cfg.sampling.num_steps)[:-1]  # [num_steps] the sampling schedule's (uniform: unused)
    old = functools.partial(ema_weights, run.ema)  # the old adapter's weights, swapped in
    unit_rows, unit_keep = forward_loss.units(groups.advantages[groups.local], traj.group_ids, keep,
                                              shards)  # [U, R], [U]
    units, rows_per_unit = unit_rows.shape
    unit_advantage = clipped[unit_rows[:, 0]]  # [U]
    pairs = units * n.timesteps_per_sample
    for inner in range(t.inner_epochs):
        order = np.random.default_rng([cfg.seed, epoch, inner, rank, 0x4F7]).permutation(pairs)
        # sampling: [N, num_steps]; stratified (AWM's), logit_normal (DPO's): [N, timesteps_per_sample]; uniform:
        # None, t ~ U(0, 1) drawn with the noise
        timesteps = timestep_schedule(schedule, traj.num_rows, n, [cfg.seed, epoch, inner, rank, 0x7153],
                                      policy.sigmas)
        for chunk_index, chunk in enumerate(np.array_split(order, t.optimizer_steps_per_epoch)):
            chunk = torch.as_tensor(chunk, dtype=torch.long)
            weight = shards.reduce(unit_keep[chunk % units].sum().to(shards.device), "sum").item()  # each unit once
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
                            policy, old, traj.final_latents[flat], traj.cond.select(traj.prompt_ids[flat]),
                            advantage[micro], unit_keep[micro % units], loss=forward_loss, guidance=run.guidance,
                            beta=run.beta, noise_seed=noise_seed, stats=chunk_stats, sigma=sigma, scale=scale,
                            kl_guidance=kl_guidance, rows_per_unit=rows_per_unit,
                            kl_weights=forward_loss.kl_weights(clipped[rows[:, 0]], run.beta),
                            reference=run.kl_reference)  # DPO's refreshed reference, else the base model
                        accelerator.backward(loss_sum * shards.gradient_scale / max(weight, 1.0))

            def log_ratios() -> torch.Tensor:
                """[pairs] the chunk's implicit log-ratios to the old adapter, at the noise its update uses."""
                ratios = torch.zeros(pairs)
                for i, micro in enumerate(micro_batches):
                    rows, sigma, noise_seed = micro_inputs(i, micro)
                    rows = rows[:, 0]  # CRD's units are single samples
                    ratios[micro] = implicit_log_ratio(policy, old, traj.final_latents[rows],
                                                       traj.cond.select(traj.prompt_ids[rows]), guidance=run.guidance,
                                                       noise_seed=noise_seed, sigma=sigma,
                                                       adaptive=n.adaptive_weighting).cpu()
                return ratios

            measured = forward_loss.chunk_weights(log_ratios, chunk, clipped, keep, traj, stats)  # CRD's
            if measured is not None:
                chunk_backward(measured, stats)
            else:  # reward-balanced where an extra does (MARBLE)
                step = (epoch * t.inner_epochs + inner) * t.optimizer_steps_per_epoch + chunk_index
                run.backward(step, unit_advantage.repeat(n.timesteps_per_sample), per_reward, chunk_backward, stats)
            optimizer_step(run, stats)
            if run.eval_ema is not None and n.choice("eval_ema_every") == "step":  # DiffusionNFT's eval EMA
                done = (epoch * t.inner_epochs + inner) * t.optimizer_steps_per_epoch + chunk_index + 1
                run.eval_ema.scheduled_step(done, start=0, warmup="flow_grpo")


def follow_trained_adapter(run: Run, epoch: int) -> None:
    """After epoch ``epoch``'s update: the old adapter (and CRD's sampler) follows the trained one once, on its
    decay schedule of the optimizer steps so far; AWM's eval EMA folds once an epoch (``nft.eval_ema_every:
    epoch``), with the ramp min(decay, (1 + s) / (10 + s))."""
    n, t = run.cfg.nft, run.cfg.train
    steps_so_far = (epoch + 1) * t.inner_epochs * t.optimizer_steps_per_epoch
    run.ema.blend(decay_schedule(steps_so_far, n.choice("old_decay")))
    sampler = run.extras["adapters"].copies.get("sampler")
    if sampler is not None:
        sampler.blend(decay_schedule(steps_so_far, n.sampler_schedule()))
    if run.eval_ema is not None and n.choice("eval_ema_every") != "step":
        run.eval_ema.scheduled_step(steps_so_far, start=0, warmup="flow_grpo")


def adapter_copies(run: Run) -> AdapterCopies:
    """The adapter copies checkpoints keep besides ema.safetensors (which holds the eval EMA): the old adapter
    (``run.ema``) as "old", and loss crd's own rollout adapter as "sampler", starting as the initial weights."""
    copies = {"old": run.ema} if run.ema is not None and run.eval_ema is not None else {}
    if run.cfg.nft.sampler_schedule() is not None:
        copies["sampler"] = LoraEMA(run.policy.named_trainable_parameters(), decay=0.0)  # blended on its schedule
    return AdapterCopies(copies)


# Recipe nft's own extras, built after the common ones (names are trainer-state keys: never rename one).
NFT_EXTRAS = {"adapters": adapter_copies, "dpo_reference": dpo_reference}


