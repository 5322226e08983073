"""Validation: one reason per rejection, total over arbitrary bytes."""

from __future__ import annotations

import math
import time

import numpy as np
import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from streamtrain.events import (
    NO_LABEL,
    REASONS,
    EventBatch,
    EventError,
    EventLimits,
    Rejection,
    SensorEvent,
    decode_batch,
    decode_event,
    parse_values,
)

NOW = 1_764_412_345.0
LIMITS = EventLimits(max_len=8, channels=1, n_classes=3, max_message_bytes=512, max_future_skew_s=300)
LIMITS_C3 = EventLimits(max_len=8, channels=3, n_classes=0, max_message_bytes=512)


def msg(**fields) -> bytes:
    base = {"sensor_id": "pump-17", "ts": NOW - 5, "values": [0.1, 0.5, 0.25]}
    base.update(fields)
    return orjson.dumps({k: v for k, v in base.items() if v is not ...})


CASES = [
    ("too_large", b'{"sensor_id":"a","ts":1,"values":[' + b"1," * 400 + b"1]}"),
    ("decode", b"\xff\xfe not utf8"),
    ("decode", b"[1, 2, 3]"),
    ("decode", b"not json"),
    ("decode", b'"a string"'),
    ("schema", msg(sensor_id=...)),
    ("schema", msg(ts=...)),
    ("schema", msg(values=...)),
    ("schema", msg(sensor_id=17)),
    ("schema", msg(sensor_id="")),
    ("schema", msg(sensor_id="x" * 129)),
    ("schema", msg(ts="yesterday")),
    ("schema", msg(ts=True)),
    ("schema", msg(values="1,2,3")),
    ("schema", msg(values=[1.0, "2.0"])),
    ("schema", msg(values=[1.0, True])),
    ("schema", msg(values=[1.0, None])),
    ("schema", msg(label=1.5)),
    ("schema", msg(label="1")),
    ("non_finite", b'{"sensor_id":"a","ts":1764412000,"values":[1.0, NaN]}'),
    ("non_finite", b'{"sensor_id":"a","ts":1764412000,"values":[Infinity]}'),
    ("non_finite", b'{"sensor_id":"a","ts":1764412000,"values":[1e39]}'),
    ("non_finite", b'{"sensor_id":"a","ts":NaN,"values":[1]}'),
    ("empty", msg(values=[])),
    ("too_long", msg(values=[0.0] * 9)),
    ("bad_channels", msg(values=[[1.0], [2.0]])),
    ("bad_label", msg(label=3)),
    ("bad_label", msg(label=-1)),
    ("bad_timestamp", msg(ts=NOW + 301)),
    ("bad_timestamp", msg(ts=-1.0)),
]


@pytest.mark.parametrize(("reason", "raw"), CASES)
def test_each_rule_rejects_with_its_reason(reason: str, raw: bytes) -> None:
    result = decode_event(raw, LIMITS, NOW)
    assert isinstance(result, Rejection), result
    assert result.reason == reason, result.detail


def test_every_reason_is_covered_by_a_case() -> None:
    assert {reason for reason, _ in CASES} == set(REASONS)


def test_channels_rules() -> None:
    ok = decode_event(msg(values=[[1, 2, 3], [4, 5, 6]]), LIMITS_C3, NOW)
    assert isinstance(ok, SensorEvent) and ok.values.shape == (2, 3)
    for bad in ([[1, 2], [3, 4, 5]], [1, 2, 3], [[1, 2, 3, 4]], [[1, 2, "3"]]):
        result = decode_event(msg(values=bad), LIMITS_C3, NOW)
        assert isinstance(result, Rejection)
        assert result.reason in {"bad_channels", "schema"}


def test_valid_event_and_defaults() -> None:
    event = decode_event(msg(label=2, extra_field={"ignored": True}), LIMITS, NOW)
    assert isinstance(event, SensorEvent)
    assert event.sensor_id == "pump-17" and event.label == 2
    assert event.values.dtype == np.float32 and event.values.shape == (3, 1)
    no_label = decode_event(msg(), LIMITS, NOW)
    assert no_label.label == NO_LABEL
    # labels mean nothing without a classification head
    assert decode_event(msg(label=7), EventLimits(max_len=8), NOW).label == NO_LABEL


def test_old_events_only_rejected_when_max_age_set() -> None:
    old = msg(ts=NOW - 10 * 86400)
    assert isinstance(decode_event(old, LIMITS, NOW), SensorEvent)
    aged = EventLimits(max_len=8, max_age_s=3600)
    assert decode_event(old, aged, NOW).reason == "bad_timestamp"


def test_batch_keeps_order_positions_and_offsets() -> None:
    raws = [msg(values=[1.0]), b"junk", msg(values=[2.0, 3.0]), msg(values=[float("nan")]), None, msg(values=[4.0])]
    raws[3] = b'{"sensor_id":"a","ts":1764412000,"values":[NaN]}'
    decoded = decode_batch(raws, LIMITS, NOW, partitions=[0, 0, 1, 1, 2, 2], offsets=[10, 11, 12, 13, 14, 15])
    assert decoded.accepted_positions.tolist() == [0, 2, 5]
    assert [pos for pos, _ in decoded.rejections] == [1, 3, 4]
    assert [r.reason for _, r in decoded.rejections] == ["decode", "non_finite", "decode"]
    events = decoded.events
    assert events.lengths.tolist() == [1, 2, 1]
    assert events.values[:, 0].tolist() == [1.0, 2.0, 3.0, 4.0]
    assert events.offsets.tolist() == [10, 12, 15] and events.partitions.tolist() == [0, 1, 2]


def test_parse_values_for_predict() -> None:
    assert parse_values([1, 2.5], channels=1, max_len=4).shape == (2, 1)
    with pytest.raises(EventError) as err:
        parse_values([1, float("inf")], channels=1, max_len=4)
    assert err.value.reason == "non_finite"


# ---------------------------------------------------------------- properties
@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=600))
def test_arbitrary_bytes_never_raise(raw: bytes) -> None:
    result = decode_event(raw, LIMITS, NOW)
    assert isinstance(result, (SensorEvent, Rejection))
    if isinstance(result, Rejection):
        assert result.reason in REASONS


json_leaf = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=True), st.text(max_size=5)
)
json_value = st.recursive(
    json_leaf,
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=5), inner, max_size=4),
    max_leaves=20,
)


@settings(max_examples=400, deadline=None)
@given(
    sensor_id=json_value | st.text(max_size=130),
    ts=json_value | st.floats(allow_nan=True, allow_infinity=True),
    values=json_value | st.lists(st.floats(allow_nan=True, allow_infinity=True, width=64), max_size=10),
    label=json_value,
)
def test_structured_garbage_gets_exactly_one_reason(sensor_id, ts, values, label) -> None:
    import json

    raw = json.dumps({"sensor_id": sensor_id, "ts": ts, "values": values, "label": label}).encode()
    results = decode_batch([raw, raw], LIMITS, NOW)
    # exactly one outcome per message, the same for both copies
    assert len(results.rejections) + len(results.events) == 2
    assert len(results.rejections) in (0, 2)
    if results.rejections:
        assert results.rejections[0][1] == results.rejections[1][1]
        assert results.rejections[0][1].reason in REASONS
    else:
        assert np.isfinite(results.events.values).all()
        assert 1 <= results.events.lengths[0] <= LIMITS.max_len
        assert math.isfinite(results.events.ts[0])


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(width=32, allow_nan=False, allow_infinity=False), min_size=1, max_size=8))
def test_valid_readings_round_trip_exactly(readings: list[float]) -> None:
    event = decode_event(msg(values=readings), LIMITS, time.time())
    assert isinstance(event, SensorEvent)
    assert event.values[:, 0].tolist() == [np.float32(r) for r in readings]


@settings(max_examples=500, deadline=None)
@given(
    obj=st.dictionaries(
        st.sampled_from(["sensor_id", "ts", "values", "label", "other"]),
        json_value
        | st.floats(allow_nan=True, allow_infinity=True)
        | st.integers(-5, 5)
        | st.lists(st.floats(-10, 10), min_size=0, max_size=10),
        max_size=5,
    )
    | json_value,
    limits=st.sampled_from([LIMITS, EventLimits(max_len=4), EventLimits(max_len=8, n_classes=2, max_age_s=3600.0)]),
)
def test_fast_header_path_agrees_with_the_full_rules(obj, limits) -> None:
    from streamtrain.events import _check_header, _valid_header_or_none

    fast = _valid_header_or_none(obj, limits, NOW)
    try:
        full = _check_header(obj, limits, NOW)
    except EventError:
        full = None
    assert fast == full


DETAILS = [
    "837 bytes, the limit is 512",
    "not UTF-8 JSON",
    "expected a JSON object, got list",
    "not UTF-8 JSON",
    "expected a JSON object, got str",
    "missing required field 'sensor_id'",
    "missing required field 'ts'",
    "missing required field 'values'",
    "'sensor_id' must be a string, got int",
    "'sensor_id' must have 1..128 characters",
    "'sensor_id' must have 1..128 characters",
    "'ts' must be a number, got str",
    "'ts' must be a number, got bool",
    "'values' must be an array, got str",
    "'values' must hold only numbers",
    "'values' must hold only numbers",
    "'values' must hold only numbers",
    "'label' must be an integer, got float",
    "'label' must be an integer, got str",
    "'values' holds NaN or infinity, or overflows float32",
    "'values' holds NaN or infinity, or overflows float32",
    "'values' holds NaN or infinity, or overflows float32",
    "'ts' is NaN or infinite",
    "'values' has no time steps",
    "'values' has 9 steps, the limit is 8",
    "channels=1 expects an array of numbers, got nested arrays",
    "'label' 3 is outside [0, 3)",
    "'label' -1 is outside [0, 3)",
    "'ts' is 301s ahead of the clock",
    "'ts' is before 1970",
]


@pytest.mark.parametrize(("case", "detail"), list(zip(CASES, DETAILS, strict=True)))
def test_each_rejection_says_which_rule_in_its_detail(case: tuple[str, bytes], detail: str) -> None:
    reason, raw = case
    assert decode_event(raw, LIMITS, NOW) == Rejection(reason, detail)


@pytest.mark.parametrize(
    ("raw", "limits", "rejection"),
    [
        (None, LIMITS, Rejection("decode", "message has no value (tombstone)")),
        (
            msg(ts=NOW - 7200),
            EventLimits(max_len=8, max_age_s=3600),
            Rejection("bad_timestamp", "'ts' is older than max_age_s=3600"),
        ),
        (
            b'{"sensor_id":"a","ts":1' + b"0" * 400 + b',"values":[1]}',
            LIMITS,
            Rejection("non_finite", "'ts' is too large to represent"),
        ),
        (
            msg(values=[[1, 2], [3, 4, 5]]),
            LIMITS_C3,
            Rejection("bad_channels", "every step must be an array of 3 numbers, got 2"),
        ),
        (
            msg(values=[1, 2, 3]),
            LIMITS_C3,
            Rejection("bad_channels", "every step must be an array of 3 numbers, got int"),
        ),
        (msg(values=[[1, 2, "3"]]), LIMITS_C3, Rejection("schema", "'values' must hold only numbers")),
        (
            b'{"sensor_id":"a","ts":1764412000,"values":[[1,2,3],[1,2,NaN]]}',
            LIMITS_C3,
            Rejection("non_finite", "'values' holds NaN or infinity, or overflows float32"),
        ),
        (
            b'{"sensor_id":"a","ts":1764412000,"values":[1' + b"0" * 400 + b"]}",
            LIMITS,
            Rejection("non_finite", "a value is too large to represent"),
        ),
    ],
)
def test_the_rarer_rules_say_why_too(raw: bytes | None, limits: EventLimits, rejection: Rejection) -> None:
    assert decode_event(raw, limits, NOW) == rejection


def test_a_huge_integer_reading_in_a_batch_is_refused_alone() -> None:
    huge = b'{"sensor_id":"a","ts":1764412000,"values":[1' + b"0" * 400 + b"]}"
    decoded = decode_batch([msg(values=[1.0]), huge, msg(values=[2.0])], LIMITS, NOW)
    assert decoded.rejections == [(1, Rejection("non_finite", "a value is too large to represent"))]
    assert decoded.events.values[:, 0].tolist() == [1.0, 2.0] and decoded.accepted_positions.tolist() == [0, 2]


def test_parse_values_names_each_rule() -> None:
    cases = [
        ("1,2", 1, "schema", "'values' must be an array, got str"),
        ([], 1, "empty", "'values' has no time steps"),
        ([1.0] * 5, 1, "too_long", "'values' has 5 steps, the limit is 4"),
        ([[1.0]], 1, "bad_channels", "channels=1 expects an array of numbers, got nested arrays"),
        ([1.0, "x"], 1, "schema", "'values' must hold only numbers"),
        ([[1.0, 2.0], [1.0]], 2, "bad_channels", "every step must be an array of 2 numbers, got 1"),
        ([[1.0, True]], 2, "schema", "'values' must hold only numbers"),
        ([10**400], 1, "non_finite", "a value is too large to represent"),
        ([1.0, 1e39], 1, "non_finite", "'values' holds NaN or infinity, or overflows float32"),
    ]
    for values, channels, reason, detail in cases:
        with pytest.raises(EventError) as err:
            parse_values(values, channels=channels, max_len=4)
        assert (err.value.reason, err.value.detail, str(err.value)) == (reason, detail, f"{reason}: {detail}")
    assert parse_values([[1, 2], [3, 4]], channels=2, max_len=4).tolist() == [[1.0, 2.0], [3.0, 4.0]]
    assert parse_values([[1, 2.5]], channels=2, max_len=4).tolist() == [[1.0, 2.5]]  # ints and floats mix
    assert parse_values([3e38, 3e38], channels=1, max_len=4).tolist() == [[np.float32(3e38)]] * 2  # finite
    assert parse_values([1.0] * 4, channels=1, max_len=4).dtype == np.float32


def test_limits_come_from_the_settings() -> None:
    from types import SimpleNamespace

    settings = SimpleNamespace(
        max_len=9, channels=2, n_classes=4, max_message_bytes=99, max_future_skew_s=7.0, max_age_s=60.0
    )
    assert EventLimits.from_settings(settings) == EventLimits(9, 2, 4, 99, 7.0, 60.0)


def test_a_batch_gives_back_each_event_and_its_columns() -> None:
    events = [
        SensorEvent("a", 1.0, np.ones((2, 1), np.float32), 1),
        SensorEvent("b", 2.0, np.full((3, 1), 2.0, np.float32)),
    ]
    batch = EventBatch.from_events(events, partitions=[4, 5], offsets=np.array([10, 11], np.int32))
    assert len(batch) == 2 and batch.starts.tolist() == [0, 2]
    assert batch.partitions.tolist() == [4, 5] and batch.offsets.tolist() == [10, 11]
    assert batch.partitions.dtype == np.int32 and batch.offsets.dtype == np.int64
    assert batch.sensor_ids.dtype == object and batch.labels.tolist() == [1, NO_LABEL]
    second = batch.event(1)
    assert (second.sensor_id, second.ts, second.label, second.length) == ("b", 2.0, NO_LABEL, 3)
    assert second.values[:, 0].tolist() == [2.0, 2.0, 2.0]
    plain = EventBatch.from_events(events)
    assert plain.partitions.tolist() == [0, 0] and plain.offsets.tolist() == [-1, -1]
    assert plain.partitions.dtype == np.int32 and plain.offsets.dtype == np.int64
    empty = EventBatch.from_events([], channels=3)
    assert len(empty) == 0 and empty.values.shape == (0, 3) and empty.values.dtype == np.float32
    assert EventBatch.from_events([]).values.shape == (0, 1)
    columns = {
        name: getattr(empty, name).dtype for name in ("sensor_ids", "ts", "labels", "lengths", "partitions", "offsets")
    }
    assert columns == {"sensor_ids": object, "ts": np.float64, "labels": np.int64, "lengths": np.int64,
                       "partitions": np.int32, "offsets": np.int64}  # fmt: skip
    single = EventBatch.from_events([SensorEvent("c", 3, np.zeros((1, 2), np.float32))])
    assert single.values.shape == (1, 2) and single.ts.dtype == np.float64 and single.ts.tolist() == [3.0]


def test_take_gives_the_rows_asked_in_their_order_with_their_readings_and_sources() -> None:
    events = [SensorEvent(f"s{i}", float(i), np.full((1 + i, 2), i, np.float32), i % 3) for i in range(5)]
    batch = EventBatch.from_events(events, partitions=[0, 1, 2, 3, 4], offsets=np.arange(10, 15))
    taken = batch.take(np.array([3, 0, 4]))
    assert len(taken) == 3 and taken.lengths.tolist() == [4, 1, 5] and taken.values.shape == (10, 2)
    for j, i in enumerate([3, 0, 4]):
        event = taken.event(j)
        assert (event.sensor_id, event.ts, event.label) == (f"s{i}", float(i), i % 3)
        assert np.array_equal(event.values, events[i].values)
    assert taken.partitions.tolist() == [3, 0, 4] and taken.offsets.tolist() == [13, 10, 14]
    assert len(batch.take(np.array([], dtype=np.int64))) == 0


def test_a_batch_without_sources_gets_partition_zero_and_no_offsets() -> None:
    decoded = decode_batch([msg(values=[1.0]), msg(values=[2.0, 3.0])], LIMITS, NOW)
    events = decoded.events
    assert events.partitions.tolist() == [0, 0] and events.offsets.tolist() == [-1, -1]
    assert events.partitions.dtype == np.int32 and events.offsets.dtype == np.int64
    given = decode_batch([msg(values=[1.0])], LIMITS, NOW, partitions=[3], offsets=[9]).events
    assert given.partitions.dtype == np.int32 and given.offsets.dtype == np.int64
    assert (given.partitions.tolist(), given.offsets.tolist()) == ([3], [9])
    assert events.sensor_ids.tolist() == ["pump-17", "pump-17"] and events.ts.dtype == np.float64
    assert events.labels.tolist() == [NO_LABEL, NO_LABEL] and events.lengths.tolist() == [1, 2]


def test_an_empty_poll_decodes_to_an_empty_batch() -> None:
    decoded = decode_batch([], LIMITS_C3, NOW)
    assert len(decoded.events) == 0 and decoded.rejections == [] and decoded.accepted_positions.tolist() == []
    assert decoded.events.values.shape[1] == 3


def test_a_multi_channel_batch_with_a_bad_event_keeps_the_good_ones_in_order() -> None:
    raws = [msg(values=[[1, 2, 3]]), msg(values=[[1, 2]]), msg(values=[[4, 5, 6], [7, 8, 9]])]
    decoded = decode_batch(raws, LIMITS_C3, NOW, offsets=[5, 6, 7])
    assert [(p, r.reason) for p, r in decoded.rejections] == [(1, "bad_channels")]
    assert decoded.events.values.tolist() == [[1, 2, 3], [4, 5, 6], [7, 8, 9]]
    assert decoded.events.values.dtype == np.float32
    assert decoded.events.lengths.tolist() == [1, 2] and decoded.events.offsets.tolist() == [5, 7]


def test_labels_are_kept_only_with_a_classification_head() -> None:
    decoded = decode_batch([msg(label=2), msg()], LIMITS, NOW)
    assert decoded.events.labels.tolist() == [2, NO_LABEL]
    headless = decode_batch([msg(label=2)], EventLimits(max_len=8), NOW)
    assert headless.events.labels.tolist() == [NO_LABEL]


def test_integer_timestamps_and_the_edges_of_the_clock_are_accepted() -> None:
    for ts in (int(NOW), NOW + 300, 0.0, 0):
        event = decode_event(msg(ts=ts), LIMITS, NOW)
        assert isinstance(event, SensorEvent) and event.ts == float(ts) and type(event.ts) is float
    aged = EventLimits(max_len=8, max_age_s=3600)
    assert isinstance(decode_event(msg(ts=NOW - 3600), aged, NOW), SensorEvent)
    assert isinstance(decode_event(msg(sensor_id="x" * 128), LIMITS, NOW), SensorEvent)
    assert isinstance(decode_event(msg(values=[0.5] * 8), LIMITS, NOW), SensorEvent)
    assert decode_event(msg(label=0), LIMITS, NOW).label == 0


def test_json_that_only_the_standard_library_reads_is_still_judged_by_the_rules() -> None:
    """orjson refuses NaN; the stdlib parse says which rule it breaks, not "decode"."""
    nan_reading = b'{"sensor_id":"a","ts":1764412000,"values":[NaN]}'
    assert decode_event(nan_reading, LIMITS, NOW) == Rejection(
        "non_finite", "'values' holds NaN or infinity, or overflows float32"
    )
    deep = EventLimits(max_len=8, max_message_bytes=1 << 20)
    assert decode_event(b"[" * 100_000, deep, NOW) == Rejection("decode", "not UTF-8 JSON")  # too deep for either


def test_a_reading_that_overflows_float32_is_a_rejection_not_a_warning() -> None:
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(EventError) as err:
            parse_values([1.0, 1e39], channels=1, max_len=4)
        assert err.value.reason == "non_finite"
        decoded = decode_batch([b'{"sensor_id":"a","ts":1764412000,"values":[1e39]}'], LIMITS, NOW)
        assert decoded.rejections[0][1].reason == "non_finite"


def test_a_message_of_exactly_the_size_limit_is_accepted() -> None:
    raw = msg()
    assert isinstance(decode_event(raw, EventLimits(max_len=8, max_message_bytes=len(raw)), NOW), SensorEvent)
    assert decode_event(raw, EventLimits(max_len=8, max_message_bytes=len(raw) - 1), NOW).reason == "too_large"


def test_input_that_is_not_bytes_at_all_is_refused_and_the_batch_goes_on() -> None:
    decoded = decode_batch([12345, msg(values=[1.0])], LIMITS, NOW)  # type: ignore[list-item]
    assert decoded.rejections == [(0, Rejection("decode", "undecodable message (TypeError)"))]
    assert decoded.accepted_positions.tolist() == [1] and decoded.events.values[:, 0].tolist() == [1.0]


HEADLESS = EventLimits(max_len=8)
ONE_CLASS = EventLimits(max_len=8, n_classes=1)
FORGETFUL = EventLimits(max_len=8, max_age_s=3600.0)
LONG_MEMORY = EventLimits(max_len=8, max_age_s=NOW + 10)  # the oldest allowed time is before 1970: 0 rules

EDGE_VALID = [
    ({"sensor_id": "s", "ts": NOW, "values": [1.0]}, LIMITS, ("s", NOW, NO_LABEL)),
    ({"sensor_id": "x" * 128, "ts": NOW, "values": [1.0]}, LIMITS, ("x" * 128, NOW, NO_LABEL)),
    ({"sensor_id": "s", "ts": 0, "values": [1.0]}, LIMITS, ("s", 0.0, NO_LABEL)),
    ({"sensor_id": "s", "ts": 0.5, "values": [1.0]}, LIMITS, ("s", 0.5, NO_LABEL)),
    ({"sensor_id": "s", "ts": 0.5, "values": [1.0]}, LONG_MEMORY, ("s", 0.5, NO_LABEL)),
    ({"sensor_id": "s", "ts": NOW + 300, "values": [1.0]}, LIMITS, ("s", NOW + 300, NO_LABEL)),
    ({"sensor_id": "s", "ts": NOW - 3600, "values": [1.0]}, FORGETFUL, ("s", NOW - 3600, NO_LABEL)),
    ({"sensor_id": "s", "ts": NOW, "values": [1.0] * 8}, LIMITS, ("s", NOW, NO_LABEL)),
    ({"sensor_id": "s", "ts": NOW, "values": [1.0], "label": 0}, LIMITS, ("s", NOW, 0)),
    ({"sensor_id": "s", "ts": NOW, "values": [1.0], "label": 2}, LIMITS, ("s", NOW, 2)),
    ({"sensor_id": "s", "ts": NOW, "values": [1.0], "label": 0}, ONE_CLASS, ("s", NOW, 0)),
    ({"sensor_id": "s", "ts": NOW, "values": [1.0], "label": 7}, HEADLESS, ("s", NOW, NO_LABEL)),
    ({"sensor_id": "s", "ts": NOW, "values": [1.0], "label": None}, LIMITS, ("s", NOW, NO_LABEL)),
]

EDGE_INVALID = [
    ({"sensor_id": "", "ts": NOW, "values": [1.0]}, LIMITS, "schema"),
    ({"sensor_id": "x" * 129, "ts": NOW, "values": [1.0]}, LIMITS, "schema"),
    ({"sensor_id": "s", "ts": -0.5, "values": [1.0]}, LIMITS, "bad_timestamp"),
    ({"sensor_id": "s", "ts": NOW + 301, "values": [1.0]}, LIMITS, "bad_timestamp"),
    ({"sensor_id": "s", "ts": NOW - 3601, "values": [1.0]}, FORGETFUL, "bad_timestamp"),
    ({"sensor_id": "s", "ts": NOW, "values": [1.0] * 9}, LIMITS, "too_long"),
    ({"sensor_id": "s", "ts": NOW, "values": []}, LIMITS, "empty"),
    ({"sensor_id": "s", "ts": NOW, "values": [1.0], "label": 3}, LIMITS, "bad_label"),
    ({"sensor_id": "s", "ts": NOW, "values": [1.0], "label": -1}, LIMITS, "bad_label"),
    ({"sensor_id": "s", "ts": NOW, "values": [1.0], "label": 1}, ONE_CLASS, "bad_label"),
    ({"sensor_id": "s", "ts": "now", "values": [1.0]}, LIMITS, "schema"),
    ({"sensor_id": 5, "ts": NOW, "values": [1.0]}, LIMITS, "schema"),
    ({"sensor_id": "s", "ts": NOW, "values": 1.0}, LIMITS, "schema"),
]


@pytest.mark.parametrize(("obj", "limits", "header"), EDGE_VALID)
def test_both_header_paths_accept_the_edges_of_every_rule(obj: dict, limits: EventLimits, header: tuple) -> None:
    from streamtrain.events import _check_header, _valid_header_or_none

    fast, full = _valid_header_or_none(obj, limits, NOW), _check_header(obj, limits, NOW)
    assert fast == header and full == header
    assert type(fast[1]) is float and type(full[1]) is float


@pytest.mark.parametrize(("obj", "limits", "reason"), EDGE_INVALID)
def test_both_header_paths_refuse_just_past_the_edges(obj: dict, limits: EventLimits, reason: str) -> None:
    from streamtrain.events import _check_header, _valid_header_or_none

    assert _valid_header_or_none(obj, limits, NOW) is None
    with pytest.raises(EventError) as err:
        _check_header(obj, limits, NOW)
    assert err.value.reason == reason


def test_an_empty_poll_has_typed_columns() -> None:
    events = decode_batch([b"junk"], LIMITS, NOW).events
    assert (events.ts.dtype, events.labels.dtype, events.lengths.dtype) == (np.float64, np.int64, np.int64)


# ------------------------------------------------ integers beyond 64 bits (docs/contract.md, section 1)
BIG = 2**64  # orjson reads integer literals from here on (and below -2**63) as floats
DIGITS_5000 = b"7" * 5000  # beyond Python's int-from-text limit (4300 digits)
NO_SKEW_LIMIT = EventLimits(max_len=8, max_future_skew_s=math.inf)
WIDE = EventLimits(max_len=8, n_classes=3, max_message_bytes=1 << 16)  # room for 5000 digits
WIDE_HEADLESS = EventLimits(max_len=8, max_message_bytes=1 << 16)


def raw_msg(ts: bytes = b"1764412000", values: bytes = b"[1.0]", extra: bytes = b"") -> bytes:
    return b'{"sensor_id":"a","ts":' + ts + b',"values":' + values + extra + b"}"


@pytest.mark.parametrize("label", [BIG, BIG + 1, 10**30, -(2**63) - 1, -(10**30), 10**400])
def test_an_integer_label_beyond_64_bits_is_a_bad_label_not_a_schema_error(label: int) -> None:
    raw = raw_msg(extra=b',"label":' + str(label).encode())
    rejection = decode_event(raw, LIMITS, NOW)
    assert isinstance(rejection, Rejection) and rejection.reason == "bad_label", rejection
    assert rejection.detail.endswith("is outside [0, 3)")
    # labels mean nothing without a classification head: the event is accepted
    assert decode_event(raw, HEADLESS, NOW).label == NO_LABEL


def test_a_label_beyond_python_s_digit_limit_is_a_bad_label_and_ignored_without_a_head() -> None:
    raw = raw_msg(extra=b',"label":' + DIGITS_5000)
    assert decode_event(raw, WIDE, NOW) == Rejection("bad_label", "'label' beyond 64 bits is outside [0, 3)")
    assert decode_event(raw, WIDE_HEADLESS, NOW).label == NO_LABEL


@pytest.mark.parametrize("literal", [b"1.8446744073709552e19", b"18446744073709551616.0", b"1e30", b"-1e30"])
def test_a_label_written_as_a_float_stays_a_schema_error_however_large(literal: bytes) -> None:
    raw = raw_msg(extra=b',"label":' + literal)
    assert decode_event(raw, LIMITS, NOW) == Rejection("schema", "'label' must be an integer, got float")


def test_a_big_integer_label_is_judged_alone_in_its_batch() -> None:
    decoded = decode_batch([msg(label=1), raw_msg(extra=b',"label":' + str(BIG).encode()), msg(label=2)], LIMITS, NOW)
    assert [(i, r.reason) for i, r in decoded.rejections] == [(1, "bad_label")]
    assert decoded.events.labels.tolist() == [1, 2]


@pytest.mark.parametrize(
    ("ts", "reason"),
    [
        (str(BIG).encode(), "bad_timestamp"),
        (str(-BIG).encode(), "bad_timestamp"),
        (b"1" + b"0" * 400, "non_finite"),
        (b"-1" + b"0" * 400, "non_finite"),
        (DIGITS_5000, "non_finite"),
    ],
)
def test_a_huge_integer_timestamp_is_refused_for_its_rule(ts: bytes, reason: str) -> None:
    rejection = decode_event(raw_msg(ts=ts), WIDE, NOW)
    assert isinstance(rejection, Rejection) and rejection.reason == reason, rejection


@pytest.mark.parametrize(("ts", "reason"), [(b"Infinity", "non_finite"), (b"1" + b"0" * 400, "non_finite")])
def test_without_a_future_limit_a_timestamp_must_still_be_finite(ts: bytes, reason: str) -> None:
    """MAX_FUTURE_SKEW_S=inf lets any finite time in; infinity and beyond-float64 integers stay out."""
    rejection = decode_event(raw_msg(ts=ts), NO_SKEW_LIMIT, NOW)
    assert isinstance(rejection, Rejection) and rejection.reason == reason, rejection
    assert decode_event(raw_msg(ts=str(BIG).encode()), NO_SKEW_LIMIT, NOW).ts == float(BIG)


def test_integers_beyond_python_s_digit_limit_are_judged_by_the_rules_not_as_undecodable() -> None:
    assert decode_event(raw_msg(values=b"[1.0, " + DIGITS_5000 + b"]"), WIDE, NOW).reason == "non_finite"
    assert decode_event(raw_msg(values=b"[" + DIGITS_5000 + b", NaN]"), WIDE, NOW).reason == "non_finite"
    ignored = decode_event(raw_msg(extra=b',"other":-' + DIGITS_5000), WIDE, NOW)  # unknown fields are ignored
    assert isinstance(ignored, SensorEvent) and ignored.values[:, 0].tolist() == [1.0]


json_number = st.one_of(st.integers(-(2**1100), 2**1100), st.floats(allow_nan=True, allow_infinity=True), st.booleans())


@settings(max_examples=500, deadline=None)
@given(
    values=st.lists(json_number | json_value, max_size=10)
    | st.lists(st.lists(json_number | json_value, max_size=4), max_size=10)
    | json_value,
    channels=st.integers(1, 3),
)
def test_parse_values_raises_only_event_errors_on_any_json_value(values: object, channels: int) -> None:
    """What the slow path of decode_batch relies on: every failure is an EventError with a reason."""
    try:
        parse_values(values, channels=channels, max_len=8)
    except EventError as err:
        assert err.reason in REASONS


def test_unknown_fields_nested_deeper_than_the_stdlib_parser_reads_are_ignored() -> None:
    """orjson reads 1000 levels (its limit is 1024); the stdlib parser stops at the recursion limit (1000)."""
    deep = b',"other":' + b"[" * 1000 + b"]" * 1000
    event = decode_event(raw_msg(extra=deep), WIDE, NOW)
    assert isinstance(event, SensorEvent) and event.values[:, 0].tolist() == [1.0]
    # a float label sends the message to the stdlib parser, which cannot read it: orjson's reading stands
    assert decode_event(raw_msg(extra=deep + b',"label":1.5'), WIDE, NOW) == Rejection(
        "schema", "'label' must be an integer, got float"
    )
