"""Published model versions: the one that serves and the last few kept beside it.

Serving reads one reference (:attr:`ModelRegistry.serving`), so a request sees one whole
version, old or new, never a mix. Earlier versions stay available for version-pinned
inference and for rollback. The trainer adds versions; the HTTP layer only reads, or asks
for a rollback.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Generic, Protocol, TypeVar


class Versioned(Protocol):
    @property
    def version(self) -> int: ...


V = TypeVar("V", bound=Versioned)


class UnknownVersion(KeyError):
    """The version is not (or no longer) kept."""


class ModelRegistry(Generic[V]):
    """The last ``keep`` published versions, oldest dropped first, and which one serves."""

    def __init__(self, keep: int = 2) -> None:
        if keep < 1:
            raise ValueError(f"ModelRegistry: keep must be >= 1, got {keep}")
        self.keep = keep
        self._lock = threading.Lock()
        self._versions: OrderedDict[int, V] = OrderedDict()
        self._serving: V | None = None

    @property
    def serving(self) -> V | None:
        """The version that answers requests (a single reference read)."""
        return self._serving

    def add(self, published: V, *, serve: bool = True) -> None:
        """Keep ``published``; make it serve unless ``serve`` is False (a held-back candidate)."""
        with self._lock:
            self._versions[published.version] = published
            if serve:
                self._serving = published
            serving = None if self._serving is None else self._serving.version
            while len(self._versions) > self.keep:  # drop the oldest version that does not serve
                del self._versions[next(v for v in self._versions if v != serving)]

    def get(self, version: int) -> V:
        try:
            return self._versions[version]
        except KeyError:
            raise UnknownVersion(version) from None

    def versions(self) -> list[int]:
        """Kept versions, ascending."""
        return sorted(self._versions)

    def rollback(self, version: int) -> V:
        """Make a kept version serve again; :class:`UnknownVersion` if it is not kept."""
        with self._lock:
            published = self.get(version)
            self._serving = published
            return published
