#!/usr/bin/env bash
# Install into .venv and run the demo: 2 CPU processes train, checkpoint asynchronously,
# get killed, and resume exactly where they left off.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/setup_env.sh
python examples/demo.py "$@"
