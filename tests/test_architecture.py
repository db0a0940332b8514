"""The import contract of ``[tool.importlinter]`` in pyproject.toml: flowrl's layers, no cycles, and the reward
plugins kept apart from core.

Why a test: a lazy import inside a function breaks the layering as surely as one at the top of a module, and
it is easy to add without noticing; import-linter (through grimp) sees both. A broken contract fails here with
the linter's own report, which names each offending import and its line.

Two rules the linter does not check are held here by reading the source: no import cycle runs through a package's
``__init__`` (the linter's acyclic contract compares only a package's children), and scripts/ and tools/ never import
the test suite.
"""

import ast
import collections
import subprocess
import sys
from pathlib import Path
from typing import Iterable, Iterator

import pytest

from tests import REPO


def test_import_contract_is_kept():
    pytest.importorskip("importlinter", reason="import-linter is in the test extra: pip install -e '.[test]'")
    linter = Path(sys.executable).parent / "lint-imports"
    assert linter.is_file(), f"import-linter is installed but {linter} is missing"
    # --no-cache: nothing is written into the repository; the run takes about a second.
    result = subprocess.run([str(linter), "--no-cache", "--no-logo"], cwd=REPO, capture_output=True, text=True)
    report = result.stdout + result.stderr
    assert result.returncode == 0, f"import contract broken (pyproject.toml [tool.importlinter]):\n{report}"
    assert "0 broken" in report, report


# --- the test suite stays out of scripts/ and tools/ --------------------------------------------------------------
# Scripts and tools are run by users and jobs; the test suite may change or be absent (an installed checkout without
# tests/), and a tool that imports it ties a maintained entry point to test scaffolding. What both need is in tools/.

def imported_names(tree: ast.AST) -> Iterator[tuple[str, int]]:
    """(dotted module name, line) of every absolute import in ``tree``, those inside functions included."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.module, node.lineno


def test_scripts_and_tools_do_not_import_the_test_suite():
    files = sorted([*(REPO / "scripts").rglob("*.py"), *(REPO / "tools").rglob("*.py")])
    assert files, "no Python file found under scripts/ or tools/"
    offenders = [f"{path.relative_to(REPO)}:{line} imports {name}"
                 for path in files for name, line in imported_names(ast.parse(path.read_text(), filename=str(path)))
                 if name == "tests" or name.startswith("tests.")]
    assert not offenders, ("scripts/ and tools/ must not import tests/ (move the shared code into tools/):\n"
                           + "\n".join(offenders))


# --- no import cycle through a package __init__ -------------------------------------------------------------------
# import-linter's acyclic_siblings contract compares the modules and subpackages *of* a package, so it does not see a
# cycle that runs through the package's own __init__ (flowrl.models imports flowrl.models.base, whose code imports
# a name from flowrl.models). Such a cycle makes the result depend on which module is imported first: the package's
# namespace is half-built while its submodules run. This graph is built from the source instead.

SOURCE_PACKAGES = ("flowrl", "rewards")


def module_files(root: Path, packages: Iterable[str]) -> dict[str, Path]:
    """{dotted name: file} of every module under ``packages``; a package is named by its ``__init__.py``."""
    modules = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def requested_modules(tree: ast.AST, name: str, is_package: bool) -> Iterator[tuple[str, bool, int]]:
    """(dotted name, whether it must be a module, line) of what each import statement of module ``name`` asks for,
    lazy imports included and relative ones resolved. ``from a import b`` asks for ``a`` (``b`` is read from its
    namespace) and for ``a.b`` where that is a submodule."""
    package = name if is_package else name.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, True, node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1])
                module = f"{base}.{node.module}" if node.module else base
            else:
                module = node.module
            yield module, True, node.lineno
            for alias in node.names:
                yield f"{module}.{alias.name}", False, node.lineno


def import_graph(root: Path, packages: Iterable[str] = SOURCE_PACKAGES) -> dict[str, dict[str, int]]:
    """{importer: {imported module: line}} over the modules under ``packages`` (imports of other packages left out).

    Importing ``a.b.c`` runs the ``__init__`` of ``a`` and ``a.b`` first, so it is also an edge to those packages,
    except to the importer's own enclosing packages: Python has run (or is running) them before the importer, and
    only a name read from one of them (``from a.b import name``) makes the importer depend on it."""
    modules = module_files(root, packages)
    graph: dict[str, dict[str, int]] = {}
    for importer, path in modules.items():
        is_package = path.name == "__init__.py"
        enclosing = {".".join(importer.split(".")[:i]) for i in range(1, importer.count(".") + 1)}
        edges = graph.setdefault(importer, {})
        for requested, must_be_module, line in requested_modules(ast.parse(path.read_text(), filename=str(path)),
                                                                 importer, is_package):
            parts = requested.split(".")
            prefixes = [".".join(parts[:i]) for i in range(len(parts), 0, -1)]
            target = next((p for p in prefixes if p in modules), None)
            if target is None or (not must_be_module and target != requested):
                continue  # another package's module, or a name that is not a submodule
            implied = [p for p in prefixes if p in modules and len(p) < len(target) and p not in enclosing]
            for imported in (target, *implied):
                if imported != importer:
                    edges.setdefault(imported, line)
    return graph


def shortest_cycle(graph: dict[str, dict[str, int]], start: str) -> list[str] | None:
    """The modules of the shortest import path from ``start`` back to itself, ``start`` first; None if there is none."""
    parent: dict[str, str | None] = {start: None}
    queue = collections.deque([start])
    while queue:
        module = queue.popleft()
        for imported in sorted(graph.get(module, ())):
            if imported == start:
                path = [module]
                while parent[path[-1]] is not None:
                    path.append(parent[path[-1]])
                return path[::-1]
            if imported not in parent:
                parent[imported] = module
                queue.append(imported)
    return None


def cycles_through_packages(graph: dict[str, dict[str, int]], packages: Iterable[str]) -> list[list[str]]:
    """The shortest import cycle through each of ``packages`` that lies on one, each cycle listed once."""
    found: dict[tuple[str, ...], None] = {}
    for package in sorted(packages):
        cycle = shortest_cycle(graph, package)
        if cycle:
            first = cycle.index(min(cycle))  # one rotation per cycle, whichever package it was found from
            found.setdefault(tuple(cycle[first:] + cycle[:first]), None)
    return [list(cycle) for cycle in found]


def describe_cycle(cycle: list[str], graph: dict[str, dict[str, int]], files: dict[str, Path], root: Path) -> str:
    """``a (a.py:3) -> b (b.py:10) -> a``: each step with the line of the import that makes it."""
    steps = [f"{module} ({files[module].relative_to(root)}:{graph[module][following]})"
             for module, following in zip(cycle, cycle[1:] + cycle[:1])]
    return " -> ".join([*steps, cycle[0]])


def test_no_import_cycle_passes_through_a_package_init():
    files = module_files(REPO, SOURCE_PACKAGES)
    graph = import_graph(REPO)
    packages = [name for name, path in files.items() if path.name == "__init__.py"]
    assert "flowrl.models" in packages and "flowrl.models.base" in graph["flowrl.models"], "the graph missed imports"
    cycles = [describe_cycle(cycle, graph, files, REPO) for cycle in cycles_through_packages(graph, packages)]
    assert not cycles, ("import cycles through a package __init__ (import the name from the submodule that defines "
                        "it, not from the package):\n" + "\n".join(cycles))


# --- adding a loss and a run extra by the documented steps only (docs/architecture.md, "How to add") ----------

SMOKE = "configs/smoke/sd3_tiny.yaml"


def test_a_policy_loss_registered_by_its_decorator_trains_in_recipe_grpo(tmp_path, monkeypatch):
    """The documented steps for a loss: its function, registered with the decorator, reading its own settings
    from the ``train`` section it receives. Nothing else is edited, and ``train.loss`` then names it."""
    import torch

    from flowrl.algorithms import losses
    from flowrl.config import Config, load_config
    from flowrl.recipes.grpo import train

    seen = []

    @losses.register_policy_loss("test-sign")
    def sign_loss(log_probs, old_log_probs, advantages, config):
        seen.append((config.clip_range, tuple(advantages.shape)))
        ratio = torch.exp(log_probs - old_log_probs)
        stats = {"ratio": ratio.detach(), "clipped": torch.zeros_like(ratio),
                 "approx_kl": torch.zeros_like(ratio)}
        return -advantages.sign() * ratio, stats

    try:
        cfg = load_config(Config, SMOKE, [f"run_dir={tmp_path / 'run'}", "train.epochs=1", "train.loss=test-sign",
                                          "train.clip_range=0.25", "log.eval_every=0", "log.report_prompts=0"])
        metrics = train(cfg)
    finally:
        del losses.POLICY_LOSSES["test-sign"]
    assert seen and all(clip == 0.25 for clip, _ in seen)
    assert metrics["optim/grad_norm"] > 0


@pytest.mark.parametrize("recipe", ["grpo", "nft"])
def test_a_run_extra_added_by_one_builder_line_runs_in_both_recipes_and_is_checkpointed(tmp_path, monkeypatch,
                                                                                        recipe):
    """The documented steps for a stateful feature: its class and one builder line in ``COMMON_EXTRAS``. Both
    recipes call its hooks without naming it, and its state rides in the checkpoint."""
    import json

    from flowrl.commands.train import recipe_train
    from flowrl.config import Config, load_config
    from flowrl.recipes import extras

    calls = []

    class Counter:
        def __init__(self):
            self.count = 0

        def after_scoring(self, run, epoch, traj, combined):
            calls.append(("after_scoring", epoch, len(combined)))
            return {"counter/scored": float(len(combined))}

        def after_update(self, run, epoch, traj, stats):
            self.count += 1
            calls.append(("after_update", epoch))
            return {"counter/updates": float(self.count)}

        def state_dict(self):
            return {"count": self.count}

        def load_state_dict(self, state):
            self.count = state["count"]

    monkeypatch.setitem(extras.COMMON_EXTRAS, "test_counter", lambda run: Counter())
    overrides = [f"run_dir={tmp_path / 'run'}", "train.epochs=2", "log.eval_every=0", "log.report_prompts=0"]
    if recipe == "nft":
        overrides += ["recipe=nft"]
    cfg = load_config(Config, SMOKE, overrides)
    metrics = recipe_train(cfg.recipe)(cfg)
    assert [c[0] for c in calls] == ["after_scoring", "after_update"] * 2
    assert metrics["counter/updates"] == 2.0
    checkpoints = tmp_path / "run" / "checkpoints"
    latest = checkpoints / (checkpoints / "latest").read_text().strip()
    state = json.loads((latest / "trainer_state.json").read_text())
    assert state["test_counter"] == {"count": 2}
