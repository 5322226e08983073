"""The admission record's line format: compact JSON closed by its CRC-32, one entry per line."""

from __future__ import annotations

import json
import logging
import zlib
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


class AdmissionRecordError(ValueError):
    """The admission record is damaged or older than the checkpoint: restoring would re-admit events."""


def encode_line(entry: Mapping[str, Any]) -> bytes:
    body = json.dumps(entry, separators=(",", ":"), ensure_ascii=True, allow_nan=False)
    return f"{body}\t{zlib.crc32(body.encode('ascii')):08x}\n".encode("ascii")


def verified_entries(data: bytes, part: Path) -> Iterator[dict[str, Any]]:
    """Verified entries of one file's bytes: a torn last line is skipped, a damaged complete line refused.

    A line without its newline is the torn end of a write that never completed — never
    synced, so nothing published depended on it.
    """
    *complete, tail = data.split(b"\n")
    if tail:
        log.warning("admission record %s: skipping a torn last line (%d bytes)", part, len(tail))
    for number, line in enumerate(complete, start=1):
        try:
            body, _, crc = line.decode("ascii").rpartition("\t")
            if int(crc, 16) != zlib.crc32(body.encode("ascii")):
                raise ValueError("CRC mismatch")
            yield json.loads(body)
        except (ValueError, UnicodeDecodeError) as error:
            raise AdmissionRecordError(
                f"admission record {part} line {number} is damaged ({error}); restore the file from backup "
                "or start a new DP deployment (empty CHECKPOINT_DIR and DP_ADMISSION_DIR)"
            ) from None
