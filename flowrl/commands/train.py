"""``flowrl train [CONFIG] [overrides]``: load the config, pick the recipe, run it."""

from __future__ import annotations

from pathlib import Path

def _grpo():
    from flowrl.recipes.grpo import train

    return train


def _nft():
    from flowrl.recipes.nft import train

    return train


# The config's ``recipe:`` names -> their ``train(cfg)``, imported when asked for (``flowrl --help`` and the other
# commands never load the training stack) by a plain import, so the import contract sees the link.
RECIPES = {"grpo": _grpo, "nft": _nft}


def recipe_train(name: str):
    """The ``train(cfg)`` function of recipe ``name``."""
    return RECIPES[name]()


def run_train(config_path: str | Path, overrides: list[str]) -> dict[str, float]:
    from flowrl.config import Config, load_config

    cfg = load_config(Config, config_path, overrides)
    check_resume(cfg)  # registry names and the run directory are checked first thing in start_run
    return recipe_train(cfg.recipe)(cfg)


def check_resume(cfg) -> None:
    """``train.resume`` names a complete, readable checkpoint of this run's model and LoRA; checked before the run
    (and its directory) starts, so a truncated file or another model's checkpoint is one line naming it rather than
    a SafetensorError or an optimizer size mismatch after the model has loaded."""
    if not cfg.train.resume:
        return
    from flowrl.config import to_dict
    from flowrl.core.safe_io import check_checkpoint, check_checkpoint_matches
    from flowrl.training.checkpoint import resolve_checkpoint

    path = resolve_checkpoint(cfg.run_dir, cfg.train.resume)
    check_checkpoint(path)
    check_checkpoint_matches(path, to_dict(cfg))
