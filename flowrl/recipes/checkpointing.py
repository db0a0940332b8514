"""A run's checkpoint: write one after an epoch, check that the one ``train.resume`` names fits this run, and
restore it into the live model, optimizer, EMA and extras. The files and their atomic writes are
:mod:`flowrl.training.checkpoint`'s; this module maps a :class:`~flowrl.recipes.run.Run` onto them."""

from __future__ import annotations

from pathlib import Path

from flowrl.config import Config, to_dict
from flowrl.models.full_weights import FULL_WEIGHT_NAME
from flowrl.recipes.run import Run


def check_resumable(cfg: Config, policy) -> None:
    """The checkpoint ``train.resume`` names holds exactly this run's adapter tensors (shapes from its file header,
    nothing loaded into torch), so another model's checkpoint is one line rather than an optimizer size mismatch."""
    from flowrl.core.safe_io import check_checkpoint_shapes
    from flowrl.training.checkpoint import resolve_checkpoint
    from flowrl.training.ema import peft_key

    check_checkpoint_shapes(resolve_checkpoint(cfg.run_dir, cfg.train.resume),
                            {peft_key(name): tuple(p.shape) for name, p in policy.named_trainable_parameters()},
                            trained=cfg.model.trainable)


def restore_checkpoint(cfg: Config, policy, optimizer, ema, *, rank: int, snapshots: dict | None = None) -> dict:
    """Load the checkpoint named by ``train.resume`` into the live objects; returns its trainer state."""
    from flowrl.models.lora_io import load_adapter_state
    from flowrl.core.sharded import like
    from flowrl.training.checkpoint import load_checkpoint
    from flowrl.training.ema import peft_key

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
