"""A window's restore from a base and a delta, its readings mapped from the files or read into memory.

One window of ``--size`` items (``window_scale.py``'s events: lognormal lengths of median 48,
one channel, 10,000 sensors) is checkpointed as a base, then 1% more events go in and a
delta is written on it (``WindowChain``, ``CheckpointStore``), in a process of its own
that then exits. Each restore (``CheckpointStore.load_latest`` and ``load_state_dict``)
runs in a fresh process, as after a restart:

* ``mapped``: the code as it is (tensors of ``MAP_MIN_BYTES`` or more mapped from the file);
* ``read``: every tensor read into memory of the process's own (``MAP_MIN_BYTES`` set past
  any tensor: the restore before mapping);

each with the files' pages ``cold`` (dropped from the page cache with
``posix_fadvise(DONTNEED)`` first, as after a crash long after the base was written: the
writer drops them as it writes) or ``warm`` (read once through a small buffer first: every
page in the page cache). The arms alternate, in reversed order every other round.

Reported per arm (median over ``--rounds``, the range beside it): the restore, its part
reading the files, the growth of the process's RSS in it (anonymous memory, and file pages mapped),
the page cache the files hold after it (``fincore``, when present), a full pass over the
restored readings (``snapshot().all_values()``, memory of its own in both arms), and
each child's rate of first touch of 256 MB of fresh memory, measured after the restore
(the development VM's bottleneck, docs/operations.md).

Run: ``python bench/window_restore.py [--size 1000000] [--rounds 2] [--caches cold,warm] [--json]``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _table import Row, emit  # noqa: E402
from window_scale import EventSource  # noqa: E402

from streamtrain.checkpoint import format as checkpoint_format
from streamtrain.checkpoint.incremental import WindowChain
from streamtrain.checkpoint.store import CheckpointStore
from streamtrain.window.reservoir import RecencyWindow

ARMS = ("read", "mapped")


def write_checkpoints(size: int, directory: Path) -> dict[str, float]:
    """A base of a full window of ``size`` items, then a delta after 1% more events."""
    now = [1.7e9]
    window = RecencyWindow(size, 3600.0, rng=np.random.default_rng(1), clock=lambda: now[0])
    source = EventSource(0, now[0])
    filled = 0
    while filled < size:
        n = min(50_000, size - filled)
        window.insert_batch(source.batch(n))
        filled += n
    chain, store = WindowChain(), CheckpointStore(directory, keep=10)
    sizes = {}
    for kind, more in (("base", 0), ("delta", size // 100)):
        for _ in range(more // 1000):
            window.insert_batch(source.batch(1000))
        now[0] = source.ts
        pending = chain.window_state(window.capture_state(), directory)
        path = store.save({"window": pending.state}, step=len(sizes))
        chain.written(pending, path)
        assert pending.kind == kind
        sizes[f"{kind}_mb"] = path.stat().st_size / 1e6
    return sizes


def status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def cached_mb(directory: Path) -> float | None:
    """MB of the checkpoint files in the page cache (``fincore``), None without it."""
    fincore = shutil.which("fincore")
    if fincore is None:
        return None
    files = sorted(str(path) for path in directory.glob("*.stck"))
    out = subprocess.run([fincore, "--bytes", "--noheadings", "--raw", "-o", "RES", *files], capture_output=True)
    if out.returncode:
        return None
    return sum(int(line) for line in out.stdout.split()) / 1e6


def set_cache(directory: Path, cache: str) -> None:
    """Drop the files' pages from the page cache (``cold``) or bring every one in (``warm``)."""
    buffer = bytearray(8 << 20)
    for path in directory.glob("*.stck"):
        with open(path, "rb", buffering=0) as file:
            if cache == "cold":
                os.posix_fadvise(file.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
            else:
                while file.readinto(buffer):
                    pass


def restore(directory: Path, arm: str) -> dict[str, float]:
    """In a fresh process: restore the newest checkpoint, then measure what it holds."""
    if arm == "read":
        checkpoint_format.MAP_MIN_BYTES = 1 << 62
    anon_before, file_before = status_kb("RssAnon"), status_kb("RssFile")
    t = time.perf_counter()
    loaded = CheckpointStore(directory).load_latest()
    assert loaded is not None
    read_s = time.perf_counter() - t
    window = RecencyWindow(int(loaded.state["window"]["capacity"]), 3600.0, rng=np.random.default_rng(3))
    window.load_state_dict(loaded.state["window"])
    restore_s = time.perf_counter() - t
    del loaded
    anon_mb, file_mb = (status_kb("RssAnon") - anon_before) / 1e3, (status_kb("RssFile") - file_before) / 1e3
    t = time.perf_counter()
    readings = window.snapshot().all_values()
    pass_s = time.perf_counter() - t
    checksum = float(np.sum(readings[: 1 << 20]))
    del readings
    fresh = np.empty(256 << 18, dtype=np.float32)
    t = time.perf_counter()
    np.multiply(fresh, 0, out=fresh)
    first_touch = 256 / (time.perf_counter() - t)
    return {
        "restore_s": restore_s,
        "read_s": read_s,
        "rss_anon_mb": anon_mb,
        "rss_file_mb": file_mb,
        "pass_s": pass_s,
        "first_touch_mb_s": first_touch,
        "items": float(len(window)),
        "checksum": checksum,
    }


def run_child(directory: Path, arm: str) -> dict[str, float]:
    out = subprocess.run(
        [sys.executable, __file__, "--child", arm, "--directory", str(directory)],
        check=True,
        capture_output=True,
        text=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=1_000_000)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--caches", default="cold,warm")
    parser.add_argument("--directory", help="keep the checkpoints here (default: a temporary directory, removed)")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--child", choices=[*ARMS, "write"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child == "write":
        print(json.dumps(write_checkpoints(args.size, Path(args.directory))))
        return
    if args.child:
        print(json.dumps(restore(Path(args.directory), args.child)))
        return
    directory = Path(args.directory) if args.directory else Path(tempfile.mkdtemp(prefix="window-restore-"))
    try:
        if not any(directory.glob("*.stck")):
            directory.mkdir(parents=True, exist_ok=True)
            out = subprocess.run(
                [sys.executable, __file__, "--child", "write", "--size", str(args.size), "--directory", str(directory)],
                check=True,
                capture_output=True,
                text=True,
            )
            files = json.loads(out.stdout.strip().splitlines()[-1])
        else:
            files = {path.name: path.stat().st_size / 1e6 for path in directory.glob("*.stck")}
        print(json.dumps({"size": args.size, **files}), file=sys.stderr)
        results: dict[tuple[str, str], list[dict[str, float]]] = {}
        for round_ in range(args.rounds):
            for cache in args.caches.split(","):
                for arm in ARMS if round_ % 2 == 0 else ARMS[::-1]:
                    set_cache(directory, cache)
                    before = cached_mb(directory)
                    result = run_child(directory, arm)
                    result["cached_before_mb"] = before if before is not None else float("nan")
                    after = cached_mb(directory)
                    result["cached_after_mb"] = after if after is not None else float("nan")
                    print(json.dumps({"round": round_, "cache": cache, "arm": arm, **result}), file=sys.stderr)
                    results.setdefault((cache, arm), []).append(result)
        checksums = {result["checksum"] for runs in results.values() for result in runs}
        assert len(checksums) == 1, f"the arms restored different readings: {checksums}"
    finally:
        if not args.directory:
            shutil.rmtree(directory, ignore_errors=True)
    rows = []
    for (cache, arm), runs in results.items():
        label = f"W={args.size:,} {cache} {arm}"
        for metric, name in (
            ("restore_s", "restore s (base + delta, load_state_dict)"),
            ("read_s", "reading and replaying the files s"),
            ("rss_anon_mb", "RSS growth, anonymous MB"),
            ("rss_file_mb", "RSS growth, file pages mapped MB"),
            ("cached_after_mb", "files' pages in the page cache after it MB (before)"),
            ("pass_s", "a pass over all readings s"),
            ("first_touch_mb_s", "first touch of fresh memory MB/s (after the restore)"),
        ):
            values = [run[metric] for run in runs]
            baseline = None
            if metric == "cached_after_mb":
                baseline = statistics.median(run["cached_before_mb"] for run in runs)
            rows.append(
                Row(label, f"{name} [{min(values):.3g}-{max(values):.3g}]", statistics.median(values), baseline)
            )
    emit(rows, args.json)


if __name__ == "__main__":
    main()
