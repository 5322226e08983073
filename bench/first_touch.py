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
from collections.abc import Callable, Sequence
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
    planned: bool  # planned a readings compaction (inline: and gathered it)
    swapped: bool  # put a merged chunk in place of its sources


def _longest(cuts: Sequence[_Cut], which: Callable[[_Cut], bool]) -> tuple[float, float]:
    """(ms, page faults) of the longest of ``cuts`` that ``which`` picks; NaN when none."""
    picked = [c for c in cuts if which(c)]
    if not picked:
        return math.nan, math.nan
    longest = max(picked, key=lambda c: c.seconds)
    return 1000 * longest.seconds, longest.faults


def cut_stalls(
    size: int, cuts: int, batch_events: int, modes: Sequence[str] = ("reuse", "background")
) -> dict[str, dict[str, float]]:
    """One window per mode of ``modes`` (``CUT_MODES``), one after the other, each fed the same stream (a
    fill to ``size`` items, then batches of ``batch_events``) until it has cut ``cuts`` times after the
    first two (the first has no columns of a cut before; the second has the fill's, of another size)
    and, gathering in the background, has swapped a merge in among them. Over those cuts: the longest
    insert with a cut and its page faults (any cut; those that planned a compaction, inline with its
    gather; those that swapped one in; those that did neither), the longest insert without a cut while
    a gather ran, the longest gather of a compaction and the most bytes one gathered."""
    result = {}
    for mode in modes:
        reuse, runner = CUT_MODES[mode]
        now = [1.7e9]
        window = RecencyWindow(
            size, 3600.0, rng=np.random.default_rng(1), clock=lambda now=now: now[0], run_compaction=runner
        )
        window.reuse_cut_columns = reuse
        source = EventSource(0, now[0])
        for _ in range(size // 50_000):
            window.insert_batch(source.batch(50_000))
        found: list[_Cut] = []
        beside_gather = 0.0  # the longest insert without a cut while a merge was in flight
        gathers: list[tuple[float, int]] = []  # (seconds, bytes) of each merge swapped in
        while len(found) < cuts + 2 or (runner is run_in_background and not any(c.swapped for c in found[2:])):
            batch = source.batch(batch_events)
            now[0] = source.ts
            columns = id(window._cols)  # the id only: a reference would keep them from being reused
            before = window.compactions
            faults = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
            t = time.perf_counter()
            window.insert_batch(batch)
            elapsed = time.perf_counter() - t
            after = window.compactions
            if id(window._cols) != columns:  # a cut (the columns never grow once the window is full)
                faults = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - faults
                swapped = after.merges_total > before.merges_total
                planned = not before.in_flight and (after.in_flight or swapped)  # a cut that swaps plans none
                found.append(_Cut(elapsed, faults, planned, swapped))
                if swapped and len(found) > 2:
                    gathers.append((after.last_gather_s or 0.0, after.last_bytes))
            elif before.in_flight and len(found) >= 2:
                beside_gather = max(beside_gather, elapsed)
        measured = found[2:]
        result[mode] = {"cuts": len(measured), "plans": sum(c.planned for c in measured)}
        for name, which in (
            ("cut", lambda c: True),
            ("plan_cut", lambda c: c.planned),
            ("swap_cut", lambda c: c.swapped and not c.planned),
            ("plain_cut", lambda c: not c.planned and not c.swapped),
        ):
            result[mode][f"{name}_ms"], result[mode][f"{name}_faults"] = _longest(measured, which)
        result[mode]["insert_beside_gather_ms"] = 1000 * beside_gather if runner is run_in_background else math.nan
        result[mode]["gather_s_most"] = max((s for s, _ in gathers), default=math.nan)
        result[mode]["chunk_mb_most"] = max((b for _, b in gathers), default=0) / 1e6
        del window
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
        *(
            Row("cut", f"{what}, {args.cut_window} items, {pair}", one[key], two[key])
            for what, key in (
                ("longest insert with a cut ms", "cut_ms"),
                ("page faults in that insert", "cut_faults"),
                ("longest insert with a cut that planned a compaction ms (inline: and gathered it)", "plan_cut_ms"),
                ("page faults in that insert", "plan_cut_faults"),
                ("longest insert with a cut that only swapped a merge in ms", "swap_cut_ms"),
                ("page faults in that insert", "swap_cut_faults"),
                ("longest insert with a cut that compacted nothing ms", "plain_cut_ms"),
                ("page faults in that insert", "plain_cut_faults"),
                ("longest insert without a cut while a gather ran ms", "insert_beside_gather_ms"),
                ("cuts measured", "cuts"),
                ("cuts that planned a compaction", "plans"),
                ("longest gather of a compaction s", "gather_s_most"),
                ("most MB a compaction gathered into a new chunk", "chunk_mb_most"),
            )
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
