#!/usr/bin/env bash
# Creates .venv and installs streamrl into it. Idempotent: does nothing when
# pyproject.toml has not changed since the last successful install.
#   scripts/setup.sh [EXTRAS]      e.g. scripts/setup.sh dev
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-}"
venv="${STREAMRL_VENV:-.venv}"
py="${PYTHON:-python3}"

stamp="$venv/.streamrl-installed"
want="$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)-$extras"
if [[ -f "$stamp" && "$(cat "$stamp")" == "$want" ]]; then
    exit 0
fi

[[ -x "$venv/bin/python" ]] || "$py" -m venv "$venv"
pip=("$venv/bin/python" -m pip install --quiet)
"${pip[@]}" --upgrade pip "setuptools>=77" wheel

# torch first: on a machine without a GPU, the CPU build (a plain `torch`
# would pull a multi-GB CUDA build); DeepSpeed then builds against it.
if ! "$venv/bin/python" -c "import torch" 2>/dev/null; then
    if command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then
        "${pip[@]}" torch
    else
        "${pip[@]}" "torch==2.13.0"
    fi
fi

DS_BUILD_OPS=0 "${pip[@]}" --no-build-isolation -e ".${extras:+[$extras]}"
echo "$want" > "$stamp"
