"""What a run is built from, read off the config: the policy with its LoRA, the prompt splits, the eval
grid's prompts and the accelerator (with its tracker); the rewards are built by
:func:`flowrl.rewards_api.build_rewards`, which ``flowrl eval`` uses too. ``start_run`` in
:func:`flowrl.recipes.start.start_run` calls these; scripts that need one piece (a policy to benchmark, the
prompt splits to fit a reward direction on) call them directly.
"""

from __future__ import annotations

import importlib.util
import os
import shutil

import torch
from accelerate import Accelerator

from flowrl.algorithms.combine import COMBINERS, marble_initial
from flowrl.config import Config, ConfigError, to_dict
from flowrl.data.prompts import PromptSet, load_prompts, train_test_split
from flowrl.models import policy_from_config
from flowrl.models.lora_io import load_lora_into
from flowrl.models.preference import attach_preference


def build_training_policy(cfg: Config, device):
    """The configured model with a fresh (seeded) or loaded LoRA, and ParetoSlider's preference embedding where
    ``model.preference`` asks for it (zero output, seeded); base weights frozen. With ``model.trainable=full`` the
    transformer's weights (those ``model.trainable_modules`` match) train instead, from the base with
    ``lora.init_from`` fused into it where one is given."""
    m = cfg.model
    policy = policy_from_config(m, device=device, seed=cfg.seed)
    if m.trainable == "full":
        if cfg.lora.init_from:  # continue from the adapter's model: its update fused into the base weights
            from flowrl.models.full_weights import merge_lora

            load_lora_into(policy, cfg.lora.init_from)
            merge_lora(policy)
        try:
            policy.train_full(m.trainable_modules)
        except ValueError as error:  # a pattern that matches no module
            raise ConfigError(f"config key 'model.trainable_modules': {str(error).partition(': ')[2]}",
                              key="model.trainable_modules") from None
    elif cfg.lora.init_from:
        load_lora_into(policy, cfg.lora.init_from)
    else:
        try:
            policy.add_lora(rank=cfg.lora.rank, alpha=cfg.lora.alpha, target_modules=cfg.lora.target_modules,
                            dropout=cfg.lora.dropout, init_seed=cfg.seed, experts=cfg.lora.experts)
        except ValueError as error:  # lora.experts naming an expert the family does not have
            if not str(error).startswith("lora.experts"):
                raise
            raise ConfigError(f"config key 'lora.experts': {str(error).partition(': ')[2]}",
                              key="lora.experts") from None
    if m.preference.rewards:
        attach_preference(policy, m.preference.rewards, hidden=m.preference.hidden, where=m.preference.where,
                          seed=cfg.seed, blocks=m.preference.blocks)
    if m.gradient_checkpointing:
        policy.transformer.enable_gradient_checkpointing()
    return policy


def check_memory_options(cfg: Config, accelerator: Accelerator) -> None:
    """``model.quantize`` and ``train.optimizer=adamw8bit`` under a launch they cannot run in are one line.

    FSDP2 and DeepSpeed shard or flatten every parameter of the transformer, frozen ones included, and torchao's
    quantised weights cannot be split (torchao 0.18's Int8Tensor implements no ``aten.split``: ``fully_shard``
    stops there, checked on 2 CPU processes), nor is its 8-bit optimizer state gathered for a checkpoint the way
    ``flowrl.core.sharded`` gathers AdamW's. A quantised base is the small-GPU setting: one process, or DDP, which
    leaves the quantised weights alone (:func:`flowrl.models.quantize.ignore_quantized_in_ddp`)."""
    sharded = accelerator.is_fsdp2 or _env_flag("ACCELERATE_USE_DEEPSPEED") or _env_flag("ACCELERATE_USE_FSDP")
    if not sharded:
        return
    launch = "DeepSpeed" if _env_flag("ACCELERATE_USE_DEEPSPEED") else "FSDP"
    if cfg.model.quantize != "none":
        raise ConfigError(f"config key 'model.quantize': a quantised base cannot be sharded by {launch} (its "
                          "quantised weights are not DTensors); launch with DDP (configs/accelerate/ddp_8gpu.yaml) "
                          "or one process, or set model.quantize=none", key="model.quantize")
    if cfg.train.optimizer == "adamw8bit":
        raise ConfigError(f"config key 'train.optimizer': adamw8bit's 8-bit state cannot be sharded by {launch}; "
                          "launch with DDP or one process, or use train.optimizer=adamw", key="train.optimizer")


def build_optimizer(cfg: Config, params: list[torch.nn.Parameter], device) -> torch.optim.Optimizer:
    """``train.optimizer`` over the LoRA parameters: torch's AdamW, or torchao's AdamW8bit (8-bit block-wise
    moments, a quarter of AdamW's state; the same update rule). torchao's step is a ``torch.compile``d function,
    so on the CPU it needs a C++ compiler; a machine without one (or without torchao) is one line here, before
    the run directory exists, not a traceback at the first step."""
    t = cfg.train
    kwargs = dict(lr=t.learning_rate, betas=tuple(t.adam_betas), eps=t.adam_eps, weight_decay=t.weight_decay)
    if t.optimizer == "adamw":
        return torch.optim.AdamW(params, **kwargs)
    if importlib.util.find_spec("torchao") is None:
        raise ConfigError("config key 'train.optimizer': adamw8bit is torchao's AdamW8bit, and torchao is not "
                          "installed: pip install 'flowrl[quant]' (or use train.optimizer=adamw)", key="train.optimizer")
    if torch.device(device).type == "cpu" and not any(map(shutil.which, (os.environ.get("CXX", "c++"), "g++",
                                                                          "clang++"))):
        raise ConfigError("config key 'train.optimizer': adamw8bit compiles its step with torch.compile, which on the "
                          "CPU needs a C++ compiler and this machine has none (install g++, or use "
                          "train.optimizer=adamw)", key="train.optimizer")
    from torchao.optim import AdamW8bit

    return AdamW8bit(params, **kwargs)


def load_prompt_splits(cfg: Config) -> tuple[PromptSet, PromptSet]:
    """(train prompts, held-out prompts): an explicit test file or a deterministic split."""
    prompts = load_prompts(cfg.data.prompts)
    key = cfg.data.balance_by
    missing = [i for i, m in enumerate(prompts.metadata) if key not in m] if key else []
    if missing:
        raise ValueError(f"data.balance_by: {len(missing)} prompts of {cfg.data.prompts} lack metadata key {key!r} "
                         f"(first: prompt {missing[0] + 1}, {prompts.prompts[missing[0]]!r})")
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


def make_accelerator(cfg: Config) -> Accelerator:
    """CPU runs stay float32; GPU runs autocast to the configured precision.

    Launched with an FSDP2 accelerate config on the CPU (``fsdp2_cpu_2proc.yaml``), the gloo processes
    shard the transformer too (:func:`_fsdp2_on_cpu`). A DeepSpeed launch without CUDA or without the
    deepspeed package is a one-line error here, before accelerate or anything else starts."""
    check_device_available(cfg.device)
    on_cpu = cfg.device == "cpu" or (cfg.device == "auto" and not torch.cuda.is_available())
    log_with = None if cfg.log.backend == "none" else cfg.log.backend
    if log_with and not importlib.util.find_spec(log_with):  # accelerate would only warn and log nothing
        raise ConfigError(f"config key 'log.backend': {log_with} is not installed: pip install 'flowrl[tracking]' "
                          "(or set log.backend=none; metrics.jsonl is written either way)", key="log.backend")
    deepspeed = check_deepspeed_launch(cfg, on_cpu)
    accelerator = Accelerator(cpu=on_cpu, mixed_precision=autocast_precision(cfg, on_cpu=on_cpu),
                              log_with=log_with, project_dir=cfg.run_dir, deepspeed_plugin=deepspeed)
    if on_cpu and _env_flag("ACCELERATE_USE_FSDP") and accelerator.num_processes > 1:
        _fsdp2_on_cpu(accelerator)
    return accelerator


def autocast_precision(cfg: Config, *, on_cpu: bool) -> str:
    """The accelerator's ``mixed_precision``: ``train.mixed_precision`` on GPU, where ``accelerator.prepare`` wraps
    the transformer's forward in that autocast (rollouts, training log-probs and the KL reference alike), and
    "no" on the CPU, where runs compute in the weights' own dtype (accelerate has no float16 autocast there)."""
    return "no" if on_cpu else cfg.train.mixed_precision


def check_device_available(device: str) -> None:
    """A ``device`` of cuda or cuda:N that this machine lacks is a one-line ConfigError, before anything starts.
    Here and not in config validation, which stays pure: a config is checked the same on any machine."""
    if not device.startswith("cuda"):
        return
    index, count = device.partition(":")[2], torch.cuda.device_count()
    if count <= int(index or 0):
        raise ConfigError(f"config key 'device': {device} is not available: this machine has {count} CUDA device(s); "
                          "use device=auto or cpu" + (f", or cuda:0..{count - 1}" if count else ""), key="device")


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "false").strip().lower() in ("1", "true", "yes")


def check_deepspeed_launch(cfg: Config, on_cpu: bool):
    """The DeepSpeed plugin of a DeepSpeed launch (``distributed_type: DEEPSPEED``, i.e.
    ``ACCELERATE_USE_DEEPSPEED=true``), None for any other launch; a launch that cannot run is a
    one-line ConfigError. accelerate would silently drop DeepSpeed on the CPU (its state ignores the
    flag with ``cpu=True``) and raise an ImportError with a traceback without the package.

    The plugin keeps DeepSpeed's ``gradient_accumulation_steps`` at 1 (the recipes mark the boundary
    themselves, :mod:`flowrl.training.accumulate`) and clips at ``train.max_grad_norm`` (DeepSpeed
    clips inside its step; flowrl's own clip has nothing left to do). Unsupported, each for a reason
    configs/accelerate/README.md spells out: ZeRO-3, ``train.combine=marble`` and ``train.resume``."""
    if not _env_flag("ACCELERATE_USE_DEEPSPEED"):
        return None
    if on_cpu or not torch.cuda.is_available():
        raise ConfigError("accelerate config: DeepSpeed (distributed_type: DEEPSPEED) needs CUDA GPUs and this run "
                          "is on the CPU; launch with configs/accelerate/fsdp2_cpu_2proc.yaml or multi_cpu_2proc.yaml "
                          "instead (or unset ACCELERATE_USE_DEEPSPEED)")
    if importlib.util.find_spec("deepspeed") is None:
        raise ConfigError("accelerate config: DeepSpeed (distributed_type: DEEPSPEED) is not installed: "
                          "pip install deepspeed, or launch with configs/accelerate/fsdp2_sd3.yaml / ddp_8gpu.yaml")
    from accelerate.utils import DeepSpeedPlugin

    stage = int(os.environ.get("ACCELERATE_DEEPSPEED_ZERO_STAGE", 2))
    if stage == 3:
        raise ConfigError("accelerate config: DeepSpeed ZeRO-3 is not supported by flowrl (its partitioned LoRA and "
                          "optimizer state cannot be checkpointed or exported yet); use "
                          "configs/accelerate/fsdp2_sd3.yaml or fsdp2_flux.yaml, which shard the same weights, "
                          "or deepspeed_zero2.yaml")
    if COMBINERS[cfg.train.combine] is marble_initial:
        raise ConfigError("config key 'train.combine': marble reads per-reward gradients off the parameters, which "
                          "DeepSpeed keeps in its own buffers; use DDP or FSDP2 launches for it", key="train.combine")
    if cfg.train.resume:
        raise ConfigError("config key 'train.resume': resuming under DeepSpeed is not supported (its optimizer state "
                          "is partitioned inside the engine); resume under DDP or FSDP2", key="train.resume")
    gas = os.environ.get("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", "1")
    if gas not in ("1", "auto"):
        raise ConfigError(f"accelerate config: deepspeed_config.gradient_accumulation_steps is {gas}; set it to 1 "
                          "(flowrl accumulates over train.micro_batch_size itself and marks each step's boundary)")
    return DeepSpeedPlugin(zero_stage=stage, gradient_accumulation_steps=1,  # 0: DeepSpeed does not clip
                           gradient_clipping=float(cfg.train.max_grad_norm))


def _fsdp2_on_cpu(accelerator: Accelerator) -> None:
    """Turn accelerate's gloo CPU group into an FSDP2 one, so CPU processes shard as GPUs do.

    accelerate refuses FSDP on the CPU: with ``cpu=True`` its state is ``MULTI_CPU`` and the FSDP plugin
    is only attached for ``MULTI_GPU``-like types (``AcceleratorState.__init__``, accelerate/state.py,
    ``elif self.distributed_type in [DistributedType.MULTI_GPU, ...]: ... self.distributed_type =
    DistributedType.FSDP``). torch's ``fully_shard`` and DTensor do run on CPU tensors over gloo, so
    flowrl sets the type and the plugin (read from the launcher's ``FSDP_*`` variables) itself; from
    then on ``accelerator.prepare`` takes accelerate's own FSDP2 path (``_prepare_fsdp2``), the one a
    GPU launch takes. Only FSDP version 2 is supported this way."""
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    plugin = FullyShardedDataParallelPlugin()
    if plugin.fsdp_version != 2:
        raise ConfigError("accelerate config: FSDP on the CPU needs fsdp_config.fsdp_version: 2 "
                          "(see configs/accelerate/fsdp2_cpu_2proc.yaml)")
    accelerator.state.fsdp_plugin = plugin
    accelerator.state.distributed_type = DistributedType.FSDP
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP
