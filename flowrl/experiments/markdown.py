"""Writing a table into the results file without touching the rest of it.

Why: ``docs/results.md`` holds several tables, each made by its own experiment, and the prose between them is
written by hand; an experiment replaces only its own ``## `` section (or the file's head, for the main table).
"""

from __future__ import annotations

import re
from pathlib import Path

KEPT = "\n## Reading the table"
"""The hand-written section after the main table that rewriting the main table keeps."""


def table_head(title: str, command: str, prose: str, columns: list[str]) -> list[str]:
    """The lines that open a results section: its title, the command that made it, what it measured, and the
    header of its table."""
    return [title, "", f"`{command}`", "", prose, "", "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]


def replace_section(path: Path, text: str, section: str) -> None:
    """``text`` in place of the section titled ``section`` (to the next ``## `` heading), or appended. A blank line
    always follows the section, so a table that ends it does not run into the next heading."""
    path = Path(path)
    old = path.read_text() if path.exists() else ""
    pattern = re.compile(rf"^{re.escape(section)}\n.*?(?=^## |\Z)", re.S | re.M)
    if pattern.search(old):
        new = pattern.sub(lambda _: text.rstrip("\n") + "\n\n", old)
    else:
        new = (old.rstrip("\n") + "\n\n" if old.strip() else "") + text
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(new)


def replace_head(path: Path, text: str) -> None:
    """``text`` in place of everything before the file's ``## Reading the table`` section (kept, with what
    follows it), or the whole file when it has none."""
    path = Path(path)
    kept = "".join(path.read_text().partition(KEPT)[1:]) if path.exists() else ""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + kept)


def slug(title: str) -> str:
    """``"Rerun after the reference fixes"`` -> ``"rerun_after_the_reference_fixes"`` (plot file names)."""
    return re.sub(r"[^a-z0-9]+", "_", title.lower()).strip("_")
