"""Readings compaction off the ingest path: a merge planned at a cut, gathered elsewhere, swapped in later,
holds the window exactly as a compaction inside the cut does."""

from __future__ import annotations

import gc
import math
import threading
import weakref
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mapped_files import mapped_file, needs_proc_maps

from streamtrain.checkpoint import format as format_module
from streamtrain.checkpoint.incremental import WindowChain
from streamtrain.checkpoint.store import CheckpointStore
from streamtrain.events import EventBatch
from streamtrain.window import compaction
from streamtrain.window.compaction import ChunkMerge, run_in_background, run_inline
from streamtrain.window.reservoir import RecencyWindow
from streamtrain.window.storage import ItemReadings

ITEM_FIELDS = ("values", "lengths", "ts", "labels", "keys", "sensor_ids", "partitions", "offsets", "seq")
# a window of 300 items of ~100 readings: its 64k tokens of leeway are soon outgrown by garbage
CAPACITY, SLACK = 300, 200


class HeldGathers:
    """A compaction runner that keeps each gather until the test runs it."""

    def __init__(self) -> None:
        self.pending: list[Callable[[], None]] = []

    def __call__(self, gather: Callable[[], None]) -> None:
        self.pending.append(gather)

    def run(self) -> None:
        while self.pending:
            self.pending.pop(0)()


def batch(start: int, n: int, seed: int) -> EventBatch:
    """``n`` events from offset ``start``: 40-300 readings each, every reading names its event and place."""
    lengths = np.random.default_rng(seed * 100_003 + start).integers(40, 300, n)
    values = np.repeat(np.arange(start, start + n, dtype=np.float32), lengths)
    values = values + np.concatenate([np.arange(k) for k in lengths]).astype(np.float32) / 256
    return EventBatch(
        sensor_ids=np.array([f"s{(start + i) % 11}" for i in range(n)], dtype=object),
        ts=np.arange(start, start + n, dtype=np.float64),
        labels=np.arange(start, start + n) % 3,
        lengths=lengths,
        values=values[:, None],
        partitions=np.zeros(n, np.int32),
        offsets=np.arange(start, start + n),
    )


def window(
    half_life: float,
    run_compaction: Callable[[Callable[[], None]], None],
    *,
    max_age_s: float | None = None,
    now: list[float] | None = None,
) -> RecencyWindow:
    clock = now if now is not None else [0.0]
    made = RecencyWindow(
        CAPACITY,
        half_life,
        max_age_s=max_age_s,
        slack=SLACK,
        rng=np.random.default_rng(11),
        clock=lambda: clock[0],
        run_compaction=run_compaction,
    )
    made._PIECE_ROWS = 37  # a swap works on many pieces here, as on millions of rows
    return made


def assert_same_items(state: dict, expected: dict) -> None:
    for name in ITEM_FIELDS:
        np.testing.assert_array_equal(np.asarray(state[name]), np.asarray(expected[name]), err_msg=name)


def fill_until_a_merge_is_in_flight(subject: RecencyWindow, twin: RecencyWindow | None = None, seed: int = 0) -> int:
    """Insert batches of 60 into both until ``subject`` has a merge planned; the next offset."""
    start = 0
    while not subject.compactions.in_flight:
        assert start < 100_000, "no compaction was planned"
        for target in (subject, twin) if twin is not None else (subject,):
            target.insert_batch(batch(start, 60, seed), {0: start + 60})
        start += 60
    return start


@settings(max_examples=30, deadline=None)
@given(
    seed=st.integers(0, 1000),
    half_life=st.sampled_from([math.inf, 2000.0]),
    max_age_s=st.sampled_from([None, 1500.0]),
    steps=st.lists(st.tuples(st.integers(40, 150), st.booleans()), min_size=40, max_size=70),
)
def test_a_window_compacting_in_the_background_holds_what_one_compacting_at_the_cut_holds(
    seed: int, half_life: float, max_age_s: float | None, steps: list[tuple[int, bool]]
) -> None:
    """Any batches, the merge's gather run at any point (or never): the same items, readings and counters
    after every insert as a twin that compacts inside its cuts (with MAX_AGE_S: a clock at the newest event)."""
    held, now = HeldGathers(), [0.0]
    background = window(half_life, held, max_age_s=max_age_s, now=now)
    inline = window(half_life, run_inline, max_age_s=max_age_s, now=now)
    start = 0
    for size, gather_now in steps:
        now[0] = float(start + size)
        for target in (background, inline):
            target.insert_batch(batch(start, size, seed), {0: start + size})
        start += size
        if gather_now:
            held.run()
        state, expected = background.state_dict(), inline.state_dict()
        assert_same_items(state, expected)
        assert state["accepted_total"] == expected["accepted_total"] and state["version"] == expected["version"]
    assert inline.compactions.merges_total >= 1  # the steps always give the twin garbage to compact


def test_a_merge_is_swapped_in_at_the_first_cut_after_its_gather_and_only_then() -> None:
    held = HeldGathers()
    subject = window(math.inf, held)
    start = fill_until_a_merge_is_in_flight(subject)
    before = len(subject.snapshot().flat_values)
    for _ in range(6):  # cuts while the gather waits: nothing is swapped, no second merge is planned
        subject.insert_batch(batch(start, 60, 0), {0: start + 60})
        start += 60
    assert len(held.pending) == 1 and subject.compactions.merges_total == 0 and subject.compactions.in_flight
    held.run()
    assert subject.compactions.in_flight  # gathered, waiting for a cut
    while subject.compactions.merges_total == 0:
        subject.insert_batch(batch(start, 60, 0), {0: start + 60})
        start += 60
        assert start < 10_000
    report = subject.compactions
    assert report.last_bytes > 0 and report.bytes_total == report.last_bytes and report.last_gather_s is not None
    assert len(subject.snapshot().flat_values) < before + 6  # the sources went, one merged chunk came
    snap = subject.snapshot()
    for values, offset in zip(snap.values, snap.offsets.tolist()):
        np.testing.assert_array_equal(values[:, 0], offset + np.arange(values.shape[0], dtype=np.float32) / 256)


def test_readers_taken_before_the_swap_keep_their_readings() -> None:
    """A snapshot, a pass's subset and checkpoint captures taken while a merge gathers read the same
    readings while (and after) a writer thread cuts, swaps the merge in and drops the merged chunks' sources."""
    go = threading.Event()

    def gather_when_told(gather: Callable[[], None]) -> None:
        threading.Thread(target=lambda: (go.wait(10), gather()), daemon=True).start()

    subject = window(math.inf, gather_when_told)
    start = fill_until_a_merge_is_in_flight(subject)
    snap, capture, unread_capture = subject.snapshot(), subject.capture_state(), subject.capture_state()
    expected_values = [v.copy() for v in snap.values]
    expected_state = subject.state_dict()
    subset_index = np.arange(0, len(snap), 3)
    mismatches: list[str] = []
    stop = threading.Event()

    def reader() -> None:
        while not stop.is_set():
            if not all(np.array_equal(a, b) for a, b in zip(snap.subset(subset_index).values, expected_values[::3])):
                mismatches.append("subset")
            if not np.array_equal(np.asarray(capture(for_checkpoint=True)["values"]), expected_state["values"]):
                mismatches.append("capture")

    def writer() -> None:
        offset = start
        go.set()
        while subject.compactions.merges_total < 2 and offset < start + 60_000:
            subject.insert_batch(batch(offset, 60, 0), {0: offset + 60})
            offset += 60
            subject.wait_for_compaction(10)

    readers = [threading.Thread(target=reader) for _ in range(2)]
    for thread in readers:
        thread.start()
    write = threading.Thread(target=writer)
    write.start()
    write.join(60)
    stop.set()
    for thread in readers:
        thread.join(10)
    assert subject.compactions.merges_total >= 2, "the writer never swapped two merges in"
    assert not mismatches, mismatches[:3]
    assert all(np.array_equal(a, b) for a, b in zip(snap.values, expected_values))
    assert_same_items(capture(), expected_state)
    assert_same_items(unread_capture(), expected_state)  # its state is first read after the swaps


def test_a_checkpoint_taken_while_a_merge_is_in_flight_restores_exactly(tmp_path: Path) -> None:
    """A base taken mid-gather, a delta after the swap: each restores the window of its cut, the same as a
    twin compacting inside its cuts; a window restored mid-gather goes on like the twin."""
    held = HeldGathers()
    subject, twin = window(math.inf, held), window(math.inf, run_inline)
    start = fill_until_a_merge_is_in_flight(subject, twin)
    chain, store = WindowChain(compaction_ratio=100.0), CheckpointStore(tmp_path, keep=10)

    def checkpoint(step: int) -> tuple[Path, dict]:
        pending = chain.window_state(subject.capture_state(), store.directory)
        path = store.save({"window": pending.state}, step=step)
        chain.written(pending, path)
        return path, subject.state_dict()

    base, base_state = checkpoint(1)
    assert_same_items(base_state, twin.state_dict())
    held.run()
    while subject.compactions.merges_total == 0:
        for target in (subject, twin):
            target.insert_batch(batch(start, 60, 0), {0: start + 60})
        start += 60
    delta, delta_state = checkpoint(2)
    assert_same_items(delta_state, twin.state_dict())
    for path, expected in ((base, base_state), (delta, delta_state)):
        loaded = CheckpointStore(tmp_path).read(path)
        assert loaded is not None
        restored = window(math.inf, run_inline)
        restored.load_state_dict(loaded.state["window"])
        assert_same_items(restored.state_dict(), expected)
    restored = window(math.inf, held)  # restored from the mid-gather base, then fed what the twin was fed after it
    loaded = CheckpointStore(tmp_path).read(base)
    assert loaded is not None
    restored.load_state_dict(loaded.state["window"])
    twin_again = window(math.inf, run_inline)
    twin_again.load_state_dict(loaded.state["window"])
    for offset in range(start, start + 3000, 60):
        for target in (restored, twin_again):
            target.insert_batch(batch(offset, 60, 0), {0: offset + 60})
        held.run()
    assert_same_items(restored.state_dict(), twin_again.state_dict())


def test_a_gathering_merge_lets_go_of_the_columns_it_read_from(monkeypatch: pytest.MonkeyPatch) -> None:
    """Once its thread has read its rows, a merge holds none of the planning cut's columns: the cut after
    next writes them again while the gather still runs (new columns cost seconds of first touch at 10M)."""
    rows_read, release = threading.Event(), threading.Event()
    new_chunk = compaction.chunk_array

    def chunk_after_a_wait(tokens: int, channels: int) -> np.ndarray:  # asked for once the rows are read
        rows_read.set()
        release.wait(10)
        return new_chunk(tokens, channels)

    monkeypatch.setattr(compaction, "chunk_array", chunk_after_a_wait)
    subject = window(math.inf, run_in_background)
    start = fill_until_a_merge_is_in_flight(subject)
    planning_columns = id(subject._cols)  # the id only: a reference would keep them from being written again
    try:
        assert rows_read.wait(10)
        cuts = 0
        while cuts < 2:
            columns = id(subject._cols)
            subject.insert_batch(batch(start, 60, 0), {0: start + 60})
            start += 60
            cuts += id(subject._cols) != columns
        assert subject.compactions.in_flight  # still gathering
        assert id(subject._cols) == planning_columns, "the cut after next took new columns: the merge held them"
    finally:
        release.set()
    assert subject.wait_for_compaction(10)


def test_restoring_drops_a_merge_in_flight() -> None:
    """``load_state_dict`` replaces the chunks a merge was planned on: its gather, run later, changes nothing."""
    held = HeldGathers()
    subject = window(math.inf, held)
    fill_until_a_merge_is_in_flight(subject)
    other = window(math.inf, run_inline)
    other.insert_batch(batch(50_000, 100, 1), {0: 7})
    state = other.state_dict()
    subject.load_state_dict(state)
    assert not subject.compactions.in_flight
    held.run()
    subject.insert_batch(batch(60_000, 500, 1), {0: 8})  # a cut
    assert subject.compactions.merges_total == 0
    expected = other
    expected.insert_batch(batch(60_000, 500, 1), {0: 8})
    assert_same_items(subject.state_dict(), expected.state_dict())


def test_a_window_dropped_mid_gather_is_collected_and_the_gather_ends() -> None:
    go, finished = threading.Event(), threading.Event()
    merges: list[ChunkMerge] = []

    def gather_when_told(gather: Callable[[], None]) -> None:
        merges.append(gather.__self__)  # type: ignore[attr-defined]
        threading.Thread(target=lambda: (go.wait(10), gather(), finished.set()), daemon=True).start()

    subject = window(math.inf, gather_when_told)
    fill_until_a_merge_is_in_flight(subject)
    gone = weakref.ref(subject)
    del subject
    gc.collect()
    assert gone() is None, "the gather kept the window alive"
    go.set()
    assert finished.wait(10)
    assert merges[0].done.is_set() and not merges[0].failed and merges[0].merged is not None


def test_a_gather_that_fails_leaves_the_chunks_and_a_later_cut_plans_again(caplog) -> None:
    held = HeldGathers()
    subject = window(math.inf, held)
    start = fill_until_a_merge_is_in_flight(subject)
    merge = held.pending[0].__self__  # type: ignore[attr-defined]
    merge.sources = ()  # the gather will index past them
    held.run()
    assert merge.failed and "readings compaction" in caplog.text
    expected = subject.state_dict()
    while len(held.pending) == 0:  # the failed merge is dropped at the next cut, then another is planned
        subject.insert_batch(batch(start, 60, 0), {0: start + 60})
        start += 60
    assert subject.compactions.merges_total == 0
    assert set(expected["seq"].tolist()) - set(subject.state_dict()["seq"].tolist())  # cuts went on
    snap = subject.snapshot()
    for values, offset in zip(snap.values, snap.offsets.tolist()):
        np.testing.assert_array_equal(values[:, 0], offset + np.arange(values.shape[0], dtype=np.float32) / 256)


@pytest.mark.parametrize("piece_bytes", [4, 400, 1 << 20])
def test_gather_into_writes_what_asarray_gives_in_pieces_of_any_size(piece_bytes: int) -> None:
    rng = np.random.default_rng(2)
    chunks = tuple(rng.normal(size=(int(rng.integers(50, 90)), 2)).astype(np.float32) for _ in range(4))
    lengths = rng.integers(0, 8, 40)
    chunk_of = rng.integers(0, 4, 40).astype(np.int32)
    starts = np.array([rng.integers(0, chunks[c].shape[0] - k + 1) for c, k in zip(chunk_of, lengths)])
    readings = ItemReadings(chunks, chunk_of, starts, lengths)
    out = np.full((int(lengths.sum()), 2), np.nan, np.float32)
    readings.gather_into(out, piece_bytes=piece_bytes)
    np.testing.assert_array_equal(out, np.asarray(readings))


def test_the_default_runner_gathers_on_another_thread() -> None:
    threads: list[str] = []
    run_in_background(lambda: threads.append(threading.current_thread().name))
    for thread in threading.enumerate():
        if thread.name == "window-compaction":
            assert thread.daemon
            thread.join(10)
    assert threads == ["window-compaction"]


@needs_proc_maps
def test_a_window_restored_from_mapped_files_is_the_one_read_and_compacts_after_they_are_deleted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The readings of a base and a delta, mapped (checkpoint.format.MAP_MIN_BYTES), become the window's
    chunks: the same window as restored from the files read, still readable once the files are pruned, and
    a compaction gathers out of them."""
    subject = window(math.inf, run_inline)
    chain, store = WindowChain(compaction_ratio=100.0), CheckpointStore(tmp_path, keep=10)
    start = 0
    for step in (1, 2):
        for _ in range(8):
            subject.insert_batch(batch(start, 60, 3), {0: start + 60})
            start += 60
        pending = chain.window_state(subject.capture_state(), store.directory)
        path = store.save({"window": pending.state}, step=step)
        chain.written(pending, path)
        assert pending.kind == ("base" if step == 1 else "delta")
    expected = subject.state_dict()
    restored = {}
    for how, map_min_bytes in (("read", 1 << 62), ("mapped", 4096)):
        monkeypatch.setattr(format_module, "MAP_MIN_BYTES", map_min_bytes)
        loaded = CheckpointStore(tmp_path).load_latest()
        assert loaded is not None and loaded.path == path
        restored[how] = window(math.inf, run_inline)
        restored[how].load_state_dict(loaded.state["window"])
        del loaded
        assert_same_items(restored[how].state_dict(), expected)
    chunk_files = {mapped_file(chunk.ctypes.data) for chunk in restored["mapped"]._chunk_arrays}
    assert chunk_files == {str(file) for file in tmp_path.glob("*.stck")}  # the base's readings and the delta's
    assert {mapped_file(chunk.ctypes.data) for chunk in restored["read"]._chunk_arrays} == {None}
    for file in tmp_path.glob("*.stck"):
        file.unlink()
    assert_same_items(restored["mapped"].state_dict(), expected)
    while restored["mapped"].compactions.merges_total == 0:
        assert start < 100_000, "no compaction ran"
        for target in restored.values():
            target.insert_batch(batch(start, 60, 3), {0: start + 60})
        start += 60
    assert_same_items(restored["mapped"].state_dict(), restored["read"].state_dict())
