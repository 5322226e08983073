"""Window checkpoints that cost what changed: a delta on the last one written, a new base now and then.

A one-file checkpoint's window is either whole (a *base*: what ``RecencyWindow.state_dict``
returns, as every checkpoint held before deltas existed, so old checkpoints restore as they
did) or a *delta* on the checkpoint this process wrote last, its *parent*: the items that
entered the window since (readings and columns), the arrival numbers (``seq``) of the items
that left it, and the counters, offsets and RNG state whole (they are small). A delta names
its parent by file name and by the SHA-256 in the parent's prefix, so it never builds on
another file that took the name. The trainer's state is whole in every checkpoint.

Restore (:class:`~streamtrain.checkpoint.store.CheckpointStore`) reads the chain back to its
base, every file verified, and replays it (:func:`replay`); a checkpoint whose chain has a
damaged or missing link is refused as a whole and the store falls back to an older one whose
chain is sound: a restored window is always exactly the window of one cut, never a mix.

Compaction: the checkpointer writes a new base (the whole window, from memory, in its own
thread; ingest never waits for it) once the deltas since the last base hold as many bytes
as that base (``compaction_ratio``), after ``max_chain`` deltas, when the parent is gone or
was replaced, when the window's settings changed, and first after every start. With ``d``
bytes of change per checkpoint and a base of ``B``, a base comes every ``B / d``
checkpoints: the bytes written amortize to ``2 d`` per checkpoint, and a restore reads at
most ``2 B``.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

from streamtrain.checkpoint.format import read_digest
from streamtrain.window.reservoir import WindowCapture
from streamtrain.window.storage import ITEM_COLUMNS, ItemReadings

#: The key that marks a window state as a delta; its value is ``{"name", "sha256"}`` of the parent.
DELTA_OF = "delta_of"

Kind = Literal["base", "delta"]


def parent_of(window_state: Mapping[str, Any]) -> tuple[str, str] | None:
    """(file name, prefix SHA-256) of the checkpoint a delta builds on; None for a base."""
    parent = window_state.get(DELTA_OF)
    if parent is None:
        return None
    return str(parent["name"]), str(parent["sha256"])


def replay(base: Mapping[str, Any], deltas: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The whole window state a base and its deltas (oldest first) describe.

    An item is in the window when the last change that names it (its entry, in the base or
    a delta; its leaving, in a delta) is an entry: an item can leave a read and come back
    (``max_age_s``), so it may enter twice, but never twice without leaving between. Items
    come out in arrival order, the counters, offsets and RNG state are the newest delta's.
    """
    if not deltas:
        return dict(base)
    newest = deltas[-1]
    state = {key: value for key, value in newest.items() if key not in (DELTA_OF, "entered", "left_seq")}
    items = replay_items(
        base,
        [(delta["entered"], delta["left_seq"]) for delta in deltas],
        channels=int(base["channels"]),
        columns=ITEM_COLUMNS,
    )
    return {**state, **items}


def replay_items(
    base: Mapping[str, Any],
    deltas: Sequence[tuple[Mapping[str, Any], Any]],
    *,
    channels: int,
    columns: Sequence[tuple[str, Any]],
) -> dict[str, Any]:
    """The items (``columns`` and ``values``) of a base's items and deltas' ``(entered, left_seq)``.

    What :func:`replay` does to a whole window, and a sharded checkpoint to one partition's
    section chain; the columns must include ``lengths`` and ``seq``. Each source lists its
    items in the window's storage order; the items come out in that order: the sources one
    after another while every delta's items arrived after all earlier survivors (always,
    without ``max_age_s``), else by arrival number (an item that came back). ``values``
    leaves the readings where they were read (:class:`ItemReadings`) when it can.
    """
    sources = [base, *(entered for entered, _ in deltas)]
    seq = np.concatenate([np.asarray(source["seq"], dtype=np.int64).reshape(-1) for source in sources])
    sizes = [np.asarray(source["seq"]).size for source in sources]
    entered_at = np.repeat(np.arange(len(sources), dtype=np.int64), sizes)
    lefts = [np.asarray(left_seq, dtype=np.int64).reshape(-1) for _, left_seq in deltas]
    left_seq = np.concatenate([np.zeros(0, dtype=np.int64), *lefts])
    left_at = np.repeat(np.arange(1, len(lefts) + 1, dtype=np.int64), [left.size for left in lefts])
    last_left = np.full(seq.size, -1, dtype=np.int64)
    if left_seq.size:
        by_seq = np.lexsort((left_at, left_seq))
        left_seq, left_at = left_seq[by_seq], left_at[by_seq]
        final = np.ones(left_seq.size, dtype=bool)
        final[:-1] = left_seq[1:] != left_seq[:-1]
        left_seq, left_at = left_seq[final], left_at[final]  # the latest leaving of each
        at = np.minimum(np.searchsorted(left_seq, seq), left_seq.size - 1)
        named = left_seq[at] == seq
        last_left[named] = left_at[at[named]]
    # an item is in the window when its last change is an entry (one that came back is here twice)
    rows = np.flatnonzero(entered_at > last_left)
    if not _arrived_in_source_order(seq[rows], entered_at[rows]):
        rows = rows[np.argsort(seq[rows], kind="stable")]

    lengths = [np.asarray(source["lengths"], dtype=np.int64).reshape(-1) for source in sources]
    chunks = [np.asarray(source["values"], dtype=np.float32).reshape(-1, channels) for source in sources]
    items: dict[str, Any] = {"seq": seq[rows]}
    row_source = entered_at[rows]
    picks = _picks(rows, row_source, sizes)
    for name, dtype in columns:
        if name != "seq":
            items[name] = _take_rows([np.asarray(source[name], dtype=dtype).reshape(-1) for source in sources], picks)
    items["values"] = _readings_in_place(chunks, lengths, picks, row_source, items["lengths"])
    return items


_Picks = list[tuple[np.ndarray | slice, np.ndarray]]
"""Per source: where its rows go in the output (a slice when they are one stretch) and which."""


def _picks(rows: np.ndarray, row_source: np.ndarray, sizes: Sequence[int]) -> _Picks:
    """Each source's share of ``rows`` (indices into the sources' items, concatenated; the
    source of each in ``row_source``)."""
    first = np.concatenate([[0], np.cumsum(sizes)])
    ascending = bool(np.all(row_source[1:] >= row_source[:-1]))
    bounds = np.searchsorted(row_source, np.arange(len(sizes) + 1)) if ascending else None
    picks: _Picks = []
    for j in range(len(sizes)):
        at: np.ndarray | slice = (
            slice(int(bounds[j]), int(bounds[j + 1])) if bounds is not None else np.flatnonzero(row_source == j)
        )
        picks.append((at, rows[at] - first[j]))
    return picks


def _take_rows(columns: Sequence[np.ndarray], picks: _Picks) -> np.ndarray:
    """The picked rows of each source's column, into one new column (not the sources joined
    first and then picked: at 10M items that is a second column's worth of new memory)."""
    out = np.empty(sum(local.size for _, local in picks), dtype=columns[0].dtype)
    for column, (at, local) in zip(columns, picks, strict=True):
        if isinstance(at, slice):
            np.take(column, local, out=out[at])
        else:
            out[at] = column[local]
    return out


def _arrived_in_source_order(seq: np.ndarray, source: np.ndarray) -> bool:
    """Whether every source's items (``seq`` of the survivors, in source order) arrived after all
    the items of the sources before it: then the sources one after another are the storage order."""
    if seq.size < 2:
        return True
    boundaries = np.flatnonzero(source[1:] != source[:-1]) + 1
    if not boundaries.size:
        return True
    earlier_max = np.maximum.accumulate(seq)[boundaries - 1]
    later_min = np.minimum.reduceat(seq, boundaries)
    return bool(np.all(later_min > earlier_max))


def _readings_in_place(
    chunks: Sequence[np.ndarray],
    lengths: Sequence[np.ndarray],
    picks: _Picks,
    row_source: np.ndarray,
    row_lengths: np.ndarray,
) -> ItemReadings | np.ndarray:
    """The picked rows' readings where they were read, each in its source's array, in the rows'
    order (a 10M-item window's 2.6 GB are not copied again; the window adopts the arrays)."""
    if not row_source.size:
        return np.zeros((0, chunks[0].shape[1]), np.float32)
    starts = _take_rows([np.cumsum(length) - length for length in lengths], picks)
    used = np.flatnonzero(np.bincount(row_source, minlength=len(chunks)))  # sources with a survivor
    renumber = np.zeros(len(chunks), dtype=np.int32)
    renumber[used] = np.arange(used.size, dtype=np.int32)
    return ItemReadings(
        chunks=tuple(np.ascontiguousarray(chunks[j]) for j in used.tolist()),
        chunk_of=renumber[row_source],
        starts=starts,
        lengths=row_lengths,
    )


ParentRef = Mapping[str, Any]
"""What a delta names its parent by (JSON values): ``{"name", "sha256"}`` of a one-file checkpoint."""


@dataclass(frozen=True)
class PendingWindow:
    """A checkpoint's window state, built, not yet written."""

    state: dict[str, Any]
    kind: Kind
    seq: np.ndarray  # sorted arrival numbers of its window's items
    scope: Hashable  # what a delta and its parent must share: the window's settings, where it is written
    partitions: np.ndarray | None = None  # of the items ``seq`` numbers, when the chain keeps them
    left_partitions: np.ndarray | None = None  # of a delta's ``left_seq``, when the chain keeps them


@dataclass(frozen=True)
class _Link:
    """The last checkpoint written, as the next delta builds on it."""

    parent: ParentRef
    seq: np.ndarray  # as PendingWindow's
    partitions: np.ndarray | None
    scope: Hashable
    base_bytes: int
    deltas_bytes: int  # of the deltas since that base
    deltas: int


@dataclass(frozen=True)
class ChainReport:
    """What ``/v1/window`` and the metrics report of the checkpoints' chain."""

    last_kind: Kind | None
    chain_length: int  # deltas since the last base
    base_bytes: int
    deltas_bytes: int
    bytes_written: Mapping[Kind, int]
    written: Mapping[Kind, int]


class WindowChain:
    """Builds each checkpoint's window as a base or a delta on the last one written (module docstring).

    Used by one checkpointer at a time (the service serializes checkpoints). One-file
    checkpoints use :meth:`window_state` and :meth:`written`; a rank's shards of sharded
    checkpoints :meth:`next_window` and :meth:`linked`, with ``by_partition`` (a shard
    splits a delta by partition).
    """

    def __init__(self, *, compaction_ratio: float = 1.0, max_chain: int = 64, by_partition: bool = False) -> None:
        if not compaction_ratio > 0:
            raise ValueError(f"compaction_ratio must be > 0, got {compaction_ratio}")
        if max_chain < 0:
            raise ValueError(f"max_chain must be >= 0, got {max_chain}")
        self.compaction_ratio = float(compaction_ratio)
        self.max_chain = int(max_chain)
        self.by_partition = by_partition
        self._link: _Link | None = None
        self._bytes: dict[Kind, int] = {"base": 0, "delta": 0}
        self._written: dict[Kind, int] = {"base": 0, "delta": 0}
        self._last_kind: Kind | None = None

    def window_state(self, capture: WindowCapture, directory: Path) -> PendingWindow:
        """The window of the next one-file checkpoint into ``directory``: a delta where the chain allows one."""

        def parent_present(parent: ParentRef) -> bool:
            try:
                return read_digest(directory / str(parent["name"])) == parent["sha256"]
            except OSError:
                return False  # pruned, or the directory was emptied: start a new base

        return self.next_window(capture, parent_present=parent_present)

    def written(self, pending: PendingWindow, path: Path) -> None:
        """``pending`` is durable as the one-file checkpoint ``path``: the next delta builds on it."""
        self.linked(pending, {"name": path.name, "sha256": read_digest(path)}, path.stat().st_size)

    def next_window(
        self, capture: WindowCapture, *, parent_present: Callable[[ParentRef], bool], scope: Hashable = ()
    ) -> PendingWindow:
        """The window of the next checkpoint: a delta on the last one :meth:`linked` where the chain allows.

        ``parent_present(parent)``: whether the checkpoint the last link names is still
        there, unchanged; ``scope``: what else a delta and its parent must share beyond the
        window's settings (a shard's rank and ownership).
        """
        scope = (capture.settings, scope)
        if self.by_partition:
            order = np.argsort(capture.seq, kind="stable")
            seq, partitions = capture.seq[order], capture.partitions[order]
        else:
            seq, partitions = np.sort(capture.seq), None
        link = self._link
        if link is not None and self._extends(link, scope, parent_present):
            state = capture.delta(link.seq)
            state[DELTA_OF] = dict(link.parent)
            left = None
            if link.partitions is not None:
                left = link.partitions[np.searchsorted(link.seq, state["left_seq"])]
            return PendingWindow(state, "delta", seq, scope, partitions, left)
        return PendingWindow(capture(for_checkpoint=True), "base", seq, scope, partitions)

    def _extends(self, link: _Link, scope: Hashable, parent_present: Callable[[ParentRef], bool]) -> bool:
        if link.scope != scope or link.deltas >= self.max_chain:
            return False
        if link.deltas_bytes >= self.compaction_ratio * link.base_bytes:
            return False
        return parent_present(link.parent)

    def linked(self, pending: PendingWindow, parent: ParentRef, size: int) -> None:
        """``pending`` is durable, ``size`` bytes, named by ``parent``: the next delta builds on it."""
        link = self._link
        window = (pending.seq, pending.partitions, pending.scope)
        if pending.kind == "base" or link is None:
            self._link = _Link(parent, *window, base_bytes=size, deltas_bytes=0, deltas=0)
        else:
            self._link = _Link(
                parent,
                *window,
                base_bytes=link.base_bytes,
                deltas_bytes=link.deltas_bytes + size,
                deltas=link.deltas + 1,
            )
        self._bytes[pending.kind] += size
        self._written[pending.kind] += 1
        self._last_kind = pending.kind

    def report(self) -> ChainReport:
        link = self._link
        return ChainReport(
            last_kind=self._last_kind,
            chain_length=0 if link is None else link.deltas,
            base_bytes=0 if link is None else link.base_bytes,
            deltas_bytes=0 if link is None else link.deltas_bytes,
            bytes_written=dict(self._bytes),
            written=dict(self._written),
        )
