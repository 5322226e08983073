#!/usr/bin/env bash
# Run the whole thing on this machine: Kafka broker, the streamtrain service and a
# simulated sensor fleet. Ctrl-C stops all three (the service writes a last checkpoint).
#   scripts/run-local.sh                 # HTTP on :8000, 200 events/s from 16 sensors
#   SIM_RATE=1000 HTTP_PORT=8080 scripts/run-local.sh
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
scripts/bootstrap.sh test >/dev/null
export STREAMTRAIN_HTTP_PORT="${HTTP_PORT:-${STREAMTRAIN_HTTP_PORT:-8000}}"
export STREAMTRAIN_KAFKA_BOOTSTRAP="${STREAMTRAIN_KAFKA_BOOTSTRAP:-127.0.0.1:${KAFKA_PORT:-9092}}"
export STREAMTRAIN_CHECKPOINT_DIR="${STREAMTRAIN_CHECKPOINT_DIR:-var/checkpoints}"
pids=()
started_broker=0
stop_all() {
  for pid in "${pids[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
  wait || true
  if [ "$started_broker" = 1 ]; then deploy/kafka.sh down; fi
}
trap stop_all EXIT INT TERM  # set before anything starts, so Ctrl-C at any point cleans up
if ! deploy/kafka.sh status >/dev/null 2>&1; then
  started_broker=1  # before `up`: an interrupted start is still stopped
  deploy/kafka.sh up
fi
# on jemalloc as the image runs it, when it can be had (deploy/jemalloc.sh); else glibc's malloc
LD_PRELOAD="$(deploy/jemalloc.sh 2>/dev/null || echo "${LD_PRELOAD:-}")" .venv/bin/streamtrain serve --config services/trainer/trainer.toml &
pids+=($!)
healthy() { .venv/bin/python -c "import sys, urllib.request; urllib.request.urlopen('http://127.0.0.1:$STREAMTRAIN_HTTP_PORT/healthz', timeout=2)" 2>/dev/null; }
until healthy; do
  kill -0 "${pids[0]}" 2>/dev/null || { echo "run-local: the service exited; see its log above" >&2; exit 1; }
  sleep 0.5
done
.venv/bin/streamtrain simulate --config services/sensor-sim/sensor-sim.toml \
  --bootstrap "$STREAMTRAIN_KAFKA_BOOTSTRAP" --rate "${SIM_RATE:-200}" --malformed-share 0.02 &
pids+=($!)
echo "streamtrain: http://localhost:$STREAMTRAIN_HTTP_PORT (try /v1/window, /v1/model, /metrics, /docs); Ctrl-C stops everything"
wait "${pids[0]}"
