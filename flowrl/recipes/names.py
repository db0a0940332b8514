"""The names a config gives to registries, checked against the registries themselves.

The config layer sits below the algorithms (it is plain data with range checks) and cannot see their registries,
so a policy loss, reward combiner or feature space that none of them holds is caught here, before anything loads:
first thing in ``start_run``, which every recipe (and so ``flowrl train``) begins with. The config lists its registry
names itself (``Config.registry_names``, a recipe's config adding its own: GRPO's policy loss and GARDO's features),
so this module reads no recipe's keys. The message is the config's own one-line form, naming the key.
"""

from __future__ import annotations

from flowrl.algorithms.combine import COMBINERS
from flowrl.algorithms.gardo import FEATURES
from flowrl.algorithms.losses import POLICY_LOSSES
from flowrl.algorithms.sdpo import PAIR_LOSSES
from flowrl.algorithms.tmpo import PATH_LOSSES
from flowrl.config import Config, check

# Config.registry_names() kind -> (the registry, whether a dotted path 'package.module:Class' may stand in for a name)
REGISTRIES = {"policy loss": ({**POLICY_LOSSES, **PATH_LOSSES, **PAIR_LOSSES}, False),  # per transition, TMPO's
              # over paths, SDPO's over pairs
              "reward combiner": (COMBINERS, False), "feature space": (FEATURES, True)}


def check_names(cfg: Config) -> None:
    """One-line ConfigError naming the first config key whose registry name is unknown; the config says which of
    its keys are registry names (its recipe's own included)."""
    for key, (kind, name) in cfg.registry_names().items():
        registry, dotted = REGISTRIES[kind]
        check(name in registry or (dotted and ":" in name), key, f"unknown {kind} {name!r}; choose one of "
              f"{sorted(registry)}" + (" or 'package.module:Class'" if dotted else ""))
