"""Property tests of the config loader: any override either loads a valid Config or raises ConfigError (never
another exception), and a loaded config saved and loaded back is the same config."""

import dataclasses
from typing import get_type_hints

from hypothesis import HealthCheck, given, settings, strategies as st

from flowrl.config import Config, ConfigError, load_config, save_config, to_dict


def _keys(cls, prefix=""):
    out = []
    for f in dataclasses.fields(cls):
        tp = get_type_hints(cls)[f.name]
        out.append(prefix + f.name)
        if dataclasses.is_dataclass(tp):
            out += _keys(tp, f"{prefix}{f.name}.")
    return out


KEYS = sorted({key for recipe in Config.variants.values() for key in _keys(recipe)})  # every recipe's
VALUES = st.one_of(
    st.integers(-10**6, 10**6).map(str), st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.sampled_from(["", "null", "true", "false", "[]", "{}", "[1, 2]", "{a: 1}", ".inf", "-.inf", ".nan", "1e400",
                     "cuda", "cuda:7", "cpu", "grpo", "nft", "[{name: brightness}]", "'unclosed", "~", "0", "-1"]),
    st.text(max_size=12),
)
KEY = st.one_of(st.sampled_from(KEYS), st.text(max_size=15))
SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(st.lists(st.tuples(KEY, VALUES), max_size=3), st.sampled_from([None, "configs/smoke/sd3_tiny.yaml"]))
def test_any_override_loads_or_is_a_config_error(pairs, path):
    overrides = [f"{k}={v}" for k, v in pairs]
    try:
        cfg = load_config(Config, path, overrides)
    except ConfigError as error:
        assert "\n" not in str(error) and str(error)
        return
    assert isinstance(cfg, Config)


@SETTINGS
@given(st.lists(st.tuples(st.sampled_from(KEYS), VALUES), max_size=3))
def test_save_then_load_is_identity(tmp_path_factory, pairs):
    try:
        cfg = load_config(Config, "configs/smoke/sd3_tiny.yaml", [f"{k}={v}" for k, v in pairs])
    except ConfigError:
        return
    path = tmp_path_factory.mktemp("roundtrip") / "config.yaml"
    save_config(cfg, path)
    again = load_config(Config, path)
    assert to_dict(again) == to_dict(cfg) and again == cfg
