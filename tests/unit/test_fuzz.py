"""Fuzzing the two doors garbage comes through: the Kafka decoder and the HTTP API.

* The decoder: every event that breaks exactly one rule is refused with exactly that
  reason; a whole poll batch of mixed messages decodes exactly as its messages do one by
  one (the vectorized fast path agrees with the per-event rules); the predict validator
  applies the same value rules as the decoder.
* The predict validator through the real FastAPI app (``TestClient`` over a real
  :class:`Service` that never starts ingest): any body answers 200 or 4xx, never 5xx; a
  200 has one finite prediction per instance; a 422 names the first bad instance.
* schemathesis against the app's own ``/openapi.json``: zero server errors (5xx other
  than the documented 503s), responses that match the documented schemas and codes.

``STREAMTRAIN_FUZZ_EXAMPLES`` scales the example counts (CI: small; scripts/fuzz-long.sh:
thousands).
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import schemathesis
import torch
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.checks import (
    content_type_conformance,
    negative_data_rejection,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from streamtrain.config import load_settings
from streamtrain.events import (
    MAX_SENSOR_ID_CHARS,
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
from streamtrain.runtime.service import Service
from streamtrain.serve.app import create_app

torch.set_num_threads(1)

EXAMPLES = int(os.environ.get("STREAMTRAIN_FUZZ_EXAMPLES", "100"))
# CI runs a fixed sequence of examples (a red build is a bug, never bad luck); the long
# run (scripts/fuzz-long.sh sets the variable) explores fresh inputs every time.
DERANDOMIZE = "STREAMTRAIN_FUZZ_EXAMPLES" not in os.environ
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=DERANDOMIZE, suppress_health_check=list(HealthCheck))
NOW = 1_764_412_345.0
ADMIN_TOKEN = "fuzz-admin-token-0123456789"
OVERFLOW_FLOOR = 1e9  # readings below this magnitude must always get a finite forecast

LIMITS = (
    EventLimits(max_len=8, channels=1, n_classes=0, max_message_bytes=4096, max_future_skew_s=300.0),
    EventLimits(max_len=6, channels=3, n_classes=4, max_message_bytes=4096, max_future_skew_s=60.0),
    EventLimits(max_len=8, channels=2, n_classes=2, max_message_bytes=4096, max_age_s=3600.0),
)

# ---------------------------------------------------------------------------------------
# strategies

finite32 = st.floats(width=32, allow_nan=False, allow_infinity=False)
json_leaf = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**80), 2**80), st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=6),
)  # fmt: skip
json_value = st.recursive(
    json_leaf, lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=5), inner, max_size=4),
    max_leaves=24,
)  # fmt: skip


@st.composite
def valid_events(draw: st.DrawFn, limits: EventLimits) -> dict[str, Any]:
    steps = draw(st.integers(1, limits.max_len))
    number = finite32 | st.integers(-(2**24), 2**24)
    if limits.channels == 1:
        values: list[Any] = draw(st.lists(number, min_size=steps, max_size=steps))
    else:
        values = draw(
            st.lists(
                st.lists(number, min_size=limits.channels, max_size=limits.channels), min_size=steps, max_size=steps
            )
        )
    oldest = NOW - (limits.max_age_s if limits.max_age_s is not None else 1e9)
    event: dict[str, Any] = {
        "sensor_id": draw(st.text(min_size=1, max_size=MAX_SENSOR_ID_CHARS)),
        "ts": draw(st.floats(oldest + 1, NOW + limits.max_future_skew_s - 1) | st.integers(int(oldest) + 1, int(NOW))),
        "values": values,
    }
    if limits.n_classes and draw(st.booleans()):
        event["label"] = draw(st.integers(0, limits.n_classes - 1))
    if draw(st.booleans()):
        event["extra"] = draw(json_value)  # unknown fields are ignored
    return event


def _encode(obj: Any) -> bytes:
    return json.dumps(obj, allow_nan=True).encode()


def _replace_value(event: dict[str, Any], index: int, new: Any, limits: EventLimits) -> dict[str, Any]:
    values = [list(step) if isinstance(step, list) else step for step in event["values"]]
    step = index % len(values)
    if limits.channels == 1:
        values[step] = new
    else:
        values[step][index % limits.channels] = new
    return {**event, "values": values}


@st.composite
def broken_events(draw: st.DrawFn, limits: EventLimits) -> tuple[bytes, str]:
    """A valid event with exactly one rule broken, and the reason it must get."""
    event = draw(valid_events(limits))
    at = draw(st.integers(0, 10_000))
    rule = draw(st.sampled_from([r for r in REASONS if r != "bad_label" or limits.n_classes]))
    if rule == "too_large":
        return _encode({**event, "padding": "x" * limits.max_message_bytes}), rule
    if rule == "decode":
        raw = _encode(event)
        return draw(
            st.sampled_from([b"\xff" + raw, raw[: at % len(raw)], _encode([event]), _encode(event["values"])])
        ), rule
    if rule == "schema":
        broken = draw(
            st.sampled_from(
                [
                    {k: v for k, v in event.items() if k != "sensor_id"},
                    {k: v for k, v in event.items() if k != "ts"},
                    {k: v for k, v in event.items() if k != "values"},
                    {**event, "sensor_id": ""},
                    {**event, "sensor_id": "s" * (MAX_SENSOR_ID_CHARS + 1)},
                    {**event, "sensor_id": at},
                    {**event, "ts": str(event["ts"])},
                    {**event, "ts": True},
                    {**event, "ts": None},
                    {**event, "values": {"0": 1.0}},
                    {**event, "values": "1,2,3"},
                    {**event, "label": 0.5},
                    {**event, "label": "1"},
                    {**event, "label": True},
                    _replace_value(event, at, "1.0", limits),
                    _replace_value(event, at, None, limits),
                    _replace_value(event, at, False, limits),
                ]
            )
        )
        return _encode(broken), rule
    if rule == "non_finite":
        if draw(st.booleans()):
            return _encode({**event, "ts": draw(st.sampled_from([math.nan, math.inf, -math.inf]))}), rule
        bad = draw(st.sampled_from([math.nan, math.inf, -math.inf, 1e39, -3.5e38]))  # the last two overflow float32
        return _encode(_replace_value(event, at, bad, limits)), rule
    if rule == "empty":
        return _encode({**event, "values": []}), rule
    if rule == "too_long":
        return _encode(
            {**event, "values": (event["values"] * (limits.max_len + 1))[: limits.max_len + 1 + at % 5]}
        ), rule
    if rule == "bad_channels":
        if limits.channels == 1:
            return _encode({**event, "values": [[v] for v in event["values"]]}), rule
        values = [list(step) for step in event["values"]]
        values[at % len(values)] = values[at % len(values)][:-1] if at % 2 else values[at % len(values)] + [0.0]
        return _encode({**event, "values": values}), rule
    if rule == "bad_label":
        return _encode({**event, "label": draw(st.sampled_from([-1, limits.n_classes, limits.n_classes + at]))}), rule
    assert rule == "bad_timestamp"
    choices = [NOW + limits.max_future_skew_s + 1 + at, -1.0 - at]
    if limits.max_age_s is not None:
        choices.append(NOW - limits.max_age_s - 1 - at)
    return _encode({**event, "ts": draw(st.sampled_from(choices))}), rule


def messages(limits: EventLimits) -> st.SearchStrategy[bytes | None]:
    """Anything a topic may carry: valid, broken in one rule, structured junk, random bytes."""
    return st.one_of(
        valid_events(limits).map(_encode),
        broken_events(limits).map(lambda pair: pair[0]),
        json_value.map(_encode),
        st.dictionaries(st.sampled_from(["sensor_id", "ts", "values", "label"]), json_value).map(_encode),
        st.binary(max_size=300),
        st.none(),
    )


# ---------------------------------------------------------------------------------------
# the decoder


@FUZZ
@given(data=st.data(), limits=st.sampled_from(LIMITS))
def test_a_valid_event_decodes_exactly(data: st.DataObject, limits: EventLimits) -> None:
    event = data.draw(valid_events(limits))
    decoded = decode_event(_encode(event), limits, NOW)
    assert isinstance(decoded, SensorEvent), decoded
    expected = np.asarray(event["values"], dtype=np.float64).reshape(-1, limits.channels).astype(np.float32)
    assert decoded.values.dtype == np.float32 and np.array_equal(decoded.values, expected)
    assert decoded.sensor_id == event["sensor_id"] and decoded.ts == float(event["ts"])
    assert decoded.label == (event.get("label", NO_LABEL) if limits.n_classes else NO_LABEL)


@FUZZ
@given(data=st.data(), limits=st.sampled_from(LIMITS))
def test_one_broken_rule_gives_exactly_that_reason(data: st.DataObject, limits: EventLimits) -> None:
    raw, reason = data.draw(broken_events(limits))
    decoded = decode_event(raw, limits, NOW)
    assert isinstance(decoded, Rejection), f"accepted although it breaks {reason}: {raw[:200]!r}"
    assert decoded.reason == reason, f"{decoded} for {raw[:200]!r}"


@FUZZ
@given(data=st.data(), limits=st.sampled_from(LIMITS))
def test_a_mixed_poll_batch_decodes_exactly_as_its_messages_one_by_one(
    data: st.DataObject, limits: EventLimits
) -> None:
    raws = data.draw(st.lists(messages(limits), min_size=1, max_size=12))
    offsets = np.arange(len(raws), dtype=np.int64) * 7 + 3
    partitions = np.arange(len(raws), dtype=np.int32) % 3
    batch = decode_batch(raws, limits, NOW, partitions=partitions, offsets=offsets)
    rejected = dict(batch.rejections)
    assert len(rejected) == len(batch.rejections), "one outcome per message"
    assert sorted(set(rejected) | set(batch.accepted_positions.tolist())) == list(range(len(raws)))
    assert not set(rejected) & set(batch.accepted_positions.tolist())
    for k, position in enumerate(batch.accepted_positions.tolist()):
        alone = decode_event(raws[position], limits, NOW)
        assert isinstance(alone, SensorEvent), (raws[position], alone)
        together = batch.events.event(k)
        assert np.array_equal(together.values, alone.values)
        assert (together.sensor_id, together.ts, together.label) == (alone.sensor_id, alone.ts, alone.label)
        assert batch.events.offsets[k] == offsets[position] and batch.events.partitions[k] == partitions[position]
    for position, rejection in rejected.items():
        assert rejection.reason in REASONS
        assert decode_event(raws[position], limits, NOW) == rejection


@FUZZ
@given(values=json_value | st.lists(json_value, max_size=10), limits=st.sampled_from(LIMITS))
def test_predict_validator_applies_the_event_value_rules(values: Any, limits: EventLimits) -> None:
    """The contract: predict instances follow the same value rules as events."""
    try:
        parsed: np.ndarray | str = parse_values(values, limits.channels, limits.max_len)
    except EventError as err:
        parsed = err.reason
    event = _encode({"sensor_id": "s", "ts": NOW, "values": values})
    decoded = decode_event(event, limits, NOW)
    if isinstance(parsed, str):
        assert isinstance(decoded, Rejection) and decoded.reason in {parsed, "too_large"}, (values, parsed, decoded)
    elif isinstance(decoded, SensorEvent):
        assert np.array_equal(decoded.values, parsed)
    else:
        assert decoded.reason == "too_large"


# ---------------------------------------------------------------------------------------
# the predict endpoint through the real app

APP_SETTINGS = {
    "c1": {"channels": 1, "n_classes": 0, "max_len": 16, "max_predict_batch": 6},
    "c2": {"channels": 2, "n_classes": 3, "max_len": 12, "max_predict_batch": 5},
}


def build_service(tmp: Path, **overrides: Any) -> Service:
    """A real Service whose ingest never starts (no Kafka), with a published model."""
    values = {
        "kafka_bootstrap": "127.0.0.1:9",  # never contacted: ingest is not started
        "checkpoint_dir": tmp,
        "d_model": 16, "n_heads": 2, "n_layers": 1, "token_budget": 512,
        "admin_token": ADMIN_TOKEN,
        "max_request_bytes": 64 * 1024,
        **overrides,
    }  # fmt: skip
    service = Service(load_settings(**values))
    service.trainer.publish()
    return service


@pytest.fixture(scope="module", params=sorted(APP_SETTINGS))
def api(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[TestClient, Service]]:
    service = build_service(tmp_path_factory.mktemp("fuzz-ckpt"), **APP_SETTINGS[request.param])
    with TestClient(create_app(service), raise_server_exceptions=False) as client:
        yield client, service


def instance_values(channels: int, max_len: int) -> st.SearchStrategy[Any]:
    number = st.floats(-1e6, 1e6) | st.integers(-1000, 1000)
    step = number if channels == 1 else st.lists(number, min_size=channels, max_size=channels)
    return st.one_of(
        st.lists(step, min_size=1, max_size=max_len),  # valid
        st.lists(step, min_size=max_len + 1, max_size=max_len + 3),  # too long
        st.lists(step | json_value, min_size=0, max_size=max_len),  # a bad element maybe
        st.lists(st.floats(width=32) | finite32, min_size=1, max_size=4).map(
            lambda xs: xs if channels == 1 else [[x] * channels for x in xs]
        ),  # NaN, inf and float32 extremes
        json_value,
    )


@st.composite
def predict_bodies(draw: st.DrawFn, channels: int, max_len: int, max_batch: int) -> Any:
    count = draw(st.integers(0, max_batch + 2))
    instances = [
        draw(st.fixed_dictionaries({"values": instance_values(channels, max_len)}) | json_value) for _ in range(count)
    ]
    return draw(st.sampled_from([{"instances": instances}, {"instances": instances, "extra": 1}, instances]))


def expected_outcome(body: Any, channels: int, max_len: int, max_batch: int) -> tuple[int, str | None]:
    """(status, the instance a 422 must name) by the contract's rules, from the validator itself."""
    if not isinstance(body, dict) or not isinstance(body.get("instances"), list):
        return 422, None
    instances = body["instances"]
    for i, instance in enumerate(instances):
        if not isinstance(instance, dict) or not isinstance(instance.get("values"), list):
            return 422, f"instances.{i}"
    if not 1 <= len(instances) <= max_batch:
        return 422, "instances"
    for i, instance in enumerate(instances):
        try:
            parse_values(instance["values"], channels, max_len)
        except EventError:
            return 422, f"instances[{i}]"
    return 200, None


def test_predict_answers_200_or_422_naming_the_instance_never_5xx(api: tuple[TestClient, Service]) -> None:
    client, service = api
    s = service.settings

    @FUZZ
    @given(body=predict_bodies(s.channels, s.max_len, s.max_predict_batch))
    def check(body: Any) -> None:
        response = client.post(
            "/v1/predict", content=json.dumps(body, allow_nan=True), headers={"content-type": "application/json"}
        )
        status, names = expected_outcome(body, s.channels, s.max_len, s.max_predict_batch)
        if status == 200 and response.status_code == 422 and "forecast overflows" in response.text:
            # allowed only for readings far outside any sensor's range (float32 extremes)
            bad = int(re.search(r"instances\[(\d+)\]", response.json()["detail"]).group(1))
            assert np.abs(np.asarray(body["instances"][bad]["values"], dtype=np.float64)).max() > OVERFLOW_FLOOR, body
            return
        assert response.status_code == status, (body, response.text)
        if status == 422:
            assert names is None or names in response.json()["detail"], (body, response.text)
            return
        answer = response.json()
        assert answer["model_version"] == service.published.version
        assert len(answer["predictions"]) == len(body["instances"])
        for prediction in answer["predictions"]:
            assert len(prediction["next"]) == s.channels and all(map(math.isfinite, prediction["next"]))
            assert math.isfinite(prediction["anomaly_score"]) and prediction["anomaly_score"] >= 0
            if s.n_classes:
                assert len(prediction["probs"]) == s.n_classes and math.isclose(
                    sum(prediction["probs"]), 1, rel_tol=1e-6
                )
            else:
                assert "probs" not in prediction

    check()


def test_extreme_but_finite_readings_never_answer_nan(api: tuple[TestClient, Service]) -> None:
    """float32-range readings may overflow the model: the answer is a 422 naming the instance, never NaN/null."""
    client, service = api
    c = service.settings.channels
    for value in (3.0e38, -1.35e28, 1e20, 65504.0):
        step = value if c == 1 else [value] * c
        response = client.post(
            "/v1/predict", json={"instances": [{"values": [0.5] if c == 1 else [[0.5] * c]}, {"values": [step, step]}]}
        )
        if response.status_code == 200:
            for prediction in response.json()["predictions"]:
                assert None not in prediction["next"] and all(map(math.isfinite, prediction["next"]))
        else:
            assert response.status_code == 422 and "instances[1]" in response.json()["detail"], response.text


def test_any_bytes_as_a_predict_body_are_a_4xx(api: tuple[TestClient, Service]) -> None:
    client, _ = api

    @FUZZ
    @given(raw=st.binary(max_size=400) | json_value.map(lambda v: json.dumps(v, allow_nan=True).encode()))
    def check(raw: bytes) -> None:
        response = client.post("/v1/predict", content=raw, headers={"content-type": "application/json"})
        assert response.status_code in (413, 422), (raw, response.status_code, response.text)

    check()


# ---------------------------------------------------------------------------------------
# schemathesis against the app's own OpenAPI document


CHECKS = [
    status_code_conformance,
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    negative_data_rejection,
]


def test_openapi_operations_have_no_server_errors(tmp_path: Path) -> None:
    """Every documented operation, valid and invalid data, with and without the admin token:
    no 500, no 5xx the document does not declare, responses as documented.

    (Driven from inside one test: ``schemathesis.pytest.from_fixture`` reads a private
    pytest attribute that pytest 9 no longer has.)
    """
    service = build_service(tmp_path, **APP_SETTINGS["c2"])
    schema = schemathesis.openapi.from_asgi("/openapi.json", create_app(service))
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {(op.method.upper(), op.path) for op in operations} >= {
        ("GET", "/healthz"), ("GET", "/readyz"), ("GET", "/v1/window"), ("GET", "/v1/model"),
        ("POST", "/v1/predict"), ("GET", "/metrics"), ("POST", "/v1/admin/checkpoint"),
    }  # fmt: skip
    for operation in operations:
        declared = set(operation.definition.raw.get("responses", {}))
        takes_input = any(
            len(part) for part in (operation.body, operation.query, operation.headers, operation.path_parameters)
        )
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE) if takes_input else (GenerationMode.POSITIVE,):
            _fuzz_operation(operation, mode, declared)


def _fuzz_operation(operation: Any, mode: GenerationMode, declared: set[str]) -> None:
    """One operation in one generation mode; ``declared`` holds the status codes its document lists."""

    @settings(max_examples=max(10, EXAMPLES // 4), deadline=None, derandomize=DERANDOMIZE,
              suppress_health_check=list(HealthCheck), database=None)  # fmt: skip
    @given(case=operation.as_strategy(generation_mode=mode))
    def check(case: Any) -> None:
        for headers in ({"Authorization": f"Bearer {ADMIN_TOKEN}"}, None):
            response = case.call(headers=headers)
            where = f"{case.method} {case.path} ({mode.value})"
            assert response.status_code != 500, (where, response.text)
            if response.status_code >= 500:  # only documented 503s: not ready, overloaded, checkpoint failed
                assert str(response.status_code) in declared, (where, response.status_code, response.text)
            case.validate_response(response, checks=CHECKS)

    try:
        check()
    except Unsatisfiable:
        # Only plain string path parameters (the OIP routes' model name and
        # version, the admin model route's version): no value breaks the schema.
        assert mode is GenerationMode.NEGATIVE and not (operation.body or operation.query), operation.path


# ---------------------------------------------------------------------------------------
# atheris: coverage-guided byte-level fuzzing (scripts/fuzz_atheris.py); a short run here


@pytest.mark.parametrize("target", ["decoder", "predict"])
def test_atheris_targets_run_clean(target: str, tmp_path: Path) -> None:
    pytest.importorskip("atheris")
    import subprocess
    import sys

    script = Path(__file__).resolve().parents[2] / "scripts" / "fuzz_atheris.py"
    runs = max(3000, 30 * EXAMPLES)
    done = subprocess.run(
        [sys.executable, str(script), target, f"-runs={runs}", "-seed=1", f"-artifact_prefix={tmp_path}/"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"Done {runs} runs" in done.stderr
