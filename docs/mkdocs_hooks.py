"""Hooks of the docs site (``mkdocs.yml``): the README as the home page, and links to repository files.

The guides are written to be read on GitHub as much as on the site, so their links are relative paths in the
repository. Two kinds need help on the site, which holds only ``docs/``:

- ``docs/index.md`` is the README: its text is replaced by README.md's, whose links are relative to the
  repository root, and those that point into ``docs/`` are rewritten relative to ``docs/``
  (``docs/algorithms.md#grpo`` -> ``algorithms.md#grpo``). mkdocs then checks them as any link between pages.
- A link to a repository file outside ``docs/`` (``../flowrl/recipes/grpo.py``, or ``configs/toy/nft.yaml`` in the
  README) has no page on the site: it becomes its text. A link to a file that does not exist is a warning, so
  ``mkdocs build --strict`` fails on it as it fails on a broken link between pages (``tests/test_docs_site.py``).
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path

# Under the "mkdocs" logger, so that --strict counts its warnings.
log = logging.getLogger("mkdocs.hooks.flowrl_links")

# [text](target) or ![alt](target); the text may hold one level of brackets ("FLUX.1 [dev]").
LINK = re.compile(r"(!?)\[((?:[^\[\]]|\[[^\[\]]*\])*)\]\(([^()\s]+)\)")
FENCE = re.compile(r"\s*(`{3,}|~{3,})")
SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*:")


def _inside(path: Path, folder: Path) -> bool:
    return path == folder or folder in path.parents


def rewrite_links(markdown: str, base: Path, page_dir: Path, docs_dir: Path, where: str) -> str:
    """``markdown`` whose relative links resolve from ``base``, as a page in ``page_dir`` of ``docs_dir`` links.

    Links inside ``docs_dir`` are made relative to ``page_dir``; links to existing files outside it become their
    text; links to missing files outside it are logged as warnings and left as they are. Fenced code is skipped.
    """
    def link(m: re.Match) -> str:
        bang, text, target = m.groups()
        if SCHEME.match(target) or target.startswith(("#", "/")):
            return m.group(0)
        path, sep, anchor = target.partition("#")
        resolved = (base / path).resolve()
        if _inside(resolved, docs_dir):
            if base == page_dir:
                return m.group(0)
            return f"{bang}[{text}]({Path(os.path.relpath(resolved, page_dir)).as_posix()}{sep}{anchor})"
        if not resolved.exists():
            log.warning("%s links to '%s', which is not a file of the repository", where, target)
            return m.group(0)
        return text

    out, fence = [], None
    for line in markdown.splitlines(keepends=True):
        m = FENCE.match(line)
        if fence is None and m:
            fence = m.group(1)
        elif fence is not None and m and m.group(1).startswith(fence) and not line.strip()[len(m.group(1)):]:
            fence = None
        elif fence is None:
            line = LINK.sub(link, line)
        out.append(line)
    return "".join(out)


def on_page_markdown(markdown, page, config, files):
    docs_dir = Path(config["docs_dir"]).resolve()
    page_dir = Path(page.file.abs_src_path).resolve().parent
    base = page_dir
    if page.file.src_uri == "index.md":
        repo = Path(config["config_file_path"]).resolve().parent
        markdown, base = (repo / "README.md").read_text(encoding="utf-8"), repo
    return rewrite_links(markdown, base, page_dir, docs_dir, page.file.src_uri)
