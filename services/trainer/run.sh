#!/usr/bin/env sh
# Start the trainer service with its default config; extra arguments go to `streamtrain serve`.
# Override any setting with STREAMTRAIN_<NAME>, e.g. STREAMTRAIN_KAFKA_BOOTSTRAP=broker:9092.
set -eu
exec streamtrain serve --config "$(dirname "$0")/trainer.toml" "$@"
