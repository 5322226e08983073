"""Durable files: written whole or not at all, and the directory entry made durable too.

Every checkpoint file (and the DP admission record's new files) goes through here. A
file is written to a temporary name beside its final one, ``.{name}.{pid}.tmp``,
flushed and fsynced, renamed over the final name, and then the directory is fsynced,
so after a crash the final name holds either the old contents or the complete new
ones, never a mix. The temporary name carries the writer's pid so that a store can
tell its own leftovers (and those of processes that are gone) from a write in flight.
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable

logger = logging.getLogger(__name__)

TEMP_SUFFIX = ".tmp"


@runtime_checkable
class PieceSource(Protocol):
    """Bytes made piece by piece while they are written (a window's readings, gathered from
    where they lie into one small buffer): each piece is valid until the next is asked for."""

    @property
    def nbytes(self) -> int: ...

    def pieces(self) -> Iterator[memoryview]: ...


Chunk = bytes | memoryview | PieceSource
"""A piece of a file's bytes: a tensor's own memory is written as it lies, a
:class:`PieceSource` as it makes its pieces."""


def chunk_pieces(chunk: Chunk) -> Iterator[memoryview]:
    """``chunk``'s bytes, in pieces of its own making (one piece for bytes and memoryviews)."""
    if isinstance(chunk, PieceSource):
        yield from chunk.pieces()
    else:
        yield memoryview(chunk).cast("B")


def chunk_length(chunk: Chunk) -> int:
    return chunk.nbytes if isinstance(chunk, PieceSource) else memoryview(chunk).nbytes


# A write of hundreds of megabytes in one call holds the interpreter for tens of milliseconds
# (measured: 24 ms for 300 MB, 9 ms in 64 MB pieces); checkpoints write in pieces.
_WRITE_PIECE_BYTES = 16 << 20
# A large file is made durable and dropped from the page cache every this many bytes as it
# is written (RocksDB's ``bytes_per_sync``, with the cache dropped too): a 3 GB base then
# holds ~64 MB of page cache, reused piece after piece, instead of 3 GB of memory taken
# fresh from the OS (on a VM whose host backs memory on first touch, the slowest part of
# the write). The file is read back only on a restore, which reads it once.
SYNC_EVERY_BYTES = 64 << 20


def drop_cached(fd: int, offset: int, length: int) -> None:
    """Tell the kernel the pages of ``[offset, offset + length)`` of ``fd`` are not needed again
    (clean ones are dropped from the page cache); a no-op where the call is missing."""
    if hasattr(os, "posix_fadvise"):
        os.posix_fadvise(fd, offset, length, os.POSIX_FADV_DONTNEED)


@dataclass(frozen=True)
class WrittenFile:
    """A file now durable under its final name."""

    path: Path
    size: int
    stat: os.stat_result  # as written (fstat before the rename; the rename keeps it)
    sha256: str | None = None  # of the whole file, when asked for


def temp_path(path: Path) -> Path:
    """The temporary name a write of ``path`` by this process uses."""
    return path.with_name(f".{path.name}.{os.getpid()}{TEMP_SUFFIX}")


def write_atomically(path: Path, chunks: Iterable[Chunk], *, sha256: bool = False) -> WrittenFile:
    """Write ``chunks`` as the file ``path``: temp file, fsync, rename, fsync of the directory.

    The temporary file is created with O_EXCL (never writing through a file or link
    someone else placed there) and mode 0600 (checkpoints are private to the service
    user). On any failure it is removed and the error raised; the final name is then
    untouched, unless only the directory fsync failed. ``sha256`` also hashes the bytes
    as they are written (a manifest records it); the chunks are never joined.
    """
    temp = temp_path(path)
    digest = hashlib.sha256() if sha256 else None
    size = 0
    try:
        fd = os.open(temp, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_CLOEXEC, 0o600)
        try:
            # the with below closes it; until open() returns, the descriptor is ours to close
            file = open(fd, "wb", closefd=True)  # noqa: SIM115
        except BaseException:
            os.close(fd)
            raise
        synced = 0
        with file:
            for view in (view for chunk in chunks for view in chunk_pieces(chunk)):
                for at in range(0, len(view), _WRITE_PIECE_BYTES):  # one long write would hold the interpreter
                    file.write(view[at : at + _WRITE_PIECE_BYTES])
                if digest is not None:
                    digest.update(view)
                size += len(view)
                if size - synced >= SYNC_EVERY_BYTES:
                    file.flush()
                    os.fdatasync(file.fileno())
                    drop_cached(file.fileno(), synced, size - synced)
                    synced = size
            file.flush()
            os.fsync(file.fileno())
            stat = os.fstat(file.fileno())
        os.replace(temp, path)
        fsync_directory(path.parent)
    except BaseException:
        remove_quietly(temp)
        raise
    return WrittenFile(path=path, size=size, stat=stat, sha256=None if digest is None else digest.hexdigest())


def fsync_directory(directory: Path) -> None:
    """Make the entries of ``directory`` (a rename, a new or deleted file) durable.

    File systems that cannot sync a directory (EINVAL, ENOTSUP) make this a no-op; any
    other failure is raised, since the entry may then be lost in a crash.
    """
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    except OSError as exc:
        if exc.errno not in (errno.EINVAL, errno.ENOTSUP):
            raise
    finally:
        os.close(fd)


def file_sha256(path: Path) -> tuple[int, str]:
    """(size, SHA-256 hex) of a file, read in 1 MiB blocks."""
    digest = hashlib.sha256()
    size = 0
    with open(path, "rb") as file:
        while block := file.read(1 << 20):
            digest.update(block)
            size += len(block)
    return size, digest.hexdigest()


def read_range(path: Path, start: int, length: int) -> bytearray:
    """``length`` bytes of ``path`` from byte ``start``, read into a buffer the caller owns (no copy);
    OSError when the file ends before."""
    data = bytearray(length)
    with open(path, "rb", buffering=0) as file:
        file.seek(start)
        view, at = memoryview(data), 0
        while at < length:
            got = file.readinto(view[at:])
            if not got:
                raise OSError(f"{path} ends at byte {start + at}, before {start + length}")
            at += got
    return data


def remove_quietly(path: Path) -> None:
    """Delete ``path`` if it exists; a failure is logged, not raised (a leftover is pruned later)."""
    try:
        path.unlink(missing_ok=True)
    except OSError as exc:
        logger.warning("could not remove temporary checkpoint file %s: %s", path, exc)
