#!/usr/bin/env bash
# Create .venv and install streamtrain with its test extra from the pinned pyproject.
# Idempotent; re-running only installs what changed. Usage: scripts/bootstrap.sh [extras]
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
extras="${1:-test}"
python="${PYTHON:-python3.11}"
command -v "$python" >/dev/null 2>&1 || python=python3
"$python" -c 'import sys; assert sys.version_info >= (3, 11), "Python 3.11+ needed"' \
  || { echo "bootstrap: Python 3.11 or newer is required" >&2; exit 1; }
[ -x .venv/bin/python ] || "$python" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e ".[${extras}]"
echo "bootstrap: .venv ready ($(.venv/bin/python -c 'import streamtrain; print("streamtrain", streamtrain.__version__)'))"
