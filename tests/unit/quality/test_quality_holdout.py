"""The holdout: the share kept out of the window, reproducible and restored; no held-out reading trained on."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from streamtrain.events import EventBatch, SensorEvent
from streamtrain.model.normalization import RunningNorm
from streamtrain.quality.holdout import HoldoutBuffer, HoldoutSplitter, overlap_start, overlap_starts

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tests/unit/quality: the shared quality fixtures
from quality_fixtures import ForecastsZero, Frozen, events, monitor  # noqa: E402


def test_holdout_share_is_kept_out_of_the_window_and_reproducible() -> None:
    batch = events(*[[float(i), float(i) + 1.0] for i in range(2000)])
    kept = []
    for _ in range(2):
        quality = monitor(None, holdout_share=0.1, holdout_capacity=5000)
        to_window = quality.observe(batch)
        kept.append(to_window.ts.tolist())
        held_ts = sorted(set(batch.ts.tolist()) - set(to_window.ts.tolist()))
        assert len(quality.holdout) == quality.held_out_total == 2000 - len(to_window)
        assert [float(v[0, 0]) for v in quality.holdout.values] == [t - 1000.0 for t in held_ts]
        # each kept event keeps its own readings
        for i in range(len(to_window)):
            assert to_window.event(i).values[0, 0] == to_window.ts[i] - 1000.0
    assert kept[0] == kept[1]  # seeded mode: the same events are held out
    assert 150 <= 2000 - len(kept[0]) <= 250  # Binomial(2000, 0.1): 200 +- 5 sd


def test_holdout_state_round_trips() -> None:
    quality = monitor(Frozen(ForecastsZero(), RunningNorm.from_public([0.0], [1.0])), holdout_share=0.5)
    quality.observe(events(*[[float(i), 2.0 * i, 1.0] for i in range(40)], labels=None))
    clone = monitor(None, holdout_share=0.5)
    clone.load_state_dict(quality.state_dict(), channels=1)
    assert [v.tolist() for v in clone.holdout.values] == [v.tolist() for v in quality.holdout.values]
    assert clone.report(1) == quality.report(1)
    assert clone.observe(events([1.0, 2.0])).ts.tolist() == quality.observe(events([1.0, 2.0])).ts.tolist()


def sliding(values: np.ndarray, sensor: str, length: int = 24, stride: int = 1) -> list[SensorEvent]:
    return [
        SensorEvent(sensor, 1000.0 + i, values[i : i + length, None].astype(np.float32))
        for i in range(0, len(values) - length + 1, stride)
    ]


@pytest.mark.parametrize("stride", [1, 5])
def test_no_held_out_reading_of_sliding_windows_is_ever_trained_on(stride: int) -> None:
    rng = np.random.default_rng(8)
    items = sliding(rng.normal(size=3000), "a", stride=stride) + sliding(rng.normal(size=3000), "b", stride=stride)
    batch = EventBatch.from_events(sorted(items, key=lambda e: e.ts))
    splitter = HoldoutSplitter(0.1, 32, "seeded", 0)  # blocks longer than the overlap: guarded
    held, guard = np.zeros(0, np.int64), np.zeros(0, np.int64)
    for part in np.array_split(np.arange(len(batch)), 7):  # poll batches
        h, g = splitter.split(EventBatch.from_events([batch.event(int(i)) for i in part]))
        held, guard = np.concatenate([held, part[h]]), np.concatenate([guard, part[g]])
    trained = np.setdiff1d(np.arange(len(batch)), np.concatenate([held, guard]))
    readings = lambda rows: {(batch.sensor_ids[i], float(v)) for i in rows for v in batch.event(int(i)).values[:, 0]}  # noqa: E731
    assert held.size > 0.07 * len(batch) and not readings(held) & readings(trained)
    assert guard.size <= 2 * (24 // stride) * (held.size // 32 + 2)  # only the overlapping neighbours of each block


def test_events_that_do_not_overlap_are_held_out_in_blocks_without_a_guard() -> None:
    rng = np.random.default_rng(9)
    items = [SensorEvent(f"s{i % 10}", 1000.0 + i, rng.normal(size=(30, 1)).astype(np.float32)) for i in range(6400)]
    splitter = HoldoutSplitter(0.1, 32, "crypto", 0)
    held, guard = splitter.split(EventBatch.from_events(items))
    assert guard.size == 0 and held.size == 640  # one block in ten of every sensor, whatever the phases
    clone = HoldoutSplitter(0.1, 32, "crypto", 0)
    clone.load_state_dict(splitter.state_dict())
    more = EventBatch.from_events(
        [SensorEvent(f"s{i % 10}", 9000.0 + i, rng.normal(size=(30, 1)).astype(np.float32)) for i in range(640)]
    )
    assert np.array_equal(clone.split(more)[0], splitter.split(more)[0])  # restored phases and counts decide alike


def test_the_holdout_buffer_keeps_each_events_sensor_through_a_checkpoint() -> None:
    batch = EventBatch.from_events(
        [SensorEvent(name, 1000.0 + i, np.full((3 + i, 1), i, np.float32)) for i, name in enumerate("abab")], channels=1
    )
    buffer = HoldoutBuffer(capacity=3)
    buffer.add(batch, np.arange(4))
    assert list(buffer.sensors) == ["b", "a", "b"]  # the most recent three, with their sensors
    state = buffer.state_dict()
    back = HoldoutBuffer(capacity=3)
    back.load_state_dict(state, channels=1)
    assert list(back.sensors) == ["b", "a", "b"] and [len(v) for v in back.values] == [4, 5, 6]
    del state["sensors"]  # a holdout saved before sensors were kept: each event a sensor of its own
    back.load_state_dict(state, channels=1)
    assert len(set(back.sensors)) == 3 and len(back.values) == 3


def test_a_short_stream_of_sliding_windows_keeps_its_first_readings_to_train_on_whatever_its_phase() -> None:
    """100 yearly readings make 77 sliding windows of 24: a sensor whose phase held its first
    block lost it and its guard, 70 of the 77 events, and the window could not reach the
    trainer's minimum. Now the first block of a sensor's grown blocks trains, and
    an event held before its blocks grew keeps its overlapping neighbours out as guards."""
    rng = np.random.default_rng(3)
    phases, kept = set(), []
    for s in range(60):  # sensors whose phases cover the period
        sensor = f"series-{s}"
        items = sliding(rng.normal(size=100), sensor)
        batch = EventBatch.from_events(items)
        splitter = HoldoutSplitter(0.1, 1, "seeded", 0)
        phases.add(splitter._phase(sensor))
        held, guard = splitter.split(batch)
        trained = np.setdiff1d(np.arange(len(batch)), np.concatenate([held, guard]))
        readings = lambda rows: {float(v) for i in rows for v in batch.event(int(i)).values[:, 0]}  # noqa: E731
        assert not readings(held) & readings(trained), sensor
        kept.append(trained.size)
    assert phases == set(range(10))
    assert min(kept) >= 23, sorted(kept)  # the first 24 events train, whatever the phase


def test_an_event_held_before_the_blocks_grew_keeps_its_neighbours_out() -> None:
    splitter = HoldoutSplitter(0.1, 1, "seeded", 0)
    sensor = next(f"p{i}" for i in range(1000) if splitter._phase(f"p{i}") == 0)  # its first event is held
    batch = EventBatch.from_events(sliding(np.random.default_rng(4).normal(size=60), sensor))
    held, guard = splitter.split(batch)
    assert held.tolist() == [0] and guard.tolist() == list(range(1, 24))
    clone = HoldoutSplitter(0.1, 1, "seeded", 0)
    clone.load_state_dict(splitter.state_dict())
    more = EventBatch.from_events(sliding(np.random.default_rng(5).normal(size=600), sensor))
    assert all(np.array_equal(a, b) for a, b in zip(clone.split(more), splitter.split(more), strict=True))


def split_rows(splitter: HoldoutSplitter, batch: EventBatch, rows: range) -> tuple[np.ndarray, np.ndarray]:
    """(held, guard) among ``rows`` of ``batch``, split as one poll batch, as indices of ``batch``."""
    held, guard = splitter.split(EventBatch.from_events([batch.event(i) for i in rows], channels=1))
    return np.asarray(rows)[held], np.asarray(rows)[guard]


def test_a_splitter_restored_anywhere_in_a_stream_splits_the_rest_as_the_uninterrupted_one() -> None:
    """A restart must not move the blocks: an event trained before it could be held out after
    it (and scored as if unseen), or a held one trained. Restored at every poll boundary, in
    the middle of blocks, guards and the trail of an event held before its sensor's blocks grew."""
    rng = np.random.default_rng(11)
    probe = HoldoutSplitter(0.25, 3, "seeded", 0)
    first_held = next(f"t{i}" for i in range(1000) if probe._phase(f"t{i}") == 0)  # held at once, then grows
    items = (
        sliding(rng.normal(size=90), first_held, length=8)
        + sliding(rng.normal(size=120), "stride-3", length=8, stride=3)
        + [SensorEvent("apart", 1000.0 + i, rng.normal(size=(5, 1)).astype(np.float32)) for i in range(60)]
    )
    batch = EventBatch.from_events(sorted(items, key=lambda e: (e.ts, e.sensor_id)), channels=1)
    expected = split_rows(HoldoutSplitter(0.25, 3, "seeded", 0), batch, range(len(batch)))
    assert expected[0].size > 0 and expected[1].size > 0
    for cut in range(1, len(batch), 4):
        before = HoldoutSplitter(0.25, 3, "seeded", 0)
        head = split_rows(before, batch, range(cut))
        after = HoldoutSplitter(0.25, 3, "seeded", 0)
        after.load_state_dict(before.state_dict())
        assert after.redundancy_sums().tolist() == before.redundancy_sums().tolist(), cut
        tail = split_rows(after, batch, range(cut, len(batch)))
        got = [np.concatenate([h, t]) for h, t in zip(head, tail, strict=True)]
        assert all(np.array_equal(a, b) for a, b in zip(got, expected, strict=True)), cut


def test_no_held_out_reading_is_trained_on_when_the_service_restarts_right_after_a_held_event() -> None:
    splitter = HoldoutSplitter(0.1, 1, "seeded", 0)
    sensor = next(f"p{i}" for i in range(1000) if splitter._phase(f"p{i}") == 0)  # its first event is held
    batch = EventBatch.from_events(sliding(np.random.default_rng(4).normal(size=80), sensor))
    held, guard = split_rows(splitter, batch, range(1))
    restarted = HoldoutSplitter(0.1, 1, "seeded", 0)
    restarted.load_state_dict(splitter.state_dict())
    more = split_rows(restarted, batch, range(1, len(batch)))
    held, guard = np.concatenate([held, more[0]]), np.concatenate([guard, more[1]])
    trained = np.setdiff1d(np.arange(len(batch)), np.concatenate([held, guard]))
    readings = lambda rows: {float(v) for i in rows for v in batch.event(int(i)).values[:, 0]}  # noqa: E731
    assert held.tolist()[:1] == [0] and not readings(held) & readings(trained)


def test_a_splitter_state_saved_before_blocks_grew_or_trails_existed_still_loads() -> None:
    splitter = HoldoutSplitter(0.1, 1, "seeded", 0)
    splitter.split(EventBatch.from_events(sliding(np.random.default_rng(12).normal(size=40), "old")))
    state = splitter.state_dict()
    assert state["last_lengths"].tolist() == [24] and state["last_values"].shape == (24, 1)
    del state["grown"], state["trails"], state["last_lengths"], state["last_values"]
    clone = HoldoutSplitter(0.1, 1, "seeded", 0)
    clone.load_state_dict(state)
    restored = clone.state_dict()
    assert restored["grown"].tolist() == [False] and restored["trails"].tolist() == [0]
    assert restored["last_lengths"].tolist() == [-1]  # its next event is compared with nothing
    assert restored["counts"].tolist() == state["counts"].tolist() and restored["blocks"].tolist() == [46]
    broken = splitter.state_dict()
    broken["last_values"] = broken["last_values"][:-1]
    with pytest.raises(ValueError, match="^holdout splitter state is inconsistent: previous events do not match"):
        HoldoutSplitter(0.1, 1, "seeded", 0).load_state_dict(broken, channels=1)
    broken = splitter.state_dict()
    broken["counts"] = broken["counts"][:0]  # a field per sensor, or the state is not this splitter's
    with pytest.raises(ValueError):
        HoldoutSplitter(0.1, 1, "seeded", 0).load_state_dict(broken, channels=1)


def test_previous_events_of_several_channels_round_trip_with_or_without_their_width() -> None:
    rng = np.random.default_rng(15)
    readings = rng.normal(size=(40, 2)).astype(np.float32)
    items = [SensorEvent(f"w{k}", 1000.0 + i, readings[i + k : i + k + 6]) for i in range(20) for k in range(2)]
    splitter = HoldoutSplitter(0.1, 1, "seeded", 0)
    splitter.split(EventBatch.from_events(items, channels=2))
    state = splitter.state_dict()
    assert state["last_values"].shape == (12, 2)
    for channels, values in (
        (2, state["last_values"]),
        (None, state["last_values"]),
        (2, state["last_values"].ravel()),
    ):
        clone = HoldoutSplitter(0.1, 1, "seeded", 0)
        clone.load_state_dict({**state, "last_values": values}, channels)
        assert np.array_equal(clone.state_dict()["last_values"], state["last_values"])
    one = HoldoutSplitter(0.1, 1, "seeded", 0)
    one.split(EventBatch.from_events([SensorEvent("one", 1000.0, np.arange(3, dtype=np.float32)[:, None])]))
    flat_state = {**one.state_dict(), "last_values": np.arange(3, dtype=np.float32)}  # stored without its width
    clone = HoldoutSplitter(0.1, 1, "seeded", 0)
    clone.load_state_dict(flat_state)  # one reading wide unless told otherwise
    assert clone.state_dict()["last_values"].shape == (3, 1)
    empty = HoldoutSplitter(0.1, 1, "seeded", 0)
    empty.load_state_dict(HoldoutSplitter(0.1, 1, "seeded", 0).state_dict())  # no sensor yet
    assert empty.state_dict()["sensors"] == []


def test_a_sensor_restored_from_an_old_state_keeps_no_previous_event_until_it_sends_one() -> None:
    splitter = HoldoutSplitter(0.1, 1, "seeded", 0)
    splitter.split(EventBatch.from_events([SensorEvent("old", 1000.0, np.ones((3, 1), np.float32))]))
    state = splitter.state_dict()
    del state["last_lengths"], state["last_values"]
    clone = HoldoutSplitter(0.1, 1, "seeded", 0)
    clone.load_state_dict(state)
    clone.split(EventBatch.from_events([SensorEvent("new", 1001.0, np.full((4, 1), 2.0, np.float32))]))
    for _ in range(2):  # and through another checkpoint
        saved = clone.state_dict()
        assert saved["last_lengths"].tolist() == [-1, 4] and saved["last_values"].ravel().tolist() == [2.0] * 4
        clone = HoldoutSplitter(0.1, 1, "seeded", 0)
        clone.load_state_dict(saved, channels=1)


def test_a_producer_that_turns_to_sliding_windows_keeps_the_neighbours_of_a_held_event_out() -> None:
    """Blocks grow when a sensor's events first overlap, which need not be at its second event:
    the block the event before the growth fell in decides whether its overlapping successors
    are guards, whatever the block length."""
    probe = HoldoutSplitter(0.5, 3, "seeded", 0)
    sensor = next(f"r{i}" for i in range(1000) if probe._phase(f"r{i}") == 1)  # blocks 1, 3, ... held
    rng = np.random.default_rng(16)
    apart = [SensorEvent(sensor, 1000.0 + i, rng.normal(size=(6, 1)).astype(np.float32)) for i in range(5)]
    batch = EventBatch.from_events(apart + sliding(rng.normal(size=40), sensor, length=6))
    held, guard = HoldoutSplitter(0.5, 3, "seeded", 0).split(batch)
    trained = np.setdiff1d(np.arange(len(batch)), np.concatenate([held, guard]))
    readings = lambda rows: {float(v) for i in rows for v in batch.event(int(i)).values[:, 0]}  # noqa: E731
    assert 4 in held.tolist() and not readings(held) & readings(trained)


def test_a_zero_share_holds_nothing_and_a_half_share_every_other_event() -> None:
    batch = EventBatch.from_events([SensorEvent("s", 1000.0 + i, np.full((3, 1), i, np.float32)) for i in range(40)])
    held, guard = HoldoutSplitter(0.0, 1, "seeded", 0).split(batch)
    assert held.dtype == guard.dtype == np.int64 and held.size == guard.size == 0
    held, guard = HoldoutSplitter(0.5, 1, "seeded", 0).split(batch)
    assert guard.size == 0 and np.diff(held).tolist() == [2] * 19  # blocks of one event, one in two


def test_the_first_grown_block_trains_and_the_second_is_held_when_its_phase_says_so() -> None:
    probe = HoldoutSplitter(0.1, 1, "seeded", 0)
    sensor = next(f"q{i}" for i in range(1000) if probe._phase(f"q{i}") == 9)  # (1 + 9) % 10: block 1 held
    batch = EventBatch.from_events(sliding(np.random.default_rng(13).normal(size=60), sensor, length=8))
    held, guard = HoldoutSplitter(0.1, 1, "seeded", 0).split(batch)
    # overlap 7: blocks of 14 from the second event on (the first, before the overlap was seen, trains)
    assert held.tolist() == list(range(15, 29)) and guard.tolist() == [*range(8, 15), *range(29, 36)]


def test_the_least_recently_seen_sensors_are_forgotten_first(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(HoldoutSplitter, "MAX_SENSORS", 2)
    splitter = HoldoutSplitter(0.1, 1, "seeded", 0)
    for name in "aba":
        splitter.split(EventBatch.from_events([SensorEvent(name, 1000.0, np.zeros((2, 1), np.float32))]))
    assert splitter.state_dict()["sensors"] == ["b", "a"]
    splitter.split(EventBatch.from_events([SensorEvent("c", 1001.0, np.zeros((2, 1), np.float32))]))
    assert splitter.state_dict()["sensors"] == ["a", "c"]  # b, seen least recently, forgotten


def test_redundancy_counts_the_events_each_reading_is_in_per_sensor() -> None:
    rng = np.random.default_rng(14)
    items = sliding(rng.normal(size=30), "slide-1", length=8)
    items += sliding(rng.normal(size=30), "slide-2", length=8, stride=2)
    items.append(SensorEvent("apart", 1000.0, rng.normal(size=(8, 1)).astype(np.float32)))
    splitter = HoldoutSplitter(0.1, 1, "seeded", 0)
    splitter.split(EventBatch.from_events(items))
    assert splitter.redundancy_sums().tolist() == [8.0 + 4.0 + 1.0, 3.0]


@pytest.mark.parametrize(
    ("previous", "current", "start"),
    [
        ([1.0, 2.0, 3.0], [], 0),  # nothing to compare
        ([1.0, 2.0, 3.0], [2.0], 1),  # a one-reading event that slid by one
        ([1.0, 2.0, 1.0, 2.0], [1.0, 2.0, 9.0], 2),  # a periodic signal: the first match at 0 is no slide
        ([1.0, 2.0, 1.0, 2.0], [1.0, 2.0, 1.0, 2.0, 1.0, 2.0], 2),  # ... even where it would fit
        ([1.0, 2.0, 3.0], [1.0, 2.0, 3.0], 0),  # the same event again
        ([1.0, 2.0, 3.0], [5.0, 6.0], 0),  # no overlap
    ],
)
def test_overlap_start_finds_the_stride_of_a_sliding_window(
    previous: list[float], current: list[float], start: int
) -> None:
    as_readings = lambda xs: np.array(xs, np.float32).reshape(-1, 1)  # noqa: E731
    assert overlap_start(as_readings(previous), as_readings(current)) == start


def test_the_holdout_buffer_round_trips_every_event_and_refuses_an_inconsistent_state() -> None:
    batch = EventBatch.from_events(
        [SensorEvent(name, 1000.0 + i, np.full((2 + i, 2), i, np.float32), label=i) for i, name in enumerate("abc")],
        channels=2,
    )
    buffer = HoldoutBuffer(capacity=5)
    versions = [buffer.version]
    buffer.add(batch, np.arange(3))
    versions.append(buffer.version)
    buffer.add(batch, np.zeros(0, np.int64))  # nothing added: the content did not change
    versions.append(buffer.version)
    buffer.add(batch, np.array([1]))
    versions.append(buffer.version)
    assert versions[0] != versions[1] == versions[2] != versions[3]
    back = HoldoutBuffer(capacity=5)
    before = back.version
    back.load_state_dict(buffer.state_dict(), channels=2)
    assert back.version != before
    before = back.version
    back.load_state_dict(buffer.state_dict(), channels=2)
    assert back.version != before  # every load, not only the first
    assert [v.tolist() for v in back.values] == [v.tolist() for v in buffer.values]
    assert list(back.labels) == [0, 1, 2, 1] and list(back.sensors) == ["a", "b", "c", "b"]
    empty = HoldoutBuffer(capacity=5)
    again = HoldoutBuffer(capacity=5)
    again.load_state_dict(empty.state_dict(), channels=2)
    assert len(again) == 0
    state = buffer.state_dict()
    state["lengths"] = state["lengths"][:-1]
    with pytest.raises(ValueError, match="^holdout state is inconsistent: lengths do not sum to the stored values$"):
        HoldoutBuffer(capacity=5).load_state_dict(state, channels=2)
    state = buffer.state_dict()
    state["sensors"] = state["sensors"][:-1]
    with pytest.raises(ValueError):  # a sensor per label, or the state is not this buffer's
        HoldoutBuffer(capacity=5).load_state_dict(state, channels=2)


def related_event(draw: st.DrawFn, previous: np.ndarray) -> np.ndarray:
    """An event that follows ``previous`` as producers send them: slid by some stride, the same
    again, unrelated, or cut from a signal of few values (many false starts to rule out)."""
    channels = previous.shape[1]
    kind = draw(st.sampled_from(["slide", "same", "other", "periodic"]))
    if kind == "slide" and len(previous) > 1:
        stride = draw(st.integers(1, len(previous) - 1))
        more = np.array(draw(st.lists(st.integers(-2, 2), min_size=channels, max_size=channels * 6)), np.float32)
        return np.concatenate([previous[stride:], more[: len(more) // channels * channels].reshape(-1, channels)])
    if kind == "same":
        return previous.copy()
    length = draw(st.integers(0, 12))  # an empty event too: overlap_start finds no slide in it
    values = draw(
        st.lists(st.integers(0, 1 if kind == "periodic" else 9), min_size=length * channels, max_size=length * channels)
    )
    return np.array(values, np.float32).reshape(length, channels)


@st.composite
def event_pairs(draw: st.DrawFn) -> tuple[list[np.ndarray], list[tuple[int, int]]]:
    channels = draw(st.integers(1, 2))
    events: list[np.ndarray] = []
    pairs: list[tuple[int, int]] = []
    for _ in range(draw(st.integers(1, 12))):
        length = draw(st.integers(0, 12))
        values = draw(st.lists(st.integers(0, 2), min_size=length * channels, max_size=length * channels))
        events.append(np.array(values, np.float32).reshape(length, channels))
        for _ in range(draw(st.integers(0, 3))):
            events.append(related_event(draw, events[-1]))
            pairs.append((len(events) - 2, len(events) - 1))
    return events, pairs


@settings(max_examples=300, deadline=None)
@given(event_pairs())
def test_the_batch_overlap_starts_are_overlap_start_of_each_pair(
    case: tuple[list[np.ndarray], list[tuple[int, int]]],
) -> None:
    events, pairs = case
    lengths = np.array([len(e) for e in events], dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(lengths[:-1])]).astype(np.int64)
    previous = np.array([p for p, _ in pairs], dtype=np.int64)
    current = np.array([c for _, c in pairs], dtype=np.int64)
    got = overlap_starts(np.concatenate(events), starts, lengths, previous, current)
    assert got.dtype == np.int64 and got.tolist() == [overlap_start(events[p], events[c]) for p, c in pairs]


def test_a_stream_split_in_poll_batches_of_any_size_is_split_as_one_event_at_a_time() -> None:
    """Within a poll batch a sensor's previous event is in the batch; across batches the splitter
    keeps it: both must find the same overlaps, blocks and guards."""
    rng = np.random.default_rng(12)
    items = (
        sliding(rng.normal(size=160), "stride-1", length=8)
        + sliding(rng.normal(size=200), "stride-3", length=12, stride=3)
        + sliding(np.tile([0.0, 1.0], 80), "periodic", length=6, stride=2)
        + [SensorEvent("apart", 1000.0 + i, rng.normal(size=(5, 1)).astype(np.float32)) for i in range(80)]
        + [SensorEvent("constant", 1000.0 + i, np.full((4, 1), 2.0, np.float32)) for i in range(80)]
    )
    batch = EventBatch.from_events(sorted(items, key=lambda e: (e.ts, e.sensor_id)), channels=1)
    one_at_a_time = HoldoutSplitter(0.25, 3, "seeded", 0)
    expected = [
        np.concatenate(parts)
        for parts in zip(*(split_rows(one_at_a_time, batch, range(i, i + 1)) for i in range(len(batch))), strict=True)
    ]
    assert expected[0].size > 0 and expected[1].size > 0
    for size in (2, 7, 64, len(batch)):
        splitter = HoldoutSplitter(0.25, 3, "seeded", 0)
        parts = [split_rows(splitter, batch, range(i, min(i + size, len(batch)))) for i in range(0, len(batch), size)]
        got = [np.concatenate(p) for p in zip(*parts, strict=True)]
        assert all(np.array_equal(a, b) for a, b in zip(got, expected, strict=True)), size
        assert splitter.redundancy_sums().tolist() == one_at_a_time.redundancy_sums().tolist()
