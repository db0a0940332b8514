"""flowrl's test suite, a package so that every test module has a unique dotted name (``tests.eval.test_eval``)
and the shared helpers import the same way from every folder (``from tests.reward_fixtures import ...``).

``REPO`` is the repository root: tests find configs, assets and scripts from it wherever their file sits."""

from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
