#!/usr/bin/env bash
# The GPU check of docs/accelerators.md: GPU tests and three figures on one CUDA GPU, in
# under 10 minutes (sized for one H200 with 16 cores), results as JSON + a summary table.
#
#   scripts/gpu-check.sh                 on the GPU machine (see "Running it on a machine without network")
#   scripts/gpu-check.sh --dry-run       the same steps on the CPU with tiny sizes (checks the script itself)
#   scripts/gpu-check.sh --fetch-wheels  HERE, with PyPI reachable: the wheels the GPU machine lacks, into .whl/
#
# Steps (each under its own time limit, so a slow step cannot eat the others' time):
#   1. tests: tests/unit/test_device.py, test_model.py, test_predict_batcher.py; their `gpu`
#      cases run on the GPU (skipped with a reason elsewhere, never passed silently)
#   2. bench/train_throughput.py --device cuda: real tokens/s, GPU busy share (torch.profiler
#      kernel union; NVML as a cross-check), data-wait share, collate cost per batch; bf16 and float32
#   3. bench/predict_latency.py --in-process --device cuda: p99 of 32-instance requests at
#      concurrency 8 through the real FastAPI app and batcher while training, / the bare GPU forward
#   4. event-to-trained latency at 5k events/s: bench/latency.py against a broker when one can
#      start here (Java 17 and Kafka's jars already cached), else its --in-process variant
#      (events fed straight into the window: the trainer's part of the latency), and says which
#
# Everything goes to $OUT (the device tool's output folder; default bench/out/gpu-check):
# summary.md, summary.json, env.json, tests.txt, train_throughput.jsonl,
# predict_latency.jsonl, latency.jsonl, gpu-check.log (8 files: what the tool brings back).
#
# Running it on a machine without network (the GPU machine): it installs nothing from
# anywhere. Its python3 must already hold torch with CUDA (the GPU machine's does: torch,
# numpy, safetensors, prometheus-client, psutil, httpx, pytest, hypothesis, scipy, ...). What
# that image lacks (pydantic, pydantic-settings, fastapi, starlette, uvicorn, kafka-python,
# orjson, crc32c, river and their small dependencies, ~7 MB for CPython 3.12) travels as
# wheels: run `scripts/gpu-check.sh --fetch-wheels` here (it fills .whl/, which git
# ignores), then on the GPU machine carry `.whl` with the working tree; this script then
# installs them with `pip install --no-index --no-deps --target` into a private folder
# (/tmp/streamtrain-site) on PYTHONPATH, leaving the image's packages alone. A .venv is not
# carried: the project's venv holds a CPU-machine torch build of several GB for Python
# 3.11, far over what travels (64 MiB) and of the wrong Python. With the device tool:
#   run(command="scripts/gpu-check.sh", carry=[".whl"], timeout_s=600)
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

# The image's python3 is 3.12; pins as in pyproject.toml, plus what they need that the image lacks.
WHEELS=(
  pydantic==2.14.4 pydantic_core==2.50.5 pydantic-settings==2.16.3 python-dotenv==1.2.4
  typing-inspection==0.4.5 annotated-types==0.8.0 typing_extensions==4.16.0
  fastapi==0.163.2 starlette==1.10.0 annotated-doc==0.0.7 opentelemetry-api==1.45.2
  uvicorn==0.54.0 kafka-python==3.0.12 crc32c==2.9.post0 orjson==3.13.0 river==0.26.1
)

if [ "$MODE" = fetch ]; then
  PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
  rm -rf .whl && mkdir -p .whl
  "$PY" -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl "${WHEELS[@]}"
  du -sh .whl
  echo "now carry .whl to the GPU machine: run(command=\"scripts/gpu-check.sh\", carry=[\".whl\"])"
  exit 0
fi

OUT=${OUT:-$ROOT/bench/out/gpu-check}
mkdir -p "$OUT"
WORK=$(mktemp -d)  # step bookkeeping: $OUT holds only the 8 result files
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
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl >>"$LOG" 2>&1
  export PYTHONPATH="$PYTHONPATH:$SITE"
fi
if ! "$PY" -c "import torch, pydantic_settings, fastapi, uvicorn, kafka, orjson, river, streamtrain.serve.app" >>"$LOG" 2>&1; then
  say "FAILED: $PY cannot import the project (see $LOG): on a machine without network carry the wheels"
  say "  (scripts/gpu-check.sh --fetch-wheels here, then run with carry=[\".whl\"])"
  exit 3
fi

if [ "$MODE" = dry ]; then
  DEVICE=cpu
  TRAIN_ARGS=(--tokens 40000 --items 2000 --segments 1 --set d_model=32)
  TRAIN_FLOAT32_ARGS=(--tokens 20000 --items 2000 --segments 1 --set d_model=32)
  PREDICT_ARGS=(--requests 16 --rounds 1 --bare-calls 4 --stream-rate 200 --set d_model=32)
  LATENCY_ARGS=(--rate 300 --warmup-s 2 --measure-s 4 --tail-s 2)
  LIMIT_TESTS=600 LIMIT_TRAIN=300 LIMIT_PREDICT=240 LIMIT_LATENCY=180
else
  DEVICE=cuda
  if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    say "FAILED: torch.cuda.is_available() is False on this machine; use --dry-run for the CPU"
    exit 4
  fi
  # Sized for one H200: ~2 minutes of training in all, the rest well inside 10 minutes.
  TRAIN_ARGS=(--tokens 24000000 --items 100000 --segments 2 --profile-steps 40)
  TRAIN_FLOAT32_ARGS=(--tokens 8000000 --items 100000 --segments 1 --profile-steps 20)
  PREDICT_ARGS=(--requests 400 --rounds 2 --bare-calls 64 --stream-rate 5000)
  LATENCY_ARGS=(--rate 5000 --warmup-s 6 --measure-s 20 --tail-s 6)
  LIMIT_TESTS=120 LIMIT_TRAIN=200 LIMIT_PREDICT=120 LIMIT_LATENCY=100
fi

STARTED=$(date +%s)
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
    "settings": {k: getattr(settings, k) for k in ("d_model", "n_heads", "n_layers", "token_budget", "max_batch_sequences", "amp", "pass_max_items", "prefetch_depth")},
}, indent=1))
EOF
say "environment: $(tr -d '\n' <"$OUT/env.json" | cut -c1-300)"

step() {  # step NAME LIMIT_S OUTFILE COMMAND...: run with a time limit, stdout to OUTFILE, stderr to the log
  local name=$1 limit=$2 outfile=$3; shift 3
  local began=$(date +%s) rc=0
  say "== $name (limit ${limit}s): $*"
  timeout --kill-after=10 "$limit" "$@" >"$outfile" 2>>"$LOG" || rc=$?
  say "   $name: exit $rc after $(( $(date +%s) - began ))s"
  echo "$name $rc" >>"$WORK/status"
}
: >"$WORK/status"

step tests "$LIMIT_TESTS" "$OUT/tests.txt" \
  "$PY" -m pytest -q -rs -p no:cacheprovider tests/unit/test_device.py tests/unit/test_model.py tests/unit/test_predict_batcher.py
tail -n 15 "$OUT/tests.txt" | tee -a "$LOG"

: >"$OUT/train_throughput.jsonl"
step train-bf16 "$LIMIT_TRAIN" "$WORK/train_bf16.jsonl" \
  "$PY" bench/train_throughput.py --device "$DEVICE" --amp bf16 --arms ours "${TRAIN_ARGS[@]}" --json
step train-float32 $(( LIMIT_TRAIN / 2 )) "$WORK/train_fp32.jsonl" \
  "$PY" bench/train_throughput.py --device "$DEVICE" --amp off --arms ours "${TRAIN_FLOAT32_ARGS[@]}" --json
cat "$WORK/train_bf16.jsonl" "$WORK/train_fp32.jsonl" >"$OUT/train_throughput.jsonl"

step predict "$LIMIT_PREDICT" "$OUT/predict_latency.jsonl" \
  "$PY" bench/predict_latency.py --in-process --device "$DEVICE" --routes v1 "${PREDICT_ARGS[@]}" --json

# A broker needs Java 17 and Kafka's jars, which deploy/kafka.sh fetches from Maven Central:
# with no network only an already cached copy can start.
BROKER=""
if [ "$MODE" = gpu ] && command -v java >/dev/null 2>&1 && ls "${XDG_CACHE_HOME:-$HOME/.cache}"/streamtrain/*kafka* >/dev/null 2>&1; then
  export KAFKA_PORT=${KAFKA_PORT:-19092}
  if timeout 90 deploy/kafka.sh up >>"$LOG" 2>&1; then BROKER="127.0.0.1:$KAFKA_PORT"; fi
fi
if [ -n "$BROKER" ]; then
  say "broker: started at $BROKER; event-to-trained latency through Kafka and ingest"
  step latency "$LIMIT_LATENCY" "$OUT/latency.jsonl" \
    "$PY" bench/latency.py --bootstrap "$BROKER" --configs "device=$DEVICE" "${LATENCY_ARGS[@]}" --json
  deploy/kafka.sh down >>"$LOG" 2>&1 || true
else
  say "broker: cannot start here (needs java and a cached Kafka, and this machine has no network):"
  say "        bench/latency.py --in-process instead (the trainer's part of the latency; no Kafka, no ingest)"
  step latency "$LIMIT_LATENCY" "$OUT/latency.jsonl" \
    "$PY" bench/latency.py --in-process --configs "device=$DEVICE" "${LATENCY_ARGS[@]}" --json
fi

"$PY" - "$OUT" "$WORK" "$MODE" "$(( $(date +%s) - STARTED ))" "${BROKER:-none (in-process)}" <<'EOF' | tee -a "$LOG"
"""summary.json and summary.md from the step outputs: the issue's figures against its targets."""
import json, math, pathlib, re, sys

out, work, mode, seconds, broker = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2]), sys.argv[3], int(sys.argv[4]), sys.argv[5]

def rows(name):
    path = out / name
    found = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            found.append(json.loads(line))
        except ValueError:
            pass
    return found

def pick(found, bench_part, metric_part):
    for row in found:
        if bench_part in row["bench"] and metric_part in row["metric"]:
            return row
    return None

status = dict(line.split() for line in (work / "status").read_text().splitlines() if line.strip())
tests = (out / "tests.txt").read_text() if (out / "tests.txt").exists() else ""
tail = [l for l in tests.splitlines() if re.search(r"\d+ (passed|failed)", l)]
train, predict, latency = rows("train_throughput.jsonl"), rows("predict_latency.jsonl"), rows("latency.jsonl")

def figure(label, row, target=None, key="value", ok=None):
    value = None if row is None else row.get(key)
    verdict = "" if ok is None or value is None or (isinstance(value, float) and math.isnan(value)) else ("met" if ok(value) else "NOT met")
    return {"figure": label, "value": value, "target": target or "", "verdict": verdict,
            "source": None if row is None else f'{row["bench"]}: {row["metric"]}'}

figures = [
    {"figure": "GPU tests", "value": tail[-1] if tail else f"no result (exit {status.get('tests')})", "target": "0 failed", "verdict": ("met" if tail and " failed" not in tail[-1] else "NOT met"), "source": "tests.txt"},
    figure("real tokens/s (bf16)", pick(train, "amp=bf16", "real tokens/s")),
    figure("real tokens/s (float32)", pick(train, "amp=off", "real tokens/s")),
    figure("GPU busy share (bf16, profiler)", pick(train, "amp=bf16", "GPU busy share"), ">= 0.90", ok=lambda v: v >= 0.90),
    figure("GPU utilization, NVML (bf16)", pick(train, "amp=bf16", "NVML")),
    figure("data-wait share (bf16)", pick(train, "amp=bf16", "data-wait share"), "<= 0.05", ok=lambda v: v <= 0.05),
    figure("producer ms/batch, plan+gather+collate (bf16)", pick(train, "amp=bf16", "producer ms/batch")),
    figure("collate_flat ms/batch (bf16)", pick(train, "amp=bf16", "collate_flat alone")),
    figure("pin ms/batch (bf16)", pick(train, "amp=bf16", "pin ms/batch")),
    figure("producer batches/s / steps/s (bf16)", pick(train, "amp=bf16", "producer batches/s"), "> 1", key="ratio", ok=lambda v: v > 1),
    figure("predict p99 s, 32 instances, concurrency 8", pick(predict, "[v1", "p99 s (HTTP while training vs bare forward)")),
    figure("predict p99 / bare GPU forward p99", pick(predict, "[v1", "p99 s (HTTP while training vs bare forward)"), "<= 3x", key="ratio", ok=lambda v: v <= 3),
    figure("event-to-trained p50 s at 5k events/s (trained events)", pick(latency, "latency[", "p50 s, trained events only"), "<= 2 s", ok=lambda v: v <= 2),
    figure("event-to-trained p50 s, all events (untrained = inf)", pick(latency, "latency[", "all measured events")),
    figure("share of events trained", pick(latency, "latency[", "share of measured events trained")),
    figure("events/s fed", pick(latency, "latency[", "events/s achieved")),
]
summary = {"mode": mode, "seconds": seconds, "broker": broker, "steps": status, "figures": figures,
           "env": json.loads((out / "env.json").read_text() or "{}")}
(out / "summary.json").write_text(json.dumps(summary, indent=1, default=str))

def fmt(v):
    if isinstance(v, float):
        return f"{v:,.0f}" if abs(v) >= 1000 else f"{v:.4g}"
    return str(v)

lines = [f"# GPU check ({mode}): {summary['env'].get('device')}", "",
         f"{seconds} s in all; broker: {broker}; step exits: {status}", "",
         "| figure | value | target | verdict |", "|---|---|---|---|"]
lines += [f"| {f['figure']} | {fmt(f['value'])} | {f['target']} | {f['verdict']} |" for f in figures]
(out / "summary.md").write_text("\n".join(lines) + "\n")
print("\n".join(lines))
EOF
say "results in $OUT"
