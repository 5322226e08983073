"""Argument checks shared by the data modules, so every refusal reads the same way."""

from __future__ import annotations

from typing import Literal, overload

import numpy as np


@overload
def require_int(value: object, name: str, minimum: int = 0, *, optional: Literal[False] = False) -> int: ...
@overload
def require_int(value: object, name: str, minimum: int = 0, *, optional: Literal[True]) -> int | None: ...
def require_int(value: object, name: str, minimum: int = 0, *, optional: bool = False) -> int | None:
    """``value`` as an int if it is an integer >= ``minimum`` (or None when ``optional``); else ValueError."""
    if optional and value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < minimum:
        allowed = "None or an integer" if optional else "an integer"
        raise ValueError(f"{name} must be {allowed} >= {minimum}, got {value!r}")
    return int(value)
