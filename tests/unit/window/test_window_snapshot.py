"""Window snapshots: the same items over one array of readings or over the window's shared chunks,
subsets that gather only their own readings, and a pass's source that builds only what it takes."""

from __future__ import annotations

import numpy as np
import pytest

from streamtrain.window.snapshot import PassSource, WindowSnapshot
from streamtrain.window.storage import SensorCodes

LENGTHS = np.array([2, 3, 1, 4, 2], dtype=np.int64)


def readings(total: int) -> np.ndarray:
    return np.arange(total * 2, dtype=np.float32).reshape(total, 2)


def snapshot(flat: np.ndarray | tuple[np.ndarray, ...], starts: np.ndarray, *, seq: bool = True) -> WindowSnapshot:
    n = LENGTHS.shape[0]
    return WindowSnapshot(
        flat_values=flat, starts=starts, lengths=LENGTHS, ts=np.arange(n, dtype=np.float64) + 100,
        labels=np.arange(n) - 1, keys=np.linspace(0, 1, n), sensor_ids=np.array([f"s{i}" for i in range(n)], object),
        partitions=np.arange(n, dtype=np.int32) % 2, offsets=np.arange(n, dtype=np.int64) * 10,
        next_offsets={0: 99, 1: 98}, version=4, taken_at=12.5, seq=np.arange(n, dtype=np.int64) + 7 if seq else None,
    )  # fmt: skip


def gapped() -> tuple[np.ndarray, np.ndarray]:
    """Readings with a gap before every item (evicted readings stay in the array): starts 1, 4, 8, 10, 15."""
    starts = np.array([1, 4, 8, 10, 15], dtype=np.int64)
    return readings(17), starts


def chunked() -> tuple[tuple[np.ndarray, ...], np.ndarray]:
    """The same readings as three chunks of 7, 7 and 3 rows (the window's, shared; no item spans two)."""
    flat, starts = gapped()
    return (flat[:7], flat[7:14], flat[14:]), starts


def item_values(flat: np.ndarray, starts: np.ndarray, index: list[int]) -> list[list[list[float]]]:
    return [flat[starts[i] : starts[i] + LENGTHS[i]].tolist() for i in index]


@pytest.mark.parametrize("layout", ["array", "chunks", "chunks, readings gathered first"])
def test_a_subset_is_the_chosen_items_whole_wherever_their_readings_lie(layout: str) -> None:
    flat, starts = gapped()
    whole = snapshot(flat, starts) if layout == "array" else snapshot(chunked()[0], starts)
    if layout == "chunks, readings gathered first":
        whole.values  # noqa: B018 - gathers every item's readings once; a subset then reuses them
    part = whole.subset(np.array([3, 0]))
    assert [v.tolist() for v in part.values] == item_values(flat, starts, [3, 0])
    assert part.lengths.tolist() == [4, 2] and part.ts.tolist() == [103.0, 100.0] and part.labels.tolist() == [2, -1]
    assert part.keys.tolist() == [0.75, 0.0] and part.sensor_ids.tolist() == ["s3", "s0"]
    assert part.partitions.tolist() == [1, 0] and part.offsets.tolist() == [30, 0]
    assert part.seq is not None and part.seq.tolist() == [10, 7]
    assert (part.next_offsets, part.version, part.taken_at) == ({0: 99, 1: 98}, 4, 12.5)
    if layout == "chunks":  # only the chosen items' readings were gathered
        assert isinstance(part.flat_values, np.ndarray) and part.flat_values.shape == (6, 2)
        assert part.starts.tolist() == [0, 4]
    if layout == "chunks, readings gathered first":  # the subset shares them: no second gather
        assert part.flat_values is whole._readings[0]
    assert snapshot(flat, starts, seq=False).subset(np.array([1])).seq is None


@pytest.mark.parametrize("layout", ["array", "chunks"])
def test_all_values_and_gathers_are_the_items_back_to_back(layout: str) -> None:
    flat, starts = gapped()
    view = snapshot(flat, starts) if layout == "array" else snapshot(chunked()[0], starts)
    back_to_back = [row for item in item_values(flat, starts, list(range(5))) for row in item]
    assert view.all_values().tolist() == back_to_back and view.tokens == 12
    values, lengths = view.gather_values(np.array([4, 2]))
    assert values.tolist() == [r for item in item_values(flat, starts, [4, 2]) for r in item]
    assert lengths.tolist() == [2, 1]


def test_readings_already_back_to_back_are_returned_without_a_gather() -> None:
    flat = readings(14)  # 12 readings of the items, 2 past them
    starts = np.array([0, 2, 5, 6, 10], dtype=np.int64)
    view = snapshot(flat, starts)
    assert view.all_values().tolist() == flat[:12].tolist()
    assert np.shares_memory(view.all_values(), flat)  # a view of them, not a copy
    gap = snapshot(flat, np.array([0, 3, 6, 7, 11], dtype=np.int64))  # from 0, but a reading between items
    assert gap.all_values().tolist() == flat[[0, 1, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]].tolist()
    shifted = snapshot(flat, starts + 1)  # one reading before the first item: a gather
    assert shifted.all_values().tolist() == flat[1:13].tolist() and not np.shares_memory(shifted.all_values(), flat)
    empty = WindowSnapshot(
        flat_values=flat, starts=starts[:0], lengths=LENGTHS[:0], ts=np.zeros(0), labels=np.zeros(0, np.int64),
        keys=np.zeros(0), sensor_ids=np.zeros(0, object), partitions=np.zeros(0, np.int32),
        offsets=np.zeros(0, np.int64),
    )  # fmt: skip
    assert empty.all_values().shape == (0, 2)


@pytest.mark.parametrize("layout", ["array", "chunks"])
def test_item_readings_say_where_each_item_lies(layout: str) -> None:
    flat, starts = gapped()
    chunks = chunked()[0]
    view = snapshot(flat, starts) if layout == "array" else snapshot(chunks, starts)
    where = view.item_readings()
    if layout == "array":
        assert where.chunk_of.tolist() == [0] * 5 and where.starts.tolist() == starts.tolist()
    else:
        assert where.chunk_of.tolist() == [0, 0, 1, 1, 2] and where.starts.tolist() == [1, 4, 1, 3, 1]
    assert where.chunk_of.dtype == np.int32 and where.starts.dtype == np.int64
    assert np.asarray(where).tolist() == view.all_values().tolist()


def test_a_reading_at_a_chunk_boundary_belongs_to_the_next_chunk() -> None:
    flat = readings(12)
    starts = np.array([0, 2, 6, 7, 11], dtype=np.int64)  # item 2 starts where the second chunk does
    view = snapshot((flat[:6], flat[6:]), starts)
    assert view.item_readings().chunk_of.tolist() == [0, 0, 1, 1, 1]
    assert [v.tolist() for v in view.subset(np.array([2])).values] == [flat[6:7].tolist()]


def pass_source(view: WindowSnapshot) -> tuple[PassSource, list[np.ndarray | None]]:
    taken: list[np.ndarray | None] = []

    def take(index: np.ndarray | None) -> WindowSnapshot:
        taken.append(None if index is None else index.copy())
        return view if index is None else view.subset(index)

    codes = SensorCodes(np.arange(5, dtype=np.int32), np.array([f"s{i}" for i in range(5)], dtype=object))
    source = PassSource(
        lengths=view.lengths, labels=view.labels, sensor_ids=codes, seq=np.arange(5, dtype=np.int64),
        version=view.version, taken_at=view.taken_at, take=take,
    )  # fmt: skip
    return source, taken


def test_a_pass_source_takes_the_same_items_as_a_snapshot_subset() -> None:
    view = snapshot(*gapped())
    source, taken = pass_source(view)
    assert len(source) == 5
    for index in (np.array([4, 1]), np.array([-1, 0]), np.array([False, True, False, True, False])):
        assert source.subset(index).offsets.tolist() == view.subset(index).offsets.tolist()
    assert [t.tolist() for t in taken if t is not None] == [[4, 1], [4, 0], [1, 3]]
    assert all(t is not None and t.dtype == np.int64 for t in taken)
    for bad in (np.array([5]), np.array([-6]), np.array([True, False])):
        with pytest.raises(IndexError):
            source.subset(bad)
    assert source.ts.tolist() == view.ts.tolist() and source.whole is view
    values, lengths = source.gather_values(np.array([2]))
    assert values.tolist() == view.gather_values(np.array([2]))[0].tolist() and lengths.tolist() == [1]
    assert sum(t is None for t in taken) == 1  # the whole snapshot built once
