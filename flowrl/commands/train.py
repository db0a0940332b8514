"""``flowrl train [CONFIG] [overrides]``: load the config, pick the recipe, run it."""

from __future__ import annotations

from pathlib import Path

RECIPES = {"grpo": "flowrl.recipes.grpo:train"}


def run_train(config_path: str | Path, overrides: list[str]) -> dict[str, float]:
    import importlib

    from flowrl.config import Config, load_config

    cfg = load_config(Config, config_path, overrides)
    module_name, function_name = RECIPES[cfg.recipe].split(":")
    train = getattr(importlib.import_module(module_name), function_name)
    metrics = train(cfg)
    return metrics
