#!/usr/bin/env bash
# Create .venv at the repo root and install flowrl with its test tools and reward models. Idempotent: a
# second run with unchanged pyproject.toml and constraints.txt installs nothing.
#
# torch and torchvision are installed first as a matched pair with plain pip, at the tested versions
# of constraints.txt (pyproject.toml only declares a range), so pip can take them from a local wheel
# directory when the machine has one (uv/poetry would ignore it) and from PyPI (a CUDA build on Linux)
# otherwise. The same constraints hold them there while flowrl's own dependencies install.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON="${PYTHON:-python3}"
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv

stamp=.venv/.flowrl-installed
want="$(cat pyproject.toml constraints.txt | sha256sum | cut -d' ' -f1)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
    exit 0
fi

.venv/bin/python -m pip install --quiet --upgrade pip
.venv/bin/python -m pip install --quiet -c constraints.txt torch torchvision
.venv/bin/python -m pip install --quiet -c constraints.txt -e ".[test,rewards]"
echo "$want" > "$stamp"
