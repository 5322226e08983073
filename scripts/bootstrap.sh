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
# uv installs the pinned set in parallel (a fresh .venv in ~25 s where pip took minutes) and
# keeps a cache for the next clone; pip does it when uv cannot be had. Unlike pip, uv writes no
# bytecode unless asked: with PYTHONDONTWRITEBYTECODE set (as in this machine's environment),
# every process of a fresh clone's test run then compiled torch's modules again at import.
uv_pin=$(sed -n 's/^ *"\(uv==[^"]*\)".*/\1/p' pyproject.toml | head -n 1)
if [ -n "$uv_pin" ] && { [ -x .venv/bin/uv ] || .venv/bin/python -m pip install -q "$uv_pin"; }; then
  .venv/bin/uv pip install -q --compile-bytecode --python .venv/bin/python -e ".[${extras}]"
else
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q -e ".[${extras}]"
fi
echo "bootstrap: .venv ready ($(.venv/bin/python -c 'import streamtrain; print("streamtrain", streamtrain.__version__)'))"
