"""Typed YAML configuration: YAML files + ``a.b=value`` overrides -> nested dataclasses.

``load_config(Config, ...)`` builds the config class of the recipe that ``recipe:`` names: :class:`GRPOConfig`
(the default) or :class:`NFTConfig`, each the shared sections of :class:`Config` plus the recipe's own.
"""

from flowrl.config.loader import ConfigError, check, from_dict, load_config, save_config, to_dict

__all__ = ["ConfigError", "check", "from_dict", "load_config", "save_config", "to_dict"]
from flowrl.config.schema import (  # noqa: E402
    Config, DataConfig, LogConfig, LoraConfig, ModelConfig, RewardSpec, SamplingConfig, TrainConfig, TreeConfig, WindowConfig,
)
from flowrl.config.grpo import GardoConfig, GRPOConfig, GRPOTrainConfig  # noqa: E402  (registers recipe grpo)
from flowrl.config.nft import NFTConfig, NFTSection  # noqa: E402  (registers recipe nft)

__all__ += ["Config", "DataConfig", "LogConfig", "TrainConfig", "LoraConfig", "ModelConfig", "RewardSpec", "SamplingConfig", "TreeConfig",
            "WindowConfig"]
__all__ += ["GardoConfig", "GRPOConfig", "GRPOTrainConfig", "NFTConfig", "NFTSection"]
