"""The public clock: steps numbered by time alone, re-anchored after a restart."""

from __future__ import annotations

import math

import pytest

from streamtrain.privacy.clock import DPClock


def test_clock_numbers_steps_by_time_only() -> None:
    clock = DPClock(step_rate_hz=2.0)
    assert clock.due_steps(100.0) == 0  # anchored at the first reading
    assert clock.arrival_step(100.2) == 1
    assert clock.due_steps(100.49) == 0 and clock.due_steps(100.5) == 1 and clock.due_steps(101.6) == 3
    clock.steps_done = 3
    assert clock.arrival_step(101.6) == 4  # step 3 is done: arrivals go to the next one
    assert clock.next_due_at(101.6) == pytest.approx(102.0)
    restored = DPClock(2.0)
    restored.load_state_dict(clock.state_dict())
    assert restored.due_steps(5000.0) == 0  # re-anchored: no catch-up burst after downtime
    assert restored.due_steps(5000.5) == 1 and restored.steps_done == 3


def test_an_arrival_goes_to_the_first_step_due_after_it_never_to_one_already_run() -> None:
    clock = DPClock(step_rate_hz=2.0)
    assert clock.due_at(3, 100.0) == pytest.approx(101.5)  # the first reading anchors the clock
    assert clock.arrival_step(100.5) == 2 and clock.arrival_step(100.6) == 2 and clock.arrival_step(101.0) == 3
    clock.steps_done = 3  # steps run ahead of this clock (a rank that follows rank 0's)
    assert clock.arrival_step(100.6) == 4


@pytest.mark.parametrize("rate", [0.0, -1.0, math.inf, math.nan])
def test_a_rate_that_is_not_finite_and_positive_is_refused(rate: float) -> None:
    with pytest.raises(ValueError) as raised:
        DPClock(rate)
    assert str(raised.value) == f"DPClock: step_rate_hz must be finite and > 0, got {rate}"


def test_a_slow_clock_and_its_checkpoint() -> None:
    clock = DPClock(0.5)  # a step every two seconds
    assert clock.due_steps(10.0) == 0 and clock.due_steps(11.9) == 0 and clock.due_steps(12.0) == 1
    clock.steps_done = 1
    assert clock.state_dict() == {"step_rate_hz": 0.5, "steps_done": 1}
