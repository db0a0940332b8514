"""Typed YAML configs mapped onto any tree of nested dataclasses.

Why not plain dicts: a typo'd key or a string where a float belongs should fail at start-up with
a one-line message naming the dotted key, not hours into a GPU run. The dataclass annotations
are the single source of truth for the schema.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import re
import types
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar, Union, get_args, get_origin, get_type_hints

import yaml

T = TypeVar("T")

class ConfigError(ValueError):
    """A user-fixable config mistake. The message is always one line so it reads well in logs."""

    def __init__(self, message: str, *, key: str | None = None, detail: str | None = None):
        super().__init__(re.sub(r"\s*\n\s*", " ", str(message)).strip())
        self.key, self.detail = key, detail  # set only by check(): key relative to the validating class


def check(condition: bool, key: str, message: str) -> None:
    """One-liner for ``validate()`` methods. ``key`` is relative to the dataclass whose
    ``validate()`` calls it; the loader prefixes it with that dataclass's dotted path."""
    if not condition:
        raise ConfigError(f"config key '{key}': {message}", key=key, detail=message)


@dataclass(frozen=True)
class Requires:
    """A compatibility rule, declared beside the option it belongs to: where the dotted key ``option`` holds one of
    ``values``, ``holds(cfg)`` must be true, else a one-line error on ``key``: ``message``, formatted with the
    config as ``cfg`` (``{cfg.train.credit}``). :func:`check_requirements` checks a table of them in order."""

    option: str
    values: tuple[Any, ...]
    key: str
    holds: Callable[[Any], bool]
    message: str


def dotted(cfg: Any, key: str) -> Any:
    """The value of dotted ``key`` (``train.loss``) in a config."""
    for part in key.split("."):
        cfg = getattr(cfg, part)
    return cfg


def check_requirements(cfg: Any, rules: Sequence[Requires]) -> None:
    """Every rule of ``rules`` whose option holds one of its values must hold (:class:`Requires`)."""
    for rule in rules:
        if dotted(cfg, rule.option) in rule.values:
            check(rule.holds(cfg), rule.key, rule.message.format(cfg=cfg))


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _describe(value: Any) -> str:
    text = repr(value) if len(repr(value)) <= 60 else repr(value)[:57] + "..."
    return "None" if value is None else f"{type(value).__name__} {text}"


def _tname(tp: Any) -> str:
    return tp.__name__ if isinstance(tp, type) and not get_args(tp) else repr(tp).replace("typing.", "")


def _optional_inner(tp: Any) -> Any:
    """``X`` for ``X | None`` / ``Optional[X]``; ``tp`` itself for anything else."""
    if get_origin(tp) in (Union, types.UnionType):
        options = [a for a in get_args(tp) if a is not type(None)]
        return options[0] if len(options) == 1 else tp
    return tp


def _type_error(key: str, expected: str, value: Any, hint: str = "") -> ConfigError:
    return ConfigError(f"config key '{key}': expected {expected}, got {_describe(value)}{hint}")


def _coerce(tp: Any, value: Any, key: str) -> Any:
    """Check ``value`` against annotation ``tp``, converting only where lossless and unambiguous
    (int -> float; numeric strings -> numbers, since PyYAML reads ``1e-4`` as a string)."""
    origin, args = get_origin(tp), get_args(tp)
    if tp is Any or tp is object:
        return value
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        if _optional_inner(tp) is not tp:  # Optional[X]: delegate, so the precise inner error surfaces
            return _coerce(_optional_inner(tp), value, key)
        if isinstance(value, str) and str in args:
            return value
        for option in (a for a in args if a is not type(None)):
            try:
                return _coerce(option, value, key)
            except ConfigError:
                pass
        raise _type_error(key, " | ".join(_tname(a) for a in args), value)
    if origin is Literal:
        if any(value == a and type(value) is type(a) for a in args):
            return value
        raise _type_error(key, "one of " + ", ".join(repr(a) for a in args), value)
    if dataclasses.is_dataclass(tp):
        if isinstance(value, (tp, Mapping)):
            return value if isinstance(value, tp) else _build(tp, value, key)
        raise _type_error(key, f"a mapping for {tp.__name__}", value)
    if tp is bool and isinstance(value, bool) or tp is str and isinstance(value, str):
        return value
    if tp in (bool, str):
        raise _type_error(key, _tname(tp), value, " (quote it in YAML)" if tp is str else "")
    if tp in (int, float):
        if isinstance(value, str):  # PyYAML reads 1e-4 as a string; "3" from an override is fine too
            try:
                value = tp(value)
            except ValueError:
                pass
        if isinstance(value, int if tp is int else (int, float)) and not isinstance(value, bool):
            number = tp(value)  # bool is an int subclass, but `lr: true` is surely a mistake
            if tp is float and not math.isfinite(number):  # no option means anything at inf or NaN
                raise ConfigError(f"config key '{key}': must be a finite number, got {number} (lr=inf once wrote "
                                  "NaN into every LoRA weight); use a finite value, or null where the key allows it")
            return number
        raise _type_error(key, tp.__name__, value)
    if origin in (list, tuple) or tp in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise _type_error(key, "a list", value)
        fixed = origin is tuple and args and args[-1] is not Ellipsis  # tuple[int, str] vs tuple[int, ...]
        if fixed and len(args) != len(value):
            raise _type_error(key, f"a list of {len(args)} items", value)
        item_types = args if fixed else [args[0] if args else Any] * len(value)
        items = [_coerce(t, v, f"{key}[{i}]") for i, (t, v) in enumerate(zip(item_types, value))]
        return tuple(items) if (origin or tp) is tuple else items
    if origin is dict or tp is dict:
        if not isinstance(value, Mapping):
            raise _type_error(key, "a mapping", value)
        key_tp, val_tp = args if args else (Any, Any)
        return {_coerce(key_tp, k, key): _coerce(val_tp, v, _join(key, str(k))) for k, v in value.items()}
    if isinstance(tp, type) and isinstance(value, tp):
        return value
    raise _type_error(key, _tname(tp), value)


class UnknownKeyError(ConfigError):
    """A key the schema does not have: ``path`` is its dotted name and ``where`` the override that set it (or ""), so
    the builder of a variant can say which other variant has it."""

    def __init__(self, message: str, *, path: str, where: str = ""):
        super().__init__(message)
        self.path, self.where = path, where


def _unknown_key(name: str, valid: Sequence[str], prefix: str, where: str = "") -> UnknownKeyError:
    close = difflib.get_close_matches(name, valid, n=1)
    hint = f"did you mean '{_join(prefix, close[0])}'?" if close else \
        f"valid keys {'under ' + repr(prefix) if prefix else 'at top level'}: {', '.join(valid)}"
    return UnknownKeyError(f"unknown config key '{_join(prefix, name)}'{where} ({hint})", path=_join(prefix, name),
                           where=where)


# Variants: a dataclass whose ClassVar ``variant_key`` names one of its fields, and whose ClassVar ``variants`` maps
# that field's values to subclasses, is built as the subclass its data names (flowrl's Config: ``recipe:`` picks
# the recipe's config class). A key only another variant has is then unknown, with a message naming both.

def _variant(cls: type, data: Any, prefix: str) -> type:
    """The class that ``data`` (a mapping for ``cls``) builds: ``cls`` or the variant its ``variant_key`` names."""
    key = getattr(cls, "variant_key", None)
    if key is None or not isinstance(data, Mapping):
        return cls
    default = next(f.default for f in dataclasses.fields(cls) if f.name == key)
    value = _coerce(get_type_hints(cls)[key], data.get(key, default), _join(prefix, key))
    chosen = cls.variants.get(value, cls)
    return chosen if issubclass(chosen, cls) else cls


def _has_key(cls: type, path: Sequence[str]) -> bool:
    """Whether the dataclass ``cls`` has the dotted key ``path`` (below a dict or Any field, anything goes)."""
    for part in path:
        cls = _optional_inner(cls)
        if not dataclasses.is_dataclass(cls):
            return True
        names = [f.name for f in dataclasses.fields(cls) if f.init]
        if part not in names:
            return False
        cls = get_type_hints(cls)[part]
    return True


def _other_variant_key(cls: type, chosen: type, error: UnknownKeyError, prefix: str) -> ConfigError:
    """``error`` again, or, where the key belongs to another variant of ``cls``, one line naming both variants."""
    path = error.path[len(prefix) + 1:] if prefix else error.path
    key = cls.variant_key
    mine = next((value for value, variant in cls.variants.items() if variant is chosen), None)
    owners = [value for value, variant in cls.variants.items()
              if variant is not chosen and _has_key(variant, path.split("."))]
    if mine is None or not owners:
        return error
    return ConfigError(f"unknown config key '{error.path}'{error.where}: a {key} {owners[0]} option; {key} {mine} "
                       f"has no such key (set {_join(prefix, key)}: {owners[0]}, or remove it)")


def _build(cls: type[T], data: Any, prefix: str) -> T:
    if not isinstance(data, Mapping):
        raise _type_error(prefix or "<root>", f"a mapping for {cls.__name__}", data)
    chosen = _variant(cls, data, prefix)
    try:
        return _build_fields(chosen, data, prefix)
    except UnknownKeyError as error:
        if getattr(cls, "variant_key", None) is None:
            raise
        raise _other_variant_key(cls, chosen, error, prefix) from None


def _build_fields(cls: type[T], data: Mapping, prefix: str) -> T:
    fields, hints = {f.name: f for f in dataclasses.fields(cls) if f.init}, get_type_hints(cls)
    kwargs = {}
    for name, value in data.items():
        if name not in fields:
            raise _unknown_key(str(name), list(fields), prefix)
        kwargs[name] = _coerce(hints[name], value, _join(prefix, name))
    for name, f in fields.items():
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        if name not in kwargs and required:
            key, kind = _join(prefix, name), _tname(hints[name])
            raise ConfigError(f"missing required config key '{key}' ({kind}): set it in YAML or pass {key}=...")
    return cls(**kwargs)


def _validate(obj: Any, prefix: str) -> None:
    """Run ``validate()`` bottom-up, so a parent may rely on its children being consistent."""
    if isinstance(obj, (list, tuple, dict)):
        for k, v in obj.items() if isinstance(obj, dict) else enumerate(obj):
            _validate(v, _join(prefix, str(k)) if isinstance(obj, dict) else f"{prefix}[{k}]")
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            _validate(getattr(obj, f.name), _join(prefix, f.name))
        if callable(getattr(obj, "validate", None)):
            try:
                obj.validate()
            except ConfigError as e:
                if e.key is None or not prefix:
                    raise
                raise ConfigError(f"config key '{_join(prefix, e.key)}': {e.detail}") from None


def from_dict(cls: type[T], data: Mapping[str, Any], *, prefix: str = "") -> T:
    """Build and validate ``cls`` from a plain mapping; absent keys keep their defaults."""
    obj = _build(cls, data, prefix)
    _validate(obj, prefix)
    return obj


def _deep_merge(base: dict, child: dict) -> dict:
    """Child wins; mappings merge recursively, everything else (lists included) is replaced."""
    out = dict(base)
    for k, v in child.items():
        out[k] = _deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _read_yaml(path: Path, chain: tuple[Path, ...] = ()) -> dict:
    """Read one file and, recursively, its ``base:`` file (relative to the including file)."""
    if not path.is_file():
        raise ConfigError(f"missing file: {path}" + (f" (the 'base' of {chain[-1]})" if chain else ""))
    if path.resolve() in chain:
        cycle = " -> ".join(str(p) for p in (*chain, path.resolve()))
        raise ConfigError(f"config key 'base' in {chain[-1]}: inheritance cycle {cycle}; remove one 'base'")
    try:
        with path.open() as f:  # a stream, so YAML errors name the file
            raw = yaml.safe_load(f) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"invalid YAML in {path}: {e}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of keys, got {_describe(raw)}")
    base = raw.pop("base", None)
    if base is not None and not isinstance(base, str):
        raise ConfigError(f"config key 'base' in {path}: expected a relative path, got {_describe(base)}")
    return _deep_merge(_read_yaml(path.parent / base, (*chain, path.resolve())), raw) if base else raw


def _apply_override(data: dict, text: str, cls: type) -> None:
    """Set ``a.b.c=value`` in ``data``. Names are checked against the schema here so a typo's error
    can quote the override; a str field keeps the raw text (run_name=2024 means "2024")."""
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError(f"override '{text}' must look like key=value, e.g. {key or 'train.lr'}=...")
    try:
        value = yaml.safe_load(raw) if raw.strip() else raw
    except yaml.YAMLError:
        value = raw  # e.g. an unbalanced quote in a prompt: take it literally
    root = _variant(cls, data, "")  # the recipe that the file and the overrides so far name
    parts, tp, node = key.split("."), root, data
    for i, part in enumerate(parts):
        tp = _optional_inner(tp)
        if dataclasses.is_dataclass(tp):  # below a dict / Any field, from_dict checks the rest
            names = [f.name for f in dataclasses.fields(tp) if f.init]
            if part not in names:
                error = _unknown_key(part, names, ".".join(parts[:i]), f" in override '{text}'")
                raise error if getattr(cls, "variant_key", None) is None else _other_variant_key(cls, root, error, "")
        tp = get_type_hints(tp)[part] if dataclasses.is_dataclass(tp) else Any
        if i < len(parts) - 1:
            node[part] = node[part] if isinstance(node.get(part), dict) else {}  # e.g. replaces a null
            node = node[part]
    node[parts[-1]] = raw if _optional_inner(tp) is str and isinstance(value, (bool, int, float)) else value


def load_config(cls: type[T], path: str | Path | None, overrides: Sequence[str] = ()) -> T:
    """YAML file (with optional ``base:`` chain) -> overrides ``a.b=value`` -> typed, validated ``cls``."""
    data = _read_yaml(Path(path)) if path is not None else {}
    for text in overrides:
        _apply_override(data, text, cls)
    return from_dict(cls, data)


def to_dict(cfg: Any) -> Any:
    """Plain YAML-safe structure (tuples -> lists) that from_dict accepts back."""
    if dataclasses.is_dataclass(cfg) and not isinstance(cfg, type):
        return {f.name: to_dict(getattr(cfg, f.name)) for f in dataclasses.fields(cfg) if f.init}
    if isinstance(cfg, (list, tuple)):
        return [to_dict(v) for v in cfg]
    if isinstance(cfg, Mapping):
        return {k: to_dict(v) for k, v in cfg.items()}
    return cfg


def save_config(cfg: Any, path: str | Path) -> None:
    """Write atomically (tmp file + os.replace) so a crash never leaves a half-written config."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")  # same directory, so os.replace is an atomic rename
    tmp.write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
    os.replace(tmp, path)

