#!/usr/bin/env sh
# Start the trainer service with its default config; extra arguments go to `streamtrain serve`.
# Override any setting with STREAMTRAIN_<NAME>, e.g. STREAMTRAIN_KAFKA_BOOTSTRAP=broker:9092.
# The image preloads jemalloc; elsewhere run it as LD_PRELOAD="$(deploy/jemalloc.sh)" services/trainer/run.sh.
set -eu
exec streamtrain serve --config "$(dirname "$0")/trainer.toml" "$@"
