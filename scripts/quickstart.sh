#!/usr/bin/env bash
# Installs streamrl into .venv and runs the quickstart.
# Until `streamrl up` lands (issue 7), the biggest real end-to-end path is the replay
# stream: an embedded redis-server, groups through the wire codec, a table and a plot.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/streamrl bench queue --quick "$@"
