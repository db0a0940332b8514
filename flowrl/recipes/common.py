"""Set-up and bookkeeping that every recipe shares: building the policy, rewards and prompt splits,
the per-epoch step plan, checkpoint save/restore, eval grids and the final LoRA export.

Recipes stay leaf code that reads top to bottom; what lives here is what would otherwise be
copied verbatim into every loop.
"""

from __future__ import annotations

from pathlib import Path

import torch

from flowrl.config import Config, SamplingConfig, to_dict
from flowrl.config.schema import RewardSpec
from flowrl.data import PromptSet, load_prompts, train_test_split
from flowrl.models import build_policy
from flowrl.models.lora_io import load_lora_into, lora_config_dict, lora_state_dict, save_diffusers_lora
from flowrl.rewards_api import build_reward
from flowrl.sampling import StepPlan, window_start
from flowrl.training.ema import ema_weights


def build_training_policy(cfg: Config, device):
    """The configured model with a fresh (seeded) or loaded LoRA; base weights frozen."""
    m = cfg.model
    policy = build_policy(m.family, m.path, dtype=m.dtype, device=device, height=m.height, width=m.width,
                          max_sequence_length=m.max_sequence_length, seed=cfg.seed)
    if cfg.lora.init_from:
        load_lora_into(policy, cfg.lora.init_from)
    else:
        policy.add_lora(rank=cfg.lora.rank, alpha=cfg.lora.alpha, target_modules=cfg.lora.target_modules,
                        dropout=cfg.lora.dropout, init_seed=cfg.seed)
    if m.gradient_checkpointing:
        policy.transformer.enable_gradient_checkpointing()
    return policy


def build_rewards(specs: list[RewardSpec], device) -> tuple[list, dict[str, float]]:
    """Instantiate the configured rewards -> (rewards, {training signal key: weight}).

    The signal key is the reward's main score unless the spec names one of its sub-scores (a dense
    partial score trains better than a sparse strict one when the base model rarely succeeds)."""
    rewards, weights = [], {}
    for spec in specs:
        kwargs = dict(spec.kwargs)
        if device is not None and accepts_keyword(spec.name, "device"):
            kwargs.setdefault("device", str(device))  # each process scores on its own accelerator
        reward = build_reward(spec.name, **kwargs)
        key = spec.key or reward.name
        if key != reward.name and not key.startswith(f"{reward.name}/"):
            raise ValueError(f"reward '{spec.name}': key {key!r} is not one of its outputs "
                             f"(use '{reward.name}' or '{reward.name}/<sub-score>')")
        rewards.append(reward)
        weights[key] = spec.weight
    return rewards, weights


def accepts_keyword(reward_name: str, keyword: str) -> bool:
    """Whether the reward class behind ``reward_name`` takes ``keyword`` (imports it, builds nothing)."""
    import inspect

    from flowrl.rewards_api import resolve_reward_class

    try:
        return keyword in inspect.signature(resolve_reward_class(reward_name)).parameters
    except (TypeError, ValueError):
        return False


def load_prompt_splits(cfg: Config) -> tuple[PromptSet, PromptSet]:
    """(train prompts, held-out prompts): an explicit test file or a deterministic split."""
    prompts = load_prompts(cfg.data.prompts)
    if cfg.data.test_prompts:
        return prompts, load_prompts(cfg.data.test_prompts)
    if cfg.data.test_fraction > 0 and len(prompts) >= 2:
        return train_test_split(prompts, cfg.data.test_fraction, cfg.seed)
    return prompts, prompts


def eval_prompt_set(cfg: Config, test: PromptSet) -> PromptSet:
    """The fixed prompts of the eval grids: configured ones, else the first four held-out prompts."""
    if cfg.data.eval_prompts:
        return PromptSet(list(cfg.data.eval_prompts))
    return test.subset(range(min(4, len(test))))


def step_plan(s: SamplingConfig, epoch: int, seed: int) -> StepPlan:
    """This epoch's plan: full SDE, a (random / sliding / fixed) window, and tree branch points."""
    branch = dict(branch_steps=tuple(s.tree.branch_steps), branch_factor=s.tree.branch_factor if s.tree.branch_steps else 1)
    if s.window.size is None:
        return StepPlan(s.num_steps, **branch)
    start_range = tuple(s.window.start_range) if s.window.start_range else None
    start = window_start(epoch, num_steps=s.num_steps, size=s.window.size, mode=s.window.mode,
                         start_range=start_range, shift_every=s.window.shift_every, seed=seed)
    return StepPlan(s.num_steps, sde_start=start, sde_size=s.window.size, **branch)


def restore_checkpoint(cfg: Config, policy, optimizer, ema, *, rank: int) -> dict:
    """Load the checkpoint named by ``train.resume`` into the live objects; returns its trainer state."""
    from peft.utils import set_peft_model_state_dict

    from flowrl.training.checkpoint import load_checkpoint

    lora_state, trainer_state = load_checkpoint(cfg.run_dir, resume=cfg.train.resume, optimizer=optimizer, ema=ema,
                                                rank=rank)
    set_peft_model_state_dict(policy.transformer, lora_state)
    return trainer_state


def save_run_checkpoint(cfg: Config, policy, optimizer, ema, accelerator, *, epoch: int,
                        counters: dict | None = None) -> Path:
    from flowrl.training.checkpoint import save_checkpoint

    return save_checkpoint(
        cfg.run_dir, epoch, lora_state=lora_state_dict(policy.transformer), lora_config=lora_config_dict(policy.transformer),
        optimizer=optimizer, ema=ema, trainer_state={"epoch": epoch, **(counters or {})}, config=to_dict(cfg),
        rank=accelerator.process_index, world_size=accelerator.num_processes, barrier=accelerator.wait_for_everyone,
        keep_last=cfg.train.keep_checkpoints,
    )


@torch.no_grad()
def eval_grid(policy, ema, prompts: PromptSet, cfg: Config, guidance: float, out: Path, *, save: bool = True) -> Path:
    """ODE samples of the fixed eval prompts (EMA weights when kept), one grid row per prompt.

    Every process calls this (a sharded model needs all ranks for a forward); only ``save`` writes."""
    from torchvision.utils import save_image

    from flowrl.report import render

    n = cfg.log.eval_images_per_prompt
    with ema_weights(ema):
        images = render(policy, prompts, images_per_prompt=n, num_steps=cfg.sampling.num_steps, guidance=guidance,
                        seed=cfg.seed + 1)
    if save:
        out.parent.mkdir(parents=True, exist_ok=True)
        save_image(images, out, nrow=n, padding=2)
    return out


def export_final_lora(policy, ema, out_dir: Path) -> Path:
    """Write the adapter (EMA weights when kept) as a diffusers LoRA that plain diffusers loads."""
    import diffusers

    with ema_weights(ema):
        state = lora_state_dict(policy.transformer)
    pipeline_class = getattr(diffusers, policy.pipeline_class_name)
    return save_diffusers_lora(pipeline_class, out_dir, state, lora_config_dict(policy.transformer))


def flat_config(cfg: Config) -> dict[str, int | float | str | bool]:
    """``{"train.lr": 3e-4, ...}`` with scalar values only, as tracker hyper-parameter tables need."""
    flat: dict[str, int | float | str | bool] = {}

    def walk(prefix: str, value) -> None:
        if isinstance(value, dict):
            for key, inner in value.items():
                walk(f"{prefix}.{key}" if prefix else str(key), inner)
        elif isinstance(value, (bool, int, float, str)):
            flat[prefix] = value
        else:  # lists, None
            flat[prefix] = str(value)

    walk("", to_dict(cfg))
    return flat
