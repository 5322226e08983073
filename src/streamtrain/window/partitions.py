"""A window state split by Kafka partition, and joined back: what a sharded checkpoint
stores per partition, so a partition's items can move to whichever rank owns it next."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from streamtrain.window.storage import ITEM_COLUMNS, SensorCodes, gather_tokens


@dataclass
class PartitionItems:
    """One partition's part of a window state: its items' columns and readings, its next offset.

    ``columns`` holds every :data:`ITEM_COLUMNS` column but ``partitions`` (all of them
    ``partition``); ``values`` the items' readings back to back, float32 ``[tokens, C]``.
    """

    partition: int
    next_offset: int | None
    values: np.ndarray
    columns: dict[str, np.ndarray]

    def __len__(self) -> int:
        return int(self.columns["lengths"].shape[0])


def empty_partition(partition: int, next_offset: int | None, channels: int) -> PartitionItems:
    """A partition's part that holds no items (its offset may still have moved)."""
    columns = {name: np.zeros(0, dtype=dtype) for name, dtype in ITEM_COLUMNS if name != "partitions"}
    return PartitionItems(partition, next_offset, np.zeros((0, channels), dtype=np.float32), columns)


def split_by_partition(state: Mapping[str, Any]) -> list[PartitionItems]:
    """Cut a :meth:`RecencyWindow.state_dict` into its partitions' parts, ascending partition order.

    A partition appears when it has items or a next offset (one whose events were all
    refused or evicted still moves its offset). Without ``seq`` (a state from before
    the window kept arrival order) items are numbered in the order the state holds them.
    """
    channels = int(state["channels"])
    columns = {
        name: state[name] if isinstance(state[name], SensorCodes) else np.asarray(state[name], dtype=dtype).reshape(-1)
        for name, dtype in ITEM_COLUMNS
        if name not in ("partitions", "seq")
    }
    lengths = columns["lengths"]
    values = np.asarray(state["values"], dtype=np.float32).reshape(-1, channels)
    if int(lengths.sum()) != values.shape[0]:
        raise ValueError("window state is inconsistent: lengths do not add up to its readings")
    n = lengths.shape[0]
    seq = state.get("seq")
    columns["seq"] = np.arange(n, dtype=np.int64) if seq is None else np.asarray(seq, dtype=np.int64).reshape(-1)
    partitions = np.asarray(state["partitions"], dtype=np.int64).reshape(-1)
    next_offsets = {int(p): int(o) for p, o in dict(state.get("next_offsets") or {}).items()}
    starts = np.zeros(n, dtype=np.int64)
    np.cumsum(lengths[:-1], out=starts[1:])
    order = np.argsort(partitions, kind="stable")
    sorted_partitions = partitions[order]
    parts = []
    for partition in sorted(set(sorted_partitions.tolist()) | set(next_offsets)):
        lo, hi = np.searchsorted(sorted_partitions, [partition, partition + 1])
        index = order[lo:hi]
        parts.append(
            PartitionItems(
                partition=int(partition),
                next_offset=next_offsets.get(int(partition)),
                values=gather_tokens(values, starts[index], lengths[index]).reshape(-1, channels),
                columns={name: column[index] for name, column in columns.items()},
            )
        )
    return parts


def join_partitions(parts: Sequence[PartitionItems], channels: int) -> dict[str, Any]:
    """The item columns, ``values`` and ``next_offsets`` of a window state holding ``parts``, in their order."""
    joined: dict[str, Any] = {
        name: np.concatenate([part.columns[name] for part in parts]) if parts else np.zeros(0, dtype=dtype)
        for name, dtype in ITEM_COLUMNS
        if name != "partitions"
    }
    joined["partitions"] = (
        np.concatenate([np.full(len(part), part.partition, dtype=np.int32) for part in parts])
        if parts
        else np.zeros(0, np.int32)
    )
    joined["values"] = np.concatenate([part.values for part in parts]) if parts else np.zeros((0, channels), np.float32)
    joined["next_offsets"] = {str(part.partition): part.next_offset for part in parts if part.next_offset is not None}
    return joined
