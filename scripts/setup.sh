#!/usr/bin/env bash
# Create .venv at the repo root and install flowrl with its test tools and reward models. Idempotent: a
# second run with unchanged pyproject.toml and constraints.txt installs nothing.
#
# torch and torchvision are installed first as a matched pair with plain pip, at the tested versions
# of constraints.txt (pyproject.toml only declares a range), so pip can take them from a local wheel
# directory when the machine has one (uv/poetry would ignore it) and from PyPI (a CUDA build on Linux)
# otherwise. The same constraints hold them there while flowrl's own dependencies install.
#
# PyPI's Linux torch is the CUDA build: with its nvidia-* wheels the venv is about 7 GB (3.2 GB of them CUDA
# libraries), GPU or not. On a machine without a GPU, take the CPU build from PyTorch's own index instead:
#     FLOWRL_TORCH_INDEX=https://download.pytorch.org/whl/cpu ./scripts/setup.sh
# (an estimated 3 GB venv: torch without the CUDA libraries). It is a switch, not automatic, because a machine
# without a GPU may still install from a local wheel directory or reach PyPI only.
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
torch_index=()
if [ -n "${FLOWRL_TORCH_INDEX:-}" ]; then
    torch_index=(--index-url "$FLOWRL_TORCH_INDEX")
fi
.venv/bin/python -m pip install --quiet -c constraints.txt "${torch_index[@]}" torch torchvision
.venv/bin/python -m pip install --quiet -c constraints.txt -e ".[test,rewards]"
echo "$want" > "$stamp"
