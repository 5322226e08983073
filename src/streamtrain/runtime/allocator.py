"""Which malloc the process runs on, said once at start-up.

Why it matters: under glibc's malloc the service's RSS climbs for about ten minutes after
every start and settles far above what it uses. Measured in the 5,000 events/s soak
(mallinfo2 sampled inside the service): memory in use flat at 300-450 MB while glibc's
arenas grew to 1-1.35 GB, the rest free chunks it kept for the training step's transient
peaks. Capping the arenas (MALLOC_ARENA_MAX=2) helped in one run and not in the next, a
fixed mmap threshold cost 25-60% of the training steps, malloc_trim released little and
stalled allocating threads for 20-200 ms. With jemalloc preloaded the same soak's RSS
was flat from the second minute and training ran faster (docs/operations.md, "Memory").
So the image preloads jemalloc, and ``deploy/jemalloc.sh`` finds or fetches it elsewhere.
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
