"""Collate: shapes, masks, lengths, padding and labels, checked against a per-item reference."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from streamtrain.data.collate import Batch, BatchPosition, collate, collate_flat
from streamtrain.events import NO_LABEL


@st.composite
def ragged_batches(draw: st.DrawFn) -> tuple[list[np.ndarray], list[int] | None, list[float] | None, int]:
    channels = draw(st.integers(1, 3))
    lengths = draw(st.lists(st.integers(0, 17), min_size=1, max_size=9))
    # Zeros, negatives and huge readings: nothing about a value may mark it as padding.
    readings = st.sampled_from([0.0, -0.0, 1.5, -3.25, 1e30])
    values = [draw(hnp.arrays(np.float32, (length, channels), elements=readings)) for length in lengths]
    labels = draw(st.none() | st.lists(st.integers(-1, 5), min_size=len(lengths), max_size=len(lengths)))
    ts = draw(st.none() | st.lists(st.floats(0, 2e9), min_size=len(lengths), max_size=len(lengths)))
    return values, labels, ts, draw(st.integers(1, 8))


@settings(max_examples=200, deadline=None)
@given(ragged_batches())
def test_collate_matches_a_per_item_reference(case: tuple) -> None:
    values, labels, ts, multiple = case
    batch = collate(values, labels, ts, pad_to_multiple_of=multiple)
    lengths = [len(v) for v in values]
    width = -(-max(lengths) // multiple) * multiple
    channels = values[0].shape[1]

    assert batch.values.shape == (len(values), width, channels) and batch.values.dtype == torch.float32
    assert batch.mask.shape == (len(values), width) and batch.mask.dtype == torch.bool
    assert batch.lengths.tolist() == lengths and batch.lengths.dtype == torch.int64
    assert batch.real_tokens == sum(lengths) and batch.padded_tokens == len(values) * width
    for i, item in enumerate(values):
        length = len(item)
        assert batch.mask[i, :length].all() and not batch.mask[i, length:].any()
        assert np.array_equal(batch.values[i, :length].numpy(), item)
        assert not batch.values[i, length:].any(), "padding must be 0.0"
    assert batch.labels.dtype == torch.int64 and batch.ts.dtype == torch.float64
    assert batch.labels.tolist() == (labels if labels is not None else [NO_LABEL] * len(values))
    if ts is None:
        assert torch.isnan(batch.ts).all()
    else:
        assert batch.ts.tolist() == ts


def test_zero_readings_are_real_and_only_the_mask_says_so() -> None:
    batch = collate([np.zeros((3, 1), np.float32), np.ones((1, 1), np.float32)])
    assert batch.mask.tolist() == [[True, True, True], [True, False, False]]
    assert batch.values[0].eq(0).all() and batch.values[1, 1:].eq(0).all()


def test_collate_flat_equals_collate_on_the_same_items() -> None:
    rng = np.random.default_rng(0)
    items = [rng.standard_normal((n, 2)).astype(np.float32) for n in (4, 1, 7)]
    a = collate(items, [0, 1, -1], [1.0, 2.0, 3.0], pad_to_multiple_of=4)
    b = collate_flat(np.concatenate(items), [4, 1, 7], [0, 1, -1], [1.0, 2.0, 3.0], pad_to_multiple_of=4)
    for name in ("values", "mask", "lengths", "labels", "ts"):
        assert torch.equal(getattr(a, name), getattr(b, name))


def test_inputs_are_copied_not_aliased() -> None:
    item = np.ones((2, 1), np.float32)
    labels = np.array([3])
    batch = collate([item], labels)
    item[:] = 5.0
    labels[:] = 4
    assert batch.values.eq(1.0).sum() == 2 and batch.labels.tolist() == [3]


def test_batch_moves_as_a_whole() -> None:
    batch = collate([np.ones((2, 1), np.float32)], [1], [5.0])
    moved = batch.to("cpu")
    assert isinstance(moved, Batch) and torch.equal(moved.values, batch.values)


@pytest.mark.parametrize(
    "values, kwargs, message",
    [
        ([], {}, "at least one sequence"),
        ([np.ones((2, 1)), np.ones((2, 2))], {}, "item 1 has 2 channels"),
        ([np.ones((2, 1)), np.ones(3)], {}, "item 1 has shape"),
        ([np.ones(3)], {}, "item 0 has shape"),
        ([np.ones((2, 1))], {"labels": [1, 2]}, "labels has 2 entries for 1 sequences"),
        ([np.ones((2, 1))], {"pad_to_multiple_of": 0}, "pad_to_multiple_of"),
    ],
)
def test_bad_input_names_the_item_and_the_rule(values: list, kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        collate(values, **kwargs)


def test_collate_flat_checks_lengths_against_the_readings() -> None:
    with pytest.raises(ValueError, match="sum\\(lengths\\) = 5"):
        collate_flat(np.ones((4, 1), np.float32), [2, 3])


class _RecordingTensor:
    """Stands in for a tensor and records how the batch asked it to move."""

    def __init__(self, name: str) -> None:
        self.name = name

    def to(self, device: object, non_blocking: bool = False) -> tuple:
        return ("to", self.name, device, non_blocking)

    def pin_memory(self) -> tuple:
        return ("pinned", self.name)


def _recording_batch() -> Batch:
    return Batch(**{name: _RecordingTensor(name) for name in ("values", "mask", "lengths", "labels", "ts")})


@pytest.mark.parametrize("kwargs, non_blocking", [({}, False), ({"non_blocking": True}, True)])
def test_batch_to_moves_every_tensor_to_the_device_with_the_callers_non_blocking(
    kwargs: dict, non_blocking: bool
) -> None:
    moved = _recording_batch().to("cuda:1", **kwargs)
    for name in ("values", "mask", "lengths", "labels", "ts"):
        assert getattr(moved, name) == ("to", name, "cuda:1", non_blocking)


def test_pin_memory_pins_every_tensor_and_keeps_the_position() -> None:
    pinned = replace(_recording_batch(), position=BatchPosition(2, 3, 9)).pin_memory()
    for name in ("values", "mask", "lengths", "labels", "ts"):
        assert getattr(pinned, name) == ("pinned", name)
    assert pinned.position == BatchPosition(2, 3, 9)


def test_readings_given_as_text_are_refused_not_parsed() -> None:
    with pytest.raises((TypeError, ValueError)):
        collate([np.array([["1.5"]])])


def test_collate_flat_pads_to_the_longest_item_by_default() -> None:
    batch = collate_flat(np.ones((3, 1), np.float32), [3])
    assert batch.values.shape == (1, 3, 1) and batch.mask.all()


def test_lengths_and_labels_may_be_a_scalar_for_a_one_item_batch() -> None:
    batch = collate_flat(np.ones((2, 1), np.float32), 2, labels=4, ts=7.0)
    assert batch.lengths.tolist() == [2] and batch.labels.tolist() == [4] and batch.ts.tolist() == [7.0]


def test_lengths_labels_and_ts_of_any_shape_are_read_as_one_entry_per_item() -> None:
    batch = collate_flat(np.ones((3, 1), np.float32), [[1], [2]], labels=[[0], [1]], ts=[[1.0], [2.0]])
    assert batch.lengths.tolist() == [1, 2] and batch.labels.tolist() == [0, 1] and batch.ts.tolist() == [1.0, 2.0]


def test_column_dtypes_are_fixed_whatever_the_caller_passes() -> None:
    batch = collate_flat(
        np.ones((5, 1), np.float64),
        np.array([2, 3], np.int32),
        labels=np.array([1, 2], np.int32),
        ts=np.array([1.5, 2.5], np.float32),
    )
    assert batch.values.dtype == torch.float32 and batch.lengths.dtype == torch.int64
    assert batch.labels.dtype == torch.int64 and batch.ts.dtype == torch.float64


def test_collate_flat_copies_the_lengths_it_is_given() -> None:
    lengths = np.array([1, 1], np.int64)
    batch = collate_flat(np.ones((2, 1), np.float32), lengths)
    lengths[:] = 7
    assert batch.lengths.tolist() == [1, 1]


@pytest.mark.parametrize(
    "flat, lengths, kwargs, message",
    [
        (np.ones((0, 1)), [], {}, r"^collate needs at least one sequence, got an empty list$"),
        (np.ones((2, 1)), [3, -1], {}, r"^collate: lengths must be >= 0, got -1$"),
        (np.ones((2, 1)), [2], {"pad_to_multiple_of": 0}, r"^pad_to_multiple_of must be an integer >= 1, got 0$"),
        (np.ones((2, 1)), [2], {"ts": [1.0, 2.0]}, r"^collate: ts has 2 entries for 1 sequences; give one per item$"),
        (
            np.ones((4, 1)),
            [2, 3],
            {},
            r"^collate: flat values of shape \(4, 1\) do not hold sum\(lengths\) = 5 rows of \[channels\]; "
            r"pass readings back to back as \[tokens, C\]$",
        ),
    ],
)
def test_collate_flat_refusals_say_the_rule_in_full(
    flat: np.ndarray, lengths: list, kwargs: dict, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        collate_flat(flat, lengths, **kwargs)


def test_collate_of_no_items_says_so_in_full() -> None:
    with pytest.raises(ValueError, match=r"^collate needs at least one sequence, got an empty list$"):
        collate([])


@pytest.mark.parametrize(
    "item, rule",
    [
        (np.array([["a"]]), "holds <U1 values"),
        (np.array([["1.5"]]), "holds <U3 values"),
        (np.array([[b"1"]]), "holds \\|S1 values"),
        (np.array([[None]], dtype=object), "holds object values"),
        (np.array([[1.0]], dtype=object), "holds object values"),
        (np.array([[1j]]), "holds complex128 values"),
        (np.array([["2020-01-01"]], dtype="datetime64[D]"), "holds datetime64\\[D\\] values"),
        ([[1.0], [1.0, 2.0]], "is ragged"),
    ],
)
def test_items_that_are_not_real_numbers_are_refused_by_collate_naming_the_item(item: object, rule: str) -> None:
    with pytest.raises(ValueError, match=rf"^collate: item 1 {rule}; "):
        collate([np.ones((2, 1), np.float32), item])


def test_bool_and_integer_items_are_numbers() -> None:
    batch = collate([np.array([[True], [False]]), np.array([[3]], np.int64), np.array([[2]], np.uint8)])
    assert batch.values[:, :, 0].tolist() == [[1.0, 0.0], [3.0, 0.0], [2.0, 0.0]]


@pytest.mark.parametrize("flat", [np.array([["1.5"]]), np.array([[1.0]], dtype=object)])
def test_collate_flat_refuses_readings_that_are_not_real_numbers(flat: np.ndarray) -> None:
    with pytest.raises(ValueError, match=rf"^collate: flat values hold {flat.dtype} values; "):
        collate_flat(flat, [1])
