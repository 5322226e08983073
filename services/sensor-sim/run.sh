#!/usr/bin/env sh
# Start the sensor simulator with its default config; extra arguments go to `streamtrain simulate`
# (e.g. --rate 1000 --count 50000). STREAMTRAIN_KAFKA_BOOTSTRAP etc. override the file.
set -eu
exec streamtrain simulate --config "$(dirname "$0")/sensor-sim.toml" "$@"
