#!/usr/bin/env bash
# Install cuserve (editable) into the current Python environment, with optional extras:
#   bash tools/install.sh            # the server, CPU only
#   bash tools/install.sh test       # + test dependencies (what CI runs, via the README's test command)
#   bash tools/install.sh cuda13     # + CuPy for CUDA 13 (what the Docker image runs)
# One script for CI and the Dockerfile, so the image installs exactly as CI does.
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-}"
python3 -m pip install --quiet --upgrade pip
if [ -n "$extras" ]; then
    python3 -m pip install --quiet -e ".[${extras}]"
else
    python3 -m pip install --quiet -e .
fi
python3 -c "import engine, server; print('cuserve installed:', engine.__file__)"
