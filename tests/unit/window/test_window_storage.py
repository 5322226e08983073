"""Readings where they lie (ItemReadings): gathered whole, and in pieces as a checkpoint writes them."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from streamtrain.window.storage import ItemReadings, held_only_by


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
