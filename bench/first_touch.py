"""What memory the process has never touched costs here, and what it does to a thread beside it.

Two figures, each side by side in one run:

* the rate of writing ``--mb`` MB the process just took from the OS (first touch: the
  kernel, and on a VM the host, must back every page), against writing the same memory
  again;
* a window writer inserting 25 events every 5 ms (as ``bench/window_scale.py``'s, at a
  2M-item window, which cuts every 250k events) while a
  second thread takes ``--mb`` MB of new memory ``--rounds`` times with the interpreter
  released (a numpy ufunc), against a thread that only sleeps 1 ms in a loop: the longest
  insert and its page faults (an insert that faults thousands of times is the writer's own
  cut, paying first touch for new memory), and the sleeper's longest gap;
* the window's cuts themselves: two windows of ``--cut-window`` items fed the same batches of
  ``--cut-batch`` events one after the other until each has cut ``--cuts`` times, one writing
  the columns of the cut before last again (``RecencyWindow.reuse_cut_columns``, the default)
  and one taking new columns at every cut: the longest insert that contains a cut, its page
  faults, and the most readings a cut's compaction gathered into a new chunk
  (``chunk_array``: memory the process never touched either).

Run: ``python bench/first_touch.py [--mb 512] [--rounds 6] [--cut-window 2000000] [--cuts 6] [--json]``.
"""

from __future__ import annotations

import argparse
import math
import resource
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _table import Row, emit  # noqa: E402
from window_scale import EventSource, first_touch_rates  # noqa: E402

from streamtrain.window import reservoir
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


# A cut that allocated this much in readings chunks compacted readings (a batch's own chunk is kBs)
COMPACTED_BYTES = 1 << 20


def cut_stalls(
    size: int, cuts: int, batch_events: int, modes: Sequence[str] = ("reuse", "new")
) -> dict[str, dict[str, float]]:
    """Per window of ``modes`` (``reuse``, ``new``), over its cuts after the first two (the first has no columns
    of a cut before; the second has the fill's, of another size): the longest insert with a cut and
    its page faults, the same for the cuts that compacted no readings, and the most bytes a cut's
    compaction gathered into a new readings chunk."""
    now = [1.7e9]
    windows = {mode: RecencyWindow(size, 3600.0, rng=np.random.default_rng(1), clock=lambda: now[0]) for mode in modes}
    for mode, window in windows.items():
        window.reuse_cut_columns = mode == "reuse"
    source = EventSource(0, now[0])
    for _ in range(size // 50_000):
        fill = source.batch(50_000)
        for window in windows.values():
            window.insert_batch(fill)
    allocated: list[int] = []  # bytes of each readings chunk the window allocates
    take_chunk = reservoir.chunk_array

    def counted_chunk(tokens: int, channels: int) -> np.ndarray:
        allocated.append(4 * tokens * channels)
        return take_chunk(tokens, channels)

    reservoir.chunk_array = counted_chunk  # type: ignore[assignment]
    found: dict[str, list[tuple[float, int, int]]] = {mode: [] for mode in windows}
    order = list(windows.items())
    try:
        while min(len(cut) for cut in found.values()) < cuts + 2:
            batch = source.batch(batch_events)
            now[0] = source.ts
            compacted = False
            for mode, window in order:
                columns = id(window._cols)  # the id only: a reference would keep them from being reused
                allocated.clear()
                faults = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
                t = time.perf_counter()
                window.insert_batch(batch)
                elapsed = time.perf_counter() - t
                if id(window._cols) != columns:  # a cut (the columns never grow once the window is full)
                    faults = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - faults
                    found[mode].append((elapsed, faults, sum(allocated)))
                    compacted = compacted or sum(allocated) >= COMPACTED_BYTES
            if compacted:  # compactions come every other cut: after each, the other window runs first
                order.reverse()  # (at both kinds of cut, in turn: the second may take pages the first freed)
    finally:
        reservoir.chunk_array = take_chunk  # type: ignore[assignment]
    result = {}
    for mode, all_cuts in found.items():
        cut = all_cuts[2 : cuts + 2]
        longest = max(cut)
        plain = max((c for c in cut if c[2] < COMPACTED_BYTES), default=(math.nan, 0, 0))
        result[mode] = {
            "cut_ms": 1000 * longest[0],
            "cut_faults": longest[1],
            "plain_cut_ms": 1000 * plain[0],
            "plain_cut_faults": plain[1],
            "compactions": sum(c[2] >= COMPACTED_BYTES for c in cut),
            "chunk_mb_most": max(c[2] for c in cut) / 1e6,
        }
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--cut-window", type=int, default=2_000_000)
    parser.add_argument("--cuts", type=int, default=6)
    parser.add_argument("--cut-batch", type=int, default=25)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    rates = first_touch_rates(args.mb)  # first: before this process frees any memory
    first, again = rates["first_touch_mb_s"], rates["touched_mb_s"]
    cut = cut_stalls(args.cut_window, args.cuts, args.cut_batch)
    reuse, new = cut["reuse"], cut["new"]
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
            "cut",
            f"longest insert with a cut ms, {args.cut_window} items, reuse (new columns)",
            reuse["cut_ms"],
            new["cut_ms"],
        ),
        Row("cut", "page faults in that insert, reuse (new columns)", reuse["cut_faults"], new["cut_faults"]),
        Row(
            "cut",
            "longest insert with a cut that compacted no readings ms, reuse (new columns)",
            reuse["plain_cut_ms"],
            new["plain_cut_ms"],
        ),
        Row(
            "cut", "page faults in that insert, reuse (new columns)", reuse["plain_cut_faults"], new["plain_cut_faults"]
        ),
        Row(
            "cut",
            f"cuts of {args.cuts} that compacted readings (reuse); most MB gathered into a new chunk",
            reuse["compactions"],
            reuse["chunk_mb_most"],
        ),
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
