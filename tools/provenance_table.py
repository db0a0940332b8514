"""Render configs/provenance/*.yaml into configs/README.md: ``python -m tools.provenance_table``.

Each configs/provenance/<folder>.yaml says, per config of configs/<folder>/, which recipe it cites, the reference
file and commit, the reference's value of each setting and flowrl's where it deliberately differs (with why), and
what flowrl has no key for. tests/config/test_provenance.py holds every config to its table; this tool renders
the tables for readers, between the markers ``<!-- provenance:start -->`` and ``<!-- provenance:end -->`` of
configs/README.md, so the README cannot drift from what the test checks (the same test fails when the README is
out of date). ``--check`` only compares and exits 1 when the README needs regenerating.

Run from the repository root (it is a tool, not part of the package).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
TABLES = REPO / "configs" / "provenance"
README = REPO / "configs" / "README.md"
START, END = "<!-- provenance:start -->", "<!-- provenance:end -->"
COMMAND = "python -m tools.provenance_table"


def load_tables(folder: Path = TABLES) -> dict[str, dict]:
    """{config folder: {config file: entry}} for every table, in name order."""
    tables = {}
    for path in sorted(folder.glob("*.yaml")):
        try:
            data = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as error:
            raise SystemExit(f"provenance_table: {path.relative_to(REPO)} is not valid YAML: {error}".splitlines()[0])
        if not isinstance(data, dict):
            raise SystemExit(f"provenance_table: {path.relative_to(REPO)} must map config files to entries")
        tables[path.stem] = data
    return tables


def number(value: float) -> str:
    """A float as a config would write it: 0.9, 1.0, 3e-4, 1e-8 (no 0.0003, no 1e-08)."""
    if value != 0 and abs(value) < 1e-3:
        mantissa, exponent = f"{value:.12e}".split("e")
        return f"{mantissa.rstrip('0').rstrip('.')}e{int(exponent)}"
    text = f"{value:g}"
    return text if any(c in text for c in ".en") else text + ".0"


def show(value) -> str:
    """A setting's value as a table cell: numbers in their shortest form, lists inline, null as `null`."""
    if isinstance(value, bool) or value is None:
        return f"`{yaml.safe_dump(value).splitlines()[0]}`"
    if isinstance(value, float):
        return f"`{number(value)}`"
    if isinstance(value, (list, tuple)):
        return "`[" + ", ".join(show(v).strip("`") for v in value) + "]`"
    return f"`{value}`"


def where(setting: dict, source: dict) -> str:
    """The file a setting was read from; with its repository and commit when they are not the entry's."""
    file = setting.get("file", source.get("file", ""))
    repo, commit = setting.get("repo", source.get("repo")), setting.get("commit", source.get("commit"))
    if (repo, commit) != (source.get("repo"), source.get("commit")):
        return f"{repo} `{file}` @ {str(commit)[:7]}"
    return f"`{file}`"


def config_section(folder: str, name: str, entry: dict) -> list[str]:
    """One config's block: what it cites, its source, the settings table, the differences and the gaps."""
    source = entry.get("source") or {}
    cites = entry.get("cites")
    summary = f"<code>{folder}/{name}</code>: " + (cites if cites else "flowrl's own recipe")
    lines = ["<details>", f"<summary>{summary}</summary>", ""]
    if cites is None:
        lines += [f"flowrl's own: {entry.get('why', '')}", ""]
    if source:
        lines += [f"Source: {source['repo']} `{source['file']}` @ {str(source['commit'])[:7]} "
                  f"(`{source['commit']}`)", ""]
    settings = entry.get("settings") or {}
    if settings:
        lines += ["| setting | reference | flowrl | read from |", "|---|---|---|---|"]
        for key, setting in settings.items():
            ours = f"**{show(setting['ours'])}**" if "ours" in setting else "same"
            lines.append(f"| `{key}` | {show(setting.get('reference'))} | {ours} | {where(setting, source)} |")
        lines.append("")
    differences = [(key, s["why"]) for key, s in settings.items() if "ours" in s]
    if differences:
        lines += ["Deliberate differences:", ""] + [f"- `{key}`: {why}" for key, why in differences] + [""]
    gaps = entry.get("not_expressible") or {}
    if gaps:
        lines += ["Not expressible as a flowrl key:", ""] + [f"- {gap}: {text}" for gap, text in gaps.items()]
        lines.append("")
    return lines + ["</details>", ""]


def render(tables: dict[str, dict]) -> str:
    """The generated part of configs/README.md, markers included."""
    lines = [START, f"<!-- generated from configs/provenance/*.yaml by `{COMMAND}`; do not edit by hand -->", ""]
    for folder, entries in tables.items():
        lines += [f"### `configs/{folder}/`", ""]
        for name, entry in entries.items():
            lines += config_section(folder, name, entry)
    return "\n".join(lines + [END])


def updated_readme(text: str, tables: dict[str, dict]) -> str:
    """``text`` with the part between the markers replaced by the rendered tables."""
    if text.count(START) != 1 or text.count(END) != 1 or text.index(START) > text.index(END):
        raise SystemExit(f"provenance_table: {README.relative_to(REPO)} needs one {START} line followed by one {END}")
    head, rest = text.split(START)
    tail = rest.split(END, 1)[1]
    return head + render(tables) + tail


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true",
                        help="exit 1 if configs/README.md is out of date; write nothing")
    args = parser.parse_args(argv)
    text = README.read_text()
    new = updated_readme(text, load_tables())
    if args.check:
        if new != text:
            print(f"configs/README.md is out of date with configs/provenance: run {COMMAND}")
            return 1
        return 0
    if new != text:
        README.write_text(new)
        print(f"wrote {README.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
