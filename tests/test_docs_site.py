"""The docs site (mkdocs.yml) builds under --strict, and every link of README.md and docs/ leads somewhere.

mkdocs checks links between pages (and their anchors) but not links to repository files outside docs/: the
site's hook (docs/mkdocs_hooks.py) warns on a missing one, and test_links_to_repository_files_exist checks
them without mkdocs. A broken-site build shows that --strict really fails on each kind of broken link.
"""

import importlib.util
import os
import re
import shutil
import subprocess
import sys

import yaml

from tests import REPO

HOOKS = REPO / "docs" / "mkdocs_hooks.py"
PAGES = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]


def _hooks():
    spec = importlib.util.spec_from_file_location("flowrl_docs_hooks", HOOKS)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _build(config_file, site_dir):
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}  # mkdocs-material's banner about its successor
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(config_file),
                           "--site-dir", str(site_dir)], capture_output=True, text=True, env=env, timeout=120)


def _links(text):
    """(line number, target) of every markdown link outside fenced code."""
    hooks, fence, found = _hooks(), None, []
    for number, line in enumerate(text.splitlines(), 1):
        m = hooks.FENCE.match(line)
        if fence is None and m:
            fence = m.group(1)
        elif fence is not None and m and m.group(1).startswith(fence) and not line.strip()[len(m.group(1)):]:
            fence = None
        elif fence is None:
            found += [(number, link.group(3)) for link in hooks.LINK.finditer(line)]
    return found


def test_the_site_builds_strict_with_the_readme_as_home_page(tmp_path):
    result = _build(REPO / "mkdocs.yml", tmp_path / "site")
    assert result.returncode == 0, result.stdout + result.stderr
    home = (tmp_path / "site" / "index.html").read_text(encoding="utf-8")
    assert 'id="two-commands"' in home and 'id="model-families"' in home  # the README's text, not the stub
    assert 'href="algorithms/#grpo"' in home  # README's docs/algorithms.md#grpo, rewritten for the site


def test_every_guide_is_in_the_nav():
    nav = yaml.safe_load((REPO / "mkdocs.yml").read_text())["nav"]

    def pages(item):
        if isinstance(item, str):
            return [item]
        if isinstance(item, list):
            return [p for x in item for p in pages(x)]
        return [p for x in item.values() for p in pages(x)]

    listed = pages(nav)
    guides = sorted(p.relative_to(REPO / "docs").as_posix() for p in (REPO / "docs").rglob("*.md"))
    assert sorted(listed) == guides


def test_links_to_repository_files_exist():
    checked, broken = 0, []
    for page in PAGES:
        for number, target in _links(page.read_text(encoding="utf-8")):
            if re.match(r"[A-Za-z][A-Za-z0-9+.-]*:", target) or target.startswith("#"):
                continue  # a URL, or an anchor of the same page (mkdocs checks those)
            path = target.partition("#")[0]
            checked += 1
            if target.startswith("/") or not (page.parent / path).exists():
                broken.append(f"{page.relative_to(REPO)}:{number}: {target}")
    assert not broken, "links to no file of the repository:\n" + "\n".join(broken)
    assert checked > 100  # the scan finds the links (the README alone has more than 60)


def test_readme_holds_the_two_commands_and_ci_runs_the_second():
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    ci = [line for line in (REPO / ".ci" / "run").read_text().splitlines() if line.startswith("./scripts/setup.sh")]
    assert ci == ["./scripts/setup.sh && HF_HUB_OFFLINE=1 .venv/bin/python -m pytest -q -n 2"]
    for command in ("./scripts/setup.sh && .venv/bin/flowrl train", ci[0]):
        assert f"```bash\n{command}\n```" in readme


def test_strict_build_fails_on_each_kind_of_broken_link(tmp_path):
    """A small site with the real settings and hook, and one broken link of each kind: every one is reported."""
    config = yaml.safe_load((REPO / "mkdocs.yml").read_text())
    config["nav"] = ["index.md", "a.md", "b.md"]
    (tmp_path / "docs").mkdir()
    shutil.copy(HOOKS, tmp_path / "docs" / HOOKS.name)
    (tmp_path / "mkdocs.yml").write_text(yaml.safe_dump(config))
    (tmp_path / "code.py").write_text("")
    (tmp_path / "README.md").write_text("# Home\n\n[ok](docs/a.md#a) [ok](code.py) [bad](docs/gone.md)\n")
    (tmp_path / "docs" / "index.md").write_text("# stub\n")
    (tmp_path / "docs" / "a.md").write_text(
        "# A\n\n[ok](b.md#b) [ok](../code.py) [bad](missing.md) [bad](b.md#no-such-heading) [bad](../no/such.py)\n"
        "\n```markdown\n[in code, not a link](nowhere.md)\n```\n")
    (tmp_path / "docs" / "b.md").write_text("# B\n")
    (tmp_path / "docs" / "c.md").write_text("# C, not in the nav\n")
    result = _build(tmp_path / "mkdocs.yml", tmp_path / "site")
    out = result.stdout + result.stderr
    assert result.returncode != 0, out
    # the log's records (a record's continuation lines belong to it) at WARNING, what --strict counts
    records = re.split(r"\n(?=(?:DEBUG|INFO|WARNING|ERROR)\b)", "\n" + out)
    warnings = "\n".join(r for r in records if r.startswith("WARNING"))
    for reported in ("'gone.md'", "'missing.md'", "'#no-such-heading'", "'../no/such.py'", "- c.md"):
        assert reported in warnings, f"{reported} not warned about:\n{out}"
    for fine in ("nowhere.md", "code.py", "'b.md#b'"):
        assert fine not in out, out
