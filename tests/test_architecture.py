"""The import contract of ``[tool.importlinter]`` in pyproject.toml: flowrl's layers, no cycles, and the reward
plugins kept apart from core.

Why a test: a lazy import inside a function breaks the layering as surely as one at the top of a module, and
it is easy to add without noticing; import-linter (through grimp) sees both. A broken contract fails here with
the linter's own report, which names each offending import and its line.
"""

import subprocess
import sys
from pathlib import Path

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
