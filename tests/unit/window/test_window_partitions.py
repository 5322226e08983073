"""A window state cut into its Kafka partitions' parts and joined back (what a sharded checkpoint moves)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from streamtrain.window.partitions import empty_partition, join_partitions, split_by_partition
from streamtrain.window.storage import ITEM_COLUMNS, SensorCodes

DTYPES = dict(ITEM_COLUMNS)


def state_of(n: int, seed: int, *, seq: bool = True) -> dict[str, Any]:
    """A state as plain Python lists (a JSON-ish restore): ``n`` items of partitions 0 and 2, two channels."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 5, n).tolist()
    state: dict[str, Any] = {
        "channels": 2,
        "keys": rng.random(n).tolist(),
        "ts": (1000.0 + np.arange(n)).tolist(),
        "labels": rng.integers(-1, 3, n).tolist(),
        "lengths": lengths,
        "partitions": rng.choice([0, 2], n).tolist(),
        "offsets": list(range(100, 100 + n)),
        "sensor_ids": [f"s{i % 4}" for i in range(n)],
        "values": [[float(i), float(-i)] for i in range(sum(lengths))],
        "next_offsets": {"1": 55, "2": 9000},
    }
    if seq:
        state["seq"] = list(range(500, 500 + n))
    return state


def test_each_partition_gets_its_items_in_window_order_with_their_readings_and_offset() -> None:
    state = state_of(200, seed=1)
    parts = split_by_partition(state)
    assert [(p.partition, p.next_offset) for p in parts] == [(0, None), (1, 55), (2, 9000)]
    starts = np.concatenate([[0], np.cumsum(state["lengths"])[:-1]])
    for part in parts:
        mine = [i for i, p in enumerate(state["partitions"]) if p == part.partition]
        assert len(part) == len(mine)
        for name, column in part.columns.items():
            expected = np.array([state[name][i] for i in mine], dtype=DTYPES[name])
            assert column.dtype == DTYPES[name] and column.tolist() == expected.tolist(), name
        readings = [state["values"][starts[i] + t] for i in mine for t in range(state["lengths"][i])]
        assert part.values.dtype == np.float32 and part.values.tolist() == readings
        assert "partitions" not in part.columns
    assert len(parts[1]) == 0 and parts[1].values.shape == (0, 2)  # only its offset moved


def test_split_then_join_keeps_every_item_grouped_by_partition() -> None:
    state = state_of(50, seed=2)
    joined = join_partitions(split_by_partition(state), channels=2)
    order = np.argsort(state["partitions"], kind="stable")
    assert joined["partitions"].dtype == np.int32
    assert joined["partitions"].tolist() == np.asarray(state["partitions"])[order].tolist()
    assert joined["offsets"].tolist() == np.asarray(state["offsets"])[order].tolist()
    assert joined["next_offsets"] == {"1": 55, "2": 9000}
    assert sorted(map(tuple, joined["values"].tolist())) == sorted(map(tuple, state["values"]))


def test_a_state_from_before_the_arrival_order_numbers_its_items_in_order() -> None:
    parts = split_by_partition(state_of(30, seed=3, seq=False))
    numbered = sorted(int(s) for part in parts for s in part.columns["seq"])
    assert numbered == list(range(30)) and all(part.columns["seq"].dtype == np.int64 for part in parts)


def test_a_state_whose_lengths_miss_its_readings_is_refused_in_full() -> None:
    state = state_of(5, seed=4)
    state["values"] = state["values"][:-1]
    with pytest.raises(ValueError) as refused:
        split_by_partition(state)
    assert str(refused.value) == "window state is inconsistent: lengths do not add up to its readings"


def test_an_empty_part_and_an_empty_join_have_every_column_typed() -> None:
    empty = empty_partition(3, 77, channels=2)
    assert (empty.partition, empty.next_offset, len(empty)) == (3, 77, 0)
    assert empty.values.shape == (0, 2) and empty.values.dtype == np.float32
    assert {name: column.dtype for name, column in empty.columns.items()} == {
        name: np.dtype(dtype) for name, dtype in ITEM_COLUMNS if name != "partitions"
    }
    joined = join_partitions([], channels=3)
    assert {name: joined[name].dtype for name, _ in ITEM_COLUMNS} == {
        name: np.dtype(dtype) for name, dtype in ITEM_COLUMNS
    }
    assert joined["values"].shape == (0, 3) and joined["values"].dtype == np.float32 and joined["next_offsets"] == {}
    assert join_partitions([empty], channels=2)["next_offsets"] == {"3": 77}


def test_columns_of_any_shape_are_read_flat_and_sensor_codes_stay_codes() -> None:
    state = state_of(40, seed=5)
    flat = split_by_partition(state)
    for name in ("keys", "partitions", "seq", "offsets"):
        state[name] = np.asarray(state[name]).reshape(-1, 1)  # a column vector, as some writers keep one
    ids = sorted(set(state["sensor_ids"]))
    state["sensor_ids"] = SensorCodes(
        np.array([ids.index(s) for s in state["sensor_ids"]], dtype=np.int32), np.array(ids, dtype=object)
    )
    for got, want in zip(split_by_partition(state), flat, strict=True):
        codes = got.columns["sensor_ids"]
        assert isinstance(codes, SensorCodes)  # never materialized as Python strings
        assert codes.tolist() == want.columns["sensor_ids"].tolist()
        for name in ("keys", "seq", "offsets"):
            assert got.columns[name].tolist() == want.columns[name].tolist(), name
        assert got.values.tolist() == want.values.tolist()
