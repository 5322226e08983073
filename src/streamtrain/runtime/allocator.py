"""Which malloc the process runs on, said once at start-up.

Under glibc's malloc the service's RSS climbs for minutes after a start and settles far
above the memory it uses (glibc keeps the training step's freed peaks); with jemalloc
preloaded it stays flat. So the image preloads jemalloc, ``deploy/jemalloc.sh`` finds or
fetches it elsewhere, and the start-up log names the allocator in use. The measurements
behind this are in docs/operations.md, "Memory".
"""

from __future__ import annotations

import platform
from pathlib import Path

# what a preloaded allocator's library is called in /proc/self/maps
PRELOADABLE = {"libjemalloc": "jemalloc", "libtcmalloc": "tcmalloc", "libmimalloc": "mimalloc"}


def malloc_in_use(maps: Path = Path("/proc/self/maps")) -> str:
    """``jemalloc``, ``tcmalloc`` or ``mimalloc`` when one is mapped; else the C library's."""
    try:
        libraries = {line.rsplit("/", 1)[-1].strip() for line in maps.read_text().splitlines() if "/" in line}
    except OSError:
        libraries = set()
    for prefix, name in PRELOADABLE.items():
        if any(library.startswith(prefix) for library in libraries):
            return name
    return platform.libc_ver()[0] or "unknown"
