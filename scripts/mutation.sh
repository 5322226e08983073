#!/usr/bin/env bash
# Mutation score for the modules whose bugs would be silent (issue 19, docs/testing.md).
#
#   scripts/mutation.sh               every module, in the order listed
#   scripts/mutation.sh collate       one module (names: see MODULES below)
#   scripts/mutation.sh collate 'streamtrain.data.collate.x_collate__mutmut_*'
#                                     rerun only the mutants named (globs), keeping the other results
#   scripts/mutation.sh --list        the module names, their sources and their tests
#
# Each module runs in its own work dir, mutants/<module>/ (git-ignored), that sees the
# repository's src/, tests/ and pyproject.toml through symlinks and holds a generated
# mutmut config: only that module is mutated and only its unit tests run, so a run is
# as short as it can be. A run starts fresh (the module's previous results are removed);
# MUTATION_RESUME=1 keeps them and runs only mutants without a result (naming mutants implies it).
# MUTATION_CHILDREN=N runs N mutants at a time (default 1: the machine is shared).
#
# Afterwards, from the work dir:  cd mutants/<module> && ../../.venv/bin/mutmut results
#                                 cd mutants/<module> && ../../.venv/bin/mutmut show <name>
# Not part of the default test command: on two cores the whole set takes hours.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="$ROOT/.venv/bin/python"
MUTMUT_VERSION="3.8.1"

# module | source file | its unit tests (space separated; a missing file is skipped; a word
# starting with "--" is a pytest option, e.g. --deselect=<test id> for a test too slow to rerun per mutant)
MODULES=(
  "collate|src/streamtrain/data/collate.py|tests/unit/data/test_collate.py"
  "per_sample|src/streamtrain/privacy/per_sample.py|tests/unit/privacy/test_dp_per_sample.py"
  "noise|src/streamtrain/privacy/noise.py|tests/unit/privacy/test_dp_noise.py tests/unit/privacy/test_dp_noise_mutants.py"
  "passes|src/streamtrain/data/passes.py|tests/unit/data/test_passes.py"
  "events|src/streamtrain/events.py|tests/unit/test_events.py"
  "policies|src/streamtrain/data/policies.py|tests/unit/data/test_policies.py"
  "bucketing|src/streamtrain/data/bucketing.py|tests/unit/data/test_bucketing.py tests/unit/data/test_policies.py"
  "admissions|src/streamtrain/privacy/admissions.py|tests/unit/privacy/test_dp_admissions.py tests/unit/privacy/test_dp_ledger.py"
  "window_compaction|src/streamtrain/window/compaction.py|tests/unit/window/test_window_compaction.py tests/unit/window/test_window_reservoir.py"
  "window|src/streamtrain/window/reservoir.py|tests/unit/window/test_window_reservoir.py tests/unit/window/test_window_compaction.py tests/unit/checkpoint/test_checkpoint_incremental.py --deselect=tests/unit/checkpoint/test_checkpoint_incremental.py::test_sigkill_in_the_middle_of_a_write_restores_the_last_cut_nothing_lost_nothing_twice"
  "checkpoint_codec|src/streamtrain/checkpoint/codec.py|tests/unit/checkpoint/test_checkpoint_codec.py tests/unit/checkpoint/test_checkpoint_format.py tests/unit/checkpoint/test_checkpoint_store.py"
  "checkpoint_format|src/streamtrain/checkpoint/format.py|tests/unit/checkpoint/test_checkpoint_codec.py tests/unit/checkpoint/test_checkpoint_format.py tests/unit/checkpoint/test_checkpoint_store.py tests/unit/checkpoint/test_checkpoint_incremental.py --deselect=tests/unit/checkpoint/test_checkpoint_incremental.py::test_sigkill_in_the_middle_of_a_write_restores_the_last_cut_nothing_lost_nothing_twice"
  "checkpoint_store|src/streamtrain/checkpoint/store.py|tests/unit/checkpoint/test_checkpoint_store.py tests/unit/checkpoint/test_checkpoint_format.py tests/unit/checkpoint/test_checkpoint_compat.py tests/unit/checkpoint/test_checkpoint_incremental.py --deselect=tests/unit/checkpoint/test_checkpoint_incremental.py::test_sigkill_in_the_middle_of_a_write_restores_the_last_cut_nothing_lost_nothing_twice"
  "forecasters|src/streamtrain/model/forecasters.py|tests/unit/model/test_model_forecasters.py tests/unit/quality/test_quality_selection.py"
  "holdout|src/streamtrain/quality/holdout.py|tests/unit/quality/test_quality_holdout.py tests/unit/quality/test_quality_selection.py tests/unit/quality/test_quality_gate_and_rollback.py"
  "selection|src/streamtrain/quality/selection.py|tests/unit/quality/test_quality_selection.py tests/unit/quality/test_quality_gate_and_rollback.py tests/unit/quality/test_quality_holdout.py"
  "publishing|src/streamtrain/training/publishing.py|tests/unit/training/test_training_publishing.py tests/unit/training/test_training_trainer.py tests/unit/training/test_training_registry.py tests/unit/training/test_training_faults.py tests/unit/training/test_training_resume.py tests/unit/quality/test_quality_gate_and_rollback.py tests/unit/quality/test_quality_selection.py"
  "monitor|src/streamtrain/quality/monitor.py|tests/unit/quality/test_quality_monitor.py tests/unit/quality/test_quality_drift.py tests/unit/quality/test_quality_scoring.py tests/unit/quality/test_quality_gate_and_rollback.py tests/unit/quality/test_quality_selection.py tests/unit/quality/test_quality_holdout.py"
  "replays|src/streamtrain/training/replays.py|tests/unit/training/test_training_replays.py tests/unit/quality/test_quality_selection.py"
  "checkpoint_incremental|src/streamtrain/checkpoint/incremental.py|tests/unit/checkpoint/test_checkpoint_incremental.py --deselect=tests/unit/checkpoint/test_checkpoint_incremental.py::test_sigkill_in_the_middle_of_a_write_restores_the_last_cut_nothing_lost_nothing_twice"
  "accounting|src/streamtrain/privacy/accounting.py|tests/unit/privacy/test_dp_accounting.py"
  "dataset|src/streamtrain/data/dataset.py|tests/unit/data/test_dataset.py tests/unit/data/test_passes.py tests/unit/data/test_policies.py tests/unit/data/test_prefetch.py tests/unit/data/test_randomness.py tests/unit/training/test_training_resume.py tests/unit/distributed/test_data_parallel.py tests/unit/distributed/test_lockstep.py"
  "scoring|src/streamtrain/quality/scoring.py|tests/unit/quality/test_quality_scoring.py tests/unit/quality/test_quality_drift.py tests/unit/quality/test_quality_monitor.py"
  "drift|src/streamtrain/quality/drift.py|tests/unit/quality/test_quality_drift.py tests/unit/quality/test_quality_monitor.py"
  "dp_window|src/streamtrain/privacy/window.py|tests/unit/privacy/test_dp_window.py tests/unit/privacy/test_dp_admissions.py tests/unit/privacy/test_dp_ledger.py"
  "dp_validators|src/streamtrain/privacy/validators.py|tests/unit/privacy/test_dp_validators.py"
  "dp_engine|src/streamtrain/privacy/engine.py|tests/unit/privacy/test_dp_engine.py tests/unit/privacy/test_dp_engine_group.py tests/unit/privacy/test_dp_scale_out.py tests/unit/privacy/test_dp_operator_plane.py"
  "dp_sampling|src/streamtrain/privacy/sampling.py|tests/unit/privacy/test_dp_sampling.py"
  "dp_clock|src/streamtrain/privacy/clock.py|tests/unit/privacy/test_dp_clock.py tests/unit/privacy/test_dp_engine.py"
  "dp_ledger|src/streamtrain/privacy/ledger.py|tests/unit/privacy/test_dp_ledger.py tests/unit/privacy/test_dp_admissions.py"
  "dp_group|src/streamtrain/privacy/group.py|tests/unit/privacy/test_dp_engine_group.py tests/unit/distributed/test_dp_group.py"
  "dp_config|src/streamtrain/privacy/config.py|tests/unit/privacy/test_dp_validators.py tests/unit/privacy/test_dp_sampling.py tests/unit/privacy/test_dp_engine.py"
  "dp_jsonlines|src/streamtrain/privacy/jsonlines.py|tests/unit/privacy/test_dp_jsonlines.py tests/unit/privacy/test_dp_admissions.py tests/unit/privacy/test_dp_ledger.py"
  "dead_letters|src/streamtrain/ingest/dead_letters.py|tests/unit/ingest/test_ingest_dead_letters.py"
  "watchdog|src/streamtrain/ingest/watchdog.py|tests/unit/ingest/test_ingest_watchdog.py"
  "consumers|src/streamtrain/ingest/consumers.py|tests/unit/ingest/test_ingest_consumers.py"
  "topics|src/streamtrain/ingest/topics.py|tests/unit/ingest/test_ingest_topics.py"
  "kafka_compat|src/streamtrain/ingest/kafka_compat.py|tests/unit/ingest/test_ingest_kafka_compat.py tests/unit/ingest/test_ingest_dead_letters.py"
  "security|src/streamtrain/ingest/security.py|tests/unit/ingest/test_ingest_security.py"
  "losses|src/streamtrain/model/losses.py|tests/unit/model/test_model_losses.py tests/unit/model/test_model_network.py"
  "normalization|src/streamtrain/model/normalization.py|tests/unit/model/test_model_normalization.py tests/unit/model/test_model_network.py"
  "ownership|src/streamtrain/distributed/ownership.py|tests/unit/distributed/test_distributed_ownership.py"
  "randomness|src/streamtrain/data/randomness.py|tests/unit/data/test_randomness.py"
  "batcher|src/streamtrain/serve/batcher.py|tests/unit/serve/test_serve_batcher.py"
  "inference|src/streamtrain/model/inference.py|tests/unit/model/test_model_inference.py tests/unit/model/test_model_compiled.py tests/unit/serve/test_serve_batcher.py"
  "averages|src/streamtrain/quality/averages.py|tests/unit/quality/test_quality_averages.py tests/unit/quality/test_quality_monitor.py"
  "registry|src/streamtrain/training/registry.py|tests/unit/training/test_training_registry.py"
  "cpus|src/streamtrain/runtime/cpus.py|tests/unit/runtime/test_runtime_cpus.py"
  "files|src/streamtrain/checkpoint/files.py|tests/unit/checkpoint/test_checkpoint_files.py"
  "snapshot|src/streamtrain/window/snapshot.py|tests/unit/window/test_window_snapshot.py tests/unit/data/test_policies.py tests/unit/data/test_dataset.py"
  "network|src/streamtrain/model/network.py|tests/unit/model/test_model_network.py tests/unit/model/test_model_inference.py tests/unit/model/test_model_losses.py"
  "decoders|src/streamtrain/ingest/decoders.py|tests/unit/ingest/test_ingest_decoders.py"
  "window_storage|src/streamtrain/window/storage.py|tests/unit/window/test_window_storage.py tests/unit/window/test_window_reservoir.py tests/unit/window/test_window_snapshot.py"
  "wire|src/streamtrain/distributed/wire.py|tests/unit/distributed/test_distributed_wire.py"
  "prefetch|src/streamtrain/data/prefetch.py|tests/unit/data/test_prefetch.py tests/unit/test_device.py tests/unit/data/test_dataset.py"
  "quality_config|src/streamtrain/quality/config.py|tests/unit/quality/test_quality_config.py"
  "launch|src/streamtrain/distributed/launch.py|tests/unit/distributed/test_distributed_launch.py"
  "simulation_config|src/streamtrain/tools/simulation_config.py|tests/unit/tools/test_tools_simulation_config.py"
  "sharded_store|src/streamtrain/checkpoint/sharded_store.py|tests/unit/checkpoint/test_checkpoint_sharded_store.py tests/unit/checkpoint/test_checkpoint_sharded_deltas.py tests/unit/checkpoint/test_checkpoint_rescale.py"
  "shards|src/streamtrain/checkpoint/shards.py|tests/unit/checkpoint/test_checkpoint_shards.py tests/unit/checkpoint/test_checkpoint_sharded_deltas.py tests/unit/checkpoint/test_checkpoint_rescale.py tests/unit/checkpoint/test_checkpoint_collective.py"
  "validate|src/streamtrain/data/_validate.py|tests/unit/data/test_validate.py"
  "exits|src/streamtrain/runtime/exits.py|tests/unit/runtime/test_runtime_exits.py"
  "allocator|src/streamtrain/runtime/allocator.py|tests/unit/runtime/test_runtime_allocator.py --deselect=tests/unit/runtime/test_runtime_allocator.py::test_deploy_jemalloc_gives_a_library_the_process_then_runs_on"
  "manifest|src/streamtrain/checkpoint/manifest.py|tests/unit/checkpoint/test_checkpoint_manifest.py tests/unit/checkpoint/test_checkpoint_compat.py tests/unit/checkpoint/test_checkpoint_sharded_deltas.py tests/unit/checkpoint/test_checkpoint_shards.py tests/unit/checkpoint/test_checkpoint_rescale.py"
  "partitions|src/streamtrain/window/partitions.py|tests/unit/window/test_window_partitions.py tests/unit/checkpoint/test_checkpoint_rescale.py tests/unit/checkpoint/test_checkpoint_incremental.py --deselect=tests/unit/checkpoint/test_checkpoint_incremental.py::test_sigkill_in_the_middle_of_a_write_restores_the_last_cut_nothing_lost_nothing_twice"
  "rescale|src/streamtrain/checkpoint/rescale.py|tests/unit/checkpoint/test_checkpoint_rescale.py tests/unit/checkpoint/test_checkpoint_sharded_deltas.py tests/unit/checkpoint/test_checkpoint_collective.py"
  "collective|src/streamtrain/checkpoint/collective.py|tests/unit/checkpoint/test_checkpoint_collective.py tests/unit/checkpoint/test_checkpoint_rescale.py tests/unit/checkpoint/test_checkpoint_sharded_deltas.py --deselect=tests/unit/checkpoint/test_checkpoint_sharded_deltas.py::test_sigkill_in_the_middle_of_a_shard_write_restores_the_last_cut_nothing_lost_nothing_twice"
  "lockstep|src/streamtrain/distributed/lockstep.py|tests/unit/distributed/test_lockstep.py tests/unit/test_device.py --deselect=tests/unit/distributed/test_lockstep.py::test_a_launch_that_cannot_work_stops_in_one_line"
  "trainer|src/streamtrain/training/trainer.py|tests/unit/training/test_training_trainer.py tests/unit/training/test_training_publishing.py tests/unit/training/test_training_faults.py tests/unit/training/test_training_resume.py tests/unit/training/test_training_replays.py tests/unit/quality/test_quality_gate_and_rollback.py tests/unit/runtime/test_service_restore.py tests/unit/distributed/test_lockstep.py tests/unit/test_device.py --deselect=tests/unit/distributed/test_lockstep.py::test_a_launch_that_cannot_work_stops_in_one_line"
  "oip|src/streamtrain/serve/oip.py|tests/unit/serve/test_serve_oip.py"
)

usage() { sed -n '2,18p' "$0" | sed 's/^# \{0,1\}//'; }

if [[ "${1:-}" == "-h" || "${1:-}" == "--help" ]]; then usage; exit 0; fi
if [[ "${1:-}" == "--list" ]]; then
  for row in "${MODULES[@]}"; do IFS='|' read -r name src tests <<<"$row"; printf '%-11s %s  <-  %s\n' "$name" "$src" "$tests"; done
  exit 0
fi

if [[ ! -x "$PY" ]]; then
  echo "mutation.sh: no virtual environment at .venv; run scripts/bootstrap.sh first" >&2
  exit 2
fi
if ! "$PY" -c "import mutmut, sys; sys.exit(mutmut.__version__ != '$MUTMUT_VERSION')" 2>/dev/null; then
  echo "mutation.sh: installing mutmut==$MUTMUT_VERSION into .venv" >&2
  "$PY" -m pip install --quiet "mutmut==$MUTMUT_VERSION"
fi

# One worker, lowest priority, one BLAS/torch thread: the machine is shared.
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 PYTHONHASHSEED=0
NICE=(nice -n 19)

run_module() {
  local name="$1" src="$2" tests="$3"
  shift 3  # the rest: mutant names to rerun
  local work="$ROOT/mutants/$name" selected=() t
  local files=0
  for t in $tests; do
    if [[ "$t" == --* ]]; then selected+=("$t"); elif [[ -f "$t" ]]; then selected+=("$t"); files=$((files + 1)); fi
  done
  if [[ $files -eq 0 ]]; then echo "mutation.sh: $name has no unit tests ($tests)" >&2; return 1; fi

  if [[ "${MUTATION_RESUME:-0}" != "1" && $# -eq 0 ]]; then rm -rf "$work"; fi
  mkdir -p "$work"
  ln -sfn "$ROOT/src" "$work/src"
  ln -sfn "$ROOT/tests" "$work/tests"
  ln -sfn "$ROOT/pyproject.toml" "$work/pyproject.toml"   # pytest settings (markers, timeout)
  if "$PY" - "$work/pyproject.toml" <<'EOF'
import sys, tomllib
sys.exit(0 if "mutmut" in tomllib.load(open(sys.argv[1], "rb")).get("tool", {}) else 1)
EOF
  then
    echo "mutation.sh: pyproject.toml has a [tool.mutmut] table; it would override the generated setup.cfg" >&2
    return 2
  fi
  {
    echo "# generated by scripts/mutation.sh for $name; do not edit"
    echo "[mutmut]"
    echo "source_paths = src"
    echo "only_mutate = $src"
    echo "pytest_add_cli_args_test_selection ="
    for t in "${selected[@]}"; do echo "    $t"; done
    echo "pytest_add_cli_args ="
    echo "    -p"
    echo "    no:cacheprovider"
    echo "use_git_change_detection = false"
    echo "# a mutant counts as a timeout past 2 x (its tests' time + 10 s) of wall time, or 4 x that of CPU"
    echo "# time: the 10 s covers what no test's duration holds (the tests' collection, a module fixture)"
    echo "timeout_multiplier = 2.0"
    echo "timeout_constant = 10.0"
    echo "# each mutant's tests run in a child of a fork server that never ran a test: forked straight from"
    echo "# mutmut's process, which did (threads of torch, uvicorn), a child can deadlock and count as a timeout"
    echo "process_isolation = forkserver"
  } >"$work/setup.cfg"

  echo "== $name: mutating $src, tests: ${selected[*]}"
  local start=$SECONDS rc=0
  (cd "$work" && "${NICE[@]}" "$PY" -m mutmut run --max-children "${MUTATION_CHILDREN:-1}" "$@") || rc=$?
  if [[ $rc -ne 0 ]]; then echo "mutation.sh: mutmut run for $name exited $rc" >&2; return $rc; fi
  (cd "$work" && "$PY" -m mutmut export-cicd-stats >/dev/null)
  "$PY" - "$name" "$work/mutants/mutmut-cicd-stats.json" "$((SECONDS - start))" <<'EOF'
import json, sys
name, path, seconds = sys.argv[1], sys.argv[2], int(sys.argv[3])
s = json.load(open(path))
killed = s["killed"] + s["timeout"]  # a mutant that makes a test hang is caught too
line = (f"{name}: mutants {s['total']}, killed {killed}, survived {s['survived']}, "
        f"no tests {s['no_tests']}, suspicious {s['suspicious']}, skipped {s['skipped']}, "
        f"raw score {killed / max(s['total'], 1):.1%} (before equivalents), {seconds} s")
print(line)
with open(path.rsplit("/", 2)[0] + "/summary.txt", "w") as f:
    f.write(line + "\n")
EOF
  (cd "$work" && "$PY" -m mutmut results) || true
}

want="${1:-all}"
names=("${@:2}")
if [[ ${#names[@]} -gt 0 && "$want" == "all" ]]; then echo "mutation.sh: name one module to rerun mutants of" >&2; exit 2; fi
found=0
for row in "${MODULES[@]}"; do
  IFS='|' read -r name src tests <<<"$row"
  if [[ "$want" == "all" || "$want" == "$name" ]]; then
    found=1
    run_module "$name" "$src" "$tests" "${names[@]}"
  fi
done
if [[ $found -eq 0 ]]; then
  echo "mutation.sh: no module '$want'; one of: $(for r in "${MODULES[@]}"; do printf '%s ' "${r%%|*}"; done)" >&2
  exit 2
fi
