#!/usr/bin/env bash
# The long fuzz run: the properties of tests/unit/test_fuzz.py with thousands of fresh
# examples each (CI runs a fixed 100), against the decoder, the predict validator
# through the real FastAPI app, and schemathesis over every operation of /openapi.json.
#
#   scripts/fuzz-long.sh              # 3000 examples per property (about 10 min on 2 cores)
#   scripts/fuzz-long.sh 20000 -x     # more; extra arguments go to pytest
#
# No broker needed. A failure prints the falsifying example and a @seed(...) to replay it.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
examples="${1:-3000}"
shift || true
export STREAMTRAIN_FUZZ_EXAMPLES="$examples"
exec .venv/bin/python -m pytest tests/unit/test_fuzz.py -q -p no:cacheprovider --timeout=0 \
  --hypothesis-show-statistics "$@"
