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


def test_the_heartbeat_limit_defaults_to_three_intervals_of_three_seconds() -> None:
    assert IngestWatchdog(2).heartbeat_timeout_s == 9.0 and IngestWatchdog(20).heartbeat_timeout_s == 20.0
    with pytest.raises(ValueError, match=r"^timeout_s must be > 0, got -1$"):
        IngestWatchdog(-1)


def test_each_stall_names_its_cause_in_full() -> None:
    clock = Clock()
    dog = IngestWatchdog(10, clock=clock)
    stuck = probe(group_state="rebalancing", assigned=frozenset(), fetchable=frozenset(), heartbeat_age_s=None)
    assert run(dog, clock, stuck, 2).detail == "no partition assigned (group membership: rebalancing)"
    dog = IngestWatchdog(10, clock=clock)
    stall = dog.observe(probe(heartbeat_age_s=6.4))
    assert stall is not None and stall.detail == "no group heartbeat got through for 6 s"
    assert stall.since == clock.now - 6.4
    dog = IngestWatchdog(10, clock=clock)
    dog.observe(probe(log_ends={0: 10, 1: 50}))
    stall = run(dog, clock, probe(), 7)
    assert stall is not None and stall.detail == (
        "partition 1 has 40 records waiting (next offset 10, log end 50) but none was read for 7 s"
    )


def test_a_heartbeat_exactly_half_the_limit_old_is_no_stall_yet() -> None:
    dog = IngestWatchdog(2, heartbeat_interval_s=3.0, clock=Clock())  # limit 9 s
    assert dog.observe(probe(heartbeat_age_s=4.5)) is None
    assert dog.observe(probe(heartbeat_age_s=4.51)) is not None


def test_a_partition_without_a_position_yet_does_not_hide_the_others() -> None:
    clock = Clock()
    dog = IngestWatchdog(10, clock=clock)
    waiting = probe(positions={1: 10}, log_ends={1: 50})  # partition 0 has no position yet
    stall = run(dog, clock, waiting, 10)
    assert stall is not None and stall.reason == "no_fetch_progress" and dog.overdue(stall)


def test_a_log_end_that_falls_back_to_the_position_ends_the_wait() -> None:
    """A topic deleted and created again: its log end can fall back to where the consumer is."""
    clock = Clock()
    dog = IngestWatchdog(10, clock=clock)
    dog.observe(probe(log_ends={0: 10, 1: 50}))
    assert run(dog, clock, probe(), 6) is not None
    assert dog.observe(probe(log_ends={0: 10, 1: 10})) is None


def test_of_two_waiting_partitions_the_one_waiting_longer_is_named() -> None:
    clock = Clock()
    dog = IngestWatchdog(10, clock=clock)
    dog.observe(probe(log_ends={0: 10, 1: 50}))  # partition 1 waits from now
    run(dog, clock, probe(), 3)
    stall = dog.observe(probe(log_ends={0: 30, 1: 50}))  # partition 0 from 3 s later
    assert stall is not None and stall.detail.startswith("partition 1 has 40 records waiting")
    assert stall.age(clock.now) == 3.0


def test_of_two_stalls_the_longer_standing_is_the_verdict() -> None:
    clock = Clock()
    dog = IngestWatchdog(2, heartbeat_interval_s=3.0, clock=clock)  # heartbeat limit 9 s
    dog.observe(probe(log_ends={0: 10, 1: 50}))  # records wait from now on
    clock.now += 0.5
    older = dog.observe(probe(heartbeat_age_s=8.0))  # heartbeats stopped 7.5 s before that
    assert older is not None and older.reason == "no_heartbeat" and dog.current == older
    run(dog, clock, probe(), 6)  # heartbeats again; the records still wait
    newer = dog.observe(probe(heartbeat_age_s=5.0))  # heartbeats stopped 1.5 s after the records began to wait
    assert newer is not None and newer.reason == "no_fetch_progress" and dog.current == newer


def test_probes_exactly_a_third_of_the_timeout_apart_all_count() -> None:
    clock = Clock()
    dog = IngestWatchdog(9, clock=clock)
    stuck = probe(group_state="rebalancing", assigned=frozenset(), fetchable=frozenset())
    stall = run(dog, clock, stuck, 9, step=3.0)
    assert stall is not None and dog.overdue(stall)


def test_time_away_does_not_count_for_an_unassigned_member_either() -> None:
    clock = Clock()
    dog = IngestWatchdog(9, clock=clock)
    stuck = probe(group_state="rebalancing", assigned=frozenset(), fetchable=frozenset())
    run(dog, clock, stuck, 2)
    clock.now += 20  # the thread did not probe for 20 s
    stall = dog.observe(stuck)
    assert stall is not None and stall.age(clock.now) == 2.0 and not dog.overdue(stall)


def test_a_stall_is_reportable_from_exactly_half_the_timeout() -> None:
    clock = Clock()
    dog = IngestWatchdog(10, clock=clock)
    stall = run(dog, clock, probe(fetchable=frozenset()), 5)
    assert stall is not None and stall.age(clock.now) == 5.0 and dog.reportable(stall)
