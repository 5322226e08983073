"""Readings where they lie (ItemReadings): gathered whole, and in pieces as a checkpoint writes them."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from streamtrain.window import storage
from streamtrain.window.storage import (
    ItemReadings,
    SensorCodes,
    decay_rate,
    gather_items,
    gather_tokens,
    held_only_by,
    readings_size,
    take_objects,
    token_positions,
)


@st.composite
def scattered_readings(draw: st.DrawFn) -> tuple[ItemReadings, list[np.ndarray]]:
    """Items in chunks in any order (a compacted window interleaves chunks), with what each item holds."""
    channels = draw(st.integers(1, 3))
    sizes = draw(st.lists(st.integers(0, 40), min_size=1, max_size=4))
    chunks = tuple(
        np.arange(size * channels, dtype=np.float32).reshape(size, channels) + 1000 * c for c, size in enumerate(sizes)
    )
    items = draw(
        st.lists(st.tuples(st.integers(0, len(sizes) - 1), st.integers(0, 40), st.integers(0, 12)), max_size=30)
    )
    chosen = [(c, min(start, sizes[c]), min(length, sizes[c] - min(start, sizes[c]))) for c, start, length in items]
    readings = ItemReadings(
        chunks=chunks,
        chunk_of=np.array([c for c, _, _ in chosen], dtype=np.int32),
        starts=np.array([s for _, s, _ in chosen], dtype=np.int64),
        lengths=np.array([n for _, _, n in chosen], dtype=np.int64),
    )
    return readings, [chunks[c][s : s + n] for c, s, n in chosen]


@settings(max_examples=200, deadline=None)
@given(scattered_readings(), st.integers(1, 64))
def test_readings_gathered_whole_and_in_pieces_are_the_items_back_to_back(
    drawn: tuple[ItemReadings, list[np.ndarray]], piece_bytes: int
) -> None:
    readings, expected_items = drawn
    channels = readings.shape[1]
    expected = np.concatenate([*expected_items, np.zeros((0, channels), np.float32)])
    assert np.array_equal(np.asarray(readings), expected) and readings.nbytes == expected.nbytes
    pieces = [bytes(piece) for piece in readings.pieces(piece_bytes)]
    assert b"".join(pieces) == expected.tobytes()
    # a piece is about piece_bytes: it ends at the first item boundary past them (never splits an item)
    longest = 4 * channels * int(readings.lengths.max(initial=0))
    assert all(len(piece) <= piece_bytes + longest for piece in pieces)
    assert all(len(piece) % (4 * channels) == 0 and piece for piece in pieces)


def test_pieces_reuse_one_buffer_and_never_copy_the_window_at_once() -> None:
    chunk = np.arange(4000, dtype=np.float32)[:, None]
    readings = ItemReadings((chunk,), np.zeros(400, np.int32), np.arange(0, 4000, 10), np.full(400, 10))
    buffers = {np.frombuffer(piece, np.float32).__array_interface__["data"][0] for piece in readings.pieces(1600)}
    assert len(buffers) == 1  # one buffer of ~1600 bytes for 16,000 bytes of readings


def test_held_only_by_sees_every_other_reference_to_the_arrays() -> None:
    arrays = {"keys": np.zeros(8), "ts": np.zeros(8)}
    assert held_only_by(arrays)
    another = dict(arrays)  # a published state's own dict of the same arrays
    assert not held_only_by(arrays)
    del another
    view = arrays["ts"][2:5]  # a view refers to the array that owns the memory
    assert not held_only_by(arrays)
    del view
    name = arrays["keys"]
    assert not held_only_by(arrays)
    del name
    assert held_only_by(arrays)


def test_decay_rate_is_ln2_over_the_half_life_and_zero_for_an_infinite_one() -> None:
    assert decay_rate(math.inf) == 0.0
    assert decay_rate(10.0) == math.log(2.0) / 10.0


class CountedTable(np.ndarray):
    """An object table that counts the gathers taken from it."""

    gathers = 0

    def __getitem__(self, index):  # type: ignore[no-untyped-def]
        CountedTable.gathers += 1
        return np.asarray(super().__getitem__(index))


def test_object_gathers_go_in_pieces_so_other_threads_run_in_between(monkeypatch) -> None:
    monkeypatch.setattr(storage, "OBJECT_PIECE_ITEMS", 4)
    monkeypatch.setattr(CountedTable, "gathers", 0)
    table = np.array([f"s{i}" for i in range(6)], dtype=object).view(CountedTable)
    index = np.array([5, 0, 1, 1, 2, 3, 4, 5, 0, 2])
    out = take_objects(table, index)
    assert CountedTable.gathers == 3  # 10 items in pieces of 4
    assert type(out) is np.ndarray and out.dtype == object
    assert out.tolist() == [f"s{i}" for i in index]


@pytest.mark.parametrize("shape", [(5,), (2, 3)])
def test_sensor_codes_give_the_ids_they_stand_for(shape: tuple[int, ...]) -> None:
    strings = np.array(["a", "b", "c"], dtype=object)
    codes = np.arange(int(np.prod(shape)), dtype=np.int32).reshape(shape) % 3
    column = SensorCodes(codes, strings)
    assert len(column) == shape[0] and column.shape == shape
    ids = np.asarray(column)
    assert ids.shape == shape and ids.dtype == object
    assert ids.tolist() == strings[codes].tolist() == column.tolist()
    assert column[1:].tolist() == strings[codes[1:]].tolist()


def test_items_back_to_back_keep_their_readings_and_the_documented_dtypes() -> None:
    flat = np.arange(10, dtype=np.float32)  # 5 readings of 2 channels, as state_dict stores them
    lengths = np.array([2, 0, 3], dtype=np.int64)
    readings = ItemReadings.back_to_back(flat, lengths, 2)
    [chunk] = readings.chunks
    assert chunk.shape == (5, 2)
    assert readings.chunk_of.dtype == np.int32 and readings.chunk_of.tolist() == [0, 0, 0]
    assert readings.starts.dtype == np.int64 and readings.starts.tolist() == [0, 2, 2]
    assert readings.lengths is lengths
    assert np.array_equal(np.asarray(readings), flat.reshape(5, 2))


def test_readings_come_as_float32_unless_another_dtype_is_asked() -> None:
    readings = ItemReadings.back_to_back(np.array([0.1, 2.5], dtype=np.float32), np.array([2]), 1)
    assert np.asarray(readings).dtype == np.float32
    assert np.asarray(readings, dtype=np.float32).dtype == np.float32
    wide = np.asarray(readings, dtype=np.float64)
    assert wide.dtype == np.float64 and wide.ravel().tolist() == np.array([0.1, 2.5], np.float32).tolist()


@pytest.mark.parametrize(("piece_bytes", "items_per_piece"), [(1, 1), (4, 1), (8, 2), (10, 2), (12, 3)])
def test_a_piece_holds_as_many_whole_readings_as_its_bytes_allow(piece_bytes: int, items_per_piece: int) -> None:
    """Items of one reading of one channel: a piece holds ``max(1, piece_bytes // 4)`` of them."""
    readings = ItemReadings.back_to_back(np.arange(9, dtype=np.float32), np.ones(9, dtype=np.int64), 1)
    sizes = [len(piece) for piece in readings.pieces(piece_bytes)]
    assert sizes[:-1] == [4 * items_per_piece] * (len(sizes) - 1) and sum(sizes) == 36
    assert 0 < sizes[-1] <= 4 * items_per_piece


def owner(array: np.ndarray) -> np.ndarray:
    while isinstance(array.base, np.ndarray):
        array = array.base
    return array


def test_a_piece_is_flat_bytes_in_a_buffer_as_large_as_the_largest_piece() -> None:
    # items of 3, 1 and 5 readings of 2 channels, cut in pieces of about 8 bytes: whole items each
    readings = ItemReadings.back_to_back(np.arange(18, dtype=np.float32), np.array([3, 1, 5]), 2)
    pieces = list(readings.pieces(8))
    assert [len(piece) for piece in pieces] == [24, 8, 40]
    assert all(piece.ndim == 1 and piece.itemsize == 1 for piece in pieces)
    assert owner(pieces[-1].obj).nbytes == 40  # not the window's bytes, nor more than one piece's


def test_no_items_gather_to_no_readings() -> None:
    empty = np.zeros(0, dtype=np.int64)
    assert gather_items((), empty.astype(np.int32), empty, empty).shape == (0, 1)


def test_items_that_lie_back_to_back_are_copied_as_slices_not_through_a_position_per_token(monkeypatch) -> None:
    """A restored window's items lie chunk by chunk, back to back: gathering them is one slice copy
    per chunk; scattered items need a position per token."""
    calls: list[int] = []

    def counted(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        calls.append(len(starts))
        return token_positions(starts, lengths)

    monkeypatch.setattr(storage, "token_positions", counted)
    chunks = (np.arange(10, dtype=np.float32)[:, None], np.arange(100, 106, dtype=np.float32)[:, None])
    chunk_of = np.array([0, 0, 0, 1, 1], dtype=np.int32)
    starts = np.array([0, 2, 7, 0, 4])
    lengths = np.array([2, 5, 3, 4, 2])
    assert gather_items(chunks, chunk_of, starts, lengths).ravel().tolist() == [*range(10), *range(100, 106)]
    assert calls == []
    gaps = np.array([0, 3, 7])
    assert gather_tokens(chunks[0], gaps, np.array([2, 2, 1])).ravel().tolist() == [0, 1, 3, 4, 7]
    assert calls == [3]
    calls.clear()
    scattered = gather_items(chunks, chunk_of[::-1].copy(), starts[::-1].copy(), lengths[::-1].copy())
    assert scattered.ravel().tolist() == [104, 105, 100, 101, 102, 103, 7, 8, 9, 2, 3, 4, 5, 6, 0, 1]
    assert calls  # items out of chunk order are put in place through their positions


def test_the_size_of_a_states_readings_is_known_without_gathering_them(monkeypatch) -> None:
    readings = ItemReadings.back_to_back(np.arange(12, dtype=np.float32), np.array([4, 2]), 2)
    monkeypatch.setattr(storage, "gather_items", lambda *args, **kw: pytest.fail("gathered"))
    assert readings_size(readings) == 12
    assert readings_size(np.zeros((3, 2))) == 6
    assert readings_size([[1.0, 2.0], [3.0, 4.0]]) == 4
