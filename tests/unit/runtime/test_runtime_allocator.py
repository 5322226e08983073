"""Which malloc the service runs on: read from the process's own mappings."""

from __future__ import annotations

import platform
import subprocess
import sys
from pathlib import Path

import pytest

from streamtrain.runtime.allocator import malloc_in_use

ROOT = Path(__file__).resolve().parents[3]
LIBC_LINE = "7f0000000000-7f0000001000 r-xp 00000000 fe:00 1 /usr/lib/x86_64-linux-gnu/libc.so.6\n"


def test_a_preloaded_jemalloc_is_named(tmp_path: Path) -> None:
    maps = tmp_path / "maps"
    maps.write_text(LIBC_LINE + "7f0000002000-7f0000003000 r--p 00000000 fe:00 2 /opt/lib/libjemalloc.so.2\n")
    assert malloc_in_use(maps) == "jemalloc"


def test_without_one_it_is_the_c_librarys(tmp_path: Path) -> None:
    maps = tmp_path / "maps"
    maps.write_text(LIBC_LINE + "7f0000004000-7f0000005000 rw-p 00000000 00:00 0 [heap]\n")
    assert malloc_in_use(maps) == (platform.libc_ver()[0] or "unknown")
    assert malloc_in_use(tmp_path / "missing") == malloc_in_use(maps)


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs /proc")
def test_deploy_jemalloc_gives_a_library_the_process_then_runs_on() -> None:
    found = subprocess.run([str(ROOT / "deploy/jemalloc.sh")], capture_output=True, text=True)
    if found.returncode != 0:
        pytest.skip(f"no jemalloc on this machine: {found.stderr.strip()}")
    library = found.stdout.strip()
    probe = "from streamtrain.runtime.allocator import malloc_in_use; print(malloc_in_use())"
    run = subprocess.run([sys.executable, "-c", probe], env={"LD_PRELOAD": library}, capture_output=True, text=True)
    assert run.stdout.strip() == "jemalloc", run.stderr
    plain = subprocess.run([sys.executable, "-c", probe], env={}, capture_output=True, text=True)
    assert plain.stdout.strip() == (platform.libc_ver()[0] or "unknown"), plain.stderr


def test_a_c_library_python_cannot_name_is_unknown(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(platform, "libc_ver", lambda: ("", ""))  # musl, as on Alpine
    assert malloc_in_use(tmp_path / "missing") == "unknown"
