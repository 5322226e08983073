"""Puts tests/unit on sys.path: the helpers these tests share with the rest of the unit suite
(mapped_files.py) live there, and this folder must import them whichever other tests were
collected with it (or none)."""

from __future__ import annotations

import sys
from pathlib import Path

_UNIT_TESTS = str(Path(__file__).resolve().parents[1])
if _UNIT_TESTS not in sys.path:
    sys.path.insert(0, _UNIT_TESTS)
