"""Every shipped YAML loads into the typed config; each bad config gets a one-line error naming its key."""

import pytest

from flowrl.config import Config, ConfigError, load_config
from tests import REPO

CONFIGS = sorted(p for p in (REPO / "configs").rglob("*.yaml") if "accelerate" not in p.parts)


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: str(p.relative_to(REPO)))
def test_every_shipped_config_loads(path):
    cfg = load_config(Config, path)
    assert cfg.sampling.num_steps >= 1 and cfg.rewards


def test_smoke_flux_inherits_from_sd3():
    cfg = load_config(Config, REPO / "configs/smoke/flux_tiny.yaml")
    assert cfg.model.family == "flux" and cfg.sampling.num_steps == 4 and cfg.sampling.noise_level == 0.9


@pytest.mark.parametrize(
    "overrides, key",
    [
        (["sampling.num_stepz=4"], "sampling.num_stepz"),
        (["sampling.num_steps=four"], "sampling.num_steps"),
        (["sampling.kind=euler"], "sampling.kind"),
        (["sampling.window.size=20"], "sampling.window.size"),
        (["sampling.window.size=4", "sampling.window.start_range=[0,9]"], "sampling.window.start_range"),
        (["sampling.tree.branch_steps=[1,2]", "sampling.group_size=6"], "sampling.group_size"),
        (["sampling.tree.branch_steps=[12]"], "sampling.tree.branch_steps"),
        (["model.dtype=float8"], "model.dtype"),
        (["lora.rank=0"], "lora.rank"),
        (["device=tpu"], "device"),
        (["sampling.group_size"], "sampling.group_size"),
    ],
)
def test_bad_configs_name_the_key_in_one_line(overrides, key):
    with pytest.raises(ConfigError) as error:
        load_config(Config, REPO / "configs/smoke/sd3_tiny.yaml", overrides)
    message = str(error.value)
    assert "\n" not in message and key in message


def test_missing_config_file():
    with pytest.raises(ConfigError, match="missing file"):
        load_config(Config, REPO / "configs/does_not_exist.yaml")
