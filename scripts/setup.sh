#!/usr/bin/env bash
# Create .venv at the repo root and install flowrl with its test tools. Idempotent: a second run
# with unchanged pyproject.toml installs nothing.
#
# torch and torchvision are installed first as a matched pair with plain pip, so pip can take them
# from a local wheel directory when the machine has one (uv/poetry would ignore it) and from
# PyPI (a CUDA build on Linux) otherwise.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON="${PYTHON:-python3}"
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv

stamp=.venv/.flowrl-installed
want="$(sha256sum pyproject.toml | cut -d' ' -f1)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
    exit 0
fi

.venv/bin/python -m pip install --quiet --upgrade pip
.venv/bin/python -m pip install --quiet "torch==2.14.1" "torchvision==0.29.1"
.venv/bin/python -m pip install --quiet -e ".[test]"
echo "$want" > "$stamp"
