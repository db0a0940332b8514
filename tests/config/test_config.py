"""Every shipped YAML loads into the typed config; each bad config gets a one-line error naming its key."""

import copy

import pytest

from flowrl.config import Config, ConfigError, GRPOConfig, NFTConfig, load_config
from tests import REPO

# training configs: not the accelerate launchers, provenance tables or reward service configs
CONFIGS = sorted(p for p in (REPO / "configs").rglob("*.yaml")
                 if not {"accelerate", "provenance", "serve"} & set(p.relative_to(REPO / "configs").parts))


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


# --- recipes own their config ------------------------------------------------------------------------------

SMOKE = REPO / "configs/smoke/sd3_tiny.yaml"


@pytest.mark.parametrize("path, recipe", [(REPO / "configs/toy/grpo.yaml", GRPOConfig), (SMOKE, GRPOConfig),
                                          (REPO / "configs/toy/nft.yaml", NFTConfig)])
def test_recipe_key_picks_the_config_class(path, recipe):
    assert type(load_config(Config, path)) is recipe
    assert type(load_config(Config, SMOKE, ["recipe=nft"])) is NFTConfig


@pytest.mark.parametrize("key", ["train.clip_range=1e-3", "train.loss=tmpo", "train.credit=dense_ode",
                                 "train.ratio_norm=true", "train.ema_every=8", "train.skip_last_step=false",
                                 "gardo.kl_fraction=0.1", "gardo.diversity=true"])
def test_a_grpo_key_in_an_nft_config_is_unknown_naming_the_recipe(tmp_path, key):
    name = key.partition("=")[0]
    expected = f"unknown config key '{'gardo' if name.startswith('gardo') else name}'"  # gardo: the whole section
    with pytest.raises(ConfigError) as error:  # as an override
        load_config(Config, SMOKE, ["recipe=nft", key])
    message = str(error.value)
    assert "\n" not in message and expected in message
    assert "a recipe grpo option; recipe nft has no such key" in message
    section, _, rest = name.partition(".")
    field, value = rest, key.partition("=")[2]
    path = tmp_path / "nft.yaml"  # and in the file itself, or set before recipe=nft
    path.write_text(f"base: {SMOKE}\nrecipe: nft\n{section}:\n  {field}: {value}\n")
    for args in ((path, []), (SMOKE, [key, "recipe=nft"])):
        with pytest.raises(ConfigError) as error:
            load_config(Config, *args)
        message = str(error.value)
        assert "\n" not in message and expected in message
        assert "a recipe grpo option; recipe nft has no such key (set recipe: grpo, or remove it)" in message


def test_an_nft_key_in_a_grpo_config_names_recipe_nft_and_typos_still_get_a_suggestion():
    with pytest.raises(ConfigError, match=r"unknown config key 'nft' in override 'nft.loss=awm': a recipe nft option; "
                                          r"recipe grpo has no such key"):
        load_config(Config, SMOKE, ["nft.loss=awm"])
    with pytest.raises(ConfigError, match=r"did you mean 'nft.strength'\?"):
        load_config(Config, SMOKE, ["recipe=nft", "nft.strenght=0.5"])
    with pytest.raises(ConfigError, match=r"did you mean 'train.clip_range'\?"):
        load_config(Config, SMOKE, ["train.clip_rang=1e-3"])
    with pytest.raises(ConfigError, match=r"config key 'recipe': expected one of 'nft', got str 'grpo'"):
        load_config(NFTConfig, SMOKE, ["recipe=grpo"])  # a recipe's own class loads that recipe only


def test_validation_changes_nothing_and_probes_no_device(monkeypatch):
    """validate() only reads: MARBLE with one trained reward stays marble (the run falls back when it starts), a
    CUDA device this machine lacks is not looked up (the run checks it when it starts)."""
    import torch

    def probe(*args):
        raise AssertionError("config validation probed the device")

    monkeypatch.setattr(torch.cuda, "is_available", probe)
    monkeypatch.setattr(torch.cuda, "device_count", probe)
    cfg = load_config(Config, SMOKE, ["train.combine=marble", "device=cuda:7",
                                      "rewards=[{name: brightness}, {name: saturation, weight: 0}]"])
    before = copy.deepcopy(cfg)
    for section in (cfg, cfg.train, cfg.sampling, cfg.gardo):
        section.validate()
    assert cfg == before and cfg.train.combine == "marble"
