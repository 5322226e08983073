"""Durable files: whole or nothing under the final name, private, and a directory fsync that tolerates only 'cannot'."""

from __future__ import annotations

import errno
import hashlib
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from streamtrain.checkpoint import files
from streamtrain.checkpoint.files import file_sha256, fsync_directory, temp_path, write_atomically


def test_a_write_is_whole_private_and_hashed_as_written(tmp_path: Path) -> None:
    path = tmp_path / "blob"
    written = write_atomically(path, [b"abc", b"", b"def"], sha256=True)
    assert path.read_bytes() == b"abcdef" and written.size == 6
    assert written.sha256 == hashlib.sha256(b"abcdef").hexdigest() == file_sha256(path)[1]
    assert written.stat.st_ino == path.stat().st_ino and path.stat().st_mode & 0o777 == 0o600
    assert write_atomically(path, [b"x"]).sha256 is None  # hashing only when asked
    assert sorted(p.name for p in tmp_path.iterdir()) == ["blob"]


def test_large_chunks_are_written_in_pieces_byte_for_byte(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A tensor's own memory (a memoryview of any format) goes out in pieces, whole and in order."""
    monkeypatch.setattr(files, "_WRITE_PIECE_BYTES", 3)
    floats = np.arange(5, dtype=np.float32)
    written = write_atomically(tmp_path / "blob", [b"abcdefgh", floats.data, b"z"], sha256=True)
    expected = b"abcdefgh" + floats.tobytes() + b"z"
    assert (tmp_path / "blob").read_bytes() == expected and written.size == len(expected)
    assert written.sha256 == hashlib.sha256(expected).hexdigest()


def test_a_range_is_read_whole_or_refused(tmp_path: Path) -> None:
    (tmp_path / "blob").write_bytes(b"0123456789")
    assert files.read_range(tmp_path / "blob", 2, 5) == bytearray(b"23456")
    with pytest.raises(OSError, match="ends at byte 10, before 12"):
        files.read_range(tmp_path / "blob", 4, 8)


def test_a_failed_write_leaves_the_old_contents_and_no_temp_file(tmp_path: Path) -> None:
    path = tmp_path / "blob"
    write_atomically(path, [b"old"])

    def chunks() -> Any:
        yield b"new, half"
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    with pytest.raises(OSError, match="No space left"):
        write_atomically(path, chunks())
    assert path.read_bytes() == b"old" and not temp_path(path).exists()


def test_the_temp_name_carries_the_writers_pid(tmp_path: Path) -> None:
    assert temp_path(tmp_path / "ckpt-1-2.stck").name == f".ckpt-1-2.stck.{os.getpid()}.tmp"


@pytest.mark.parametrize("code", [errno.EINVAL, errno.ENOTSUP])
def test_a_directory_that_cannot_be_synced_is_not_an_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code: int
) -> None:
    def cannot(fd: int) -> None:
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(files.os, "fsync", cannot)
    fsync_directory(tmp_path)


def test_a_directory_sync_that_fails_is_raised(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def failing(fd: int) -> None:
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(files.os, "fsync", failing)
    with pytest.raises(OSError, match="Input/output error"):
        fsync_directory(tmp_path)


def test_a_large_file_is_synced_and_dropped_from_the_page_cache_as_it_is_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every SYNC_EVERY_BYTES written are made durable, then dropped from the cache (a 3 GB base
    took 3 GB of page cache before); the bytes and the final fsync are as before."""
    calls: list[tuple[str, int, int]] = []
    monkeypatch.setattr(files, "SYNC_EVERY_BYTES", 100)
    monkeypatch.setattr(files.os, "fdatasync", lambda fd: calls.append(("sync", 0, 0)))
    monkeypatch.setattr(files, "drop_cached", lambda fd, offset, length: calls.append(("drop", offset, length)))
    data = [bytes([i]) * 60 for i in range(5)]  # 300 bytes in pieces of 60
    written = files.write_atomically(tmp_path / "f", data)
    assert (tmp_path / "f").read_bytes() == b"".join(data) and written.size == 300
    assert calls == [("sync", 0, 0), ("drop", 0, 120), ("sync", 0, 0), ("drop", 120, 120)]
