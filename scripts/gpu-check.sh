#!/usr/bin/env bash
# The GPU check of docs/accelerators.md: GPU tests and the issue's figures on one CUDA GPU,
# in under 10 minutes (sized for one H200 with 16 cores), as JSON + a summary table.
#
#   scripts/gpu-check.sh                 on the GPU machine (see "Without network" below)
#   scripts/gpu-check.sh --dry-run       the same steps on the CPU with tiny sizes (checks the script)
#   scripts/gpu-check.sh --fetch-wheels  HERE, where PyPI answers: the wheels the GPU machine lacks, into .whl/
#   GPU_CHECK_STEPS="train-bf16 predict" scripts/gpu-check.sh   only those steps (names as in the log)
#
# Steps, each under its own time limit (their sum stays under 10 minutes, so a slow step
# cannot eat the others' time; the summary is rewritten after every step):
#   1. tests: tests/unit/test_device.py, model/test_model_inference.py, serve/test_serve_batcher.py; their `gpu`
#      cases run on the GPU (elsewhere they are skipped with a reason, never passed silently)
#   2. bench/train_throughput.py --device cuda, three runs: the GPU profile in bf16, the same in
#      float32, and bf16 with a 131,072-token budget (does a bigger step raise the busy share?):
#      real tokens/s, GPU busy share (torch.profiler kernel union; NVML as a cross-check),
#      data-wait share, collate and pin cost per batch
#   3. bench/predict_latency.py --in-process --device cuda: p99 of 32-instance requests at
#      concurrency 8 through the real FastAPI app and predict batcher while the model trains,
#      over the bare GPU forward
#   4. event-to-trained latency at 5k events/s: bench/latency.py through a broker when one can
#      start here (Java 17 and Kafka's jars already cached), else bench/latency.py --in-process
#      (events fed straight into the window: the trainer's part), and the summary says which
#
# Results in $OUT (the device tool's output folder; default bench/out/gpu-check), 8 files:
# summary.md, summary.json, env.json, tests.txt, train_throughput.jsonl,
# predict_latency.jsonl, latency.jsonl, gpu-check.log.
#
# Without network (the GPU machine): this script installs nothing from anywhere. The
# machine's python3 must already hold torch with CUDA (the GPU image's does, with numpy,
# safetensors, prometheus-client, psutil, httpx, pytest, pytest-timeout, hypothesis, scipy,
# narwhals). What that image lacks (pydantic, pydantic-settings, fastapi, starlette,
# uvicorn, kafka-python, orjson, crc32c, river and their small dependencies: ~7 MB of
# CPython 3.12 wheels) travels with the working tree as wheels:
#   1. here:  scripts/gpu-check.sh --fetch-wheels     (fills .whl/, which git ignores)
#   2. there: the device tool's run(command="scripts/gpu-check.sh", carry=[".whl"], timeout_s=600)
# The script installs them with `pip install --no-index --no-deps --target` into a private
# folder (/tmp/streamtrain-site) put on PYTHONPATH, leaving the image's packages alone. The
# project's .venv is not carried: its torch (a CUDA build of several GB, for Python 3.11)
# is far over the 64 MiB that travels, and of another Python than the image's.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

MODE=gpu
case "${1:-}" in
  --dry-run) MODE=dry ;;
  --fetch-wheels) MODE=fetch ;;
  "") ;;
  *) echo "usage: scripts/gpu-check.sh [--dry-run | --fetch-wheels]" >&2; exit 2 ;;
esac

# For the image's CPython 3.12: the pins of pyproject.toml that the image lacks, and what they need.
WHEELS=(
  pydantic==2.14.4 pydantic_core==2.50.5 pydantic-settings==2.16.3 python-dotenv==1.2.4
  typing-inspection==0.4.5 annotated-types==0.8.0 typing_extensions==4.16.0
  fastapi==0.163.2 starlette==1.10.0 annotated-doc==0.0.7 opentelemetry-api==1.45.2
  uvicorn==0.54.0 kafka-python==3.0.12 crc32c==2.9.post0 orjson==3.13.0 river==0.26.1
  narwhals==2.29.0  # river needs >= 2.0; the image's may be older
)

if [ "$MODE" = fetch ]; then
  PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
  rm -rf .whl && mkdir -p .whl
  "$PY" -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl "${WHEELS[@]}"
  du -sh .whl
  echo "next, on the GPU machine: run(command=\"scripts/gpu-check.sh\", carry=[\".whl\"], timeout_s=600)"
  exit 0
fi

OUT=${OUT:-$ROOT/bench/out/gpu-check}
mkdir -p "$OUT"
WORK=$(mktemp -d)  # step bookkeeping lives here: $OUT holds only the 8 result files
trap 'rm -rf "$WORK"' EXIT
LOG=$OUT/gpu-check.log
: >"$LOG"
say() { echo "$*" | tee -a "$LOG"; }

PY=${PYTHON:-python3}
if [ "$MODE" = dry ] && [ -z "${PYTHON:-}" ] && [ -x .venv/bin/python ]; then PY=.venv/bin/python; fi
export PYTHONPATH="$ROOT/src${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
  SITE=/tmp/streamtrain-site
  say "installing $(ls .whl/*.whl | wc -l) carried wheels into $SITE (no index, no network)"
  if "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl >>"$LOG" 2>&1; then
    export PYTHONPATH="$PYTHONPATH:$SITE"
  else  # e.g. --dry-run with another Python than the wheels' 3.12: the environment may hold it all
    say "  the wheels do not install for $("$PY" -V 2>&1) (see the log); going on with its own packages"
  fi
fi
if ! "$PY" -c "import torch, pydantic_settings, fastapi, uvicorn, kafka, orjson, river, streamtrain.serve.app" >>"$LOG" 2>&1; then
  say "FAILED: $PY cannot import the project (the log says what is missing): without network, carry"
  say "  the wheels (scripts/gpu-check.sh --fetch-wheels here, then run with carry=[\".whl\"])"
  exit 3
fi

if [ "$MODE" = dry ]; then
  DEVICE=cpu
  TINY=(--items 2000 --segments 1 --set d_model=32 --set n_layers=1)
  # The first training run compiles as on the GPU (the compile path is what most needs
  # checking); the other steps skip the CPU's compile waits (~17 s each on a quiet machine; the
  # predict step's four compiles took 143 s of a loaded one): the dry run is part of the test
  # suite, whose time CI counts, and tests/unit/model/test_model_compiled.py compiles the predict forward.
  TRAIN_RUNS=(
    "bf16|--amp bf16 --tokens 30000 --max-seconds 30 --op-table --profile-steps 2 ${TINY[*]}"
    "float32|--amp off --tokens 20000 ${TINY[*]} --set compile=off"
    "bf16-budget-131072|--amp bf16 --tokens 20000 ${TINY[*]} --set token_budget=16384 --set compile=off"
  )
  PREDICT_ARGS=(--requests 16 --rounds 1 --bare-calls 4 --stream-rate 200 --set d_model=32 --set compile=off)
  LATENCY_ARGS=(--rate 300 --warmup-s 2 --measure-s 4 --tail-s 2)
  LATENCY_CONFIG="device=cpu,d_model=32,compile=off"
  LIMIT_TESTS=600 LIMIT_TRAIN=(300 300 300) LIMIT_PREDICT=240 LIMIT_LATENCY=180
  # only the CUDA cases, which skip here with their reason: the CPU cases are the unit suite's own
  TEST_SELECT=(-k cuda)
else
  DEVICE=cuda
  if ! "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    say "FAILED: torch.cuda.is_available() is False here; --dry-run runs the steps on the CPU"
    exit 4
  fi
  COMMON=(--items 100000 --segments 2)
  # Bounded by time, not tokens (the first H200 run trained ~190k tokens/s, so 24M tokens
  # outran the step's limit and nothing came back): the compile wait and the timed segments
  # each at most --max-seconds, the rest (window fill, matmul reference, profile) ~20-30 s.
  TRAIN_RUNS=(
    "bf16|--amp bf16 --tokens 24000000 --max-seconds 50 --profile-steps 10 --op-table ${COMMON[*]}"
    "float32|--amp off --tokens 8000000 --max-seconds 20 --profile-steps 10 ${COMMON[*]}"
    "bf16-budget-131072|--amp bf16 --tokens 8000000 --max-seconds 20 --profile-steps 10 ${COMMON[*]} --set token_budget=131072 --set max_batch_sequences=8192"
  )
  PREDICT_ARGS=(--requests 400 --rounds 2 --bare-calls 64 --stream-rate 5000)
  LATENCY_ARGS=(--rate 5000 --warmup-s 6 --measure-s 20 --tail-s 6)
  LATENCY_CONFIG="device=cuda"
  # 100 + 150 + 70 + 70 + 90 + 80 = 560 s at most, plus start-up: inside 10 minutes.
  LIMIT_TESTS=100 LIMIT_TRAIN=(150 70 70) LIMIT_PREDICT=90 LIMIT_LATENCY=80
  TEST_SELECT=()
fi

STARTED=$(date +%s)
BROKER_NOTE="not run yet"
summarize() {  # after every step, so a run cut short still leaves its summary
  "$PY" scripts/gpu_check_summary.py "$OUT" "$WORK/status" "$MODE" "$(( $(date +%s) - STARTED ))" "$BROKER_NOTE" >>"$LOG" 2>&1 || true
}
wanted() {  # GPU_CHECK_STEPS="tests train-bf16 ..." runs only those steps (a rerun of what failed)
  [ -z "${GPU_CHECK_STEPS:-}" ] || [[ " $GPU_CHECK_STEPS " == *" $1 "* ]]
}
step() {  # step NAME LIMIT_S OUTFILE COMMAND...: a time limit, stdout to OUTFILE, stderr to the log
  local name=$1 limit=$2 outfile=$3 began rc=0
  shift 3
  if ! wanted "$name"; then say "== $name: not in GPU_CHECK_STEPS, skipped"; return 0; fi
  began=$(date +%s)
  say "== $name (limit ${limit}s): $*"
  timeout --kill-after=10 "$limit" "$@" >"$outfile" 2>>"$LOG" || rc=$?
  say "   $name: exit $rc after $(( $(date +%s) - began ))s"
  echo "$name $rc" >>"$WORK/status"
  summarize
}
: >"$WORK/status"

"$PY" - "$DEVICE" >"$OUT/env.json" 2>>"$LOG" <<'EOF'
import json, os, platform, subprocess, sys
import torch
from streamtrain.config import load_settings
from streamtrain.device import describe
settings = load_settings(device=sys.argv[1])
smi = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True) if settings.device != "cpu" else None
print(json.dumps({
    "device": describe(torch.device(settings.device)), "python": platform.python_version(),
    "torch": torch.__version__, "cuda": torch.version.cuda, "cpus": os.cpu_count(),
    "nvidia_smi": None if smi is None else smi.stdout.strip(),
    "gpu_profile_applied": list(settings.gpu_profile_applied),
    "settings": {k: getattr(settings, k) for k in ("d_model", "n_heads", "n_layers", "token_budget",
                                                   "max_batch_sequences", "amp", "pass_max_items", "prefetch_depth")},
}, indent=1))
EOF
say "environment: $(tr -d '\n' <"$OUT/env.json" | tr -s ' ' | cut -c1-400)"

step tests "$LIMIT_TESTS" "$OUT/tests.txt" \
  "$PY" -m pytest -q -rs -p no:cacheprovider "${TEST_SELECT[@]}" tests/unit/test_device.py tests/unit/data/test_prefetch.py tests/unit/model/test_model_inference.py tests/unit/serve/test_serve_batcher.py
if [ -f "$OUT/tests.txt" ]; then tail -n 12 "$OUT/tests.txt" | tee -a "$LOG"; fi

: >"$OUT/train_throughput.jsonl"
for i in "${!TRAIN_RUNS[@]}"; do
  run=${TRAIN_RUNS[$i]%%|*}
  read -r -a run_args <<<"${TRAIN_RUNS[$i]#*|}"
  : >"$WORK/train.jsonl"
  step "train-$run" "${LIMIT_TRAIN[$i]}" "$WORK/train.jsonl" \
    "$PY" bench/train_throughput.py --device "$DEVICE" --arms ours "${run_args[@]}" --json
  # Each row tagged with its run, so the summary can tell the runs apart.
  "$PY" -c 'import json, sys
for line in open(sys.argv[1]):
    if line.strip():
        row = json.loads(line); row["run"] = sys.argv[2]; print(json.dumps(row))' \
    "$WORK/train.jsonl" "$run" >>"$OUT/train_throughput.jsonl" 2>>"$LOG" || true
  summarize
done

step predict "$LIMIT_PREDICT" "$OUT/predict_latency.jsonl" \
  "$PY" bench/predict_latency.py --in-process --device "$DEVICE" --routes v1 "${PREDICT_ARGS[@]}" --json

# deploy/kafka.sh fetches Kafka's jars from Maven Central: without network only a cached copy starts.
BROKER=""
if [ "$MODE" = gpu ] && command -v java >/dev/null 2>&1 && [ -d "${XDG_CACHE_HOME:-$HOME/.cache}/streamtrain/kafka-jars" ]; then
  export KAFKA_PORT=${KAFKA_PORT:-19092}
  if timeout 90 deploy/kafka.sh up >>"$LOG" 2>&1; then BROKER="127.0.0.1:$KAFKA_PORT"; fi
fi
if [ -n "$BROKER" ]; then
  BROKER_NOTE="through Kafka at $BROKER (bench/latency.py)"
  say "broker: started at $BROKER; event-to-trained latency through Kafka and ingest"
  step latency "$LIMIT_LATENCY" "$OUT/latency.jsonl" \
    "$PY" bench/latency.py --bootstrap "$BROKER" --configs "$LATENCY_CONFIG" "${LATENCY_ARGS[@]}" --json
  deploy/kafka.sh down >>"$LOG" 2>&1 || true
else
  BROKER_NOTE="in-process (no broker could start: java $(command -v java >/dev/null && echo found || echo missing), no cached Kafka or no network)"
  say "broker: cannot start here (needs java and a cached Kafka, and this machine has no network):"
  say "        bench/latency.py --in-process instead (the trainer's part of the latency; no Kafka, no ingest)"
  step latency "$LIMIT_LATENCY" "$OUT/latency.jsonl" \
    "$PY" bench/latency.py --in-process --configs "$LATENCY_CONFIG" "${LATENCY_ARGS[@]}" --json
fi

summarize
tee -a "$LOG" <"$OUT/summary.md"
say "results in $OUT ($(( $(date +%s) - STARTED )) s)"
