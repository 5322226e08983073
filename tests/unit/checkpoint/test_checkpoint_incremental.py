"""Incremental window checkpoints: a delta on the last checkpoint, restored as base + deltas, never mixed."""

from __future__ import annotations

import dataclasses
import textwrap
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from stalled_child import kill_when_stalled

from streamtrain.checkpoint.files import chunk_pieces
from streamtrain.checkpoint.format import CorruptCheckpoint, encode_checkpoint
from streamtrain.checkpoint.incremental import DELTA_OF, ChainReport, PendingWindow, WindowChain, replay
from streamtrain.checkpoint.store import CheckpointStore, read_checkpoint, read_checkpoint_link
from streamtrain.events import EventBatch
from streamtrain.window.partitions import join_partitions, split_by_partition
from streamtrain.window.reservoir import RecencyWindow
from streamtrain.window.storage import ItemReadings, SensorCodes

ITEM_FIELDS = ("values", "lengths", "ts", "labels", "keys", "sensor_ids", "partitions", "offsets", "seq")
COUNTERS = ("accepted_total", "rejected_total", "held_out_total", "next_offsets", "version", "reference_ts")


def batch(start: int, n: int, *, clock: float | None = None, seed: int = 0) -> EventBatch:
    """``n`` events numbered from ``start``: readings that name their event, lengths 1..8."""
    rng = np.random.default_rng(start + 7919 * seed)
    lengths = rng.integers(1, 9, n)
    values = np.repeat(np.arange(start, start + n, dtype=np.float32), lengths)[:, None]
    values = values + np.concatenate([np.arange(k) for k in lengths]).astype(np.float32)[:, None] / 16
    return EventBatch(
        sensor_ids=np.array([f"s{(start + i) % 13}" for i in range(n)], dtype=object),
        ts=np.full(n, float(start if clock is None else clock)) + np.arange(n) * 1e-3,
        labels=np.arange(start, start + n) % 3,
        lengths=lengths,
        values=values,
        partitions=(np.arange(start, start + n) % 2).astype(np.int32),
        offsets=np.arange(start, start + n),
    )


def assert_same_window(restored: dict, expected: dict) -> None:
    for name in ITEM_FIELDS:
        np.testing.assert_array_equal(np.asarray(restored[name]), np.asarray(expected[name]), err_msg=name)
    for name in COUNTERS:
        assert restored[name] == expected[name], name
    assert restored["rng_state"] == expected["rng_state"]


def checkpoint(window: RecencyWindow, chain: WindowChain, store: CheckpointStore, step: int) -> tuple[Path, str]:
    pending = chain.window_state(window.capture_state(), store.directory)
    path = store.save({"window": pending.state, "trainer": {"step": step}}, step=step)
    chain.written(pending, path)
    return path, pending.kind


def new_window(max_age_s: float | None = None, clock: list[float] | None = None) -> RecencyWindow:
    now = clock if clock is not None else [0.0]
    return RecencyWindow(60, 20.0, max_age_s=max_age_s, slack=8, rng=np.random.default_rng(5), clock=lambda: now[0])


def test_every_checkpoint_of_a_chain_restores_exactly_the_window_of_its_cut(tmp_path: Path) -> None:
    window, chain = new_window(), WindowChain(compaction_ratio=100.0)
    store = CheckpointStore(tmp_path, keep=50)
    expected: dict[Path, dict] = {}
    kinds = []
    for step in range(12):
        window.insert_batch(batch(100 * step, 30 + step), {0: 100 * step + 30 + step}, rejected={"decode": 1})
        path, kind = checkpoint(window, chain, store, step)
        expected[path], _ = window.state_dict(), kinds.append(kind)
    assert kinds == ["base"] + ["delta"] * 11
    for path, state in expected.items():  # each one, chain and all, from a store that never saw them
        loaded = CheckpointStore(tmp_path).read(path)
        assert loaded is not None
        assert_same_window(loaded.state["window"], state)
        restored = new_window()
        restored.load_state_dict(loaded.state["window"])
        assert_same_window(restored.state_dict(), state)


def test_a_delta_holds_what_entered_and_the_numbers_of_what_left(tmp_path: Path) -> None:
    window = RecencyWindow(2000, 20.0, slack=8, rng=np.random.default_rng(5), clock=lambda: 0.0)
    chain, store = WindowChain(), CheckpointStore(tmp_path)
    window.insert_batch(batch(0, 2008))
    before = set(window.state_dict()["seq"].tolist())
    base, _ = checkpoint(window, chain, store, 1)
    window.insert_batch(batch(1000, 10, clock=1000.0))  # far newer: all ten enter, ten leave
    after = window.state_dict()
    pending = chain.window_state(window.capture_state(), tmp_path)
    assert pending.kind == "delta"
    assert pending.state[DELTA_OF]["name"] == base.name
    entered = set(pending.state["entered"]["seq"].tolist())
    assert entered == set(after["seq"].tolist()) - before and len(entered) == 10
    assert set(pending.state["left_seq"].tolist()) == before - set(after["seq"].tolist())
    assert pending.state["entered"]["values"].shape[0] == int(pending.state["entered"]["lengths"].sum())
    delta = store.save({"window": pending.state}, step=2)
    assert delta.stat().st_size < base.stat().st_size / 20  # 10 of 2000 items, and the counters


def test_replay_follows_the_last_change_of_an_item_that_left_a_read_and_came_back(tmp_path: Path) -> None:
    """With MAX_AGE_S an item can leave a read and come back: X in the window, outranked by an
    older event B that arrives late, back once B expired, outranked again by a late C; the
    chain must follow every change (the last one counts, not the first)."""
    for seed in range(500):
        now = [5.0]
        window = RecencyWindow(1, 1e9, max_age_s=10.0, slack=10, rng=np.random.default_rng(seed), clock=lambda: now[0])
        chain, store = WindowChain(compaction_ratio=100.0), CheckpointStore(tmp_path / str(seed), keep=10)
        seen = []
        for step, (ts, clock) in enumerate([(5.0, 5.0), (0.0, 5.0), (-100.0, 10.5), (1.0, 10.5)]):
            now[0] = clock
            window.insert_batch(batch(10 * step, 1, clock=ts))  # X, B, a stale event, C
            path, kind = checkpoint(window, chain, store, step)
            seen.append(window.state_dict()["seq"].tolist())
        if seen == [[0], [1], [0], [3]]:  # X, B, X again, C
            break
    assert seen == [[0], [1], [0], [3]], "no seed gave B and C keys above X's"
    assert kind == "delta"
    loaded = CheckpointStore(tmp_path / str(seed)).read(path)
    assert loaded is not None
    assert_same_window(loaded.state["window"], window.state_dict())


def test_an_item_back_before_one_that_stayed_comes_back_in_arrival_order(tmp_path: Path) -> None:
    """X and Y in the base; X outranked by a late older B, back once B expired: the restored
    window lists X (from the newest delta) before Y (from the base), as the live one does."""
    for seed in range(500):
        now = [5.0]
        window = RecencyWindow(2, 1e9, max_age_s=10.0, slack=10, rng=np.random.default_rng(seed), clock=lambda: now[0])
        chain, store = WindowChain(compaction_ratio=100.0), CheckpointStore(tmp_path / str(seed), keep=10)
        seen = []
        for step, (first, n, ts, clock) in enumerate([(0, 2, 5.0, 5.0), (10, 1, 0.0, 5.0), (20, 1, -100.0, 10.5)]):
            now[0] = clock
            window.insert_batch(batch(first, n, clock=ts))  # X and Y, B, a stale event
            path, kind = checkpoint(window, chain, store, step)
            seen.append(window.state_dict()["seq"].tolist())
        if seen == [[0, 1], [1, 2], [0, 1]]:
            break
    assert seen == [[0, 1], [1, 2], [0, 1]], "no seed gave X the lowest key"
    loaded = CheckpointStore(tmp_path / str(seed)).read(path)
    assert loaded is not None
    assert_same_window(loaded.state["window"], window.state_dict())


def test_a_window_restored_out_of_arrival_order_replays_in_its_own_order(tmp_path: Path) -> None:
    """A sharded restore lists items by partition, not by arrival: base + deltas written after it
    still give every item its own readings, in the live window's order."""
    window = new_window()
    window.insert_batch(batch(0, 40))
    state = window.state_dict()
    by_partition = join_partitions(split_by_partition(state), channels=1)
    assert not np.all(np.diff(by_partition["seq"]) > 0)  # not in arrival order
    restored = new_window()
    restored.load_state_dict({**state, **by_partition})
    chain, store = WindowChain(compaction_ratio=100.0), CheckpointStore(tmp_path, keep=10)
    for step in range(4):
        restored.insert_batch(batch(100 * (step + 1), 6, clock=100.0 * (step + 1)))
        path, kind = checkpoint(restored, chain, store, step)
        loaded = CheckpointStore(tmp_path).read(path)
        assert loaded is not None
        assert_same_window(loaded.state["window"], restored.state_dict())
    assert kind == "delta"


def test_a_new_base_comes_once_the_deltas_outweigh_the_last_one_and_old_chains_are_pruned(tmp_path: Path) -> None:
    window, chain = new_window(), WindowChain(compaction_ratio=0.5)
    store = CheckpointStore(tmp_path, keep=1)
    kinds = []
    for step in range(30):
        window.insert_batch(batch(100 * step, 25, clock=100.0 * step))  # newer than all: 25 enter, 25 leave
        _, kind = checkpoint(window, chain, store, step)
        kinds.append(kind)
        files = sorted(p.name for p in tmp_path.glob("ckpt-*"))
        assert len(files) == chain.report().chain_length + 1  # the newest, its base and the deltas between
    assert kinds.count("base") >= 5 and kinds.count("delta") >= 10
    report = chain.report()
    assert report.written == {"base": kinds.count("base"), "delta": kinds.count("delta")}
    assert report.deltas_bytes < 0.5 * report.base_bytes + report.base_bytes  # compaction keeps the chain bounded
    loaded = CheckpointStore(tmp_path).load_latest()
    assert loaded is not None and loaded.step == 29
    assert_same_window(loaded.state["window"], window.state_dict())


def test_with_keep_2_a_damaged_base_leaves_the_previous_chain_to_restore(tmp_path: Path) -> None:
    """Every kept delta builds on one base; the store keeps the tip of the chain before it too."""
    window, chain = new_window(), WindowChain(compaction_ratio=1e9, max_chain=3)
    store = CheckpointStore(tmp_path, keep=2)
    states, kinds, paths = {}, [], []
    for step in range(7):  # base, 3 deltas, base, 2 deltas
        window.insert_batch(batch(100 * step, 25, clock=100.0 * step))
        path, kind = checkpoint(window, chain, store, step)
        states[step], _, _ = window.state_dict(), kinds.append(kind), paths.append(path)
    assert kinds == ["base", "delta", "delta", "delta", "base", "delta", "delta"]
    assert sorted(p.name for p in tmp_path.glob("ckpt-*")) == sorted(p.name for p in paths)  # all still needed
    new_base = paths[4]
    data = bytearray(new_base.read_bytes())
    data[len(data) // 2] ^= 0xFF
    new_base.write_bytes(bytes(data))
    loaded = CheckpointStore(tmp_path).load_latest()
    assert loaded is not None and loaded.step == 3  # the old chain's tip
    assert_same_window(loaded.state["window"], states[3])
    # once the new chain has two sound checkpoints of its own... it still keeps a second chain
    window.insert_batch(batch(5000, 25, clock=5000.0))
    chain._link = None  # as after a restart: the next one is a base
    checkpoint(window, chain, CheckpointStore(tmp_path, keep=2), 7)
    assert {p.name for p in tmp_path.glob("ckpt-*")} >= {paths[3].name, paths[0].name}


def test_the_chain_is_bounded_by_max_chain(tmp_path: Path) -> None:
    window, chain = new_window(), WindowChain(compaction_ratio=1e9, max_chain=3)
    store = CheckpointStore(tmp_path, keep=1)
    kinds = []
    for step in range(9):
        window.insert_batch(batch(100 * step, 5))
        kinds.append(checkpoint(window, chain, store, step)[1])
    assert kinds == ["base", "delta", "delta", "delta"] * 2 + ["base"]


@pytest.mark.parametrize("damage", ["flip a byte", "delete", "replace"])
def test_a_damaged_delta_falls_back_to_the_last_cut_before_it(tmp_path: Path, damage: str) -> None:
    window, chain = new_window(), WindowChain(compaction_ratio=100.0)
    store = CheckpointStore(tmp_path, keep=10)
    states, paths = [], []
    for step in range(5):
        window.insert_batch(batch(100 * step, 40, clock=100.0 * step))
        paths.append(checkpoint(window, chain, store, step)[0])
        states.append(window.state_dict())
    victim = paths[2]
    if damage == "flip a byte":
        data = bytearray(victim.read_bytes())
        data[len(data) // 2] ^= 0xFF
        victim.write_bytes(bytes(data))
    elif damage == "delete":
        victim.unlink()
    else:  # another checkpoint of the same name: not the file the later deltas build on
        other = CheckpointStore(tmp_path / "other")
        other_window = new_window()
        other_window.insert_batch(batch(5000, 3))
        victim.write_bytes(other.save({"window": other_window.state_dict(), "trainer": {}}, step=2).read_bytes())
    reported: list[tuple[str, str]] = []
    reader = CheckpointStore(tmp_path, on_corrupt=lambda path, reason: reported.append((path.name, reason)))
    loaded = reader.load_latest()
    expected_step = 2 if damage == "replace" else 1  # a replacement is a sound checkpoint of its own
    assert loaded is not None and loaded.step == expected_step
    if damage != "replace":
        assert_same_window(loaded.state["window"], states[1])
    assert {name for name, _ in reported} >= {paths[3].name, paths[4].name}
    assert all(victim.name in reason for name, reason in reported if name in (paths[3].name, paths[4].name))
    assert reader.read(paths[4]) is None


def test_read_checkpoint_gives_the_whole_window_and_read_checkpoint_link_the_delta(tmp_path: Path) -> None:
    window, chain = new_window(), WindowChain(compaction_ratio=100.0)
    store = CheckpointStore(tmp_path)
    for step in range(3):
        window.insert_batch(batch(100 * step, 20, clock=100.0 * step))
        path, _ = checkpoint(window, chain, store, step)
    assert_same_window(read_checkpoint(path).state["window"], window.state_dict())
    assert DELTA_OF in read_checkpoint_link(path).state["window"]
    next(iter(sorted(tmp_path.glob("ckpt-000000000000-*")))).unlink()  # the base
    with pytest.raises(CorruptCheckpoint, match="which is missing"):
        read_checkpoint(path)


def test_a_base_checkpoint_without_deltas_still_restores_as_before(tmp_path: Path) -> None:
    """Checkpoints written before deltas existed are bases: read exactly as they were."""
    window = new_window()
    window.insert_batch(batch(0, 100))
    path = CheckpointStore(tmp_path).save({"window": window.state_dict(), "trainer": {}}, step=3)
    loaded = CheckpointStore(tmp_path).read(path)
    assert loaded is not None
    assert_same_window(loaded.state["window"], window.state_dict())


@settings(max_examples=25, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 40), min_size=1, max_size=8),
    jumps=st.lists(st.sampled_from([0.0, 1.0, 50.0]), min_size=8, max_size=8),
    max_age=st.sampled_from([None, 30.0]),
)
def test_replay_of_any_chain_equals_the_live_window(
    sizes: list[int], jumps: list[float], max_age: float | None
) -> None:
    now = [0.0]
    window = new_window(max_age, now)
    base: dict | None = None
    deltas: list[dict] = []
    previous: np.ndarray | None = None
    for i, n in enumerate(sizes):
        now[0] += jumps[i]
        if n:
            window.insert_batch(batch(1000 * i, n, clock=now[0], seed=n))
        capture = window.capture_state()
        if previous is None:
            base = capture()
        else:
            deltas.append(capture.delta(previous))
        previous = np.sort(capture.seq)
        assert base is not None
        assert_same_window(replay(base, deltas), window.state_dict())


# A child that checkpoints a deterministic stream and stalls in the middle of writing the
# checkpoint of the kind asked for, so the test can SIGKILL it there.
_CHILD = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    import streamtrain.checkpoint.store as store_module
    from streamtrain.checkpoint.incremental import WindowChain
    from streamtrain.checkpoint.store import CheckpointStore
    sys.path.insert(0, sys.argv[3])
    from stalled_child import stall_writes
    from test_checkpoint_incremental import batch, checkpoint, new_window

    directory, kill_at = Path(sys.argv[1]), sys.argv[2]
    current = {}
    stall_writes(
        store_module,
        lambda path, i: f"{current['kind']} {current['step']}"
        if i == 0 and current["kind"] == kill_at and current["step"] >= 4
        else None,
    )
    window, chain = new_window(), WindowChain(compaction_ratio=0.9)
    store = CheckpointStore(directory, keep=1)
    for step in range(100):
        window.insert_batch(batch(100 * step, 20, clock=100.0 * step))
        current["kind"] = chain.window_state(window.capture_state(), directory).kind
        current["step"] = step
        checkpoint(window, chain, store, step)
    """
)


@pytest.mark.parametrize("kill_at", ["delta", "base"])
def test_sigkill_in_the_middle_of_a_write_restores_the_last_cut_nothing_lost_nothing_twice(
    tmp_path: Path, kill_at: str
) -> None:
    """``base`` is a compaction: the new base written while the old chain is still the newest."""
    killed_step = kill_when_stalled(_CHILD, tmp_path, kill_at, ".ckpt-*.tmp")
    loaded = CheckpointStore(tmp_path).load_latest()
    assert loaded is not None and loaded.step == killed_step - 1  # the cut before the write in flight
    # the same stream, replayed here up to that cut: the restored window is exactly its window
    window = new_window()
    for step in range(killed_step):
        window.insert_batch(batch(100 * step, 20, clock=100.0 * step))
    assert_same_window(loaded.state["window"], window.state_dict())
    restored = new_window()
    restored.load_state_dict(loaded.state["window"])
    assert_same_window(restored.state_dict(), window.state_dict())
    seq = restored.state_dict()["seq"]
    assert np.unique(seq).size == seq.size  # nothing twice


# ------------------------------------------------------------------------------ what the mutation run asked


def items(seqs: list[int]) -> dict:
    """Window items with arrival numbers ``seqs``: item s has s % 3 + 1 readings, each equal to s."""
    seq = np.asarray(seqs, dtype=np.int64)
    lengths = seq % 3 + 1
    return {
        "seq": seq,
        "lengths": lengths,
        "values": np.repeat(seq.astype(np.float32), lengths)[:, None],
        "ts": seq.astype(np.float64),
        "labels": seq % 2,
        "keys": seq / 10.0,
        "sensor_ids": np.array([f"s{s}" for s in seqs], dtype=object),
        "partitions": np.zeros(seq.size, np.int32),
        "offsets": seq * 10,
    }


def delta(entered: list[int], left: list[int], version: int) -> dict:
    return {"entered": items(entered), "left_seq": np.asarray(left, dtype=np.int64), "version": version,
            DELTA_OF: {"name": "parent", "sha256": "0"}}  # fmt: skip


def replayed(base_seqs: list[int], deltas: list[dict]) -> dict:
    state = replay({**items(base_seqs), "channels": 1, "version": 0}, deltas)
    values = np.asarray(state["values"])
    for s, length, start in zip(state["seq"], state["lengths"], np.cumsum(state["lengths"]) - state["lengths"]):
        assert np.all(values[start : start + length] == s), s  # every item keeps its own readings
    return state


def test_replay_of_an_item_that_left_came_back_and_left_again_follows_its_last_leaving() -> None:
    state = replayed([1, 3, 5], [delta([], [3, 5], 1), delta([5], [], 2), delta([], [5], 3)])
    assert state["seq"].tolist() == [1]


def test_replay_puts_an_item_back_from_a_delta_between_two_that_stayed() -> None:
    state = replayed([1, 3, 5], [delta([], [3], 1), delta([3], [], 2)])
    assert state["seq"].tolist() == [1, 3, 5] and state["offsets"].tolist() == [10, 30, 50]


def test_replay_leaves_the_readings_in_the_arrays_read_and_a_restored_window_adopts_them() -> None:
    """A 10M-item restore copied 2.6 GB of readings into a new array (docs/operations.md); now the
    base's and the deltas' arrays become the window's chunks as they are."""
    base = {**items([1, 2, 3, 4]), "channels": 1, "version": 0, "capacity": 10, "half_life_s": float("inf")}
    deltas = [delta([5, 6], [2], 1), delta([7], [5, 6], 2)]  # the second delta's items outlive its parent's
    state = replay(base, deltas)
    readings = state["values"]
    assert isinstance(readings, ItemReadings)
    kept = [chunk for chunk in readings.chunks]
    assert len(kept) == 2 and np.shares_memory(kept[0], base["values"])
    assert np.shares_memory(kept[1], deltas[1]["entered"]["values"])  # the first delta's items all left
    window = RecencyWindow(10)
    window.load_state_dict(state)
    chunks = window.snapshot().flat_values
    assert isinstance(chunks, tuple) and all(any(np.shares_memory(c, k) for k in kept) for c in chunks)
    expected = np.repeat(np.array([1, 3, 4, 7], np.float32), np.array([1, 3, 4, 7]) % 3 + 1)[:, None]
    assert np.array_equal(np.asarray(readings), expected)
    assert np.array_equal(window.snapshot().all_values(), expected)
    assert window.snapshot().seq.tolist() == [1, 3, 4, 7]


def test_replay_of_a_window_every_item_left_is_empty_and_whole() -> None:
    state = replayed([1, 3], [delta([], [1, 3], 4)])
    assert state["seq"].tolist() == [] and state["values"].shape == (0, 1) and state["values"].dtype == np.float32
    assert DELTA_OF not in state and "entered" not in state and "left_seq" not in state
    assert state["version"] == 4 and "sensor_ids" in state


def test_a_new_chain_reports_nothing_written_and_each_write_is_counted(tmp_path: Path) -> None:
    assert (WindowChain().compaction_ratio, WindowChain().max_chain) == (1.0, 64)
    chain = WindowChain(compaction_ratio=100.0)
    nothing = {"base": 0, "delta": 0}
    assert chain.report() == ChainReport(None, 0, 0, 0, nothing, nothing)
    window, store = new_window(), CheckpointStore(tmp_path, keep=10)
    paths = []
    for step in range(3):
        window.insert_batch(batch(100 * step, 5, clock=100.0 * step))
        path, kind = checkpoint(window, chain, store, step)
        paths.append(path)
    base, *deltas = (path.stat().st_size for path in paths)
    assert chain.report() == ChainReport(
        "delta", 2, base, sum(deltas), {"base": base, "delta": sum(deltas)}, {"base": 1, "delta": 2}
    )


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"compaction_ratio": 0.0}, "compaction_ratio must be > 0, got 0.0"),
        ({"max_chain": -1}, "max_chain must be >= 0, got -1"),
    ],
)
def test_chain_settings_are_checked(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError) as refused:
        WindowChain(**kwargs)
    assert str(refused.value) == message


def test_a_chain_of_no_deltas_writes_only_bases(tmp_path: Path) -> None:
    window, chain, store = new_window(), WindowChain(max_chain=0), CheckpointStore(tmp_path, keep=10)
    kinds = []
    for step in range(3):
        window.insert_batch(batch(100 * step, 5))
        kinds.append(checkpoint(window, chain, store, step)[1])
    assert kinds == ["base", "base", "base"]


def test_a_new_base_when_the_settings_change_the_deltas_reach_the_ratio_or_the_parent_is_gone(
    tmp_path: Path,
) -> None:
    window, chain, store = new_window(), WindowChain(), CheckpointStore(tmp_path, keep=10)
    window.insert_batch(batch(0, 5))
    first, _ = checkpoint(window, chain, store, 0)
    pending = chain.window_state(window.capture_state(), tmp_path)
    assert pending.kind == "delta" and pending.scope == ((60, 20.0, 1), ())  # the settings, one process
    other = RecencyWindow(61, 20.0, rng=np.random.default_rng(0))  # another capacity
    other.insert_batch(batch(0, 5))
    assert chain.window_state(other.capture_state(), tmp_path).kind == "base"
    link = chain._link
    assert link is not None
    chain._link = dataclasses.replace(link, deltas_bytes=link.base_bytes - 1)  # just below the ratio: a delta
    assert chain.window_state(window.capture_state(), tmp_path).kind == "delta"
    chain._link = dataclasses.replace(link, deltas_bytes=link.base_bytes)  # at the ratio: a new base
    assert chain.window_state(window.capture_state(), tmp_path).kind == "base"
    chain._link = link
    first.unlink()  # the parent is gone
    assert chain.window_state(window.capture_state(), tmp_path).kind == "base"


# what the mutation run of the chain by partition asked (2026-12-03) -------------------------------


def test_replay_keeps_the_storage_order_of_a_base_no_delta_added_to() -> None:
    """A base restored by partition is not in arrival order; with no item entered since, it stays in its own."""
    state = replayed([5, 1, 3], [delta([], [1], 1)])
    assert state["seq"].tolist() == [5, 3]


def test_replay_lists_a_deltas_items_in_its_own_order_after_the_survivors_before_it() -> None:
    state = replayed([1, 3], [delta([7, 6], [], 1)])
    assert state["seq"].tolist() == [1, 3, 7, 6]


def far_newer_items_entered(chain: WindowChain) -> tuple[PendingWindow, PendingWindow, dict[int, int]]:
    """A base of 100 items, then a delta on it: ten far newer items entered, ten left; and each item's partition."""
    window = RecencyWindow(100, 20.0, slack=8, rng=np.random.default_rng(5), clock=lambda: 0.0)
    window.insert_batch(batch(0, 108))
    first = chain.next_window(window.capture_state(), parent_present=lambda parent: True)
    partition_of = dict(zip(window.state_dict()["seq"].tolist(), window.state_dict()["partitions"].tolist()))
    chain.linked(first, {"name": "base", "sha256": "0"}, 1000)
    window.insert_batch(batch(1000, 10, clock=1000.0))
    second = chain.next_window(window.capture_state(), parent_present=lambda parent: True)
    partition_of.update(zip(window.state_dict()["seq"].tolist(), window.state_dict()["partitions"].tolist()))
    assert second.seq.tolist() == sorted(window.state_dict()["seq"].tolist())
    return first, second, partition_of


def test_a_chain_by_partition_keeps_the_partition_of_every_item_and_of_every_leaving() -> None:
    first, second, partition_of = far_newer_items_entered(WindowChain(by_partition=True))
    assert (first.kind, second.kind) == ("base", "delta")
    for pending in (first, second):
        assert pending.partitions is not None
        assert pending.partitions.tolist() == [partition_of[s] for s in pending.seq.tolist()]
    assert first.left_partitions is None and second.left_partitions is not None
    left = second.state["left_seq"].tolist()
    assert len(left) == 10 and second.left_partitions.tolist() == [partition_of[s] for s in left]
    assert set(second.left_partitions.tolist()) == {0, 1}


def test_a_one_file_chain_keeps_no_partitions_and_captures_sensor_ids_as_codes() -> None:
    chain = WindowChain()
    assert chain.by_partition is False
    first, second, _ = far_newer_items_entered(chain)
    assert (first.kind, second.kind) == ("base", "delta")
    for pending in (first, second):
        assert pending.partitions is None and pending.left_partitions is None
    assert isinstance(first.state["sensor_ids"], SensorCodes)  # not an object per item
    assert isinstance(second.state["entered"]["sensor_ids"], SensorCodes)


def test_a_base_writes_the_readings_from_where_they_lie_byte_for_byte_as_gathered() -> None:
    """A 10M-item base gathered 2.6 GB of readings into a new array before writing them; now they
    are written from the window's chunks, piece by piece, into the same bytes."""
    window = new_window()
    for start in range(0, 200, 20):  # many chunks, cut and compacted (slack 8): the items interleave chunks
        window.insert_batch(batch(start, 20))
    state = WindowChain().window_state(window.capture_state(), Path("unused")).state
    readings = state["values"]
    assert isinstance(readings, ItemReadings) and len(readings.chunks) > 1
    chunks = window.snapshot().flat_values
    assert isinstance(chunks, tuple) and all(any(c is w for w in chunks) for c in readings.chunks)
    gathered = dict(state, values=np.asarray(readings))
    assert np.array_equal(gathered["values"], window.snapshot().all_values())

    def file_bytes(tree: dict) -> bytes:
        return b"".join(
            bytes(p) for c in encode_checkpoint({"window": tree}, step=1, created_at=2.0) for p in chunk_pieces(c)
        )

    assert file_bytes(state) == file_bytes(gathered)
