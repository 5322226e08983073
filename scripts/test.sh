#!/usr/bin/env bash
# The test command: installs deps, brings up the local Kafka broker if it is not running,
# runs the linters and the type checker, then the whole suite (unit + integration against
# the real broker), stops what it started. Exit status: non-zero if any part failed.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
scripts/bootstrap.sh test
# lint, import order, formatting and types first: they take seconds (config: pyproject.toml)
.venv/bin/ruff check src tests bench scripts
.venv/bin/ruff format --check src tests bench scripts
.venv/bin/mypy
started_broker=0
if ! deploy/kafka.sh status >/dev/null 2>&1; then
  deploy/kafka.sh up
  started_broker=1
fi
cleanup() { if [ "$started_broker" = 1 ]; then deploy/kafka.sh down || true; fi; }
trap cleanup EXIT
export STREAMTRAIN_TEST_KAFKA="${STREAMTRAIN_TEST_KAFKA:-127.0.0.1:${KAFKA_PORT:-9092}}"
# With no test paths given: the unit tests on two workers (one per core, a file per worker),
# then the integration tests two files at a time, longest first (tests/integration/conftest.py
# orders the files by their tests' expected_seconds marks). Their services mostly start, wait
# and stop, but three files at a time were no faster in a fresh-clone CI run without the
# venv's bytecode (26 min, 14.7 here; README, "Development"). Deadlines wait for steps and admissions, not for a pace. No
# unit test competes with a service. With paths: pytest runs them as asked.
for arg in "$@"; do
  if [[ "$arg" != -* && -e "${arg%%::*}" ]]; then .venv/bin/python -m pytest "$@"; exit; fi  # not exec: the EXIT trap stops the broker
done
status=0
.venv/bin/python -m pytest -n 2 --dist loadfile "$@" tests/unit || status=$?
.venv/bin/python -m pytest -n 2 --dist loadfile --no-loadscope-reorder "$@" tests/integration || status=$?
exit "$status"
