"""The names a config gives to registries, checked against the registries themselves.

The config layer sits below the algorithms (it is plain data with range checks) and cannot see their registries,
so a policy loss, reward combiner or feature space that none of them holds is caught here, before anything loads:
first thing in ``start_run``, which every recipe (and so ``flowrl train``) begins with. The message is the
config's own one-line form, naming the key.
"""

from __future__ import annotations

from flowrl.algorithms.combine import COMBINERS
from flowrl.algorithms.gardo import FEATURES
from flowrl.algorithms.losses import POLICY_LOSSES
from flowrl.algorithms.tmpo import PATH_LOSSES
from flowrl.config import Config, check


def check_names(cfg: Config) -> None:
    """One-line ConfigError naming the first config key whose registry name is unknown."""
    t = cfg.train
    losses = {**POLICY_LOSSES, **PATH_LOSSES}  # per-transition losses, and TMPO's over whole paths
    check(t.loss in losses, "train.loss", f"unknown policy loss {t.loss!r}; choose one of {sorted(losses)}")
    check(t.combine in COMBINERS, "train.combine",
          f"unknown reward combiner {t.combine!r}; choose one of {sorted(COMBINERS)}")
    for key, features in (("gardo.features", cfg.gardo.features), ("guard.features", cfg.guard.features)):
        check(features in FEATURES or ":" in features, key,
              f"unknown feature space {features!r}; choose one of {sorted(FEATURES)} or 'package.module:Class'")
