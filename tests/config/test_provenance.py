"""Every real-model config equals the recipe it cites, value by value, or names each deliberate difference.

configs/provenance/<folder>.yaml holds one entry per config in configs/<folder>/ (``_base.yaml`` aside): the recipe
it cites, the reference file and commit its settings were read from, and per dotted flowrl key the reference's
value, with ``ours`` and ``why`` where flowrl deliberately differs. A config that is flowrl's own has ``cites: null``
and a ``why``. This test loads each config through the loader (so ``base:`` inheritance counts) and compares, so a
config edited away from its reference, or a table edited away from the config, fails here. Settings flowrl has no
key for sit under ``not_expressible``, not tested. Each deliberate difference is also named (its dotted key or the
key's last part) in the config's header comment, where a user reads it; and configs/README.md must show the tables
as they are (``python -m tools.provenance_table`` renders them).
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest

from flowrl.config import Config, load_config, to_dict
from tests import REPO
from tools import provenance_table

TABLES = provenance_table.load_tables(REPO / "configs" / "provenance")  # {config folder: {config file: entry}}
ENTRY_KEYS = {"cites", "source", "settings", "not_expressible", "why"}
SOURCE_KEYS = {"repo", "commit", "file"}
# repo and commit are optional per setting too: a setting read from another repository or commit than the entry's
SETTING_KEYS = {"reference", "ours", "why", "file", "repo", "commit"}
COMMIT = re.compile(r"[0-9a-fA-F]{40}")
ENTRIES = [(folder, name, entry) for folder, entries in TABLES.items() for name, entry in entries.items()]


def _header(path: Path) -> str:
    """The comment block a config file opens with (its lines up to the first that is not a comment)."""
    lines = []
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        lines.append(line)
    return "\n".join(lines)


def _value(cfg, dotted: str):
    """The loaded config's value at a dotted key, as plain YAML data (tuples as lists); a list is indexed by a
    number and a mapping by its key (``rewards.0.kwargs.lr``)."""
    node = to_dict(cfg)
    for part in dotted.split("."):
        if isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            assert isinstance(node, dict) and part in node, f"{dotted}: the config has no key {part!r}"
            node = node[part]
    return node


def _same(expected, actual) -> bool:
    """Equal as YAML data: numbers within rel tol 1e-9 (ints and floats alike), lists element by element."""
    if isinstance(expected, bool) or isinstance(actual, bool):
        return expected is actual
    if isinstance(expected, (int, float)) and isinstance(actual, (int, float)):
        return math.isclose(expected, actual, rel_tol=1e-9, abs_tol=0.0)
    if isinstance(expected, (list, tuple)) and isinstance(actual, (list, tuple)):
        return len(expected) == len(actual) and all(_same(e, a) for e, a in zip(expected, actual))
    return expected == actual


def test_provenance_tables_exist():
    assert TABLES, "configs/provenance holds no table"


@pytest.mark.parametrize("folder", list(TABLES))
def test_every_config_of_the_folder_is_listed(folder):
    configs_dir = REPO / "configs" / folder
    assert configs_dir.is_dir(), f"configs/provenance/{folder}.yaml: no folder configs/{folder}"
    configs = {p.name for p in configs_dir.glob("*.yaml")} - {"_base.yaml"}
    listed = set(TABLES[folder])
    assert not configs - listed, f"{folder}.yaml does not list {sorted(configs - listed)}"
    assert not listed - configs, f"{folder}.yaml lists configs that do not exist: {sorted(listed - configs)}"


@pytest.mark.parametrize("folder, name, entry", ENTRIES, ids=[f"{f}/{n}" for f, n, _ in ENTRIES])
def test_config_matches_its_reference(folder, name, entry):
    where = f"{folder}.yaml: {name}"
    assert isinstance(entry, dict), f"{where}: an entry is a mapping"
    assert not set(entry) - ENTRY_KEYS, f"{where}: unknown keys {sorted(set(entry) - ENTRY_KEYS)}"
    assert "cites" in entry, f"{where}: no cites (null for flowrl's own recipe)"
    settings = entry.get("settings") or {}
    if entry["cites"] is None:
        assert str(entry.get("why") or "").strip(), f"{where}: cites null needs a why"
    else:
        assert str(entry["cites"]).strip(), f"{where}: cites is empty"
        assert settings, f"{where}: a cited recipe needs its settings"
    if settings or "source" in entry:
        source = entry.get("source") or {}
        assert set(source) == SOURCE_KEYS, f"{where}: source needs exactly {sorted(SOURCE_KEYS)}"
        assert COMMIT.fullmatch(str(source["commit"])), f"{where}: source.commit must be 40 hex digits"
    for key, value in (entry.get("not_expressible") or {}).items():
        assert str(value or "").strip(), f"{where}: not_expressible {key} is empty"

    path = REPO / "configs" / folder / name
    cfg = load_config(Config, path)
    header = _header(path)
    problems = []  # every wrong setting of the entry at once, so one run lists all there is to fix
    for key, setting in settings.items():
        assert isinstance(setting, dict) and "reference" in setting, f"{where}: {key} needs a reference value"
        assert not set(setting) - SETTING_KEYS, f"{where}: {key} has unknown keys {sorted(set(setting) - SETTING_KEYS)}"
        if "commit" in setting:
            assert COMMIT.fullmatch(str(setting["commit"])), f"{where}: {key}.commit must be 40 hex digits"
        if "ours" in setting:
            assert str(setting.get("why") or "").strip(), f"{where}: {key} differs (ours) without a why"
            if key not in header and key.rsplit(".", 1)[-1] not in header:
                problems.append(f"{key}: a deliberate difference the header comment does not name")
        expected = setting["ours"] if "ours" in setting else setting["reference"]
        actual = _value(cfg, key)
        if not _same(expected, actual):
            problems.append(f"{key}: table {expected!r}, config {actual!r}")
    assert not problems, f"{where} differs from its table: " + "; ".join(problems)


def test_readme_shows_the_tables():
    """configs/README.md's generated section is the rendering of the tables as they are now."""
    text = (REPO / "configs" / "README.md").read_text()
    assert provenance_table.updated_readme(text, provenance_table.load_tables()) == text, (
        f"configs/README.md is out of date with configs/provenance: run {provenance_table.COMMAND}")
