"""The sensor event: decoding and validation with one reason per rejection.

Validation is total: any bytes give either a :class:`SensorEvent` or a
:class:`Rejection` with exactly one reason from :data:`REASONS`, never an exception.
Numbers are judged as written, whatever their size: an integer literal is an integer
(a label of 2**64 is ``bad_label``, not ``schema``), and a number no float64 holds is
``non_finite``. The same value rules back ``POST /v1/predict`` through :func:`parse_values`.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain
from typing import Any, Final

import numpy as np
import orjson

from streamtrain.window.storage import token_positions

NO_LABEL: Final = -1
MAX_SENSOR_ID_CHARS: Final = 128

#: Every rejection reason of docs/contract.md, section 1, in the order the checks run.
REASONS: Final = (
    "too_large",
    "decode",
    "schema",
    "non_finite",
    "empty",
    "too_long",
    "bad_channels",
    "bad_label",
    "bad_timestamp",
)

_NUMBER_TYPES: Final = frozenset({int, float})


@dataclass(frozen=True, slots=True)
class EventLimits:
    """The rules an event must meet; built once from the settings."""

    max_len: int = 512
    channels: int = 1
    n_classes: int = 0
    max_message_bytes: int = 1 << 20
    max_future_skew_s: float = 300.0
    max_age_s: float | None = None

    @classmethod
    def from_settings(cls, settings: Any) -> EventLimits:
        return cls(
            max_len=settings.max_len,
            channels=settings.channels,
            n_classes=settings.n_classes,
            max_message_bytes=settings.max_message_bytes,
            max_future_skew_s=settings.max_future_skew_s,
            max_age_s=settings.max_age_s,
        )


@dataclass(frozen=True, slots=True)
class SensorEvent:
    """A validated event. ``values`` is float32 ``[L, C]``; ``label`` is NO_LABEL if absent."""

    sensor_id: str
    ts: float
    values: np.ndarray
    label: int = NO_LABEL

    @property
    def length(self) -> int:
        return int(self.values.shape[0])


@dataclass(frozen=True, slots=True)
class Rejection:
    """Why a message was refused: ``reason`` is one of :data:`REASONS`."""

    reason: str
    detail: str


@dataclass(frozen=True)
class EventBatch:
    """Valid events of one poll batch in columns: the unit the window ingests.

    ``values`` holds every event's readings back to back (float32 ``[sum(lengths), C]``);
    event ``i`` is ``values[starts[i] : starts[i] + lengths[i]]``. Columns keep the
    window's insert free of per-event Python work.
    """

    sensor_ids: np.ndarray  # object [n] of str
    ts: np.ndarray  # float64 [n]
    labels: np.ndarray  # int64 [n], NO_LABEL when absent
    lengths: np.ndarray  # int64 [n]
    values: np.ndarray  # float32 [T, C]
    partitions: np.ndarray  # int32 [n], source partition (0 when not from Kafka)
    offsets: np.ndarray  # int64 [n], source offset (-1 when not from Kafka)

    def __len__(self) -> int:
        return int(self.ts.shape[0])

    @property
    def starts(self) -> np.ndarray:
        starts = np.zeros(self.lengths.shape[0], dtype=np.int64)
        np.cumsum(self.lengths[:-1], out=starts[1:])
        return starts

    def take(self, rows: np.ndarray) -> EventBatch:
        """The events ``rows`` (indices, in that order) as a batch of their own, readings copied once."""
        lengths = self.lengths[rows]
        return EventBatch(
            sensor_ids=self.sensor_ids[rows],
            ts=self.ts[rows],
            labels=self.labels[rows],
            lengths=lengths,
            values=self.values[token_positions(self.starts[rows], lengths)],
            partitions=self.partitions[rows],
            offsets=self.offsets[rows],
        )

    def event(self, i: int) -> SensorEvent:
        start = int(self.starts[i])
        return SensorEvent(
            str(self.sensor_ids[i]),
            float(self.ts[i]),
            self.values[start : start + int(self.lengths[i])],
            int(self.labels[i]),
        )

    @classmethod
    def from_events(
        cls,
        events: Sequence[SensorEvent],
        partitions: Sequence[int] | np.ndarray | None = None,
        offsets: Sequence[int] | np.ndarray | None = None,
        channels: int | None = None,
    ) -> EventBatch:
        n = len(events)
        width = channels if channels is not None else (events[0].values.shape[1] if n else 1)
        return cls(
            sensor_ids=np.array([e.sensor_id for e in events], dtype=object).reshape(n),
            ts=np.array([e.ts for e in events], dtype=np.float64).reshape(n),
            labels=np.array([e.label for e in events], dtype=np.int64).reshape(n),
            lengths=np.array([e.values.shape[0] for e in events], dtype=np.int64).reshape(n),
            values=np.concatenate([e.values for e in events]) if n else np.zeros((0, width), np.float32),
            partitions=np.zeros(n, np.int32) if partitions is None else np.asarray(partitions, np.int32),
            offsets=np.full(n, -1, np.int64) if offsets is None else np.asarray(offsets, np.int64),
        )


class EventError(ValueError):
    """A rule was broken; carries the reason code (docs/contract.md) and a human-readable detail."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


def parse_values(values: Any, channels: int, max_len: int) -> np.ndarray:
    """Check a ``values`` array against the rules and return float32 ``[L, C]``.

    Raises :class:`EventError` with reason ``schema``, ``empty``, ``too_long``,
    ``bad_channels`` or ``non_finite``. Booleans and numeric strings are not numbers.
    """
    if not isinstance(values, list):
        raise EventError("schema", f"'values' must be an array, got {type(values).__name__}")
    steps = len(values)
    if steps == 0:
        raise EventError("empty", "'values' has no time steps")
    if steps > max_len:
        raise EventError("too_long", f"'values' has {steps} steps, the limit is {max_len}")
    if channels == 1:
        kinds = set(map(type, values))
        if not kinds <= _NUMBER_TYPES:
            if list in kinds:
                raise EventError("bad_channels", "channels=1 expects an array of numbers, got nested arrays")
            raise EventError("schema", "'values' must hold only numbers")
        flat = values
    else:
        for step in values:
            if type(step) is not list or len(step) != channels:
                got = len(step) if type(step) is list else type(step).__name__
                raise EventError("bad_channels", f"every step must be an array of {channels} numbers, got {got}")
        flat = list(chain.from_iterable(values))
        if not set(map(type, flat)) <= _NUMBER_TYPES:
            raise EventError("schema", "'values' must hold only numbers")
    try:
        with np.errstate(over="ignore"):
            steps_array = np.array(flat, dtype=np.float32).reshape(steps, channels)
    except OverflowError:
        raise EventError("non_finite", "a value is too large to represent") from None
    if not math.isfinite(steps_array.sum(dtype=np.float64)):
        raise EventError("non_finite", "'values' holds NaN or infinity, or overflows float32")
    return steps_array


#: Stands in for an integer literal too long for Python to read (``sys.get_int_max_str_digits``,
#: 4300 digits by default; never below 640). Every rule judges such a number by its size
#: alone: beyond float64 for ``ts`` and ``values`` (non_finite), outside any class range for
#: ``label`` (bad_label), so one huge value of the right sign reads the same.
_HUGE_INT: Final = 10**400


def _parse_int(literal: str) -> int:
    try:
        return int(literal)
    except ValueError:  # only the digit limit: the JSON parser hands over valid integer literals
        return -_HUGE_INT if literal.startswith("-") else _HUGE_INT


def _loads_stdlib(raw: bytes) -> Any:
    try:
        return json.loads(raw.decode("utf-8"), parse_int=_parse_int)
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise EventError("decode", "not UTF-8 JSON") from None


def _loads(raw: bytes) -> Any:
    """orjson first; the stdlib parser where orjson's reading would change a rule's outcome.

    orjson refuses NaN, Infinity and integers beyond float64, and reads integer literals
    outside [-2**63, 2**64) as floats. The stdlib parser reads all of them as written, so the
    rules (not "decode") judge them. Only ``label`` tells an integer from a float (a float
    label is ``schema``, a big integer one ``bad_label``), so a float label is read again.
    """
    try:
        obj = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return _loads_stdlib(raw)
    if type(obj) is dict and type(obj.get("label")) is float:
        try:
            return _loads_stdlib(raw)
        except EventError:  # deeper than the stdlib parser's recursion limit: orjson's reading stands
            return obj
    return obj


def _check_header(obj: Any, limits: EventLimits, now: float) -> tuple[str, float, int]:
    """Every rule except the values' contents; returns (sensor_id, ts, label)."""
    if not isinstance(obj, dict):
        raise EventError("decode", f"expected a JSON object, got {type(obj).__name__}")
    for name in ("sensor_id", "ts", "values"):
        if name not in obj:
            raise EventError("schema", f"missing required field {name!r}")
    sensor_id = obj["sensor_id"]
    if not isinstance(sensor_id, str):
        raise EventError("schema", f"'sensor_id' must be a string, got {type(sensor_id).__name__}")
    if not 1 <= len(sensor_id) <= MAX_SENSOR_ID_CHARS:
        raise EventError("schema", f"'sensor_id' must have 1..{MAX_SENSOR_ID_CHARS} characters")
    ts = obj["ts"]
    if type(ts) not in _NUMBER_TYPES:
        raise EventError("schema", f"'ts' must be a number, got {type(ts).__name__}")
    label = obj.get("label")
    if label is not None and type(label) is not int:
        raise EventError("schema", f"'label' must be an integer, got {type(label).__name__}")
    values = obj["values"]
    if not isinstance(values, list):
        raise EventError("schema", f"'values' must be an array, got {type(values).__name__}")
    try:
        ts = float(ts)
    except OverflowError:
        raise EventError("non_finite", "'ts' is too large to represent") from None
    if not math.isfinite(ts):
        raise EventError("non_finite", "'ts' is NaN or infinite")
    if not values:
        raise EventError("empty", "'values' has no time steps")
    if len(values) > limits.max_len:
        raise EventError("too_long", f"'values' has {len(values)} steps, the limit is {limits.max_len}")
    if limits.n_classes > 0 and label is not None:
        if not 0 <= label < limits.n_classes:
            shown = label if -(2**63) <= label < 2**64 else "beyond 64 bits"
            raise EventError("bad_label", f"'label' {shown} is outside [0, {limits.n_classes})")
    else:
        label = None  # labels mean nothing without a classification head
    if ts > now + limits.max_future_skew_s:
        raise EventError("bad_timestamp", f"'ts' is {ts - now:.0f}s ahead of the clock")
    if ts < 0:
        raise EventError("bad_timestamp", "'ts' is before 1970")
    if limits.max_age_s is not None and ts < now - limits.max_age_s:
        raise EventError("bad_timestamp", f"'ts' is older than max_age_s={limits.max_age_s:g}")
    return sensor_id, ts, NO_LABEL if label is None else label


def _parse_message(raw: bytes | None, limits: EventLimits, now: float) -> tuple[Any, tuple[str, float, int]]:
    if raw is None:
        raise EventError("decode", "message has no value (tombstone)")
    if len(raw) > limits.max_message_bytes:
        raise EventError("too_large", f"{len(raw)} bytes, the limit is {limits.max_message_bytes}")
    obj = _loads(raw)
    header = _valid_header_or_none(obj, limits, now)
    return obj, header if header is not None else _check_header(obj, limits, now)


def _valid_header_or_none(obj: Any, limits: EventLimits, now: float) -> tuple[str, float, int] | None:
    """The common case in one expression; None sends the message to :func:`_check_header`,
    which finds the exact reason. Accepts exactly what ``_check_header`` accepts."""
    try:
        sensor_id, ts, values = obj["sensor_id"], obj["ts"], obj["values"]
    except (KeyError, TypeError, IndexError):
        return None
    label = obj.get("label")
    oldest = 0.0 if limits.max_age_s is None else max(0.0, now - limits.max_age_s)
    # capped so that, under MAX_FUTURE_SKEW_S=inf, infinity and integers beyond float64 still fail
    newest = min(now + limits.max_future_skew_s, sys.float_info.max)
    if (
        type(sensor_id) is str
        and 0 < len(sensor_id) <= MAX_SENSOR_ID_CHARS
        and (type(ts) is float or type(ts) is int)
        and oldest <= ts <= newest  # NaN and inf fail here too
        and type(values) is list
        and 0 < len(values) <= limits.max_len
        and (label is None or (type(label) is int and (limits.n_classes == 0 or 0 <= label < limits.n_classes)))
    ):
        return sensor_id, float(ts), label if label is not None and limits.n_classes > 0 else NO_LABEL
    return None


@dataclass(frozen=True)
class DecodedBatch:
    """The outcome of one poll batch: the valid events in columns, the rest with reasons."""

    events: EventBatch
    rejections: list[tuple[int, Rejection]]  # (position in the input, why)
    accepted_positions: np.ndarray  # int64: input position of each valid event


def decode_event(raw: bytes | None, limits: EventLimits, now: float) -> SensorEvent | Rejection:
    """Decode one Kafka message value; never raises."""
    decoded = decode_batch([raw], limits, now)
    return decoded.rejections[0][1] if decoded.rejections else decoded.events.event(0)


def decode_batch(
    raws: Sequence[bytes | None],
    limits: EventLimits,
    now: float,
    partitions: Sequence[int] | np.ndarray | None = None,
    offsets: Sequence[int] | np.ndarray | None = None,
) -> DecodedBatch:
    """Decode and validate a poll batch; never raises.

    Per message only the JSON parse and the header rules run in Python; the readings of
    the whole batch are checked and converted at once (one type scan, one float32
    conversion, one finiteness test per event via ``np.add.reduceat``). A batch that is
    not clean falls back to :func:`parse_values` per event, which names the exact reason.
    """
    n = len(raws)
    rejections: list[tuple[int, Rejection]] = []
    positions: list[int] = []
    headers: list[tuple[str, float, int]] = []
    values_lists: list[Any] = []
    for i, raw in enumerate(raws):
        try:
            obj, header = _parse_message(raw, limits, now)
        except EventError as err:
            rejections.append((i, Rejection(err.reason, err.detail)))
            continue
        except Exception as err:  # noqa: BLE001 - validation must be total, whatever the bytes
            rejections.append((i, Rejection("decode", f"undecodable message ({type(err).__name__})")))
            continue
        positions.append(i)
        headers.append(header)
        values_lists.append(obj["values"])

    converted = _convert_all(values_lists, limits.channels)
    if converted is not None:
        data, lengths, valid = converted
        for k in np.flatnonzero(~valid).tolist():
            rejections.append(
                (positions[k], Rejection("non_finite", "'values' holds NaN or infinity, or overflows float32"))
            )
    else:
        data, lengths, valid = _convert_each(values_lists, limits, rejections, positions)
    if not valid.all():
        data = data[np.repeat(valid, lengths)]
    keep = np.flatnonzero(valid)
    kept_positions = np.asarray(positions, dtype=np.int64)[keep]
    rejections.sort(key=lambda item: item[0])
    sensor_ids = np.empty(len(headers), dtype=object)
    sensor_ids[:] = [h[0] for h in headers]
    parts = np.zeros(n, np.int32) if partitions is None else np.asarray(partitions, np.int32)
    offs = np.full(n, -1, np.int64) if offsets is None else np.asarray(offsets, np.int64)
    batch = EventBatch(
        sensor_ids=sensor_ids[keep],
        ts=np.array([h[1] for h in headers], dtype=np.float64).reshape(-1)[keep],
        labels=np.array([h[2] for h in headers], dtype=np.int64).reshape(-1)[keep],
        lengths=lengths[keep],
        values=data,
        partitions=parts[kept_positions],
        offsets=offs[kept_positions],
    )
    return DecodedBatch(batch, rejections, kept_positions)


def _convert_all(values_lists: list[Any], channels: int) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """Convert a clean batch in one go; None means "some event needs a closer look"."""
    flat = list(chain.from_iterable(values_lists))
    if channels > 1:
        if set(map(type, flat)) - {list} or any(len(step) != channels for step in flat):
            return None
        flat = list(chain.from_iterable(flat))
    if not set(map(type, flat)) <= _NUMBER_TYPES:
        return None
    try:
        with np.errstate(over="ignore"):
            data = np.array(flat, dtype=np.float32).reshape(-1, channels)
    except (OverflowError, ValueError):
        return None
    lengths = np.fromiter(map(len, values_lists), dtype=np.int64, count=len(values_lists))
    return data, lengths, _finite_per_event(data, lengths)


def _convert_each(
    values_lists: list[Any],
    limits: EventLimits,
    rejections: list[tuple[int, Rejection]],
    positions: list[int],
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The slow path: :func:`parse_values` per event; failures become rejections.

    Only :class:`EventError` can come out: every ``values`` here is a parsed JSON array, and
    :func:`parse_values` refuses every element that is not a number (or, with C > 1, an array
    of C numbers) before numpy sees it; of numpy's conversion, only the ``OverflowError`` of
    an integer beyond float64 can fail, and it becomes ``non_finite``.
    """
    arrays: list[np.ndarray] = []
    ok = np.ones(len(values_lists), dtype=bool)
    for k, values in enumerate(values_lists):
        try:
            arrays.append(parse_values(values, limits.channels, limits.max_len))
        except EventError as err:
            rejections.append((positions[k], Rejection(err.reason, err.detail)))
            ok[k] = False
            arrays.append(np.zeros((0, limits.channels), np.float32))
    data = np.concatenate(arrays) if arrays else np.zeros((0, limits.channels), np.float32)
    lengths = np.fromiter((a.shape[0] for a in arrays), dtype=np.int64, count=len(arrays))
    return data, lengths, ok


def _finite_per_event(data: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    if lengths.size == 0:
        return np.ones(0, dtype=bool)
    starts = np.zeros(lengths.shape[0], dtype=np.int64)
    np.cumsum(lengths[:-1], out=starts[1:])
    return np.isfinite(np.add.reduceat(data.sum(axis=1, dtype=np.float64), starts))
