"""What memory the process has never touched costs here, and what it does to a thread beside it.

Two figures, each side by side in one run:

* the rate of writing ``--mb`` MB the process just took from the OS (first touch: the
  kernel, and on a VM the host, must back every page), against writing the same memory
  again;
* a window writer inserting 25 events every 5 ms (as ``bench/window_scale.py``'s, at a
  2M-item window, which cuts every 250k events: new columns for the whole window) while a
  second thread takes ``--mb`` MB of new memory ``--rounds`` times with the interpreter
  released (a numpy ufunc), against a thread that only sleeps 1 ms in a loop: the longest
  insert and its page faults (an insert that faults thousands of times is the writer's own
  cut, paying first touch for its new columns), and the sleeper's longest gap.

Run: ``python bench/first_touch.py [--mb 512] [--rounds 6] [--json]``.
"""

from __future__ import annotations

import argparse
import resource
import sys
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _table import Row, emit  # noqa: E402
from window_scale import EventSource, first_touch_rates  # noqa: E402

from streamtrain.window.reservoir import RecencyWindow


def stalls(megabytes: int, rounds: int) -> dict[str, float]:
    now = [1.7e9]
    window = RecencyWindow(2_000_000, 3600.0, rng=np.random.default_rng(1), clock=lambda: now[0])
    source = EventSource(0, now[0])
    for _ in range(40):
        window.insert_batch(source.batch(50_000))
    len(window.snapshot())
    stop = threading.Event()
    inserts: list[tuple[float, int]] = []
    gaps: list[float] = []

    def writer() -> None:
        next_at = time.perf_counter()
        while not stop.is_set():
            batch = source.batch(25)
            faults = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
            t = time.perf_counter()
            window.insert_batch(batch)
            inserts.append((time.perf_counter() - t, resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - faults))
            now[0] = source.ts
            next_at += 0.005
            time.sleep(max(0.0, next_at - time.perf_counter()))

    def sleeper() -> None:
        last = time.perf_counter()
        while not stop.is_set():
            time.sleep(0.001)
            t = time.perf_counter()
            gaps.append(t - last)
            last = t

    threads = [threading.Thread(target=writer, daemon=True), threading.Thread(target=sleeper, daemon=True)]
    for thread in threads:
        thread.start()
    time.sleep(2.0)
    idle_inserts, idle_gaps = len(inserts), len(gaps)
    kept = []
    for _ in range(rounds):
        fresh = np.empty(megabytes << 18, dtype=np.float32)
        np.multiply(fresh, 0, out=fresh)
        kept.append(fresh)  # kept: every round takes memory the process never had
    stop.set()
    for thread in threads:
        thread.join()
    idle = np.array([s for s, _ in inserts[:idle_inserts]])
    busy = inserts[idle_inserts:]
    longest = max(range(len(busy)), key=lambda i: busy[i][0])
    return {
        "insert_ms_idle": 1000 * float(idle.max()),
        "insert_ms_busy": 1000 * busy[longest][0],
        "insert_faults_busy": busy[longest][1],
        "gap_ms_idle": 1000 * max(gaps[:idle_gaps]),
        "gap_ms_busy": 1000 * max(gaps[idle_gaps:]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    rates = first_touch_rates(args.mb)
    first, again = rates["first_touch_mb_s"], rates["touched_mb_s"]
    found = stalls(args.mb, args.rounds)
    rows = [
        Row("first_touch", f"write {args.mb} MB of new memory, MB/s (same memory again)", first, again),
        Row(
            "first_touch",
            "writer's longest insert ms, beside new memory (idle)",
            found["insert_ms_busy"],
            found["insert_ms_idle"],
        ),
        Row("first_touch", "page faults in that insert", found["insert_faults_busy"]),
        Row(
            "first_touch",
            "sleeper's longest gap ms, beside new memory (idle)",
            found["gap_ms_busy"],
            found["gap_ms_idle"],
        ),
    ]
    emit(rows, args.json)


if __name__ == "__main__":
    main()
