#!/usr/bin/env bash
# Create .venv (if missing) and install the project into it. torch==2.13.0 goes first: it is
# the CPU build on this machine's disk, and any other torch request could pull a multi-GB
# CUDA build. Sourced by scripts/demo.sh and .ci/run.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PYTHON="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
# shellcheck disable=SC1091
. .venv/bin/activate
python -m pip install --quiet --upgrade pip 2>&1 | grep -v "is ignored" || true
if ! python -c "import torch, sys; sys.exit(0 if torch.__version__.startswith('2.13.0') else 1)" 2>/dev/null; then
  python -m pip install --quiet "torch==2.13.0" 2>&1 | grep -v "is ignored" || true
fi
python -m pip install --quiet -e ".[dev]" 2>&1 | grep -v "is ignored" || true
# LitData (the LitData tests): without its declared torchvision, whose wheels need another
# torch; its other requirements come with the dev extra above, and it never imports
# torchvision for non-image data
python -m pip install --quiet --no-deps "litdata==0.2.76" 2>&1 | grep -v "is ignored" || true
python -c "import torch, lightning_elastic; print('torch', torch.__version__, '| lightning_elastic', lightning_elastic.__version__)"
