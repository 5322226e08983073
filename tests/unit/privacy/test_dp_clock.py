"""The public clock: steps numbered by time alone, re-anchored after a restart."""

from __future__ import annotations

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
