#!/usr/bin/env bash
# The long fuzz run: the properties of tests/unit/test_fuzz.py with thousands of fresh
# examples each (CI runs a fixed 100), against the decoder, the predict validator
# through the real FastAPI app, and schemathesis over every operation of /openapi.json.
#
#   scripts/fuzz-long.sh              # 3000 examples per property (about 10 min on 2 cores)
#   scripts/fuzz-long.sh 20000 -x     # more; extra arguments go to pytest
#
# First: coverage-guided atheris runs of scripts/fuzz_atheris.py (decoder and predict
# targets, ATHERIS_SECONDS each, default 120; ATHERIS_SECONDS=0 skips them).
#
# No broker needed. A failure prints the falsifying example and a @seed(...) to replay it.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
examples="${1:-3000}"
shift || true
export STREAMTRAIN_FUZZ_EXAMPLES="$examples"
atheris_seconds="${ATHERIS_SECONDS:-120}"
if [ "$atheris_seconds" -gt 0 ]; then
  for target in decoder predict; do
    echo "atheris: $target for ${atheris_seconds}s"
    .venv/bin/python scripts/fuzz_atheris.py "$target" -max_total_time="$atheris_seconds" -print_final_stats=1 2>&1 | tail -n 12
  done
fi
exec .venv/bin/python -m pytest tests/unit/test_fuzz.py -q -p no:cacheprovider --timeout=0 \
  --hypothesis-show-statistics "$@"
