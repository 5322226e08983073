"""Durable files: whole or nothing under the final name, private, and a directory fsync that tolerates only 'cannot'."""

from __future__ import annotations

import errno
import hashlib
import logging
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


def open_descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_a_write_returns_its_path_and_closes_what_it_opened(tmp_path: Path) -> None:
    before = open_descriptors()
    written = write_atomically(tmp_path / "f", [b"abc"])
    assert written.path == tmp_path / "f" and written.size == 3 and open_descriptors() == before


def test_a_write_whose_file_object_cannot_be_made_closes_its_descriptor(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def refuse(*args: Any, **kw: Any) -> Any:
        raise OSError(errno.EMFILE, "no file object")

    monkeypatch.setattr(files, "open", refuse, raising=False)
    before = open_descriptors()
    with pytest.raises(OSError, match="no file object"):
        write_atomically(tmp_path / "f", [b"abc"])
    assert open_descriptors() == before and list(tmp_path.iterdir()) == []


def test_the_sync_every_bytes_counts_from_exactly_the_limit_on_the_file_being_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[tuple[str, int, int, int]] = []
    monkeypatch.setattr(files, "SYNC_EVERY_BYTES", 100)
    monkeypatch.setattr(files.os, "fdatasync", lambda fd: calls.append(("sync", fd, 0, 0)))
    monkeypatch.setattr(files, "drop_cached", lambda fd, offset, length: calls.append(("drop", fd, offset, length)))
    files.write_atomically(tmp_path / "f", [b"x" * 50] * 4)  # 100 bytes exactly after the second piece
    assert [(kind, offset, length) for kind, _, offset, length in calls] == [
        ("sync", 0, 0), ("drop", 0, 100), ("sync", 0, 0), ("drop", 100, 100),
    ]  # fmt: skip
    assert len({fd for _, fd, _, _ in calls}) == 1 and isinstance(calls[0][1], int) and calls[0][1] >= 0


def test_dropping_cached_pages_asks_the_kernel_for_that_range_and_nothing_where_it_cannot(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    asked: list[tuple[int, int, int, int]] = []
    monkeypatch.setattr(files.os, "posix_fadvise", lambda *args: asked.append(args), raising=False)
    files.drop_cached(7, 100, 50)
    assert asked == [(7, 100, 50, os.POSIX_FADV_DONTNEED)]
    monkeypatch.delattr(files.os, "posix_fadvise")
    files.drop_cached(7, 100, 50)  # no such call on this platform: nothing happens
    assert asked == [(7, 100, 50, os.POSIX_FADV_DONTNEED)]


def test_only_a_directory_can_be_synced_as_one(tmp_path: Path) -> None:
    plain = tmp_path / "plain"
    plain.write_bytes(b"x")
    with pytest.raises(NotADirectoryError):
        fsync_directory(plain)


def test_a_file_s_size_and_hash_cover_every_block(tmp_path: Path) -> None:
    data = bytes(range(256)) * (10 * 1024 + 7)  # 2.5 MiB and a bit: three reads
    (tmp_path / "f").write_bytes(data)
    assert file_sha256(tmp_path / "f") == (len(data), hashlib.sha256(data).hexdigest())
    (tmp_path / "empty").write_bytes(b"")
    assert file_sha256(tmp_path / "empty") == (0, hashlib.sha256(b"").hexdigest())


def test_a_range_read_in_short_reads_is_put_together_unbuffered(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "f").write_bytes(bytes(range(100)))
    opened: list[dict[str, Any]] = []
    real_open = open

    class Trickle:
        """A file whose every read returns at most 3 bytes (a pipe, a network file system)."""

        def __init__(self, path: Path, mode: str, **kw: Any) -> None:
            opened.append(kw)
            self.file = real_open(path, mode, **kw)

        def __enter__(self) -> Any:
            return self

        def __exit__(self, *exc: object) -> None:
            self.file.close()

        def seek(self, at: int) -> int:
            return self.file.seek(at)

        def readinto(self, view: memoryview) -> int:
            return self.file.readinto(view[:3])

    monkeypatch.setattr(files, "open", Trickle, raising=False)
    assert bytes(files.read_range(tmp_path / "f", 10, 20)) == bytes(range(10, 30))
    assert opened == [{"buffering": 0}]


def test_removing_a_missing_file_is_quiet_and_a_failure_is_logged_in_full(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="streamtrain.checkpoint.files"):
        files.remove_quietly(tmp_path / "missing")
        assert caplog.records == []
        (tmp_path / "dir").mkdir()
        files.remove_quietly(tmp_path / "dir")  # a directory: unlink fails
    [record] = caplog.records
    directory = tmp_path / "dir"
    assert record.getMessage() == (
        f"could not remove temporary checkpoint file {directory}: [Errno 21] Is a directory: '{directory}'"
    )


def test_a_chunk_s_length_is_its_bytes_whatever_it_is() -> None:
    class Pieces:
        nbytes = 12

        def pieces(self) -> Any:
            yield memoryview(b"x" * 12)

    assert files.chunk_length(b"abc") == 3
    assert files.chunk_length(memoryview(np.zeros(4, dtype=np.float64))) == 32
    assert files.chunk_length(Pieces()) == 12
