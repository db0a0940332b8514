"""The registries the config names by a Literal (train.ratio_norm, nft.timestep_schedule) hold exactly its names.

The config sits below the algorithms and cannot read their registries, so each option lists its names twice: in
its Literal type and as the registry's keys. These tests keep the two from drifting apart."""

import typing

import pytest

from flowrl.algorithms.ratio_norm import RATIO_NORMS
from flowrl.algorithms.timesteps import TIMESTEP_SCHEDULES
from flowrl.config.nft import NFTSection
from flowrl.config.grpo import GRPOTrainConfig


def literal_names(section: type, field: str) -> set[str]:
    """The strings of the Literal in ``section.field``'s type (a union may add bool or None around it)."""
    hint = typing.get_type_hints(section)[field]
    literals = [arg for arg in (typing.get_args(hint) or (hint,)) if typing.get_origin(arg) is typing.Literal]
    assert len(literals) == 1, hint
    return set(typing.get_args(literals[0]))


@pytest.mark.parametrize("section, field, registry", [(GRPOTrainConfig, "ratio_norm", RATIO_NORMS),
                                                      (NFTSection, "timestep_schedule", TIMESTEP_SCHEDULES)])
def test_registry_keys_are_the_configs_names(section, field, registry):
    assert set(registry) == literal_names(section, field)
