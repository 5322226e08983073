"""The ingest watchdog's rules, on probes a fake clock moves through (no broker)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from streamtrain.ingest.watchdog import ConsumerProbe, IngestWatchdog


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def probe(**overrides: object) -> ConsumerProbe:
    base: dict[str, object] = dict(
        connected=True, group_state="stable", assigned=frozenset({0, 1}), fetchable=frozenset({0, 1}),
        heartbeat_age_s=1.0, positions={0: 10, 1: 10}, log_ends=None,
    )  # fmt: skip
    base.update(overrides)
    return ConsumerProbe(**base)  # type: ignore[arg-type]


def run(watchdog: IngestWatchdog, clock: Clock, p: ConsumerProbe, seconds: float, step: float = 0.5):
    """Observe the same probe every ``step`` seconds for ``seconds``; the last verdict."""
    stall = watchdog.observe(p)
    elapsed = 0.0
    while elapsed < seconds:
        clock.now += step
        elapsed += step
        stall = watchdog.observe(p)
    return stall


def test_a_healthy_consumer_is_never_a_stall() -> None:
    clock = Clock()
    dog = IngestWatchdog(10, clock=clock)
    stall = run(dog, clock, probe(log_ends={0: 10, 1: 10}), 60)
    assert stall is None and not dog.overdue(stall)


def test_unassigned_while_rebalancing_is_reported_at_half_and_overdue_at_the_timeout() -> None:
    clock = Clock()
    dog = IngestWatchdog(10, clock=clock)
    stuck = probe(group_state="rebalancing", assigned=frozenset(), fetchable=frozenset(), heartbeat_age_s=30.0)
    stall = run(dog, clock, stuck, 4.5)
    assert stall is not None and stall.reason == "unassigned" and "rebalancing" in stall.detail
    assert not dog.reportable(stall) and not dog.overdue(stall)
    stall = run(dog, clock, stuck, 1.0)
    assert dog.reportable(stall) and not dog.overdue(stall)
    stall = run(dog, clock, stuck, 5.0)
    assert dog.overdue(stall)


def test_a_stable_member_without_partitions_is_idle_not_stalled() -> None:
    clock = Clock()
    dog = IngestWatchdog(10, clock=clock)
    assert run(dog, clock, probe(assigned=frozenset(), fetchable=frozenset(), positions={}), 60) is None
    # and without group management (partitions assigned by hand), owning none is idle too
    assert (
        run(dog, clock, probe(group_state=None, heartbeat_age_s=None, assigned=frozenset(), fetchable=frozenset()), 60)
        is None
    )


def test_assigned_but_nothing_fetchable_is_unassigned() -> None:
    clock = Clock()
    dog = IngestWatchdog(10, clock=clock)
    stall = run(dog, clock, probe(fetchable=frozenset()), 10)
    assert stall is not None and stall.reason == "unassigned" and "none fetchable" in stall.detail
    assert dog.overdue(stall)


def test_records_waiting_and_nothing_read_is_no_fetch_progress() -> None:
    clock = Clock()
    dog = IngestWatchdog(10, clock=clock)
    # the log end is probed now and then; positions stay where they are
    stall = dog.observe(probe(log_ends={0: 10, 1: 50}))
    assert stall is None or stall.age(clock.now) == 0
    stall = run(dog, clock, probe(), 9.5)
    assert stall is not None and stall.reason == "no_fetch_progress"
    assert "partition 1 has 40 records waiting" in stall.detail and not dog.overdue(stall)
    stall = run(dog, clock, probe(), 0.5)
    assert dog.overdue(stall)


def test_reading_resets_the_progress_clock_and_catching_up_ends_it() -> None:
    clock = Clock()
    dog = IngestWatchdog(10, clock=clock)
    dog.observe(probe(log_ends={0: 10, 1: 50}))
    run(dog, clock, probe(), 8)
    stall = dog.observe(probe(positions={0: 10, 1: 20}))  # partition 1 read something
    assert stall is not None and stall.age(clock.now) == 0  # 30 records still wait: the clock starts again
    assert not dog.overdue(run(dog, clock, probe(positions={0: 10, 1: 20}), 8))
    # 16 s since it last read (the log end known from before still lies ahead)
    assert dog.overdue(run(dog, clock, probe(positions={0: 10, 1: 20}), 8))
    assert dog.observe(probe(positions={0: 10, 1: 50}, log_ends={0: 10, 1: 50})) is None  # caught up


def test_missed_heartbeats_of_a_stable_member_wait_three_intervals() -> None:
    clock = Clock()
    dog = IngestWatchdog(2, heartbeat_interval_s=3.0, clock=clock)  # heartbeat limit: max(2, 9) s
    assert dog.observe(probe(heartbeat_age_s=4.0)) is None
    stall = dog.observe(probe(heartbeat_age_s=6.0))
    assert stall is not None and stall.reason == "no_heartbeat" and not dog.overdue(stall)
    clock.now += 3.5
    assert dog.overdue(dog.observe(probe(heartbeat_age_s=9.5)))


def test_nothing_is_judged_while_no_broker_is_reachable() -> None:
    clock = Clock()
    dog = IngestWatchdog(10, clock=clock)
    stuck = probe(group_state="unjoined", assigned=frozenset(), fetchable=frozenset())
    run(dog, clock, stuck, 9)
    assert (
        run(dog, clock, probe(connected=False, group_state="unjoined", assigned=frozenset(), fetchable=frozenset()), 60)
        is None
    )
    stall = run(dog, clock, stuck, 5)  # the clock starts again once connected
    assert stall is not None and not dog.overdue(stall)


def test_reset_forgets_every_condition() -> None:
    clock = Clock()
    dog = IngestWatchdog(10, clock=clock)
    stall = run(dog, clock, probe(fetchable=frozenset()), 12)
    assert dog.overdue(stall)
    dog.reset()
    assert dog.current is None
    assert not dog.overdue(dog.observe(probe(fetchable=frozenset())))


def test_timeout_must_be_positive() -> None:
    with pytest.raises(ValueError):
        IngestWatchdog(0)


@settings(max_examples=200, deadline=None)
@given(
    steps=st.lists(
        st.tuples(st.floats(0.05, 3.0), st.integers(1, 500), st.booleans(), st.integers(0, 2000)),
        min_size=1,
        max_size=60,
    )
)
def test_a_consumer_that_reads_at_every_probe_is_never_overdue(steps: list[tuple[float, int, bool, int]]) -> None:
    """Whatever the log ends and timing: a member that is stable, heartbeating and whose
    position moves at every probe is never recreated."""
    clock = Clock()
    dog = IngestWatchdog(2, clock=clock)
    position = 0
    for dt, advance, probe_ends, ahead in steps:
        clock.now += dt
        position += advance
        ends = {0: position + ahead} if probe_ends else None
        stall = dog.observe(
            probe(assigned=frozenset({0}), fetchable=frozenset({0}), positions={0: position}, log_ends=ends)
        )
        assert not dog.overdue(stall)


@settings(max_examples=200, deadline=None)
@given(gaps=st.lists(st.floats(0.01, 0.33), min_size=1, max_size=200), timeout=st.floats(1.0, 30.0))
def test_an_unassigned_member_is_overdue_exactly_when_the_timeout_has_passed(gaps: list[float], timeout: float) -> None:
    clock = Clock()
    dog = IngestWatchdog(timeout, clock=clock)
    stuck = probe(group_state="rebalancing", assigned=frozenset(), fetchable=frozenset(), positions={})
    began = clock.now
    dog.observe(stuck)
    for gap in gaps:
        clock.now += gap
        stall = dog.observe(stuck)
        assert dog.overdue(stall) == (clock.now - began >= timeout)
        assert dog.reportable(stall) == (clock.now - began >= timeout / 2)


def test_time_the_ingest_thread_was_away_does_not_count() -> None:
    """A batch that took long to apply (or a checkpoint holding the lock) is no fetch stall."""
    clock = Clock()
    dog = IngestWatchdog(9, clock=clock)
    dog.observe(probe(log_ends={0: 10, 1: 50}))
    clock.now += 20  # the thread did not probe for 20 s
    stall = dog.observe(probe())
    assert stall is not None and stall.reason == "no_fetch_progress" and not dog.overdue(stall)
    stall = run(dog, clock, probe(), 9)  # but 9 s of probing with nothing read is
    assert dog.overdue(stall)
