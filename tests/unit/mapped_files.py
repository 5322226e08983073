"""Which file a piece of this process's memory maps (Linux /proc/self/maps): what tells a restore's
mapped readings from memory of the process's own."""

from __future__ import annotations

from pathlib import Path

import pytest


def mapped_file(address: int) -> str | None:
    """The file the mapping holding ``address`` maps, as /proc/self/maps names it (None: not a file's)."""
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        low, high = (int(bound, 16) for bound in fields[0].split("-"))
        if low <= address < high:
            return fields[5] if len(fields) > 5 and fields[5].startswith("/") else None
    return None


needs_proc_maps = pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads /proc/self/maps (Linux)")
