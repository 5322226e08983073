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
  ``--cut-batch`` events one after the other until each has cut ``--cuts`` times, in two of the
  ``CUT_MODES`` (``--cut-modes``): ``reuse`` writes the columns of the cut before last again
  (``RecencyWindow.reuse_cut_columns``) and compacts readings inside the cut, ``new`` takes new
  columns at every cut, ``background`` (the service's) reuses columns and gathers a compaction
  on a thread of its own: the longest insert that contains a cut, its page faults, the longest
  insert of any kind, and the longest gather of a compaction and the most readings it gathered
  into a new chunk (``chunk_array``: memory the process never touched either).

Run: ``python bench/first_touch.py [--mb 512] [--rounds 6] [--cut-window 2000000] [--cuts 6]
[--cut-modes reuse,background] [--json]``.
"""

from __future__ import annotations

import argparse
import math
import resource
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _table import Row, emit  # noqa: E402
from window_scale import EventSource, first_touch_rates  # noqa: E402

from streamtrain.window.compaction import CompactionRunner, run_in_background, run_inline
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


# How each window of cut_stalls runs: whether a cut writes the columns of the cut before last
# again (reuse_cut_columns), and where a readings compaction gathers (inside the cut, or on a
# thread of its own while ingest goes on)
CUT_MODES: dict[str, tuple[bool, CompactionRunner]] = {
    "reuse": (True, run_inline),
    "new": (False, run_inline),
    "background": (True, run_in_background),
}


@dataclass
class _Cut:
    seconds: float
    faults: int
    compacted: bool  # planned a readings compaction (inline: gathered and swapped in too)
    swapped: bool  # put a merged chunk in place of its sources


def cut_stalls(
    size: int, cuts: int, batch_events: int, modes: Sequence[str] = ("reuse", "background")
) -> dict[str, dict[str, float]]:
    """Per window of ``modes`` (``CUT_MODES``), over its cuts after the first two (the first has no columns
    of a cut before; the second has the fill's, of another size), fed the same batches in turn: the
    longest insert with a cut and its page faults, the same for the cuts that compacted no readings, the
    longest insert of any kind after the second cut, the longest gather of a compaction and the most
    bytes one gathered. A background window is fed until a merge it planned is swapped in as well."""
    now = [1.7e9]
    windows = {}
    for mode in modes:
        reuse, runner = CUT_MODES[mode]
        windows[mode] = RecencyWindow(
            size, 3600.0, rng=np.random.default_rng(1), clock=lambda: now[0], run_compaction=runner
        )
        windows[mode].reuse_cut_columns = reuse
    source = EventSource(0, now[0])
    for _ in range(size // 50_000):
        fill = source.batch(50_000)
        for window in windows.values():
            window.insert_batch(fill)
    found: dict[str, list[_Cut]] = {mode: [] for mode in windows}
    longest_insert = dict.fromkeys(windows, 0.0)
    gathers: dict[str, list[tuple[float, int]]] = {mode: [] for mode in windows}  # (seconds, bytes) of each merge
    order = list(windows.items())

    def measured(mode: str) -> list[_Cut]:
        return found[mode][2 : cuts + 2]

    def enough() -> bool:
        return all(
            len(found[mode]) >= cuts + 2
            and (CUT_MODES[mode][1] is run_inline or any(c.swapped for c in measured(mode)))
            for mode in windows
        )

    while not enough():
        batch = source.batch(batch_events)
        now[0] = source.ts
        compacted = False
        for mode, window in order:
            columns = id(window._cols)  # the id only: a reference would keep them from being reused
            before = window.compactions
            faults = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
            t = time.perf_counter()
            window.insert_batch(batch)
            elapsed = time.perf_counter() - t
            after = window.compactions
            if len(found[mode]) >= 2:
                longest_insert[mode] = max(longest_insert[mode], elapsed)
            if id(window._cols) != columns:  # a cut (the columns never grow once the window is full)
                faults = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - faults
                swapped = after.merges_total > before.merges_total
                planned = after.in_flight and not before.in_flight
                found[mode].append(_Cut(elapsed, faults, planned or (swapped and not after.in_flight), swapped))
                if swapped:
                    gathers[mode].append((after.last_gather_s or 0.0, after.last_bytes))
                compacted = compacted or planned or swapped
        if compacted:  # compactions come every other cut: after each, the other window runs first
            order.reverse()  # (at both kinds of cut, in turn: the second may take pages the first freed)
    result = {}
    for mode in windows:
        cut = measured(mode)
        longest = max(cut, key=lambda c: c.seconds)
        plain = max((c for c in cut if not c.compacted and not c.swapped), key=lambda c: c.seconds, default=None)
        result[mode] = {
            "cut_ms": 1000 * longest.seconds,
            "cut_faults": longest.faults,
            "plain_cut_ms": math.nan if plain is None else 1000 * plain.seconds,
            "plain_cut_faults": math.nan if plain is None else plain.faults,
            "insert_ms": 1000 * longest_insert[mode],
            "compactions": sum(c.compacted for c in cut),
            "gather_s_most": max((s for s, _ in gathers[mode]), default=math.nan),
            "chunk_mb_most": max((b for _, b in gathers[mode]), default=0) / 1e6,
        }
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--cut-window", type=int, default=2_000_000)
    parser.add_argument("--cuts", type=int, default=6)
    parser.add_argument("--cut-batch", type=int, default=25)
    parser.add_argument(
        "--cut-modes",
        default="reuse,background",
        help=f"two of {','.join(CUT_MODES)}: windows compared side by side (cut_stalls)",
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    rates = first_touch_rates(args.mb)  # first: before this process frees any memory
    first, again = rates["first_touch_mb_s"], rates["touched_mb_s"]
    first_mode, second_mode = args.cut_modes.split(",")
    cut = cut_stalls(args.cut_window, args.cuts, args.cut_batch, (first_mode, second_mode))
    one, two = cut[first_mode], cut[second_mode]
    pair = f"{first_mode} ({second_mode})"
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
        Row("cut", f"longest insert with a cut ms, {args.cut_window} items, {pair}", one["cut_ms"], two["cut_ms"]),
        Row("cut", f"page faults in that insert, {pair}", one["cut_faults"], two["cut_faults"]),
        Row(
            "cut",
            f"longest insert with a cut that compacted no readings ms, {pair}",
            one["plain_cut_ms"],
            two["plain_cut_ms"],
        ),
        Row("cut", f"page faults in that insert, {pair}", one["plain_cut_faults"], two["plain_cut_faults"]),
        Row("cut", f"longest insert of any kind after the second cut ms, {pair}", one["insert_ms"], two["insert_ms"]),
        Row("cut", f"cuts of {args.cuts} that compacted readings, {pair}", one["compactions"], two["compactions"]),
        Row("cut", f"longest gather of a compaction s, {pair}", one["gather_s_most"], two["gather_s_most"]),
        Row(
            "cut", f"most MB a compaction gathered into a new chunk, {pair}", one["chunk_mb_most"], two["chunk_mb_most"]
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
