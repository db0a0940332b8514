"""Bookkeeping that every recipe shares: starting a run (from the pieces :mod:`flowrl.recipes.build`
makes), sampling and scoring with the epoch's step plan (:mod:`flowrl.recipes.plans`), checkpoint save/restore, eval grids, the end of
each epoch and of the run with the final LoRA export.

Recipes stay leaf code that reads top to bottom; what lives here is what would otherwise be
copied verbatim into every loop.
"""

from __future__ import annotations

import math
import time
import warnings
from pathlib import Path

import torch
from accelerate import Accelerator
from tqdm.auto import tqdm

from flowrl.algorithms.advantages import group_variances, zero_std_fraction
from flowrl.algorithms.combine import COMBINERS
from flowrl.algorithms.preference import draw_preferences, row_weights
from flowrl.recipes.build import (  # noqa: F401  (flat_config: re-exported for callers)
    build_optimizer, build_training_policy, check_memory_options, eval_prompt_set, flat_config, load_prompt_splits,
    make_accelerator)
from flowrl.recipes.extras import COMMON_EXTRAS, LAST_EXTRAS, ExtraBuilder
from flowrl.recipes.names import check_group_rewards, check_names
from flowrl.recipes.plans import batch_plan, step_plan  # noqa: F401  (step_plan re-exported)
from flowrl.recipes.run import Run
from flowrl.config import Config, ConfigError, check, save_config, to_dict
from flowrl.data import PromptSet, epoch_prompt_indices, prompts_per_batch
from flowrl.eval_tasks import stratified_prefix
from flowrl.models.full_weights import FULL_WEIGHT_NAME
from flowrl.models.lora_io import lora_config_dict, lora_state_dict
from flowrl.models.quantize import ignore_quantized_in_ddp
from flowrl.models.text_cache import attach_configured_cache
from flowrl.eval.held_out import evaluate_rows, render
from flowrl.eval.report import write_report
from flowrl.rewards_api import build_rewards, check_whole_groups, nan_summary
from flowrl.sampling import StepPlan, chunked_rollout, concat_trajectories, rollout, root_seeds
from flowrl.sampling.pilot import commit_candidates, join_committed, slot_seeds
from flowrl.sampling.self_guidance import SelfGuidance
from flowrl.training.ema import LoraEMA, ema_weights
from flowrl.training.lr import skip_scheduled_step
from flowrl.training.faults import TrainingAborted, grad_norm as total_grad_norm
from flowrl.training.metrics import MetricsLogger
from flowrl.training.run_dir import check_run_dir, claim_run_dir
from flowrl.training.stats import StatsAccumulator


def check_resumable(cfg: Config, policy) -> None:
    """The checkpoint ``train.resume`` names holds exactly this run's adapter tensors (shapes from its file header,
    nothing loaded into torch), so another model's checkpoint is one line rather than an optimizer size mismatch."""
    from flowrl.safe_io import check_checkpoint_shapes
    from flowrl.training.checkpoint import resolve_checkpoint
    from flowrl.training.ema import peft_key

    check_checkpoint_shapes(resolve_checkpoint(cfg.run_dir, cfg.train.resume),
                            {peft_key(name): tuple(p.shape) for name, p in policy.named_trainable_parameters()},
                            trained=cfg.model.trainable)


def restore_checkpoint(cfg: Config, policy, optimizer, ema, *, rank: int, snapshots: dict | None = None) -> dict:
    """Load the checkpoint named by ``train.resume`` into the live objects; returns its trainer state."""
    from flowrl.models.lora_io import load_adapter_state
    from flowrl.training.checkpoint import load_checkpoint
    from flowrl.training.ema import peft_key
    from flowrl.sharded import like

    lora_state, trainer_state = load_checkpoint(cfg.run_dir, resume=cfg.train.resume, optimizer=optimizer, ema=ema,
                                                rank=rank, snapshots=snapshots)
    if policy.full_weights is not None:  # the trained transformer tensors, sliced per process in there
        policy.load_trained_state(lora_state)
        return trainer_state
    live = {peft_key(name): param for name, param in policy.named_trainable_parameters()}
    lora_state = {k: like(v, live[k]) if k in live else v for k, v in lora_state.items()}  # FSDP2: this rank's slice
    load_adapter_state(policy.transformer, lora_state)  # the LoRA, and a preference embedding
    return trainer_state


def save_run_checkpoint(run: Run, *, epoch: int) -> Path:
    """The run's checkpoint after epoch ``epoch``: LoRA, optimizer, exported EMA, the counters and every extra's
    state (trainer_state.json) and snapshots (``<name>.safetensors``; a snapshot that holds nothing yet is left
    out). A failed write (a full disk) raises TrainingAborted; the previous checkpoint stays the latest one."""
    from flowrl.training.checkpoint import save_checkpoint

    cfg, policy, accelerator = run.cfg, run.policy, run.accelerator
    return save_checkpoint(
        cfg.run_dir, epoch, lora_state=policy.trained_state(keep=accelerator.is_main_process),
        lora_config=policy.trained_config(),
        weights_name=FULL_WEIGHT_NAME if policy.full_weights is not None else "lora.safetensors",
        optimizer=run.optimizer, ema=run.exported_ema,
        trainer_state={"epoch": epoch, **run.counters, **run.trainer_state()}, config=to_dict(cfg),
        rank=accelerator.process_index, world_size=accelerator.num_processes, barrier=accelerator.wait_for_everyone,
        keep_last=cfg.train.keep_checkpoints,
        snapshots={name: copy for name, copy in run.snapshots.items() if getattr(copy, "taken", True)},
    )


def check_eval_size(policy, cfg: Config) -> None:
    """A size the model cannot sample (``eval.height``/``width``/``num_frames``) is a config error at start."""
    e = cfg.eval
    try:
        policy.check_size(e.height or policy.height, e.width or policy.width, e.num_frames)
    except ValueError as error:
        raise ConfigError(str(error), key="eval") from None


def eval_size(policy, cfg: Config):
    """The policy at the evaluation size (``eval.height``, ``width``, ``num_frames``; training's where null)."""
    return policy.sized(cfg.eval.height, cfg.eval.width, cfg.eval.num_frames)


@torch.no_grad()
def eval_grid(policy, ema, prompts: PromptSet, cfg: Config, guidance: float, out: Path, *, save: bool = True) -> Path:
    """ODE samples of the fixed eval prompts (EMA weights when kept), one grid row per prompt.

    Every process calls this (a sharded model needs all ranks for a forward); only ``save`` writes."""
    from torchvision.utils import save_image

    from flowrl.eval.held_out import render
    from flowrl.media import stills

    n = cfg.log.eval_images_per_prompt
    with ema_weights(ema), eval_size(policy, cfg):
        images = render(policy, prompts, images_per_prompt=n, guidance=guidance, seed=cfg.seed + 1,
                        num_steps=cfg.log.eval_num_steps or cfg.sampling.num_steps)
    if save:
        out.parent.mkdir(parents=True, exist_ok=True)
        save_image(stills(images), out, nrow=n, padding=2)
    return out


def export_final_lora(policy, ema, out_dir: Path, config_file: Path | None = None, *, write: bool = True) -> Path:
    """Write the adapter (EMA weights when kept) to ``out_dir`` as ``export-lora --format all`` does: the diffusers
    file (returned), the kohya file and a README, scale folded, with the base model and the hash of ``config_file``
    (default ``out_dir/../config.yaml``, the run's saved config) in the metadata. Overwrites an earlier export.

    Under FSDP2 every process must call this (the sharded adapter is gathered whole); only ``write`` ones write."""
    import yaml

    from flowrl.models.lora_io import DIFFUSERS_WEIGHT_NAME, write_lora_files

    with ema_weights(ema):
        state = lora_state_dict(policy.transformer)
    if not write:
        return Path(out_dir) / DIFFUSERS_WEIGHT_NAME
    config_file = Path(config_file) if config_file is not None else Path(out_dir).parent / "config.yaml"
    config_text = config_file.read_text() if config_file.is_file() else None
    model = (yaml.safe_load(config_text) or {}).get("model", {}) if config_text else {}
    family = model.get("family") or policy.family
    base_model = model.get("path") or getattr(policy.pipeline, "name_or_path", None)
    preference = policy.preference.describe() if getattr(policy, "preference", None) is not None else None
    return write_lora_files(out_dir, state, lora_config_dict(policy.transformer), family=family, base_model=base_model,
                            config_text=config_text, force=True, preference=preference)[0]


def export_final_transformer(policy, ema, out_dir: Path, *, write: bool = True) -> Path:
    """Write the fully fine-tuned transformer (EMA weights when kept) to ``out_dir`` as a diffusers model folder
    that ``<Transformer class>.from_pretrained`` loads: every tensor, in the model's dtype. Under FSDP2 every
    process must call this (the weights are gathered whole); only ``write`` ones write."""
    from flowrl.models.full_weights import save_transformer

    with ema_weights(ema):
        return save_transformer(policy, out_dir, write=write)


def start_run(cfg: Config, accelerator: Accelerator | None = None, *, extras: dict[str, ExtraBuilder] | None = None,
              eval_ema_decay: float | None = None) -> Run:
    """Set up a run: processes, run directory and saved config, model + LoRA, optimizer, EMA, rewards,
    prompt splits, metrics logger and trackers, the run's extras, and the state of ``train.resume``.

    ``extras``: {name: builder} of the recipe's own extras, built after the common ones
    (:mod:`flowrl.recipes.extras`); ``eval_ema_decay``: keep a separate EMA of that decay for eval, the report,
    the export and ``ema.safetensors`` (recipe nft), ``run.ema`` staying the one the recipe steps."""
    check_names(cfg)
    resolve_combine(cfg)  # before the accelerator: a DeepSpeed launch refuses marble
    accelerator = accelerator or make_accelerator(cfg)  # checks that the configured device is there
    check_memory_options(cfg, accelerator)
    run_dir = Path(cfg.run_dir)
    check_run_dir(run_dir, resume=bool(cfg.train.resume), overwrite=cfg.train.overwrite)
    accelerator.wait_for_everyone()  # every process has looked before the main one claims the directory
    sampling = cfg.sampling
    if sampling.groups_per_epoch is not None:  # a global epoch: this process's share, read by every step below
        try:
            world, batches = accelerator.num_processes, cfg.train.batches_per_epoch
            sampling.prompts_per_batch = prompts_per_batch(sampling.groups_per_epoch, world_size=world,
                                                           batches_per_epoch=batches)
        except ValueError as error:
            raise ConfigError(str(error), key="sampling.groups_per_epoch") from None
        candidates = sampling.pilot.candidates
        check(not candidates or candidates >= sampling.prompts_per_batch, "sampling.pilot.candidates",
              f"must be >= the {sampling.prompts_per_batch} prompts per batch that sampling.groups_per_epoch gives")
    t = cfg.train
    policy = build_training_policy(cfg, accelerator.device)
    check_eval_size(policy, cfg)
    params = policy.trainable_parameters()
    optimizer = build_optimizer(cfg, params, accelerator.device)
    ignore_quantized_in_ddp(policy.transformer)  # model.quantize: frozen, identical on every rank, never broadcast
    policy.forward_module, optimizer = accelerator.prepare(policy.transformer, optimizer)
    params = policy.trainable_parameters()  # FSDP2 shards in place: the parameters are new (DTensor) objects
    if policy.full_weights is not None:  # the reference: the base's trained tensors, laid out (sharded) as they are
        policy.full_weights.take_base()
    if accelerator.is_fsdp2 and accelerator.is_main_process:
        from flowrl.sharded import is_sharded

        tqdm.write(f"flowrl train: FSDP2 over {accelerator.num_processes} processes: "
                   f"{sum(map(is_sharded, params))} of {len(params)} "
                   f"{'trained transformer' if policy.full_weights is not None else 'LoRA'} tensors sharded")
    ema = LoraEMA(policy.named_trainable_parameters(), decay=t.ema_decay) if t.ema else None
    rewards, weights = build_rewards(cfg.rewards, accelerator.device)
    check_group_rewards(cfg, rewards)  # a built reward may declare scores_groups itself (a remote judge)
    train_prompts, test_prompts = load_prompt_splits(cfg)
    if t.resume:
        check_resumable(cfg, policy)  # before the run directory is touched
    if accelerator.is_main_process:  # only now: a bad model path, reward or prompt file leaves no run directory
        moved = claim_run_dir(run_dir, overwrite=t.overwrite)
        save_config(cfg, run_dir / "config.yaml")
        tqdm.write(f"flowrl train: {'resuming the run in' if t.resume else 'this run goes to'} {run_dir}"
                   + (f" (the run that was there is now {moved})" if moved else ""))
    if cfg.model.text_cache == "disk":  # every prompt the run encodes, once; the encoders may go after
        attach_configured_cache(policy, cfg.model, run_dir, [*train_prompts.prompts, *test_prompts.prompts,
                                                             *eval_prompt_set(cfg, test_prompts).prompts],
                                write=accelerator.is_main_process)
    logger = MetricsLogger(run_dir, enabled=accelerator.is_main_process,
                           tracker=accelerator if cfg.log.backend != "none" else None)
    if cfg.log.backend != "none":
        accelerator.init_trackers(cfg.log.project, config=flat_config(cfg), init_kwargs={"wandb": {
            "name": cfg.log.run_name or run_dir.name, "tags": list(cfg.log.wandb_tags),
            **({"entity": cfg.log.wandb_entity} if cfg.log.wandb_entity else {})}})  # other trackers ignore it
    eval_ema = None if eval_ema_decay is None else LoraEMA(policy.named_trainable_parameters(), decay=eval_ema_decay)
    run = Run(
        cfg=cfg, accelerator=accelerator, run_dir=run_dir, policy=policy, params=params, optimizer=optimizer, ema=ema,
        rewards=rewards, weights=weights, train_prompts=train_prompts, test_prompts=test_prompts,
        eval_prompts=eval_prompt_set(cfg, test_prompts),
        test_set=stratified_prefix(test_prompts, cfg.log.test_prompts), logger=logger,
        guidance=cfg.sampling.guidance_scale if (t.cfg or policy.guidance_in_model) else 1.0, start_epoch=0,
        exported_ema=eval_ema,
    )
    for name, build in {**COMMON_EXTRAS, **(extras or {}), **LAST_EXTRAS}.items():
        extra = build(run)
        if extra is not None:
            run.extras[name] = extra
    resumed = restore_checkpoint(cfg, policy, optimizer, run.exported_ema, rank=accelerator.process_index,
                                 snapshots=run.snapshots) if t.resume else {"epoch": -1}
    run.load_trainer_state(resumed)
    run.counters = {"rollouts": resumed.get("rollouts", 0), "train_wall_s": resumed.get("train_wall_s", 0.0)}
    run.start_epoch = t.epochs if run.stopped else int(resumed["epoch"]) + 1  # stopped: only export and report
    logger.truncate_after(int(resumed["epoch"]))
    return run


def resolve_combine(cfg: Config) -> None:
    """``train.combine=marble`` balances several trained rewards; with fewer than two there is nothing to balance and
    the run combines by weight, with a warning. Decided here, as the run starts, and not in validation, which changes
    nothing: the saved config (written after this) holds the combiner the run used."""
    trained = cfg.trained_rewards()
    if cfg.train.combine == "marble" and len(trained) < 2:
        warnings.warn(f"train.combine=marble balances several rewards, but only {trained} trains (nonzero weight); "
                      "using train.combine=weighted", stacklevel=3)
        cfg.train.combine = "weighted"


def sample_and_score(run: Run, scorer, epoch: int, *, plan: StepPlan, noise_level: float, kind: str = "sde",
                     same_noise_in_group: bool = False, same_noise_in_pairs: bool = False,
                     store_x0_preds: bool = False, store_means: bool = False, batch_windows: bool = False,
                     rollout_fn=None):
    """This epoch's rollouts on this process, scored: batch b is scored in a worker while b+1 is sampled.

    With ``batch_windows`` and ``sampling.window.mode: random`` each batch rolls out with its own window,
    drawn from (seed, epoch, batch, process) (:func:`step_plan`), as Flow-GRPO-Fast draws one per sampling
    call; otherwise every batch uses ``plan``.

    Prompts are sharded over processes and row seeds come from global row indices, so N processes reproduce one.
    A prompt's group_size rows are sampled on one process, in one batch, so a group-wise reward scores whole groups
    with no gather (``check_whole_groups`` holds it). With ``sampling.pilot.candidates`` the batches are allocated by
    Pilot-Commit (:func:`pilot_sample_and_score`). Returns (trajectory with rewards, time sampling ended, time scoring
    ended); it also carries ``rollouts_sampled`` (rollouts of every process this epoch, dropped pilot ones included)
    and ``sampling_metrics`` (``perf/*``). ``rollout_fn`` samples (None: :func:`rollout`; Pilot-Commit's is its own).
    """
    cfg, accelerator, policy = run.cfg, run.accelerator, run.policy
    s, rank, world = cfg.sampling, accelerator.process_index, accelerator.num_processes
    key = cfg.data.balance_by  # equal shares of each batch per metadata value (checked in load_prompt_splits)
    strata = [m[key] for m in run.train_prompts.metadata] if key else None
    if s.pilot.candidates:
        return pilot_sample_and_score(run, scorer, epoch, plan=plan, noise_level=noise_level, kind=kind,
                                      strata=strata, store_x0_preds=store_x0_preds, store_means=store_means,
                                      batch_windows=batch_windows)
    roots_per_group = s.group_size // plan.leaves_per_root
    # Self-guidance only where configured for rollouts (recipe grpo's config refuses it: see its validate).
    guide = SelfGuidance.maybe(**s.self_guidance.settings()) if s.self_guidance.in_rollouts else None
    parts, futures = [], []
    for b in range(cfg.train.batches_per_epoch):
        batch_index = epoch * cfg.train.batches_per_epoch + b
        index = epoch_prompt_indices(len(run.train_prompts), s.prompts_per_batch, seed=cfg.seed, epoch=batch_index,
                                     rank=rank, world_size=world, strata=strata)
        batch = run.train_prompts.subset(index)
        first_root = (batch_index * world + rank) * s.prompts_per_batch * roots_per_group
        first_group = (batch_index * world + rank) * s.prompts_per_batch  # this batch's groups' run-wide ids
        cond = preference_cond(run, batch, torch.arange(first_group, first_group + len(batch)))
        with policy.local_forward():
            part = chunked_rollout(policy, batch.prompts, group_size=s.group_size, chunk=s.rollout_chunk, cond=cond,
                                   num_steps=s.num_steps, guidance_scale=run.guidance, noise_level=noise_level,
                                   kind=kind, plan=batch_plan(plan, s, batch_windows, seed=cfg.seed, epoch=epoch,
                                                              batch=b, rank=rank),
                                   same_noise_in_group=same_noise_in_group, same_noise_in_pairs=same_noise_in_pairs,
                                   metadata=batch.metadata, store_x0_preds=store_x0_preds, ode_solver=s.ode_solver,
                                   store_means=store_means,
                                   seeds=root_seeds(cfg.seed, first_root, len(batch) * roots_per_group),
                                   rollout_fn=rollout_fn, **({"self_guidance": guide} if guide else {}))
        part.group_ids = part.group_ids + first_group
        check_whole_groups(scorer.rewards, part.group_ids, s.group_size)  # a group-wise reward sees whole groups
        futures.append(scorer.submit(part.images, part.row_prompts, part.row_metadata, part.group_ids))
        parts.append(part)
    sample_done = time.perf_counter()
    for part, future in zip(parts, futures):
        part.rewards = future.result()
    traj = concat_trajectories(parts)
    traj.rollouts_sampled, traj.sampling_metrics = traj.num_rows * world, {}
    return traj, sample_done, time.perf_counter()


def preference_cond(run: Run, batch: PromptSet, group_ids: torch.Tensor):
    """ParetoSlider: the batch's conditioning with each prompt group's w (``TextCond.preference`` ``[P, K]``, drawn
    from the run seed and the group's run-wide id); None without ``model.preference`` (the rollout encodes)."""
    names = run.cfg.model.preference.rewards
    if not names:
        return None
    cond = run.policy.encode(list(batch.prompts), metadata=batch.metadata)
    cond.preference = draw_preferences(run.cfg.seed, group_ids, len(names)).to(cond.prompt_embeds.device)
    return cond


def run_weights(run: Run, group_ids: torch.Tensor) -> dict:
    """The reward weights of rows in groups ``group_ids`` ``[N]``: the configured ones, or with ``model.preference``
    each group's w in place of the slider's rewards' weights (per row, for train.combine=preference)."""
    names = run.cfg.model.preference.rewards
    if not names:
        return run.weights
    unique, inverse = torch.unique(group_ids, return_inverse=True)
    return row_weights(draw_preferences(run.cfg.seed, unique, len(names))[inverse], names, run.weights)


def pilot_sample_and_score(run: Run, scorer, epoch: int, *, plan: StepPlan, noise_level: float, kind: str,
                           strata: list | None, store_x0_preds: bool = False, store_means: bool = False,
                           batch_windows: bool = False):
    """Pilot-Commit (``flowrl.sampling.pilot``): every batch pilots ``pilot.candidates`` prompts with
    ``pilot.group_size`` rollouts each, commits the ``prompts_per_batch`` whose pilot rewards vary most
    and rolls out the rest of their groups; uncommitted pilot rollouts are dropped.

    Each process pilots its own shard of candidates (the same balanced sampler) and commits locally,
    so every process keeps ``prompts_per_batch`` groups of ``group_size`` rows (N processes draw the
    candidates and seeds of one with N times the candidates, but choose among their own). All pilots are sampled
    first, so pilot b+1 samples while pilot b is scored and each commit waits only for its own pilot.
    Same return value as :func:`sample_and_score`; ``sampling_metrics`` holds, summed over processes
    and batches, ``perf/rollouts_saved`` (skipped candidates x the commit rollouts each would have
    had), ``perf/pilot_dropped`` (pilot rollouts not trained on) and ``perf/pilot_zero_std`` (the
    fraction of candidates whose pilot rewards did not vary).
    """
    cfg, accelerator, policy = run.cfg, run.accelerator, run.policy
    s, rank, world = cfg.sampling, accelerator.process_index, accelerator.num_processes
    candidates, pilot_size, commit_size = s.pilot.candidates, s.pilot.group_size, s.group_size - s.pilot.group_size
    steps = dict(num_steps=s.num_steps, guidance_scale=run.guidance, noise_level=noise_level, kind=kind,
                 store_x0_preds=store_x0_preds, ode_solver=s.ode_solver, store_means=store_means)
    plans = [batch_plan(plan, s, batch_windows, seed=cfg.seed, epoch=epoch, batch=b, rank=rank)
             for b in range(cfg.train.batches_per_epoch)]  # a batch's pilot and commit share its window

    # 1. Pilot: a few rollouts per candidate; candidate c owns root rows first_root + c * group_size + [0, G).
    pilots = []
    for b in range(cfg.train.batches_per_epoch):
        batch_index = epoch * cfg.train.batches_per_epoch + b
        slot = batch_index * world + rank  # this process's batch among all processes' batches of the run
        index = epoch_prompt_indices(len(run.train_prompts), candidates, seed=cfg.seed, epoch=batch_index, rank=rank,
                                     world_size=world, strata=strata)
        batch = run.train_prompts.subset(index)
        first_root = slot * candidates * s.group_size
        with policy.local_forward():
            pilot = rollout(policy, batch.prompts, group_size=pilot_size, metadata=batch.metadata, **steps,
                            plan=plans[b],
                            seeds=slot_seeds(cfg.seed, first_root, range(len(batch)), s.group_size, 0, pilot_size))
        pilots.append((slot, first_root, pilot, scorer.submit(pilot.images, pilot.row_prompts, pilot.row_metadata),
                       plans[b]))

    # 2. Commit the candidates whose combined pilot reward varies most; roll out the rest of their groups.
    commits, skipped, flat = [], 0, 0
    for slot, first_root, pilot, future, pilot_plan in pilots:
        pilot.rewards = future.result()
        n = pilot.num_rows
        signal = {k: pilot.rewards.get(k, torch.full((n,), math.nan)) for k in run.weights}  # a failed reward: NaN
        _, combined = COMBINERS[cfg.train.combine](signal, run.weights, pilot.prompt_ids.cpu(), lambda r, g: r)
        variances = group_variances(combined, pilot.prompt_ids, len(pilot.prompts))  # [C]: a candidate is a group
        committed = commit_candidates(variances, s.prompts_per_batch)  # [P]
        skipped += len(pilot.prompts) - len(committed)
        flat += int((variances == 0).sum())
        chosen = committed.tolist()
        with policy.local_forward():
            commit = rollout(policy, [pilot.prompts[c] for c in chosen], group_size=commit_size, plan=pilot_plan,
                             **steps,
                             metadata=[pilot.metadata[c] for c in chosen] if pilot.metadata else None,
                             cond=pilot.cond.select(committed),
                             seeds=slot_seeds(cfg.seed, first_root, chosen, s.group_size, pilot_size, s.group_size))
        group_ids = slot * s.prompts_per_batch + torch.arange(len(chosen))  # [P] globally unique
        commits.append((pilot, committed, group_ids, commit,
                        scorer.submit(commit.images, commit.row_prompts, commit.row_metadata)))
    sample_done = time.perf_counter()

    # 3. Each committed group: its pilot rows (already scored) then its commit rows.
    parts = []
    for pilot, committed, group_ids, commit, future in commits:
        commit.rewards = future.result()
        parts.append(join_committed(pilot, commit, committed, group_ids))
    traj = concat_trajectories(parts)
    batches = cfg.train.batches_per_epoch
    counts = accelerator.reduce(torch.tensor([skipped, flat], dtype=torch.float64, device=accelerator.device),
                                "sum").cpu()
    traj.rollouts_sampled = (candidates * pilot_size + s.prompts_per_batch * commit_size) * batches * world
    traj.sampling_metrics = {"perf/rollouts_saved": float(counts[0]) * commit_size,
                             "perf/pilot_dropped": float(counts[0]) * pilot_size,
                             "perf/pilot_zero_std": float(counts[1]) / (candidates * batches * world)}
    return traj, sample_done, time.perf_counter()


def group_advantages(run: Run, traj, estimator):
    """Advantages over whole groups: gather every process's rewards, combine them, normalise per group.

    Returns (gathered rewards {name: [N_all]}, advantages [N_all], combined reward [N_all], this
    process's slice of the rows, group ids [N_all]).
    """
    accelerator, t = run.accelerator, run.cfg.train
    gathered = {k: accelerator.gather(v.to(accelerator.device)).cpu() for k, v in traj.rewards.items()}
    all_groups = accelerator.gather(traj.group_ids.to(accelerator.device)).cpu()
    advantages, combined = COMBINERS[t.combine]({key: gathered[key] for key in run.weights}, run_weights(run, all_groups),
                                                all_groups, lambda r, g: estimator(r, g, std_scope=t.std_scope))
    rank = accelerator.process_index
    return gathered, advantages, combined, slice(rank * traj.num_rows, (rank + 1) * traj.num_rows), all_groups


def log_base_model(run: Run) -> None:
    """With ``log.test_every``, the held-out score of the base model: the curve's starting point."""
    if run.cfg.log.test_every and run.start_epoch == 0:
        points, held_out = held_out_scores(run.policy, run.exported_ema, run.rewards, run.test_set, run.cfg,
                                           run.eval_guidance)
        metrics = {"epoch": -1, **points, **{f"perf/{k}": v for k, v in run.counters.items()}}
        run.logger.log({**metrics, **run.end_epoch(-1, metrics, held_out)}, step=-1)  # the guard's first point


def optimizer_step(run: Run, stats: StatsAccumulator) -> None:
    """Clip the accumulated gradients (``train.max_grad_norm``, 0: no clipping), step, clear them;
    the pre-clip norm goes into ``stats``. A non-finite norm (NaN/inf loss or gradient) skips the step with the
    gradients zeroed, so the weights stay finite; ``train.max_skipped_steps`` in a row stop the run.

    Under fp16 autocast on GPU accelerate scales the loss (``accelerator.scaler``, torch's GradScaler): a gradient
    that overflows float16 at the current scale is how the scaler finds its scale, so that step goes to the
    scaler, which skips it and halves the scale, and is not counted as a fault while the scale is >= 1 (below,
    the gradient itself is non-finite). Every skipped step passes through the scaler, which must see each step."""
    for before_step in run.hook("before_step"):  # HRF's pull toward its anchor
        before_step(run)
    max_norm = run.cfg.train.max_grad_norm
    grad_norm = run.accelerator.clip_grad_norm_(run.params, max_norm) if max_norm > 0 else None
    norm = float(grad_norm) if grad_norm is not None else float(total_grad_norm(run.params))
    scheduler = run.extras["lr_scheduler"]
    scaler = getattr(run.accelerator, "scaler", None)  # fp16 autocast on GPU: accelerate's GradScaler
    if scaler is not None:
        stats.add_scalar("optim/loss_scale", scaler.get_scale())  # the epoch's mean
    if scaler is not None and not math.isfinite(norm) and scaler.get_scale() >= 1:  # the loss scale overflowed
        skip = True
    else:
        skip = run.faults.step(norm)  # after the all-reduce: every process sees the same norm and skips alike
        if skip and run.accelerator.is_main_process:
            tqdm.write(f"flowrl train: warning: non-finite gradient (norm {norm}); optimizer step skipped "
                       f"({run.faults.skipped_in_a_row} in a row, train.max_skipped_steps="
                       f"{run.cfg.train.max_skipped_steps})")
    if skip:
        if scaler is not None:  # accelerate's optimizer step: the scaler skips an inf step and lowers its scale
            run.optimizer.step()
        run.optimizer.zero_grad(set_to_none=True)
        skip_scheduled_step(scheduler)
        return
    run.optimizer.step()
    run.optimizer.zero_grad(set_to_none=True)
    scheduler.step()
    if grad_norm is not None:
        stats.add_scalar("optim/grad_norm", grad_norm)


def end_epoch(run: Run, epoch: int, *, gathered: dict[str, torch.Tensor], combined: torch.Tensor,
              group_ids: torch.Tensor, stats: StatsAccumulator, extra: dict[str, float], rollouts: int,
              times: tuple[float, float, float, float], bar) -> dict[str, float]:
    """Collect the epoch's metrics (rewards, training stats, the recipe's ``extra``, stage times), count,
    score the held-out prompts, render the eval grid, log, checkpoint, update the progress bar.

    ``times``: when the epoch started, sampling ended, scoring ended and training ended.
    """
    cfg, accelerator, t = run.cfg, run.accelerator, run.cfg.train
    epoch_start, sample_done, reward_done, train_done = times
    metrics = {"epoch": epoch}
    metrics.update(reward_metrics(gathered, combined, [r.name for r in run.rewards]))  # NaN counts: main scores
    metrics["policy/zero_std_groups"] = zero_std_fraction(combined, group_ids)  # groups that teach nothing
    metrics.update(stats.reduce(accelerator))
    metrics.update(extra)
    aborted = None
    try:  # every trained reward NaN: nothing trained this epoch (a dead reward server under reward_errors=nan)
        warning = run.faults.epoch(gathered, [k for k, w in run.weights.items() if w != 0], epoch=epoch)
    except TrainingAborted as error:
        warning, aborted = None, error
    if warning and accelerator.is_main_process:
        tqdm.write(warning)
    for extra_metrics in run.hook("metrics"):  # MARBLE's weights, TMPO's split scheduler, the fault counts
        metrics.update(extra_metrics())
    metrics["optim/lr"] = float(run.optimizer.param_groups[0]["lr"])  # a tensor under torchao's AdamW8bit
    metrics["perf/sample_s"] = sample_done - epoch_start
    metrics["perf/reward_wait_s"] = reward_done - sample_done
    metrics["perf/train_s"] = train_done - reward_done
    run.counters["rollouts"] += rollouts
    run.counters["train_wall_s"] += train_done - epoch_start
    metrics.update({f"perf/{k}": v for k, v in run.counters.items()})
    if aborted is not None:  # logged, but no checkpoint of this epoch: the last one on disk stays the latest
        run.logger.log(metrics, step=epoch)
        raise aborted
    last = out_of_time(run) or run.stopped  # the run ends after this epoch, before train.epochs
    held_out = None  # per-image held-out scores, at a point of the curve
    if cfg.log.test_every and ((epoch + 1) % cfg.log.test_every == 0 or last):  # the curve's last point
        points, held_out = held_out_scores(run.policy, run.exported_ema, run.rewards, run.test_set, cfg,
                                           run.eval_guidance)
        metrics.update(points)
    metrics.update(run.end_epoch(epoch, metrics, held_out))  # the held-out guard: warn, stop or roll back
    last = last or run.stopped
    if cfg.log.eval_every and (epoch + 1) % cfg.log.eval_every == 0:  # every rank samples (sharded models)
        eval_grid(run.policy, run.exported_ema, run.eval_prompts, cfg, run.eval_guidance,
                  run.run_dir / "grids" / f"epoch_{epoch:05d}.png", save=accelerator.is_main_process)
    metrics["perf/epoch_s"] = time.perf_counter() - epoch_start
    run.logger.log(metrics, step=epoch)  # before the checkpoint: a resumed run redoes later epochs only
    if epoch + 1 == t.epochs or last or (t.checkpoint_every and (epoch + 1) % t.checkpoint_every == 0):
        save_run_checkpoint(run, epoch=epoch)
    bar.set_postfix(reward=f"{metrics['reward/combined_mean']:.3f}", loss=f"{metrics.get('loss/total', 0):.4f}",
                    sample=f"{metrics['perf/sample_s']:.1f}s", train=f"{metrics['perf/train_s']:.1f}s")
    return metrics


def out_of_time(run: Run) -> bool:
    """Whether ``train.time_limit_s`` of sampling, scoring and training time has been spent."""
    limit = run.cfg.train.time_limit_s
    return limit is not None and run.counters["train_wall_s"] >= limit


def finish_run(run: Run, metrics: dict) -> dict[str, float]:
    """Export the final adapter (EMA weights when kept) and report before/after on held-out prompts."""
    cfg, accelerator = run.cfg, run.accelerator
    for finish in run.hook("finish"):  # the diversity guard: export and report the best reward-diversity weights
        finish(run)
    if cfg.train.export_lora and run.policy.full_weights is not None:  # full weights: a diffusers transformer folder
        export_final_transformer(run.policy, run.exported_ema, run.run_dir / "transformer",
                                 write=accelerator.is_main_process)
    elif cfg.train.export_lora:  # every rank gathers (FSDP2), the main one writes
        export_final_lora(run.policy, run.exported_ema, run.run_dir / "lora", write=accelerator.is_main_process)
    if cfg.log.report_prompts:
        prompts = stratified_prefix(run.test_prompts, cfg.log.report_prompts)  # equal share per task
        with eval_size(run.policy, cfg):
            report = write_report(run.run_dir, policy=run.policy, ema=run.exported_ema, rewards=run.rewards,
                                  prompts=prompts, images_per_prompt=cfg.log.eval_images_per_prompt,
                                  num_steps=cfg.log.eval_num_steps or cfg.sampling.num_steps,
                                  guidance=run.eval_guidance, seed=cfg.seed + 2, diversity=cfg.log.report_diversity,
                                  save=accelerator.is_main_process,
                                  trained=[r.key or r.name for r in cfg.rewards if r.weight != 0])
        metrics.update({f"report/{when}/{k}": v for when in ("before", "after") for k, v in report[when].items()})
        if accelerator.is_main_process:
            tqdm.write(f"flowrl train: {metrics.get('epoch', -1) + 1} epochs; {report['summary']}")
    accelerator.wait_for_everyone()
    accelerator.end_training()
    return metrics


def held_out_metrics(policy, ema, rewards, prompts, cfg: Config, guidance: float, accelerator) -> dict[str, float]:
    """test/<reward> on held-out prompts: ODE samples with fixed seeds and the EMA weights; with task
    metadata also test/<reward>/task/<task> and test/<reward>/task_mean (the mean over tasks)."""
    return held_out_scores(policy, ema, rewards, prompts, cfg, guidance)[0]


def held_out_scores(policy, ema, rewards, prompts, cfg: Config,
                    guidance: float) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
    """:func:`held_out_metrics` and the per-image scores ``{key: [P * n]}`` (prompt-major) behind them."""
    n = cfg.log.eval_images_per_prompt
    with ema_weights(ema), eval_size(policy, cfg):
        images = render(policy, prompts, images_per_prompt=n, guidance=guidance, seed=cfg.seed + 3,
                        num_steps=cfg.log.eval_num_steps or cfg.sampling.num_steps)
    summary, scores = evaluate_rows(images, prompts, n, rewards, cfg.log.report_diversity)
    return {f"test/{k.removeprefix('eval/')}": v for k, v in summary.items()}, scores


def reward_metrics(rewards: dict[str, torch.Tensor], combined: torch.Tensor, main: list[str]) -> dict[str, float]:
    """reward/<name>_mean and _std for every (sub-)score, plus the combined reward and NaN counts."""
    out = {}
    for name, values in rewards.items():
        finite = values[torch.isfinite(values)]
        out[f"reward/{name}_mean"] = float(finite.mean()) if finite.numel() else math.nan
        out[f"reward/{name}_std"] = float(finite.std(unbiased=False)) if finite.numel() else math.nan
    finite = combined[torch.isfinite(combined)]
    out["reward/combined_mean"] = float(finite.mean()) if finite.numel() else math.nan
    out.update({k: float(v) for k, v in nan_summary({n: rewards[n] for n in main}).items()})
    return out
