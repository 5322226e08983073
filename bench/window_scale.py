"""The window at 100k, 1M and 10M items: memory, the lock readers take, checkpoints, restore.

Each size runs in a fresh process (so its RSS is its own). The window (``RecencyWindow``,
half-life 1 h) is filled with lognormal-length events (median 48, σ 0.8, one channel) from
a fleet of 10,000 sensors, each event with its own sensor-id string as the decoder makes
them. Then a steady stream of 5,000 events/s (batches of 100 every 20 ms) goes in from a
writer thread for ``--steady-s`` seconds while the main thread takes what a service takes:
passes (``pass_source()``, what the trainer's passes read; the service's pass selection on
it, ``PassSampler.select`` with the default settings; and the subset it chose), and two
checkpoints as the
service writes them (``capture_state`` under the lock, the state built outside it by
``WindowChain``, ``CheckpointStore.save``): a base at a third of the phase, a delta on it at
two thirds.

Reported per size:

* ``bytes/item`` and ``RSS / (readings + columns)``: RSS growth over the process before the
  window, against the readings' own bytes plus 56 bytes of columns an item (keys, ts,
  labels, lengths, offsets, seq: 8 bytes each; partition and sensor code: 4 each);
* ``snapshot lock``: the longest time the reader held the window's lock for one snapshot
  or one ``capture_state``;
* ``pass_source()`` and the pass selection: the median of each (no lock held); on a
  revision without ``pass_source`` (``PYTHONPATH`` to an older checkout), ``snapshot()``;
* ``insert_batch``: the writer's median and p99 batch insert in the steady phase, and its
  longest alone (the first quarter of the phase, the main thread asleep: what the
  machine's scheduling costs it), beside the passes and during the checkpoint (it
  waits on no lock then, but shares the interpreter with the reader; its own cuts are in
  these figures too);
* checkpoints: build, write and size of the base (the whole window: what every checkpoint
  wrote before deltas, here over the bytes that arrive in one 60 s ``CHECKPOINT_INTERVAL_S``)
  and of the delta, over the bytes (readings + columns) that arrived between the two cuts;
  and amortized with compaction: a new base once the deltas hold as many bytes as the base
  (``WindowChain``'s default), i.e. one base per ``K = ceil(base / delta)`` intervals;
* restore: reading the newest checkpoint (base + delta) and ``load_state_dict``;
* the page faults the writer took in its longest insert during the checkpoints, and the
  rate at which this machine gives the process memory it has not touched before, against
  memory touched before (on the development VM the first varies tenfold from run to run
  and bounds every figure that allocates: docs/operations.md, "A window of millions").

Run: ``python bench/window_scale.py [--sizes 100000,1000000,10000000] [--steady-s 10] [--json]``.
"""

from __future__ import annotations

import argparse
import json
import math
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _table import Row, emit  # noqa: E402

from streamtrain.checkpoint.incremental import WindowChain
from streamtrain.checkpoint.store import CheckpointStore
from streamtrain.config import Settings
from streamtrain.data.passes import pass_sampler_from_settings
from streamtrain.events import NO_LABEL, EventBatch
from streamtrain.window.reservoir import RecencyWindow

RATE = 5000  # events/s in the steady phase
WRITE_BATCH = 100
CHECKPOINT_INTERVAL_S = 60.0
PASS_MAX_ITEMS = 8192
COLUMN_BYTES = 56
FLEET = 10_000


def rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


class EventSource:
    """Poll-batch-shaped events at ``RATE`` a second of event time, from a seeded generator."""

    def __init__(self, seed: int, start_ts: float) -> None:
        self.rng = np.random.default_rng(seed)
        self.ts = start_ts
        self.offset = 0

    def batch(self, n: int) -> EventBatch:
        lengths = np.clip(np.rint(self.rng.lognormal(math.log(48), 0.8, n)), 1, 512).astype(np.int64)
        sensors = self.rng.integers(0, FLEET, n).tolist()
        ts = self.ts + np.arange(n) / RATE
        self.ts += n / RATE
        offsets = self.offset + np.arange(n, dtype=np.int64)
        self.offset += n
        return EventBatch(
            sensor_ids=np.array([f"sensor-{s:05d}" for s in sensors], dtype=object),
            ts=ts,
            labels=np.full(n, NO_LABEL, dtype=np.int64),
            lengths=lengths,
            values=self.rng.standard_normal((int(lengths.sum()), 1), dtype=np.float32),
            partitions=(offsets % 3).astype(np.int32),
            offsets=offsets,
        )


class TimedLock:
    """The window's lock, timing how long each holder keeps it (the reader side)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._acquired_at = 0.0
        self.holds: list[float] = []
        self.record = threading.local()

    def __enter__(self) -> TimedLock:
        self._lock.acquire()
        self._acquired_at = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        held = time.perf_counter() - self._acquired_at
        if getattr(self.record, "on", False):
            self.holds.append(held)
        self._lock.release()


def run_size(size: int, steady_s: float) -> dict[str, float]:
    touch_rates = first_touch_rates()  # first: memory the process never had, before it frees any
    base_rss = rss_bytes()
    now = [1.7e9]
    window = RecencyWindow(size, 3600.0, rng=np.random.default_rng(1), clock=lambda: now[0])
    lock = TimedLock()
    window._lock = lock  # type: ignore[assignment]  # the bench times the reader's holds
    source = EventSource(0, now[0])
    t0 = time.perf_counter()
    filled = 0
    while filled < size:
        n = min(50_000, size - filled)
        window.insert_batch(source.batch(n))
        filled += n
    now[0] = source.ts
    fill_s = time.perf_counter() - t0
    len(window.snapshot())  # the first read cuts the fill's overshoot
    rss = rss_bytes() - base_rss
    tokens = window.tokens
    readings = tokens * 4
    columns = size * COLUMN_BYTES

    stop = threading.Event()
    insert_s: list[float] = []
    insert_at: list[float] = []
    insert_bytes: list[int] = []  # readings + columns of each batch, at the time its insert returned
    insert_faults: list[int] = []  # page faults the writer thread took in each insert
    done_at: list[float] = []
    checkpoint_spans: list[tuple[float, float]] = []

    def writer() -> None:
        next_at = time.perf_counter()
        while not stop.is_set():
            batch = source.batch(WRITE_BATCH)
            faults = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
            t = time.perf_counter()
            window.insert_batch(batch)
            done = time.perf_counter()
            insert_faults.append(resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - faults)
            insert_s.append(done - t)
            insert_at.append(t)
            done_at.append(done)
            insert_bytes.append(batch.values.nbytes + len(batch) * COLUMN_BYTES)
            now[0] = source.ts
            next_at += WRITE_BATCH / RATE
            time.sleep(max(0.0, next_at - time.perf_counter()))

    thread = threading.Thread(target=writer, daemon=True)
    thread.start()
    quiet_start = time.perf_counter()
    time.sleep(steady_s / 4)  # the writer alone: what the machine's scheduling costs it, with no reader
    quiet_end = time.perf_counter()
    sampler = pass_sampler_from_settings(Settings(pass_max_items=PASS_MAX_ITEMS))
    read_pass = getattr(window, "pass_source", window.snapshot)  # snapshot(): a revision before pass_source
    snapshot_s: list[float] = []
    select_s: list[float] = []
    directory = Path(tempfile.mkdtemp(prefix="window-scale-"))
    store = CheckpointStore(directory, keep=1)
    chain = WindowChain()
    checkpoints: list[dict[str, float]] = []  # the base, then a delta on it
    end = time.perf_counter() + steady_s
    lock.record.on = True
    while time.perf_counter() < end or len(checkpoints) < 2:
        t = time.perf_counter()
        snap = read_pass()
        snapshot_s.append(time.perf_counter() - t)
        t = time.perf_counter()
        selection = sampler.select(snap)
        select_s.append(time.perf_counter() - t)
        pass_items = snap.subset(selection.index)
        pass_items.gather_values(np.arange(len(pass_items)))
        del snap, pass_items
        due = end - steady_s * (2 - len(checkpoints)) / 3  # the base at a third, the delta at two thirds
        if len(checkpoints) < 2 and time.perf_counter() > due:
            started = time.perf_counter()
            capture = window.capture_state()
            captured = time.perf_counter()
            pending = chain.window_state(capture, directory)
            built = time.perf_counter()
            path = store.save({"window": pending.state}, step=len(checkpoints))
            written = time.perf_counter()
            chain.written(pending, path)
            checkpoints.append(
                {
                    "captured_at": captured,
                    "capture_s": captured - started,
                    "build_s": built - captured,
                    "write_s": written - built,
                    "bytes": path.stat().st_size,
                }
            )
            checkpoint_spans.append((started, written))
            del capture, pending
        time.sleep(0.05)
    lock.record.on = False
    stop.set()
    thread.join()

    base, delta = checkpoints
    finished, sizes = np.array(done_at), np.array(insert_bytes)
    arrived = float(sizes[(finished > base["captured_at"]) & (finished <= delta["captured_at"])].sum())
    interval_s = delta["captured_at"] - base["captured_at"]
    # a new base once the deltas hold as many bytes as the last (WindowChain's default):
    # one every K intervals, so K intervals write K deltas and one base
    k = max(1, math.ceil(base["bytes"] / max(delta["bytes"], 1)))
    t = time.perf_counter()
    loaded = store.load_latest()
    assert loaded is not None
    read_s = time.perf_counter() - t
    restored = RecencyWindow(size, 3600.0, rng=np.random.default_rng(3), clock=lambda: now[0])
    restored.load_state_dict(loaded.state["window"])
    restore_s = time.perf_counter() - t
    assert len(restored) == len(window)
    shutil.rmtree(directory, ignore_errors=True)  # gigabytes at 10M
    steady, started_at = np.array(insert_s), np.array(insert_at)
    during = np.zeros(started_at.shape, dtype=bool)
    for a, b in checkpoint_spans:
        during |= (started_at >= a) & (started_at <= b)
    alone = (started_at >= quiet_start) & (started_at <= quiet_end)
    longest_during = int(np.flatnonzero(during)[np.argmax(steady[during])]) if during.any() else -1
    del loaded, restored
    return {
        "size": size,
        "fill_s": fill_s,
        "rss_mb": rss / 1e6,
        "bytes_per_item": rss / size,
        "readings_bytes_per_item": readings / size,
        "rss_over_data": rss / (readings + columns),
        "snapshot_lock_ms": 1000 * max(lock.holds),
        "snapshot_ms_p50": 1000 * float(np.median(snapshot_s)),
        "snapshots": len(snapshot_s),
        "select_ms_p50": 1000 * float(np.median(select_s)),
        "insert_ms_p50": 1000 * float(np.median(steady)),
        "insert_ms_p99": 1000 * float(np.quantile(steady, 0.99)),
        "insert_ms_max_alone": 1000 * float(steady[alone].max()),
        "insert_ms_max": 1000 * float(steady[~during & ~alone].max()),
        "insert_ms_max_checkpoint": 1000 * float(steady[during].max()) if during.any() else 0.0,
        "insert_faults_longest_checkpoint": insert_faults[longest_during] if longest_during >= 0 else 0,
        "insert_faults_mean": float(np.mean(insert_faults)),
        "capture_ms": 1000 * max(c["capture_s"] for c in checkpoints),
        "base_build_s": base["build_s"],
        "base_write_s": base["write_s"],
        "base_mb": base["bytes"] / 1e6,
        "base_over_arrived_60s": base["bytes"] / (arrived * CHECKPOINT_INTERVAL_S / interval_s),
        "delta_build_s": delta["build_s"],
        "delta_write_s": delta["write_s"],
        "delta_mb": delta["bytes"] / 1e6,
        "arrived_mb": arrived / 1e6,
        "interval_s": interval_s,
        "delta_over_arrived": delta["bytes"] / arrived,
        "amortized_over_arrived": (delta["bytes"] + base["bytes"] / k) / arrived,
        "restore_s": restore_s,
        "restore_read_s": read_s,
        **touch_rates,
    }


def first_touch_rates(megabytes: int = 512) -> dict[str, float]:
    """MB/s writing memory the process takes from the OS (first touch), then the same memory again.

    On a VM whose host backs guest memory only when it is first touched (and takes freed
    memory back), the first can be a hundred times slower than the second and vary from
    run to run; it bounds every figure above that allocates (a restore, a base's file in the
    page cache), so each run reports its own.
    """
    fresh = np.empty(megabytes << 18, dtype=np.float32)
    t = time.perf_counter()
    np.multiply(fresh, 0, out=fresh)
    first = time.perf_counter() - t
    t = time.perf_counter()
    np.multiply(fresh, 0, out=fresh)
    again = time.perf_counter() - t
    del fresh
    return {"first_touch_mb_s": megabytes / first, "touched_mb_s": megabytes / again}


def rows_for(result: dict[str, float]) -> list[Row]:
    label = f"W={int(result['size']):,}"
    return [
        Row(label, "RSS MB", result["rss_mb"]),
        Row(label, "bytes per item (readings alone)", result["bytes_per_item"], result["readings_bytes_per_item"]),
        Row(label, "RSS / (readings + columns)", result["rss_over_data"], target="<= 1.5"),
        Row(label, "snapshot/capture lock, longest ms", result["snapshot_lock_ms"], target="<= 20"),
        Row(label, "pass_source() p50 ms (whole call)", result["snapshot_ms_p50"]),
        Row(label, "insert_batch p99 ms (p50 baseline)", result["insert_ms_p99"], result["insert_ms_p50"]),
        Row(label, "insert_batch longest ms, writer alone (scheduling noise)", result["insert_ms_max_alone"]),
        Row(label, "pass selection p50 ms (PassSampler.select)", result["select_ms_p50"]),
        Row(label, "insert_batch longest ms, beside the passes", result["insert_ms_max"]),
        Row(label, "insert_batch longest ms, during the checkpoints", result["insert_ms_max_checkpoint"]),
        Row(
            label,
            "page faults in that insert (mean of all inserts)",
            result["insert_faults_longest_checkpoint"],
            result["insert_faults_mean"],
        ),
        Row(label, "base: build s", result["base_build_s"]),
        Row(label, "base: write s", result["base_write_s"]),
        Row(label, "base MB (what every checkpoint wrote before deltas)", result["base_mb"]),
        Row(label, "base / bytes arrived in 60 s", result["base_over_arrived_60s"]),
        Row(label, "delta: build s", result["delta_build_s"]),
        Row(label, "delta: write s", result["delta_write_s"]),
        Row(label, "delta MB (bytes arrived between the two cuts)", result["delta_mb"], result["arrived_mb"]),
        Row(label, "delta / bytes arrived", result["delta_over_arrived"], target="<= 2"),
        Row(label, "delta + base amortized / bytes arrived", result["amortized_over_arrived"], target="<= 3"),
        Row(label, "restore s (base + delta)", result["restore_s"], target="<= 30 at 10M"),
        Row(label, "restore: reading and replaying the files s", result["restore_read_s"]),
        Row(
            label,
            "first touch of fresh memory MB/s (memory touched before)",
            result["first_touch_mb_s"],
            result["touched_mb_s"],
        ),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="100000,1000000,10000000")
    parser.add_argument("--steady-s", type=float, default=10.0)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(run_size(args.child, args.steady_s)))
        return
    rows: list[Row] = []
    for size in (int(s) for s in args.sizes.split(",")):
        out = subprocess.run(
            [sys.executable, __file__, "--child", str(size), "--steady-s", str(args.steady_s)],
            check=True,
            capture_output=True,
            text=True,
        )
        rows += rows_for(json.loads(out.stdout.strip().splitlines()[-1]))
    emit(rows, args.json)


if __name__ == "__main__":
    main()
