"""The admission record's line format: compact ASCII JSON, a tab, its CRC-32 in hex, a newline."""

from __future__ import annotations

import logging
import math
import zlib
from pathlib import Path

import pytest

from streamtrain.privacy.jsonlines import AdmissionRecordError, encode_line, verified_entries


def test_a_line_is_compact_ascii_json_closed_by_its_crc() -> None:
    body = '{"s":1,"c":["caf\\u00e9"]}'  # a sensor name outside ASCII is escaped, never written raw
    assert encode_line({"s": 1, "c": ["café"]}) == f"{body}\t{zlib.crc32(body.encode()):08x}\n".encode()
    assert list(verified_entries(encode_line({"s": 1, "c": ["café"]}), Path("log"))) == [{"s": 1, "c": ["café"]}]


def test_a_value_json_cannot_represent_is_refused_when_written() -> None:
    with pytest.raises(ValueError, match="Out of range float values are not JSON compliant"):
        encode_line({"s": math.nan})


def test_a_torn_last_line_is_skipped_with_a_warning_naming_the_file(caplog: pytest.LogCaptureFixture) -> None:
    data = encode_line({"s": 1}) + b'{"s":2'
    with caplog.at_level(logging.WARNING, logger="streamtrain.privacy.jsonlines"):
        assert list(verified_entries(data, Path("partition-0.jsonl"))) == [{"s": 1}]
    assert [r.getMessage() for r in caplog.records] == [
        "admission record partition-0.jsonl: skipping a torn last line (6 bytes)"
    ]


def test_a_damaged_complete_line_is_refused_in_one_line() -> None:
    damaged = encode_line({"s": 1}) + encode_line({"s": 2}).replace(b"2", b"3", 1)
    with pytest.raises(AdmissionRecordError) as raised:
        list(verified_entries(damaged, Path("partition-0.jsonl")))
    assert str(raised.value) == (
        "admission record partition-0.jsonl line 2 is damaged (CRC mismatch); restore the file from backup or start "
        "a new DP deployment (empty CHECKPOINT_DIR and DP_ADMISSION_DIR)"
    )
