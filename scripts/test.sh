#!/usr/bin/env bash
# Installs streamrl with its test tools (and GEM, to test its adapter) into .venv and runs the tests.
#   scripts/test.sh                 everything (what CI runs)
#   scripts/test.sh -m "not slow"   the fast set, about a minute
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh dev,gem
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$HOME/.cache/streamrl/torch_extensions}"
set +e
.venv/bin/ruff check .  # lint (rules in pyproject.toml); the tests run either way
lint=$?
.venv/bin/python -m pytest "$@"
rc=$?
set -e
if [[ $rc -eq 5 ]]; then
    echo "pytest collected no tests: that is a failure here" >&2
fi
if [[ $rc -eq 0 && $lint -ne 0 ]]; then
    echo "ruff found problems (above): fix them, or 'ruff check --fix .'" >&2
    rc=1
fi
exit $rc
