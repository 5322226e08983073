#!/usr/bin/env bash
# Print the path of a jemalloc shared library for LD_PRELOAD, fetching it when needed.
#
#   LD_PRELOAD="$(deploy/jemalloc.sh)" streamtrain serve
#
# Why: under glibc's malloc the service's RSS climbs for about ten minutes after every
# start and settles far above what it uses (docs/operations.md, "Memory"); jemalloc
# returns freed pages within seconds. Order: JEMALLOC_PATH if set, the system's
# libjemalloc.so.2 (Debian/Ubuntu: apt-get install libjemalloc2), else the Debian package
# fetched with `apt-get download` (no root needed) and unpacked into the cache.
# Exits 1, printing nothing on stdout, when none can be had; callers then run on glibc.
set -euo pipefail

die() { echo "jemalloc.sh: $*" >&2; exit 1; }

if [ -n "${JEMALLOC_PATH:-}" ]; then
  [ -r "$JEMALLOC_PATH" ] || die "JEMALLOC_PATH=$JEMALLOC_PATH is not readable"
  echo "$JEMALLOC_PATH"; exit 0
fi
for dir in /usr/lib/x86_64-linux-gnu /usr/lib/aarch64-linux-gnu /usr/lib64 /usr/lib /usr/local/lib; do
  if [ -r "$dir/libjemalloc.so.2" ]; then echo "$dir/libjemalloc.so.2"; exit 0; fi
done

cache="${XDG_CACHE_HOME:-$HOME/.cache}/streamtrain/jemalloc"
found="$(find "$cache" -name libjemalloc.so.2 2>/dev/null | head -n1 || true)"
if [ -n "$found" ]; then echo "$found"; exit 0; fi

command -v apt-get >/dev/null 2>&1 || die "no libjemalloc.so.2 here and no apt-get to fetch it"
mkdir -p "$cache"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
( cd "$work" && apt-get download libjemalloc2 >/dev/null 2>&1 ) || die "apt-get download libjemalloc2 failed"
dpkg-deb -x "$work"/libjemalloc2_*.deb "$cache" || die "could not unpack libjemalloc2"
found="$(find "$cache" -name libjemalloc.so.2 | head -n1)"
[ -n "$found" ] || die "libjemalloc2 had no libjemalloc.so.2"
echo "$found"
