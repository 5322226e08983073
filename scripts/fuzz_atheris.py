"""Coverage-guided fuzzing (atheris / libFuzzer) of what reads untrusted bytes.

Targets:

* ``decoder``: arbitrary bytes, cut into a poll batch of several messages, through
  :func:`streamtrain.events.decode_batch`. It must never raise; every message must come
  out as exactly one event or exactly one rejection with a reason of docs/contract.md; the batch path
  must agree with decoding each message alone; accepted readings are finite float32 of
  the configured shape.
* ``predict``: arbitrary bytes as a /v1/predict body, through the same JSON parse and
  :func:`streamtrain.events.parse_values` the route uses. Only ``EventError`` (a 422) may
  come out, and what passes is finite float32 ``[L, C]`` within the limits.

hypothesis (tests/unit/test_fuzz.py) explores the structure; libFuzzer's coverage
feedback finds byte-level paths hypothesis does not think of.

    python scripts/fuzz_atheris.py decoder -runs=200000      # or -max_total_time=600
    python scripts/fuzz_atheris.py predict -max_total_time=600 corpus/

Extra arguments go to libFuzzer. CI runs a few thousand inputs of each
(tests/unit/test_fuzz.py::test_atheris_targets_run_clean).
"""

from __future__ import annotations

import sys

import atheris

with atheris.instrument_imports(include=["streamtrain"]):
    import numpy as np
    import orjson

    from streamtrain.events import REASONS, EventError, EventLimits, decode_batch, decode_event, parse_values

NOW = 1_700_000_000.0
LIMITS = EventLimits(max_len=16, channels=2, n_classes=3, max_message_bytes=512, max_future_skew_s=300.0)
PREDICT_CHANNELS, PREDICT_MAX_LEN = 2, 16


def _number(fdp: atheris.FuzzedDataProvider) -> object:
    kind = fdp.ConsumeIntInRange(0, 9)
    if kind == 0:
        return fdp.ConsumeInt(8)  # any size, also beyond float range
    if kind == 1:
        return fdp.ConsumeUnicodeNoSurrogates(3)
    if kind == 2:
        return fdp.ConsumeBool()
    return fdp.ConsumeRegularFloat() if kind < 6 else fdp.ConsumeFloatInRange(-10.0, 10.0)


def _event_like(fdp: atheris.FuzzedDataProvider) -> bytes:
    """A JSON event whose fields are mostly right, so the deep rules get exercised."""
    steps = fdp.ConsumeIntInRange(0, LIMITS.max_len + 2)
    width = fdp.ConsumeIntInRange(1, 3)
    values = [
        [_number(fdp) for _ in range(width)] if width > 1 or fdp.ConsumeBool() else _number(fdp) for _ in range(steps)
    ]
    event: dict[str, object] = {
        "sensor_id": fdp.ConsumeUnicodeNoSurrogates(fdp.ConsumeIntInRange(0, 8)),
        "ts": NOW + fdp.ConsumeFloatInRange(-1e6, 1e3) if fdp.ConsumeBool() else _number(fdp),
        "values": values,
    }
    if fdp.ConsumeBool():
        event["label"] = _number(fdp) if fdp.ConsumeBool() else fdp.ConsumeIntInRange(-1, 4)
    raw = orjson.dumps(event, option=orjson.OPT_SERIALIZE_NUMPY) if fdp.ConsumeProbability() < 0.9 else b""
    if raw and fdp.ConsumeProbability() < 0.2:  # damage one byte
        at = fdp.ConsumeIntInRange(0, len(raw) - 1)
        raw = raw[:at] + bytes([fdp.ConsumeInt(1) & 0xFF]) + raw[at + 1 :]
    return raw


def fuzz_decoder(data: bytes) -> None:
    fdp = atheris.FuzzedDataProvider(data)
    count = fdp.ConsumeIntInRange(1, 4)
    raws: list[bytes | None] = []
    for _ in range(count):
        choice = fdp.ConsumeProbability()
        if choice < 0.05:
            raws.append(None)  # a tombstone
        elif choice < 0.6:
            try:
                raws.append(_event_like(fdp))
            except (OverflowError, TypeError):  # a number orjson itself cannot write
                raws.append(b"{}")
        else:
            raws.append(fdp.ConsumeBytes(fdp.ConsumeIntInRange(0, 600)))
    decoded = decode_batch(raws, LIMITS, NOW)
    rejected = {position: rejection for position, rejection in decoded.rejections}
    if len(rejected) != len(decoded.rejections):
        raise AssertionError("a message was rejected twice")
    if len(rejected) + len(decoded.events) != len(raws):
        raise AssertionError(f"{len(raws)} messages gave {len(decoded.events)} events + {len(rejected)} rejections")
    accepted = 0
    for position, raw in enumerate(raws):
        alone = decode_event(raw, LIMITS, NOW)
        if position in rejected:
            if rejected[position].reason not in REASONS:
                raise AssertionError(f"unknown reason {rejected[position].reason!r}")
            if getattr(alone, "reason", None) != rejected[position].reason:
                raise AssertionError(f"batch said {rejected[position].reason}, alone {alone!r}")
            continue
        event = decoded.events.event(accepted)
        accepted += 1
        if getattr(alone, "reason", None) is not None:
            raise AssertionError(f"accepted in a batch, rejected alone: {alone!r}")
        values = np.asarray(event.values)
        if values.dtype != np.float32 or values.ndim != 2 or values.shape[1] != LIMITS.channels:
            raise AssertionError(f"bad readings array {values.dtype} {values.shape}")
        if not 1 <= values.shape[0] <= LIMITS.max_len or not np.isfinite(values).all():
            raise AssertionError("accepted readings out of the limits")
        np.testing.assert_array_equal(values, np.asarray(alone.values))


def _predict_body(fdp: atheris.FuzzedDataProvider) -> bytes:
    """Raw bytes, or a body of instances whose readings are mostly right."""
    if fdp.ConsumeProbability() < 0.3:
        return fdp.ConsumeBytes(fdp.ConsumeIntInRange(0, 2000))
    instances = []
    for _ in range(fdp.ConsumeIntInRange(0, 4)):
        width = fdp.ConsumeIntInRange(1, 3)
        steps = fdp.ConsumeIntInRange(0, PREDICT_MAX_LEN + 2)
        instances.append(
            {"values": [[_number(fdp) for _ in range(width)] if width > 1 else _number(fdp) for _ in range(steps)]}
        )
    try:
        return orjson.dumps({"instances": instances})
    except (OverflowError, TypeError):
        return b"{}"


def fuzz_predict(data: bytes) -> None:
    try:
        body = orjson.loads(_predict_body(atheris.FuzzedDataProvider(data)))
    except orjson.JSONDecodeError:
        return  # the route answers 422 before the validator
    if not isinstance(body, dict) or not isinstance(body.get("instances"), list):
        return  # pydantic's 422
    for instance in body["instances"]:
        if not isinstance(instance, dict) or "values" not in instance:
            continue
        try:
            values = parse_values(instance["values"], PREDICT_CHANNELS, PREDICT_MAX_LEN)
        except EventError as err:
            if err.reason not in REASONS:
                raise AssertionError(f"unknown reason {err.reason!r}") from None
            continue
        if values.dtype != np.float32 or values.shape[1:] != (PREDICT_CHANNELS,):
            raise AssertionError(f"bad array {values.dtype} {values.shape}")
        if not 1 <= len(values) <= PREDICT_MAX_LEN or not np.isfinite(values).all():
            raise AssertionError("parse_values let through what the limits refuse")


TARGETS = {"decoder": fuzz_decoder, "predict": fuzz_predict}


def main() -> None:
    if len(sys.argv) < 2 or sys.argv[1] not in TARGETS:
        sys.exit(f"usage: {sys.argv[0]} {{{'|'.join(TARGETS)}}} [libFuzzer options]")
    target = TARGETS[sys.argv.pop(1)]
    atheris.Setup(sys.argv, target)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
