"""The names a config gives to registries, checked against the registries themselves.

The config layer sits below the algorithms (it is plain data with range checks) and cannot see their registries,
so a policy loss, reward combiner or feature space that none of them holds is caught here, before anything loads:
first thing in ``start_run``, which every recipe (and so ``flowrl train``) begins with. The config lists its registry
names itself (``Config.registry_names``, a recipe's config adding its own: GRPO's policy loss and GARDO's features),
so this module reads no recipe's keys. The message is the config's own one-line form, naming the key.

The reward names are checked here too for one property: a group-wise reward (``scores_groups``, it ranks or compares
a group's images) is refused where the config scores parts of groups (``Config.scores_partial_groups``).
"""

from __future__ import annotations

from flowrl.algorithms.combine import COMBINERS
from flowrl.algorithms.gardo import FEATURE_SPACES
from flowrl.algorithms.losses import POLICY_LOSSES
from flowrl.algorithms.sdpo import PAIR_LOSSES
from flowrl.algorithms.tmpo import PATH_LOSSES
from flowrl.config import Config, check
from flowrl.features import FEATURE_NETWORKS
from flowrl.rewards_api import resolve_reward_class, scores_groups

# Config.registry_names() kind -> (the registries that hold its names, whether a dotted path 'package.module:Class' may
# stand in for a name). The registries themselves, not copies: a loss registered after import is a known name.
REGISTRIES = {"policy loss": ((POLICY_LOSSES, PATH_LOSSES, PAIR_LOSSES), False),  # per transition, TMPO's over
              # paths, SDPO's over pairs
              "reward combiner": ((COMBINERS,), False), "feature space": ((FEATURE_SPACES, FEATURE_NETWORKS), True)}


def check_names(cfg: Config) -> None:
    """One-line ConfigError naming the first config key whose registry name is unknown; the config says which of
    its keys are registry names (its recipe's own included). Then :func:`check_group_rewards` on the configured
    reward classes."""
    for key, (kind, name) in cfg.registry_names().items():
        registries, dotted = REGISTRIES[kind]
        known = sorted(key for registry in registries for key in registry)
        check(name in known or (dotted and ":" in name), key, f"unknown {kind} {name!r}; choose one of {known}"
              + (" or 'package.module:Class'" if dotted else ""))
    check_group_rewards(cfg)


def check_group_rewards(cfg: Config, rewards=None) -> None:
    """A group-wise reward scores each group whole, so a config that scores parts of groups (Pilot-Commit's pilot
    rows, SDPO's queried states) refuses it in one line naming the key. ``rewards``: the built rewards (an instance
    may declare ``scores_groups`` itself, as a remote judge can); else the configured names' classes, imported and
    not built, and only where the config scores parts of groups."""
    partial = cfg.scores_partial_groups()  # (key, why) or None
    if partial is None:
        return
    key, why = partial
    named = [(reward.name, reward) for reward in rewards] if rewards is not None else [
        (spec.name, resolve_reward_class(spec.name)) for spec in cfg.rewards]
    for name, reward in named:
        check(not scores_groups(reward), key, f"reward '{name}' scores each group whole (scores_groups), but {why}: "
              "use a pointwise reward, or change this key")
