"""Tests for flowrl.config: YAML -> nested dataclasses, base inheritance, overrides, errors."""

from __future__ import annotations  # annotations are strings: exercises get_type_hints

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal, Optional

import pytest

from flowrl.config import ConfigError, check, from_dict, load_config, save_config, to_dict


@dataclass
class LoraCfg:
    rank: int = 8
    """LoRA rank"""
    alpha: float = 16.0
    """LoRA scaling numerator"""

    def validate(self) -> None:
        check(self.rank > 0, "rank", "must be positive")


@dataclass
class ModelCfg:
    name: Literal["sd3", "flux"] = "sd3"
    """which base model"""
    lora: LoraCfg = field(default_factory=LoraCfg)
    """adapter settings"""
    dtype: Optional[str] = None
    """override the weight dtype"""


@dataclass
class TrainCfg:
    lr: float = 3e-4
    """learning rate"""
    steps: int = 100
    """optimizer steps"""
    use_ema: bool = False
    """keep an EMA copy of the weights"""
    betas: tuple[float, ...] = (0.9, 0.999)
    """Adam betas"""
    milestones: list[int] = field(default_factory=list)
    """steps where lr decays"""
    grad_clip: float | None = 1.0
    """None disables clipping"""


@dataclass
class Cfg:
    run_name: str
    """required: no default"""
    model: ModelCfg = field(default_factory=ModelCfg)
    train: TrainCfg = field(default_factory=TrainCfg)
    reward_weights: dict[str, float] = field(default_factory=dict)
    """reward name -> weight"""
    extra: dict[str, Any] = field(default_factory=dict)
    """free-form, passed through"""
    seed: int = 0

    def validate(self) -> None:
        check(self.train.steps >= len(self.train.milestones), "train.milestones", "more milestones than steps")
        check(self.model.name != "flux" or self.model.lora.rank <= 64, "model.lora.rank", "flux needs rank <= 64")


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def config_error(fn, *args, **kwargs) -> str:
    with pytest.raises(ConfigError) as info:
        fn(*args, **kwargs)
    message = str(info.value)
    assert "\n" not in message and message
    return message


# ---------------------------------------------------------------- building


def test_nested_yaml_and_defaults(tmp_path):
    path = write(tmp_path / "a.yaml", """
run_name: demo
model:
  name: flux
  lora: {rank: 4}
train:
  lr: 1e-4            # PyYAML reads this as the string '1e-4'
  steps: 10
  betas: [0.5, 0.9]
  milestones: [2, 5]
reward_weights: {pickscore: 1, clip: 0.5}
extra: {anything: [1, {b: 2}]}
""")
    cfg = load_config(Cfg, path)
    assert cfg.model == ModelCfg(name="flux", lora=LoraCfg(rank=4, alpha=16.0))
    assert cfg.train.lr == 1e-4 and isinstance(cfg.train.lr, float)
    assert cfg.train.betas == (0.5, 0.9) and cfg.train.milestones == [2, 5]
    assert cfg.train.use_ema is False and cfg.train.grad_clip == 1.0  # defaults kept
    assert cfg.reward_weights == {"pickscore": 1.0, "clip": 0.5}
    assert isinstance(cfg.reward_weights["pickscore"], float)
    assert cfg.extra == {"anything": [1, {"b": 2}]}
    assert cfg.seed == 0


def test_from_dict_int_to_float_and_empty_file(tmp_path):
    cfg = from_dict(Cfg, {"run_name": "x", "train": {"lr": 1}})
    assert cfg.train.lr == 1.0 and isinstance(cfg.train.lr, float)
    with pytest.raises(ConfigError, match="missing required config key 'run_name'"):
        load_config(Cfg, write(tmp_path / "empty.yaml", ""))
    assert load_config(Cfg, write(tmp_path / "empty.yaml", ""), ["run_name=r"]).run_name == "r"


def test_base_inheritance_deep_merge_relative(tmp_path):
    write(tmp_path / "common" / "base.yaml", """
run_name: base
model: {name: sd3, lora: {rank: 16, alpha: 32}}
train: {lr: 0.001, milestones: [1, 2, 3]}
""")
    write(tmp_path / "exp" / "mid.yaml", "base: ../common/base.yaml\ntrain: {steps: 50}\n")
    child = write(tmp_path / "exp" / "child.yaml", "base: mid.yaml\nrun_name: child\nmodel: {lora: {rank: 2}}\n"
                  "train: {milestones: [7]}\n")
    cfg = load_config(Cfg, child)
    assert cfg.run_name == "child"
    assert cfg.model.lora == LoraCfg(rank=2, alpha=32.0)  # deep merge: alpha inherited
    assert cfg.train.lr == 0.001 and cfg.train.steps == 50
    assert cfg.train.milestones == [7]  # lists are replaced, not concatenated


def test_overrides(tmp_path):
    path = write(tmp_path / "a.yaml", "run_name: demo\ntrain: {lr: 0.1}\n")
    cfg = load_config(Cfg, path, [
        "train.lr=1e-4", "train.steps=7", "train.milestones=[1,2]", "train.use_ema=true",
        "train.grad_clip=null", "model.lora.alpha=2", "model.dtype=bf16", "run_name=2024",
        "train.betas=[0.1, 0.2]", "extra.note=hello",
    ])
    assert cfg.train.lr == 1e-4 and isinstance(cfg.train.lr, float)
    assert cfg.train.steps == 7 and cfg.train.milestones == [1, 2]
    assert cfg.train.use_ema is True and cfg.train.grad_clip is None
    assert cfg.model.lora.alpha == 2.0 and cfg.model.dtype == "bf16"
    assert cfg.run_name == "2024"  # a str field takes the override text as is
    assert cfg.train.betas == (0.1, 0.2) and cfg.extra == {"note": "hello"}
    assert load_config(Cfg, None, ["run_name=x", "seed=3"]) == Cfg(run_name="x", seed=3)


# ---------------------------------------------------------------- errors


def test_unknown_key_suggests(tmp_path):
    msg = config_error(load_config, Cfg, write(tmp_path / "a.yaml", "run_name: a\ntrain: {lrr: 1}\n"))
    assert "'train.lrr'" in msg and "did you mean 'train.lr'?" in msg
    msg = config_error(load_config, Cfg, None, ["run_name=a", "model.lora.rnak=3"])
    assert "'model.lora.rnak'" in msg and "did you mean 'model.lora.rank'?" in msg
    msg = config_error(from_dict, Cfg, {"run_name": "a", "zzzzzz": 1})
    assert "'zzzzzz'" in msg and "run_name" in msg  # no close match: lists the valid keys


@pytest.mark.parametrize("data, key, expected", [
    ({"train": {"lr": "abc"}}, "train.lr", "expected float, got str 'abc'"),
    ({"train": {"lr": True}}, "train.lr", "expected float"),
    ({"train": {"steps": 1.5}}, "train.steps", "expected int"),
    ({"train": {"use_ema": "yes please"}}, "train.use_ema", "expected bool"),
    ({"train": {"use_ema": 1}}, "train.use_ema", "expected bool"),
    ({"train": {"milestones": [1, "x"]}}, "train.milestones[1]", "expected int"),
    ({"train": {"milestones": 3}}, "train.milestones", "expected a list"),
    ({"reward_weights": {"clip": "high"}}, "reward_weights.clip", "expected float"),
    ({"model": 3}, "model", "expected a mapping for ModelCfg"),
    ({"model": {"name": "sdxl"}}, "model.name", "expected one of 'sd3', 'flux', got str 'sdxl'"),
    ({"run_name": 5}, "run_name", "expected str"),
])
def test_wrong_types_name_the_key(data, key, expected):
    msg = config_error(from_dict, Cfg, {"run_name": "r", **data})
    assert f"config key '{key}'" in msg and expected in msg


def test_missing_required_and_missing_file(tmp_path):
    msg = config_error(load_config, Cfg, None, ["seed=1"])
    assert "'run_name'" in msg and "run_name=" in msg
    msg = config_error(load_config, Cfg, tmp_path / "nope.yaml")
    assert msg.startswith("missing file:") and "nope.yaml" in msg
    child = write(tmp_path / "child.yaml", "base: gone.yaml\n")
    msg = config_error(load_config, Cfg, child)
    assert "missing file:" in msg and "gone.yaml" in msg and "child.yaml" in msg


def test_override_without_equals():
    msg = config_error(load_config, Cfg, None, ["run_name=a", "train.lr"])
    assert "'train.lr'" in msg and "key=value" in msg


def test_base_cycle(tmp_path):
    write(tmp_path / "a.yaml", "base: b.yaml\nrun_name: a\n")
    write(tmp_path / "b.yaml", "base: a.yaml\n")
    msg = config_error(load_config, Cfg, tmp_path / "a.yaml")
    assert "'base'" in msg and "cycle" in msg
    write(tmp_path / "self.yaml", "base: self.yaml\n")
    assert "cycle" in config_error(load_config, Cfg, tmp_path / "self.yaml")


def test_validate_failures_are_prefixed():
    msg = config_error(from_dict, Cfg, {"run_name": "a", "model": {"lora": {"rank": 0}}})
    assert msg == "config key 'model.lora.rank': must be positive"
    msg = config_error(from_dict, Cfg, {"run_name": "a", "train": {"steps": 1, "milestones": [1, 2]}})
    assert msg == "config key 'train.milestones': more milestones than steps"
    msg = config_error(load_config, Cfg, None, ["run_name=a", "model.name=flux", "model.lora.rank=128"])
    assert msg == "config key 'model.lora.rank': flux needs rank <= 64"


def test_invalid_yaml_is_one_line(tmp_path):
    msg = config_error(load_config, Cfg, write(tmp_path / "bad.yaml", "a: [1, 2\nb: 3\n"))
    assert "invalid YAML" in msg


# ---------------------------------------------------------------- saving


def test_save_load_round_trip(tmp_path):
    cfg = load_config(Cfg, None, [
        "run_name=rt", "model.name=flux", "model.dtype=bf16", "train.lr=1e-4", "train.betas=[0.5,0.6]",
        "train.milestones=[3]", "train.grad_clip=null", "reward_weights={a: 1.5}", "extra={k: [1, x]}",
    ])
    plain = to_dict(cfg)
    assert plain["train"]["betas"] == [0.5, 0.6]  # tuples -> lists for YAML
    out = tmp_path / "run" / "config.yaml"
    save_config(cfg, out)
    assert load_config(Cfg, out) == cfg
    assert [p.name for p in out.parent.iterdir()] == ["config.yaml"]  # no tmp file left behind
    save_config(Cfg(run_name="again"), out)  # overwrite in place
    assert load_config(Cfg, out) == Cfg(run_name="again")


# --- variants: a field that picks the subclass to build ----------------------------------------------------------

@dataclass
class KindCfg:
    variant_key: ClassVar[str] = "kind"
    variants: ClassVar[dict[str, type]] = {}

    kind: Literal["a", "b"] = "a"
    """which subclass"""
    steps: int = 1
    """shared by both"""


@dataclass
class ACfg(KindCfg):
    kind: Literal["a"] = "a"
    """always a"""
    clip: float = 0.1
    """a's own"""


@dataclass
class BCfg(KindCfg):
    kind: Literal["b"] = "b"
    """always b"""
    strength: float = 1.0
    """b's own"""


KindCfg.variants.update(a=ACfg, b=BCfg)


def test_variant_key_picks_the_subclass_and_another_variants_key_is_unknown_naming_both(tmp_path):
    assert from_dict(KindCfg, {}) == ACfg() and from_dict(KindCfg, {"kind": "b", "strength": 2}) == BCfg(strength=2.0)
    assert load_config(KindCfg, None, ["kind=b", "strength=3"]) == BCfg(strength=3.0)
    with pytest.raises(ConfigError, match=r"^unknown config key 'clip': a kind a option; kind b has no such key "
                                          r"\(set kind: a, or remove it\)$"):
        from_dict(KindCfg, {"kind": "b", "clip": 0.2})
    with pytest.raises(ConfigError, match=r"unknown config key 'clip' in override 'clip=1': a kind a option; kind b"):
        load_config(KindCfg, None, ["kind=b", "clip=1"])
    with pytest.raises(ConfigError, match=r"unknown config key 'strenght' \(did you mean 'strength'\?\)"):
        from_dict(KindCfg, {"kind": "b", "strenght": 2})  # a typo keeps its suggestion
    with pytest.raises(ConfigError, match=r"config key 'kind': expected one of 'a', 'b', got str 'c'"):
        from_dict(KindCfg, {"kind": "c"})
    with pytest.raises(ConfigError, match=r"config key 'kind': expected one of 'b', got str 'a'"):
        from_dict(BCfg, {"kind": "a"})  # a variant's own class builds that variant only
