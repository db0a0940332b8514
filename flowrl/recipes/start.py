"""Starting a run: the checks that come before anything is written, the processes, the run directory and its
saved config, model + LoRA, optimizer, EMA, rewards, prompt splits, the logger, the run's extras and the
state of ``train.resume``; every recipe begins with :func:`start_run`."""

from __future__ import annotations

import warnings
from pathlib import Path

from accelerate import Accelerator
from tqdm.auto import tqdm

from flowrl.config import Config, ConfigError, check, save_config
from flowrl.core.context_parallel import (
    ContextLayout,
    build_mesh,
    check_context_plan,
    check_heads,
    device_refusal,
    enable_context_parallel,
    latent_tokens,
)
from flowrl.data.prompts import prompts_per_batch
from flowrl.data.tasks import stratified_prefix
from flowrl.models.quantize import ignore_quantized_in_ddp
from flowrl.models.text_cache import attach_configured_cache
from flowrl.recipes.build import (
    build_optimizer,
    build_training_policy,
    check_memory_options,
    eval_prompt_set,
    flat_config,
    load_prompt_splits,
    make_accelerator,
)
from flowrl.recipes.checkpointing import check_resumable, restore_checkpoint
from flowrl.recipes.epoch_end import check_eval_size
from flowrl.recipes.extras import COMMON_EXTRAS, LAST_EXTRAS, ExtraBuilder
from flowrl.recipes.names import check_group_rewards, check_names
from flowrl.recipes.run import Run
from flowrl.rewards_api import build_rewards
from flowrl.training.ema import LoraEMA
from flowrl.training.metrics import MetricsLogger
from flowrl.training.row_shards import RowShards
from flowrl.training.run_dir import check_run_dir, claim_run_dir


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
    layout = context_layout(cfg, accelerator.num_processes)  # before the model loads: the degrees fit the launch
    run_dir = Path(cfg.run_dir)
    check_run_dir(run_dir, resume=bool(cfg.train.resume), overwrite=cfg.train.overwrite)
    accelerator.wait_for_everyone()  # every process has looked before the main one claims the directory
    sampling = cfg.sampling
    if sampling.groups_per_epoch is not None:  # a global epoch: this process's share, read by every step below
        try:
            world, batches = layout.data_world, cfg.train.batches_per_epoch  # a context group samples one share
            sampling.prompts_per_batch = prompts_per_batch(sampling.groups_per_epoch, world_size=world,
                                                           batches_per_epoch=batches)
        except ValueError as error:
            raise ConfigError(str(error), key="sampling.groups_per_epoch") from None
        candidates = sampling.pilot.candidates
        check(not candidates or candidates >= sampling.prompts_per_batch, "sampling.pilot.candidates",
              f"must be >= the {sampling.prompts_per_batch} prompts per batch that sampling.groups_per_epoch gives")
    t = cfg.train
    policy = build_training_policy(cfg, accelerator.device)
    check_context_parallel(cfg, layout, policy, device_type=accelerator.device.type)
    if layout.enabled:  # after the LoRA is attached, before DDP / FSDP2 wrap the transformer
        enable_context_parallel(policy.transformer, layout, build_mesh(layout, accelerator.device.type))
    check_eval_size(policy, cfg)
    params = policy.trainable_parameters()
    optimizer = build_optimizer(cfg, params, accelerator.device)
    ignore_quantized_in_ddp(policy.transformer)  # model.quantize: frozen, identical on every rank, never broadcast
    policy.forward_module, optimizer = accelerator.prepare(policy.transformer, optimizer)
    params = policy.trainable_parameters()  # FSDP2 shards in place: the parameters are new (DTensor) objects
    if policy.full_weights is not None:  # the reference: the base's trained tensors, laid out (sharded) as they are
        policy.full_weights.take_base()
    if accelerator.is_fsdp2 and accelerator.is_main_process:
        from flowrl.core.sharded import is_sharded

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
        moved = claim_run_dir(run_dir, overwrite=t.overwrite, resume=bool(t.resume))
        save_config(cfg, run_dir / "config.yaml")
        before = "an attempt that stopped before its first checkpoint; its log" if moved and not t.overwrite else \
            "the run that was there"
        tqdm.write(f"flowrl train: {'resuming the run in' if t.resume else 'this run goes to'} {run_dir}"
                   + (f" ({before} is now {moved})" if moved else ""))
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
        exported_ema=eval_ema, shards=RowShards(accelerator, layout),
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


def context_layout(cfg: Config, world: int) -> ContextLayout:
    """The launch's processes as data x ``parallel.context`` (ulysses x ring); one line where the degrees do not
    divide the process count."""
    context = cfg.parallel.context
    layout = ContextLayout(world=world, ulysses=context.ulysses, ring=context.ring)
    try:
        layout.check_world()
    except ValueError as error:
        raise ConfigError(str(error), key="parallel.context") from None
    return layout


def check_context_parallel(cfg: Config, layout: ContextLayout, policy, *, device_type: str) -> None:
    """With ``parallel.context`` on, the checks that need the built model, each one line: diffusers has a
    context-parallel plan for the family's transformer, the Ulysses degree divides its attention heads, a row's
    latent tokens split evenly over a context group, and the processes' device runs the attention kind (ring needs
    a GPU; Ulysses also runs on CPU processes over gloo)."""
    if not layout.enabled:
        return
    transformer = policy.transformer
    try:
        check_context_plan(transformer, cfg.model.family)
        check_heads(transformer, layout)
        patch = getattr(getattr(transformer, "config", None), "patch_size", None)
        layout.check_sequence(latent_tokens(policy.latent_shape(1), patch))
    except ValueError as error:
        raise ConfigError(str(error), key="parallel.context") from None
    refusal = device_refusal(layout, device_type, next(transformer.parameters()).dtype)
    if refusal:
        raise ConfigError(refusal, key="parallel.context")
