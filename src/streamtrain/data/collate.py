"""Collate ragged sensor sequences into one padded batch with a mask.

The dataset hands over raw, unpadded items; padding happens here, once per batch, to the
batch's longest item (rounded up to ``pad_to_multiple_of``). The pad value is 0.0, but
0.0 is also a real sensor reading, so the boolean mask, never the pad value, says which
positions are real. The copy is vectorized: one concatenation of the ragged values and
one masked scatter into the padded buffer, with no Python loop over elements.

Bad items are refused with collate's own ``ValueError`` (``collate: item i ...``, never
numpy's error), naming the item and the rule: an item is a 2-D ``[L, C]`` array of real
numbers (bool, integer or float) with item 0's C. Readings given as text are refused,
never parsed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields, replace

import numpy as np
import torch
from numpy.typing import ArrayLike

from streamtrain.data._validate import require_int
from streamtrain.events import NO_LABEL


@dataclass(frozen=True)
class BatchPosition:
    """Where a batch sits in the training stream: pass ``pass_index``, batch ``index`` of ``batches``.

    Counted in this rank's share of the pass; the dataset uses it to resume right after
    the last batch the trainer actually trained (``WindowBatchDataset.mark_trained``).
    """

    pass_index: int
    index: int
    batches: int


@dataclass(frozen=True)
class Batch:
    """A padded batch; real positions come first in each row and ``mask`` marks them."""

    values: torch.Tensor  # float32 [B, L, C], pad value 0.0 (the mask is authoritative)
    mask: torch.Tensor  # bool [B, L], True at real positions
    lengths: torch.Tensor  # int64 [B]
    labels: torch.Tensor  # int64 [B], NO_LABEL (-1) where the event had no label
    ts: torch.Tensor  # float64 [B], event time (Unix s); NaN where unknown
    position: BatchPosition | None = None  # set by WindowBatchDataset; None for a hand-made batch

    @property
    def batch_size(self) -> int:
        return int(self.values.shape[0])

    @property
    def real_tokens(self) -> int:
        return int(self.lengths.sum())

    @property
    def padded_tokens(self) -> int:
        """Positions the model computes over, real or padding: ``B * L``."""
        return int(self.values.shape[0] * self.values.shape[1])

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Batch:
        return replace(self, **{name: getattr(self, name).to(device, non_blocking=non_blocking) for name in _TENSORS})

    def pin_memory(self) -> Batch:
        """Called by ``DataLoader(pin_memory=True)`` on custom batch types."""
        return replace(self, **{name: getattr(self, name).pin_memory() for name in _TENSORS})


_TENSORS = tuple(f.name for f in fields(Batch) if f.name != "position")


def padded_length(max_length: int, pad_to_multiple_of: int) -> int:
    """``max_length`` rounded up to a multiple of ``pad_to_multiple_of``."""
    return -(-max_length // pad_to_multiple_of) * pad_to_multiple_of


#: numpy dtype kinds whose values are numbers that convert to float32 without parsing: bool,
#: signed and unsigned integers, floats. Text, objects, complex numbers and dates are refused,
#: never parsed or truncated.
_REAL_KINDS = frozenset("biuf")
_REAL_RULE = "readings must be real numbers (bool, integer or float)"


def _describe_bad_item(values: Sequence[np.ndarray], error: Exception | None = None) -> str:
    """Only on the error path: name the first item that is not a real-valued 2-D ``[L, C]``
    array with item 0's C."""
    channels = None
    for index, item in enumerate(values):
        try:
            array = np.asarray(item)
        except ValueError:
            return f"item {index} is ragged; every item must be a 2-D [length, channels] array"
        if array.ndim != 2:
            return f"item {index} has shape {array.shape}; every item must be a 2-D [length, channels] array"
        if array.dtype.kind not in _REAL_KINDS:
            return f"item {index} holds {array.dtype} values; {_REAL_RULE}"
        if channels is None:
            channels = array.shape[1]
        elif array.shape[1] != channels:
            return f"item {index} has {array.shape[1]} channels but item 0 has {channels}; all items need the same C"
    # every way numpy's concatenation fails is named above; this keeps numpy's words for any other
    return f"the items could not be concatenated along the length axis ({error})"


def collate(
    values: Sequence[np.ndarray],
    labels: ArrayLike | None = None,
    ts: ArrayLike | None = None,
    pad_to_multiple_of: int = 1,
) -> Batch:
    """Pad ``values`` (each float32 ``[L_i, C]``) into a :class:`Batch`.

    ``labels`` defaults to NO_LABEL for every item and ``ts`` to NaN (unknown).
    """
    if len(values) == 0:
        raise ValueError("collate needs at least one sequence, got an empty list")
    try:
        # casting="same_kind" (the default) refuses text, objects and complex numbers with a TypeError
        flat = np.concatenate(values, axis=0, dtype=np.float32)
    except (TypeError, ValueError) as error:
        raise ValueError(f"collate: {_describe_bad_item(values, error)}") from error
    if flat.ndim != 2:
        raise ValueError(f"collate: {_describe_bad_item(values)}")
    lengths = np.fromiter(map(len, values), dtype=np.int64, count=len(values))
    return collate_flat(flat, lengths, labels, ts, pad_to_multiple_of)


def collate_flat(
    flat_values: np.ndarray,
    lengths: ArrayLike,
    labels: ArrayLike | None = None,
    ts: ArrayLike | None = None,
    pad_to_multiple_of: int = 1,
) -> Batch:
    """Like :func:`collate` for readings already back to back (``[sum(lengths), C]``).

    The window stores readings this way, so a batch is one gather plus one scatter.
    """
    lengths = np.array(lengths, dtype=np.int64, copy=True).reshape(-1)
    batch_size = lengths.shape[0]
    if batch_size == 0:
        raise ValueError("collate needs at least one sequence, got an empty list")
    require_int(pad_to_multiple_of, "pad_to_multiple_of", 1)
    if lengths.min() < 0:
        raise ValueError(f"collate: lengths must be >= 0, got {lengths.min()}")
    flat = np.asarray(flat_values)
    if flat.dtype.kind not in _REAL_KINDS:
        raise ValueError(f"collate: flat values hold {flat.dtype} values; {_REAL_RULE}")
    flat = flat.astype(np.float32, copy=False)
    if flat.ndim != 2 or flat.shape[0] != int(lengths.sum()):
        raise ValueError(
            f"collate: flat values of shape {flat.shape} do not hold sum(lengths) = {int(lengths.sum())} "
            "rows of [channels]; pass readings back to back as [tokens, C]"
        )
    label_array = _per_item(labels, batch_size, np.int64, NO_LABEL, "labels")
    ts_array = _per_item(ts, batch_size, np.float64, np.nan, "ts")

    width = padded_length(int(lengths.max()), pad_to_multiple_of)
    mask = np.arange(width) < lengths[:, None]
    padded = np.zeros((batch_size, width, flat.shape[1]), dtype=np.float32)
    # Row-major order of the mask is (item, position): the order the readings are stored in.
    padded[mask] = flat
    return Batch(
        values=torch.from_numpy(padded),
        mask=torch.from_numpy(mask),
        lengths=torch.from_numpy(lengths),
        labels=torch.from_numpy(label_array),
        ts=torch.from_numpy(ts_array),
    )


def _per_item(given: ArrayLike | None, batch_size: int, dtype: type, fill: float, name: str) -> np.ndarray:
    if given is None:
        return np.full(batch_size, fill, dtype=dtype)
    array: np.ndarray = np.array(given, dtype=dtype, copy=True).reshape(-1)
    if array.shape[0] != batch_size:
        raise ValueError(f"collate: {name} has {array.shape[0]} entries for {batch_size} sequences; give one per item")
    return array
