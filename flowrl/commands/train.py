"""``flowrl train [CONFIG] [overrides]``: load the config, pick the recipe, run it."""

from __future__ import annotations

from pathlib import Path

RECIPES = {"grpo": "flowrl.recipes.grpo:train", "nft": "flowrl.recipes.nft:train"}


def recipe_train(name: str):
    """The ``train(cfg)`` function of recipe ``name`` (imported on demand)."""
    import importlib

    module_name, function_name = RECIPES[name].split(":")
    return getattr(importlib.import_module(module_name), function_name)


def run_train(config_path: str | Path, overrides: list[str]) -> dict[str, float]:
    from flowrl.config import Config, load_config

    cfg = load_config(Config, config_path, overrides)
    return recipe_train(cfg.recipe)(cfg)
