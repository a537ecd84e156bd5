#!/usr/bin/env bash
# Installs streamrl into .venv and runs the quickstart.
# Until `streamrl up` lands (issue 7), it runs the real paths that exist, each against a
# baseline in the same run: the replay stream (an embedded redis-server, groups through the
# wire codec) and generation (rollout servers with continuous batching behind sglang-router).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/streamrl bench queue --quick "$@"
.venv/bin/streamrl bench generate --quick "$@"
