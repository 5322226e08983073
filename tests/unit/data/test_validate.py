"""The shared integer check of the data modules: what it takes, and each refusal in one form."""

from __future__ import annotations

import numpy as np
import pytest

from streamtrain.data._validate import require_int


def test_integers_at_or_above_the_minimum_are_taken_as_python_ints() -> None:
    assert require_int(0, "depth") == 0  # the default minimum is 0
    assert require_int(5, "depth", 5) == 5
    taken = require_int(np.int32(7), "depth", 1)
    assert taken == 7 and type(taken) is int
    assert require_int(None, "limit", 1, optional=True) is None
    assert require_int(3, "limit", 1, optional=True) == 3


@pytest.mark.parametrize(
    ("value", "minimum", "optional", "message"),
    [
        (-1, 0, False, "depth must be an integer >= 0, got -1"),
        (4, 5, False, "depth must be an integer >= 5, got 4"),
        (True, 0, False, "depth must be an integer >= 0, got True"),
        (2.0, 0, False, "depth must be an integer >= 0, got 2.0"),
        ("3", 0, False, "depth must be an integer >= 0, got '3'"),
        (None, 0, False, "depth must be an integer >= 0, got None"),
        (0, 1, True, "depth must be None or an integer >= 1, got 0"),
        (False, 0, True, "depth must be None or an integer >= 0, got False"),
    ],
)
def test_anything_else_is_refused_naming_the_argument_and_what_it_takes(
    value: object, minimum: int, optional: bool, message: str
) -> None:
    with pytest.raises(ValueError) as err:
        if optional:
            require_int(value, "depth", minimum, optional=True)
        else:
            require_int(value, "depth", minimum)  # not optional unless asked
    assert str(err.value) == message
