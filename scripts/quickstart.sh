#!/usr/bin/env bash
# Installs streamrl into .venv and runs the quickstart: a whole asynchronous RL run on this machine
# (embedded Redis, sglang-router, a rollout server, a rollout worker, an evaluator and a DeepSpeed
# learner), from a model the recipe makes and warm-starts itself. Extra arguments are config
# overrides, e.g. `make quickstart ARGS="run.seed=1"`; CONFIG picks another config, e.g. the real-model
# run: `make quickstart CONFIG=configs/smollm2.yaml`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$HOME/.cache/streamrl/torch_extensions}"
exec .venv/bin/streamrl up "${CONFIG:-configs/quickstart.yaml}" --fresh "$@"
