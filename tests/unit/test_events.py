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
    raws = [msg(values=[1.0]), b"junk", msg(values=[2.0, 3.0]), msg(values=[float("nan")]) , None, msg(values=[4.0])]
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
json_value = st.recursive(json_leaf, lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=5), inner, max_size=4), max_leaves=20)


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
        json_value | st.floats(allow_nan=True, allow_infinity=True) | st.integers(-5, 5)
        | st.lists(st.floats(-10, 10), min_size=0, max_size=10),
        max_size=5,
    ) | json_value,
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
