"""Typed YAML configuration: YAML files + ``a.b=value`` overrides -> nested dataclasses."""

from flowrl.config.loader import ConfigError, check, from_dict, load_config, save_config, to_dict

__all__ = ["ConfigError", "check", "from_dict", "load_config", "save_config", "to_dict"]
from flowrl.config.schema import (  # noqa: E402
    Config, DataConfig, LogConfig, LoraConfig, ModelConfig, RewardSpec, SamplingConfig, TrainConfig, TreeConfig, WindowConfig,
)

__all__ += ["Config", "DataConfig", "LogConfig", "TrainConfig", "LoraConfig", "ModelConfig", "RewardSpec", "SamplingConfig", "TreeConfig",
            "WindowConfig"]
