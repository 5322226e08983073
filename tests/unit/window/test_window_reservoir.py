"""The recency reservoir: exactness, inclusion probabilities, state round trips."""

from __future__ import annotations

import contextlib
import itertools
import math
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats

from streamtrain.events import EventBatch, SensorEvent
from streamtrain.window import storage
from streamtrain.window.compaction import run_in_background, run_inline
from streamtrain.window.reservoir import QuantileSummary, RecencyWindow, rekey, sorted_member
from streamtrain.window.storage import SensorCodes, token_positions


def make_batch(start: int, n: int, *, ts: np.ndarray | None = None, rng=None, channels: int = 1) -> EventBatch:
    rng = rng or np.random.default_rng(start)
    lengths = rng.integers(1, 6, n)
    events = [
        SensorEvent(
            f"s{(start + i) % 7}",
            float(start + i if ts is None else ts[i]),
            np.full((lengths[i], channels), start + i, np.float32),
            (start + i) % 3,
        )
        for i in range(n)
    ]
    return EventBatch.from_events(events, partitions=np.zeros(n), offsets=np.arange(start, start + n))


def feed(window: RecencyWindow, total: int, batch: int) -> None:
    for start in range(0, total, batch):
        n = min(batch, total - start)
        window.insert_batch(make_batch(start, n), {0: start + n})


def expected_top_keys(seed: int, total: int, batch: int, capacity: int, half_life: float) -> set[int]:
    rng = np.random.default_rng(seed)
    decay = 0.0 if math.isinf(half_life) else math.log(2) / half_life
    keys = np.concatenate(
        [
            decay * (np.arange(s, min(s + batch, total), dtype=float) - 0.0)
            - np.log(rng.standard_exponential(min(batch, total - s)))
            for s in range(0, total, batch)
        ]
    )
    return set(np.argsort(keys)[-capacity:].tolist())


@pytest.mark.parametrize("half_life", [50.0, math.inf])
@pytest.mark.parametrize(("capacity", "batch", "slack"), [(100, 37, None), (100, 500, 3), (1000, 64, 10)])
def test_window_is_exactly_the_top_keys_of_the_stream(half_life, capacity, batch, slack) -> None:
    window = RecencyWindow(capacity, half_life, rng=np.random.default_rng(7), slack=slack)
    feed(window, 5000, batch)
    snap = window.snapshot()
    assert set(snap.offsets.tolist()) == expected_top_keys(7, 5000, batch, capacity, half_life)
    assert len(snap) == capacity == len(window)
    assert window.evicted_total == 5000 - capacity
    # readings travel with their items
    for values, offset in zip(snap.values, snap.offsets):
        assert np.all(values == offset)
    assert snap.tokens == window.tokens == int(sum(v.shape[0] for v in snap.values))
    assert snap.next_offsets == {0: 5000}


def test_uniform_inclusion_probability_is_w_over_n() -> None:
    """Each of n items kept with probability W/n: binomial bound over seeded trials."""
    capacity, total, trials = 20, 200, 600
    counts = np.zeros(total)
    for trial in range(trials):
        window = RecencyWindow(capacity, math.inf, rng=np.random.default_rng(trial), slack=5)
        for start in range(0, total, 30):
            window.insert_batch(make_batch(start, min(30, total - start)))
        counts[window.snapshot().offsets] += 1
    p = capacity / total
    # every item's count within a Bonferroni-corrected two-sided binomial interval
    alpha = 1e-3 / total
    lo, hi = stats.binom.ppf(alpha / 2, trials, p), stats.binom.isf(alpha / 2, trials, p)
    assert counts.min() >= lo and counts.max() <= hi
    # and the overall spread matches a uniform law (chi-square)
    chi2 = ((counts - trials * p) ** 2 / (trials * p * (1 - p))).sum()
    assert chi2 < stats.chi2.isf(1e-4, total - 1)


def successive_sampling(weights: np.ndarray, draws: int, reps: int, rng: np.random.Generator) -> np.ndarray:
    """Reference sampler, independent of keys: ``draws`` successive draws without replacement,
    each with probability proportional to the weights left. Efraimidis–Spirakis' theorem says
    the top-W keys are distributed exactly so. Returns the chosen indices, ``[reps, draws]``."""
    left = np.tile(weights, (reps, 1))
    chosen = np.empty((reps, draws), dtype=np.int64)
    rows = np.arange(reps)
    for d in range(draws):
        cdf = np.cumsum(left, axis=1)
        target = rng.random(reps) * cdf[:, -1]
        chosen[:, d] = (cdf < target[:, None]).sum(axis=1)
        left[rows, chosen[:, d]] = 0.0
    return chosen


def test_weighted_inclusion_by_age_matches_exact_successive_sampling() -> None:
    """The window's decay rate, checked to a few percent.

    Statistics of the kept ages (mean age, share younger than one half-life) from
    independent seeded trials, against the exact law simulated by a key-free reference
    sampler. Each z uses both sides' empirical standard errors (trials are i.i.d.), so
    |z| < 4 is a sound bound; the same test must reject a decay rate 5% off either way.
    """
    capacity, total, trials, half_life = 50, 400, 1000, 40.0
    lam = math.log(2) / half_life
    age = (total - 1) - np.arange(total)

    def statistics(kept_ages: np.ndarray) -> np.ndarray:  # [reps, W] -> [reps, 2]
        return np.stack([kept_ages.mean(axis=1), (kept_ages < half_life).mean(axis=1)], axis=1)

    batches = [make_batch(start, min(64, total - start)) for start in range(0, total, 64)]  # ts = offset
    ours = np.empty((trials, capacity))
    for trial in range(trials):
        window = RecencyWindow(capacity, half_life, rng=np.random.default_rng(1000 + trial), slack=17)
        for batch in batches:
            window.insert_batch(batch)
        ours[trial] = age[window.snapshot().offsets]
    ours_stats = statistics(ours)

    def z_scores(rate: float, seed: int) -> np.ndarray:
        reference = statistics(
            age[successive_sampling(np.exp(-rate * age), capacity, 6000, np.random.default_rng(seed))]
        )
        se = np.sqrt(ours_stats.var(axis=0, ddof=1) / trials + reference.var(axis=0, ddof=1) / len(reference))
        return (ours_stats.mean(axis=0) - reference.mean(axis=0)) / se

    assert np.all(np.abs(z_scores(lam, seed=1)) < 4), z_scores(lam, seed=1)
    for off in (0.95, 1.05):  # the tolerance is tighter than a 5% error in the decay rate
        assert np.all(np.abs(z_scores(lam * off, seed=2)) > 4), off
    # and recent items are kept far more often than old ones
    counts = np.bincount(ours.astype(np.int64).ravel(), minlength=total)
    assert counts[:50].mean() > 3 * counts[-100:].mean()


def test_state_dict_round_trip_is_exact() -> None:
    window = RecencyWindow(300, 100.0, channels=2, rng=np.random.default_rng(3))
    for start in range(0, 2000, 111):
        n = min(111, 2000 - start)
        window.insert_batch(make_batch(start, n, channels=2), {0: start + n, 1: 7})
    state = window.state_dict()
    restored = RecencyWindow(300, 100.0, channels=2, rng=np.random.default_rng(99))
    restored.load_state_dict(state)
    a, b = window.snapshot(), restored.snapshot()
    order_a, order_b = np.argsort(a.offsets), np.argsort(b.offsets)
    for name in ("offsets", "keys", "ts", "labels", "lengths", "partitions"):
        assert np.array_equal(getattr(a, name)[order_a], getattr(b, name)[order_b]), name
    assert [x.tolist() for x in np.array(a.values, dtype=object)[order_a]] == [
        x.tolist() for x in np.array(b.values, dtype=object)[order_b]
    ]
    assert b.next_offsets == {0: 2000, 1: 7}
    assert restored.accepted_total == window.accepted_total and restored.evicted_total == window.evicted_total
    # the restored window continues identically (same RNG state)
    window.insert_batch(make_batch(5000, 100, channels=2))
    restored.insert_batch(make_batch(5000, 100, channels=2))
    assert set(window.snapshot().offsets.tolist()) == set(restored.snapshot().offsets.tolist())


def test_max_age_expires_items() -> None:
    now = [1000.0]
    window = RecencyWindow(100, math.inf, max_age_s=50, clock=lambda: now[0], rng=np.random.default_rng(0))
    window.insert_batch(make_batch(0, 10, ts=np.full(10, 960.0)))
    window.insert_batch(make_batch(10, 10, ts=np.full(10, 990.0)))
    assert len(window.snapshot()) == 20
    now[0] = 1020.0
    snap = window.snapshot()
    assert sorted(snap.offsets.tolist()) == list(range(10, 20))
    assert window.evicted_total == 10


class ScriptedDraws:
    """The window's key randomness, scripted: the E of each event in turn (key = −ln E)."""

    def __init__(self, draws: list[float]) -> None:
        self.draws = list(draws)

    def standard_exponential(self, n: int) -> np.ndarray:
        out, self.draws = self.draws[:n], self.draws[n:]
        return np.asarray(out, dtype=np.float64)


def test_with_max_age_a_read_cuts_nothing_and_a_cut_is_final() -> None:
    """The module docstring's rule: a cut (the store outgrew W + S) drops the expired, then keeps
    the top W of the rest, and what it pushed out does not come back when the winner that beat it
    expires; a read only computes what a cut would keep now, so it pushes nothing out."""
    now = [1000.0]

    def window_of_one(draws: list[float]) -> RecencyWindow:
        # W = 1, S = 2: the winner (E = 0.01, key 4.6) is older than the events it beats
        return RecencyWindow(1, math.inf, max_age_s=50, slack=2, clock=lambda: now[0], rng=ScriptedDraws(draws))

    # reads while the winner is young push nothing out: once it expires the best young event wins
    read_between = window_of_one([0.01, 1.0, 2.0])
    read_between.insert_batch(make_batch(0, 1, ts=np.array([960.0])))
    read_between.insert_batch(make_batch(1, 2, ts=np.array([990.0, 995.0])))
    assert read_between.snapshot().offsets.tolist() == [0] and len(read_between) == 1
    assert read_between.evicted_total == 2 and read_between.stats().size == 1
    now[0] = 1015.0  # the winner (ts 960) expired; the other two are young
    assert read_between.snapshot().offsets.tolist() == [1] and len(read_between) == 1
    assert read_between.evicted_total == 2

    # a cut while the winner is young (4 stored > W + S) pushes the others out for good
    now[0] = 1000.0
    cut_between = window_of_one([0.01, 1.0, 2.0, 1.5, 1.0])
    cut_between.insert_batch(make_batch(0, 1, ts=np.array([960.0])))
    cut_between.insert_batch(make_batch(1, 3, ts=np.array([990.0, 995.0, 996.0])))
    assert cut_between.snapshot().offsets.tolist() == [0]
    now[0] = 1015.0
    assert len(cut_between.snapshot()) == 0 and len(cut_between) == 0
    assert cut_between.evicted_total == 4 and cut_between.stats().size == 0
    cut_between.insert_batch(make_batch(4, 1, ts=np.array([1010.0])))
    assert cut_between.snapshot().offsets.tolist() == [4]  # only a newer event fills the hole


@contextlib.contextmanager
def inserting_in_another_thread(window: RecencyWindow, start: int, pause_s: float = 0.0) -> Iterator[None]:
    """A writer thread inserting batches of 40 (offsets from ``start``) until the block ends."""
    stop = threading.Event()

    def writer() -> None:
        offset = start
        while not stop.wait(pause_s):
            window.insert_batch(make_batch(offset, 40), {0: offset + 40})
            offset += 40

    thread = threading.Thread(target=writer)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def test_snapshot_is_consistent_under_concurrent_inserts() -> None:
    window = RecencyWindow(500, 30.0, rng=np.random.default_rng(0), slack=50)
    with inserting_in_another_thread(window, start=0):
        for _ in range(200):
            snap = window.snapshot()
            assert len(snap) <= 500
            assert len(set(snap.offsets.tolist())) == len(snap)  # no duplicates
            assert all(v.shape[0] == n for v, n in zip(snap.values, snap.lengths))
            assert all(np.all(v == o) for v, o in zip(snap.values, snap.offsets))
            if len(snap):
                assert snap.offsets.max() < snap.next_offsets[0]  # state covers its offsets


def test_stats() -> None:
    window = RecencyWindow(10, math.inf, rng=np.random.default_rng(0))
    assert window.stats().size == 0 and window.stats().age_s is None
    window.insert_batch(make_batch(0, 4, ts=np.array([10.0, 20.0, 30.0, 40.0])))
    st_ = window.stats(now=50.0)
    assert st_.size == 4 and st_.capacity == 10 and st_.sensors == 4
    assert st_.age_s.min == 10.0 and st_.age_s.max == 40.0 and st_.age_s.mean == 25.0


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="capacity"):
        RecencyWindow(0)
    with pytest.raises(ValueError, match="half_life_s"):
        RecencyWindow(10, 0.0)
    with pytest.raises(ValueError, match="tokens, 1"):
        RecencyWindow(10).insert_batch(make_batch(0, 3, channels=2))


def test_token_positions() -> None:
    starts, lengths = np.array([5, 0, 9, 20]), np.array([2, 0, 3, 1])
    assert token_positions(starts, lengths).tolist() == [5, 6, 9, 10, 11, 20]
    assert token_positions(np.array([3]), np.array([0])).tolist() == []


# --------------------------------------------------------------------------------------- counters


def test_the_ledger_counts_every_covered_message_once_across_a_restore() -> None:
    window = RecencyWindow(100, 50.0, rng=np.random.default_rng(0), slack=10)
    for start in range(0, 1000, 100):
        window.insert_batch(make_batch(start, 90), {0: start + 100}, rejected={"decode": 7, "schema": 3})
    window.advance_offsets({0: 1010}, rejected={"too_large": 10})
    stats = window.stats()
    assert stats.accepted_total == 900 and stats.rejected_total == {"decode": 70, "schema": 30, "too_large": 10}
    assert stats.seen_total == 1010 == window.seen_total == stats.accepted_total + sum(stats.rejected_total.values())
    assert stats.size == 100 == stats.accepted_total - stats.evicted_total
    assert window.evicted_since_start == window.evicted_total == 800

    restored = RecencyWindow(100, 50.0, rng=np.random.default_rng(1))
    restored.load_state_dict(window.state_dict())
    again = restored.stats()
    assert (again.seen_total, again.accepted_total, again.rejected_total, again.evicted_total) == (
        stats.seen_total, stats.accepted_total, stats.rejected_total, stats.evicted_total)  # fmt: skip
    # what this process evicts starts at zero, and only grows
    assert restored.evicted_since_start == 0
    seen = [0]
    for start in range(1010, 1500, 70):
        restored.insert_batch(make_batch(start, 70), {0: start + 70}, rejected={"empty": 1})
        assert restored.evicted_since_start >= seen[-1]
        seen.append(restored.evicted_since_start)
    assert restored.evicted_since_start == restored.evicted_total - stats.evicted_total == 490
    assert restored.stats().seen_total == 1010 + 490 + 7


def test_insert_report_drops_only_events_that_can_never_enter() -> None:
    window = RecencyWindow(50, math.inf, rng=np.random.default_rng(3), slack=5)
    starts = range(0, 4000, 40)
    reports = [window.insert_batch(make_batch(start, 40)) for start in starts]
    assert all(r.offered == 40 and r.stored + r.dropped == 40 for r in reports)
    assert reports[0].dropped == 0  # nothing is cut before the window first overflows
    assert sum(r.dropped for r in reports) > 3000  # a uniform stream is mostly dropped at once
    kept = window.snapshot().offsets
    for report, start in zip(reports, starts):
        if report.dropped == 40:  # a batch dropped whole has nothing in the window
            assert not np.any((kept >= start) & (kept < start + 40)), start
    assert any(r.dropped == 40 for r in reports)


# --------------------------------------------------------------------------------------- restore under changed settings


def day_long_window(half_life: float, seed: int) -> tuple[RecencyWindow, np.ndarray]:
    """A window fed one event a second for a day; returns it and every event's E draw."""
    rng = np.random.default_rng(seed)
    window = RecencyWindow(500, half_life, rng=rng)
    draws = np.random.default_rng(seed)  # the same stream: the window's exponential draws
    exps = []
    for start in range(0, 86_400, 2_400):
        ts = 1.7e9 + np.arange(start, start + 2_400, dtype=np.float64)
        window.insert_batch(make_batch(start, 2_400, ts=ts), {0: start + 2_400})
        exps.append(draws.standard_exponential(2_400))
    return window, np.concatenate(exps)


def test_a_window_saved_with_another_half_life_is_rekeyed_with_its_own_draws(caplog: pytest.LogCaptureFixture) -> None:
    old, exps = day_long_window(3600.0, seed=5)
    state = old.state_dict()
    for new_half_life in (math.inf, 600.0):
        window = RecencyWindow(500, new_half_life, rng=np.random.default_rng(9))
        with caplog.at_level("WARNING", logger="streamtrain.window"):
            window.load_state_dict(state)
        assert "re-keyed its 500 items for HALF_LIFE_S=" in caplog.text
        snap = window.snapshot()
        lam = 0.0 if math.isinf(new_half_life) else math.log(2) / new_half_life
        expected = lam * (snap.ts - 1.7e9) - np.log(exps[snap.offsets])
        np.testing.assert_allclose(snap.keys, expected, rtol=0, atol=1e-9)
        assert set(snap.offsets.tolist()) == set(old.snapshot().offsets.tolist())  # the same items


def test_after_switching_to_uniform_the_window_keeps_taking_events() -> None:
    """The bug the re-keying fixes: a day of 1 h-half-life keys (up to λ·86400 = 16.6) would
    outrank every uniform key −ln E of the new events, and the window would freeze."""
    old, _ = day_long_window(3600.0, seed=6)
    state = old.state_dict()
    kept = old.snapshot()
    # the window's own stream continues (its RNG state travels with the checkpoint)
    draws = np.random.default_rng(6)
    draws.standard_exponential(86_400)
    new_keys = -np.log(np.concatenate([draws.standard_exponential(500) for _ in range(10)]))

    def restored_then_fed(state: dict) -> RecencyWindow:
        window = RecencyWindow(500, math.inf, rng=np.random.default_rng(1))
        window.load_state_dict(state)
        for start in range(86_400, 86_400 + 5_000, 500):
            window.insert_batch(make_batch(start, 500, ts=np.full(500, 1.7e9 + start)))
        return window

    window = restored_then_fed(state)
    # exactly the top W of the re-keyed old items and the new events
    old_keys = kept.keys - math.log(2) / 3600.0 * (kept.ts - 1.7e9)
    keys = np.concatenate([old_keys, new_keys])
    offsets = np.concatenate([kept.offsets, np.arange(86_400, 91_400)])
    assert set(window.snapshot().offsets.tolist()) == set(offsets[np.argsort(keys)[-500:]].tolist())
    assert (window.snapshot().offsets >= 86_400).mean() > 0.05
    frozen = dict(state, half_life_s=math.inf)  # what loading the old keys as they were did
    assert (restored_then_fed(frozen).snapshot().offsets >= 86_400).sum() == 0


def test_a_window_saved_with_other_channels_is_refused_before_anything_changes() -> None:
    old = RecencyWindow(50, math.inf, channels=1, rng=np.random.default_rng(0))
    old.insert_batch(make_batch(0, 30), {0: 30})
    window = RecencyWindow(50, math.inf, channels=2, rng=np.random.default_rng(0))
    window.insert_batch(make_batch(100, 5, channels=2), {0: 105})
    with pytest.raises(ValueError, match="CHANNELS=1.*CHANNELS=2"):
        window.load_state_dict(old.state_dict())
    assert len(window) == 5 and window.next_offsets == {0: 105}


# --------------------------------------------------------------------------------------- snapshots


def test_a_pass_subset_gathers_only_its_own_readings() -> None:
    window = RecencyWindow(2000, 30.0, rng=np.random.default_rng(2), slack=500)
    for start in range(0, 6000, 250):
        window.insert_batch(make_batch(start, 250), {0: start + 250})
    snap = window.snapshot()
    assert isinstance(snap.flat_values, tuple) and len(snap.flat_values) > 1  # shared chunks, no copy
    pick = np.sort(np.random.default_rng(0).choice(len(snap), 100, replace=False))
    sub = snap.subset(pick)
    assert isinstance(sub.flat_values, np.ndarray) and sub.flat_values.shape[0] == sub.tokens  # nothing else copied
    for values, offset in zip(sub.values, sub.offsets):
        assert np.all(values == offset)
    assert sub.subset(np.arange(10)).flat_values is sub.flat_values  # a subset of a subset shares them
    flat, lengths = snap.gather_values(pick)
    assert np.array_equal(flat, sub.flat_values) and np.array_equal(lengths, sub.lengths)


def test_a_subset_in_any_order_over_chunks_gathers_each_items_own_readings() -> None:
    """Chunk by chunk (a window's order) or not (a pass in another order): every item its readings."""
    window = RecencyWindow(2000, 30.0, rng=np.random.default_rng(3), slack=500)
    for start in range(0, 3000, 250):
        window.insert_batch(make_batch(start, 250), {0: start + 250})
    snap = window.snapshot()
    assert isinstance(snap.flat_values, tuple) and len(snap.flat_values) > 1
    for pick in (np.arange(len(snap)), np.random.default_rng(1).permutation(len(snap))[:300]):
        sub = snap.subset(pick)
        assert [int(values[0, 0]) for values in sub.values] == sub.offsets.tolist()
        assert all(np.all(values == offset) for values, offset in zip(sub.values, sub.offsets))


def test_a_checkpoint_capture_keeps_sensor_ids_as_the_windows_codes(monkeypatch: pytest.MonkeyPatch) -> None:
    """No Python object per item for a checkpoint; the ids they name are the state_dict's."""
    monkeypatch.setattr(storage, "OBJECT_PIECE_ITEMS", 7)  # ids built in pieces where asked for
    window = RecencyWindow(300, 30.0, rng=np.random.default_rng(4), slack=50)
    for start in range(0, 600, 100):
        window.insert_batch(make_batch(start, 100), {0: start + 100})
    capture = window.capture_state()
    coded = capture(for_checkpoint=True)["sensor_ids"]
    assert isinstance(coded, SensorCodes) and coded.codes.dtype == np.int32
    ids = window.state_dict()["sensor_ids"]
    assert ids.dtype == object and np.asarray(coded, dtype=object).tolist() == ids.tolist()
    assert capture()["sensor_ids"].tolist() == ids.tolist()
    window.insert_batch(make_batch(1000, 40, ts=np.full(40, 1e6)), {0: 1040})  # newer: they all enter
    entered = window.capture_state().delta(np.sort(capture.seq))["entered"]
    assert isinstance(entered["sensor_ids"], SensorCodes)
    assert np.asarray(entered["sensor_ids"], dtype=object).tolist() == [f"s{(1000 + i) % 7}" for i in range(40)]


def test_large_chunks_live_off_the_heap_and_hold_only_admitted_readings() -> None:
    import mmap

    from streamtrain.window.storage import OFF_HEAP_MIN_BYTES, chunk_array

    def backing(array: np.ndarray) -> object:
        while isinstance(array, np.ndarray):
            array = array.base
        return array.obj if isinstance(array, memoryview) else array

    big, small = chunk_array(OFF_HEAP_MIN_BYTES // 4, 1), chunk_array(OFF_HEAP_MIN_BYTES // 4 - 1, 1)
    assert isinstance(backing(big), mmap.mmap) and big.flags.writeable and big.shape == (OFF_HEAP_MIN_BYTES // 4, 1)
    assert backing(small) is None
    # batches of 20,000 events (~60,000 readings of 2 channels, ~480 kB) into a window of 5,000:
    # the window keeps copies of the readings of the events it stores, not the batches' arrays
    window = RecencyWindow(5000, channels=2, rng=np.random.default_rng(4), slack=1000)
    first, second = (make_batch(start, 20_000, rng=np.random.default_rng(start), channels=2) for start in (0, 20_000))
    window.insert_batch(first, {0: 20_000})
    report = window.insert_batch(second, {0: 40_000})
    assert 0 < report.stored < report.offered  # below the first cut's threshold: dropped, never copied
    chunks = window.snapshot().flat_values
    assert all(not np.shares_memory(chunk, batch.values) for chunk in chunks for batch in (first, second))
    snap = window.snapshot()
    for values, offset in zip(snap.values, snap.offsets):
        assert np.all(values == offset)
    assert any(isinstance(backing(chunk), mmap.mmap) for chunk in snap.flat_values)


# --------------------------------------------------------------------------------------- readers and writer


def test_a_reader_never_waits_on_the_writers_cut() -> None:
    """The writer is held inside a cut; snapshots, statistics and a checkpoint capture still
    answer at once, with the state published before that insert began."""
    window = RecencyWindow(300, 30.0, rng=np.random.default_rng(0), slack=100)
    feed(window, 350, 50)  # 350 stored: the next batch of 60 takes the store past W + S
    before = window.snapshot()
    in_cut, release = threading.Event(), threading.Event()
    compact = window._compact_chunks

    def held_compaction() -> None:
        in_cut.set()
        release.wait(10)
        compact()

    window._compact_chunks = held_compaction  # type: ignore[method-assign]
    writer = threading.Thread(target=lambda: window.insert_batch(make_batch(350, 60), {0: 410}))
    writer.start()
    try:
        assert in_cut.wait(10)
        answered: list[object] = []
        reader = threading.Thread(
            target=lambda: answered.extend([window.snapshot(), window.stats(), window.capture_state()(), len(window)])
        )
        reader.start()
        reader.join(5)
        assert not reader.is_alive(), "a reader waited on the writer's cut"
        snap, stats, state, size = answered
        assert np.array_equal(snap.offsets, before.offsets) and snap.version == before.version  # type: ignore[attr-defined]
        assert stats.size == size == 300 and state["next_offsets"] == {"0": 350}  # type: ignore[attr-defined,index]
    finally:
        release.set()
        writer.join(10)
    after = window.snapshot()
    assert len(after) == 300 and after.next_offsets == {0: 410} and after.offsets.max() >= 350


def test_a_snapshot_stays_as_it_was_while_the_writer_appends_cuts_and_compacts() -> None:
    window = RecencyWindow(400, 20.0, rng=np.random.default_rng(5), slack=50)
    feed(window, 360, 60)
    snap = window.snapshot()  # no cut due: it holds views of the store's own columns
    assert not snap.ts.flags.writeable
    frozen = {name: np.array(getattr(snap, name), copy=True) for name in ("offsets", "keys", "ts", "seq", "lengths")}
    values = [v.copy() for v in snap.values]
    ids = snap.sensor_ids.tolist()
    for start in range(360, 6000, 60):  # many cuts, chunk compactions and a new vocabulary
        window.insert_batch(make_batch(start, 60), {0: start + 60})
    for name, column in frozen.items():
        assert np.array_equal(getattr(snap, name), column), name
    assert all(np.array_equal(a, b) for a, b in zip(snap.values, values)) and snap.sensor_ids.tolist() == ids
    with pytest.raises(ValueError):
        window.snapshot().ts[0] = 0.0  # views of the store are read-only


def test_sensor_ids_survive_the_vocabulary_being_pruned() -> None:
    """Ids are stored as codes; a fleet that keeps changing makes the window forget old ids
    at cuts, and every item still reads back as the sensor that sent it."""
    window = RecencyWindow(500, 5.0, rng=np.random.default_rng(9), slack=100)
    for start in range(0, 20_000, 200):
        batch = make_batch(start, 200)
        batch = EventBatch(
            sensor_ids=np.array([f"fleet-{start + i}" for i in range(200)], dtype=object),  # every event a new sensor
            ts=batch.ts,
            labels=batch.labels,
            lengths=batch.lengths,
            values=batch.values,
            partitions=batch.partitions,
            offsets=batch.offsets,
        )
        window.insert_batch(batch, {0: start + 200})
    snap = window.snapshot()
    assert len(snap) == 500
    assert snap.sensor_ids.tolist() == [f"fleet-{o}" for o in snap.offsets.tolist()]
    assert window.stats().sensors == 500
    restored = RecencyWindow(500, 5.0, rng=np.random.default_rng(1))
    restored.load_state_dict(window.state_dict())
    assert restored.snapshot().sensor_ids.tolist() == snap.sensor_ids.tolist()


@pytest.mark.parametrize(("run_compaction", "late"), [(run_inline, 0), (run_in_background, 1)])
def test_reading_chunks_hold_little_more_than_the_live_readings(run_compaction, late: int) -> None:
    """A uniform stream leaves holes everywhere in old chunks; compaction at cuts keeps the
    chunks within 1.25x the window's readings (plus 64k tokens of leeway). Gathered in the
    background, a merge planned at one cut is swapped in at the next (a cut every 4,000
    events here): the chunks may hold one more cut's evictions (4,000 events of < 60 readings)."""
    window = RecencyWindow(20_000, rng=np.random.default_rng(3), slack=2000, run_compaction=run_compaction)
    rng = np.random.default_rng(4)
    for start in range(0, 400_000, 2000):
        lengths = rng.integers(20, 60, 2000)
        window.insert_batch(
            EventBatch(
                sensor_ids=np.full(2000, "s", dtype=object),
                ts=np.arange(start, start + 2000, dtype=np.float64),
                labels=np.full(2000, -1),
                lengths=lengths,
                values=np.zeros((int(lengths.sum()), 1), np.float32),
                partitions=np.zeros(2000, np.int32),
                offsets=np.arange(start, start + 2000),
            )
        )
        assert window.wait_for_compaction(10)  # gathered before the next cut, which swaps it in
        snap = window.snapshot()
        held = sum(chunk.shape[0] for chunk in snap.flat_values)
        assert held <= 1.25 * snap.tokens + 65536 + 2 * 2000 * 60 + late * 4000 * 60  # + arrivals since the last cut
    assert window.compactions.merges_total >= 5


# --------------------------------------------------------------------------------------- what the mutation run asked


def events(lengths: list[int], *, ts: list[float] | None = None, first_offset: int = 0, sensors=None) -> EventBatch:
    """A batch whose event i (offset first_offset + i) has ``lengths[i]`` readings, each equal to its offset."""
    n = len(lengths)
    offsets = np.arange(first_offset, first_offset + n)
    return EventBatch(
        sensor_ids=np.array(sensors if sensors is not None else [f"s{o}" for o in offsets], dtype=object),
        ts=np.asarray(ts if ts is not None else offsets, dtype=np.float64),
        labels=offsets % 3,
        lengths=np.asarray(lengths, dtype=np.int64),
        values=np.repeat(offsets.astype(np.float32), lengths).reshape(-1, 1),
        partitions=np.zeros(n, np.int32),
        offsets=offsets,
    )


KEEP, DROP = 1e-3, 10.0  # exponential draws E: key −ln E = 6.9 (wins) or −2.3 (loses) with an infinite half-life


def overshooting_window(clock: Callable[[], float] = lambda: 70.0) -> RecencyWindow:
    """W = 4 and six events stored (no cut yet): the window is four of them, the store holds all six.

    Kept: ts 10, 30, 69.5 and 80 (ages at t = 70: 60, 40, 0.5 and −10, read as 0), lengths 1, 3, 5, 6.
    """
    draws = [KEEP, DROP, KEEP, DROP, KEEP, KEEP]
    window = RecencyWindow(4, math.inf, slack=10, rng=ScriptedDraws(draws), clock=clock)  # type: ignore[arg-type]
    window.insert_batch(events([1, 2, 3, 4, 5, 6], ts=[10.0, 20.0, 30.0, 40.0, 69.5, 80.0]), {0: 6}, held_out=2)
    return window


def test_statistics_and_age_quantiles_describe_the_window_not_the_store() -> None:
    window = overshooting_window()
    assert sorted(window.snapshot().offsets.tolist()) == [0, 2, 4, 5]
    assert window.age_quantiles([0.0, 0.5, 1.0]) == [0.0, 20.25, 60.0]  # now from the clock
    assert window.age_quantiles([0.9], now=71.0) == [pytest.approx(55.0)]  # ages 61, 41, 1.5, 0
    assert window.tokens == 15
    stats = window.stats()
    assert (stats.size, stats.tokens, stats.sensors, stats.half_life_s) == (4, 15, 4, math.inf)
    assert (stats.accepted_total, stats.held_out_total, stats.seen_total, stats.evicted_total) == (6, 2, 8, 2)
    assert stats.age_s == QuantileSummary(min=0.0, p50=20.25, p90=pytest.approx(54.0), max=60.0, mean=25.125)
    assert stats.length == QuantileSummary(min=1.0, p50=4.0, p90=pytest.approx(5.7), max=6.0, mean=3.75)


def test_an_empty_window_and_a_window_of_one_item() -> None:
    window = RecencyWindow(3, rng=np.random.default_rng(0), clock=lambda: 100.0)
    assert window.age_quantiles([0.1, 0.9]) == [0.0, 0.0]
    stats = window.stats()
    assert (stats.size, stats.tokens, stats.sensors, stats.age_s, stats.length) == (0, 0, 0, None, None)
    snap = window.snapshot()
    assert snap.all_values().shape == (0, 1) and snap.all_values().dtype == np.float32
    assert [(chunk.shape, chunk.dtype) for chunk in snap.flat_values] == [((0, 1), np.float32)]  # no readings
    assert snap.starts.dtype == np.int64
    restored = RecencyWindow(3, rng=np.random.default_rng(1))
    restored.load_state_dict(window.state_dict())  # an empty window's state holds no readings either
    assert len(restored) == 0
    window.insert_batch(events([2], ts=[60.0]))
    assert window.age_quantiles([0.5]) == [40.0]


def test_the_version_counts_every_published_change_and_held_out_events_add_up() -> None:
    now = [5.0]
    window = RecencyWindow(10, rng=np.random.default_rng(0), clock=lambda: now[0])
    assert window.version == 0 and window.snapshot().version == 0
    window.insert_batch(events([1, 1]), {0: 2})
    window.advance_offsets({0: 5}, held_out=3)
    window.advance_offsets({0: 7}, rejected={"schema": 2}, held_out=1)
    assert window.version == 3 and window.held_out_total == 4 and window.seen_total == 8
    now[0] = 9.0
    snap = window.snapshot()
    assert (snap.version, snap.taken_at, snap.next_offsets) == (3, 9.0, {0: 7})
    assert window.state_dict()["version"] == 3
    window.insert_batch(events([1], first_offset=2), {0: 8}, held_out=2)
    assert (window.version, window.held_out_total, window.seen_total) == (4, 6, 11)


def test_the_default_slack_and_randomness() -> None:
    """Slack: W / 8, at least 4,096 and at most W (class docstring); a given slack is at least 1."""
    slacks = [RecencyWindow(w).slack for w in (100, 10_000, 80_004)]
    assert slacks == [100, 4096, 10_000] and all(type(slack) is int for slack in slacks)
    assert RecencyWindow(10, slack=0).slack == 1
    assert RecencyWindow(10, 0.5).half_life_s == 0.5  # any positive half-life, sub-second too
    window = RecencyWindow(10)  # OS entropy
    window.insert_batch(events([1] * 30))
    assert len(window) == 10 and np.unique(window.snapshot().keys).size == 10


def test_keys_are_the_decayed_event_time_minus_the_log_of_the_draw() -> None:
    """The module docstring's key λ·(ts − L) − ln E, L the first event time the window saw (here 0)."""
    window = RecencyWindow(10, 10.0, rng=ScriptedDraws([1.0, 2.0, 0.5, 3.0]))  # type: ignore[arg-type]
    window.insert_batch(events([1, 1], ts=[0.0, 5.0]))
    window.insert_batch(events([1, 1], ts=[20.0, 1.0], first_offset=2))
    snap = window.snapshot()
    lam = math.log(2) / 10.0
    expected = lam * np.array([0.0, 5.0, 20.0, 1.0]) - np.log([1.0, 2.0, 0.5, 3.0])
    np.testing.assert_allclose(snap.keys[np.argsort(snap.offsets)], expected, rtol=0, atol=1e-12)


def test_an_event_exactly_max_age_old_is_still_in_the_window() -> None:
    window = RecencyWindow(5, max_age_s=50.0, slack=1, rng=np.random.default_rng(0), clock=lambda: 1000.0)
    window.insert_batch(events([1, 1], ts=[950.0, 949.0]))
    assert len(window) == 1 and window.snapshot().offsets.tolist() == [0]
    window.insert_batch(events([1] * 5, ts=[990.0] * 5, first_offset=2))  # a cut: 7 stored > W + S
    assert len(window) == 5 and 1 not in window.snapshot().offsets.tolist()


def test_with_max_age_the_age_quantiles_are_those_of_the_young_items() -> None:
    now = [1000.0]
    window = RecencyWindow(5, max_age_s=50.0, rng=np.random.default_rng(0), clock=lambda: now[0])
    window.insert_batch(events([1, 1, 1], ts=[940.0, 960.0, 990.0]))
    assert window.age_quantiles([0.0, 1.0]) == [10.0, 40.0]
    now[0] = 1020.0
    assert window.age_quantiles([0.0, 1.0]) == [30.0, 30.0]


def test_reads_of_one_state_select_its_rows_once() -> None:
    """Statistics, snapshots and sizes of one published state share one selection (``_window_rows``)."""
    ticks = itertools.count(100)
    window = RecencyWindow(3, slack=10, rng=np.random.default_rng(0), clock=lambda: float(next(ticks)))
    window.insert_batch(events([1] * 5))
    calls = []
    select = window._select_rows

    def counted(*args: object) -> object:
        calls.append(args)
        return select(*args)  # type: ignore[arg-type]

    window._select_rows = counted  # type: ignore[method-assign]
    window.stats(), window.snapshot(), window.tokens, window.age_quantiles([0.5]), window.capture_state()()
    assert len(calls) == 1  # the clock moved on every read: without MAX_AGE_S the rows do not depend on it
    window.insert_batch(events([1], first_offset=5))
    window.stats(), window.snapshot()
    assert len(calls) == 2


# ---------------------------------------------------------------- readings compaction (the 1.25x / 1.1x rule)


def window_of_chunks(batches: list[list[tuple[int, bool]]]) -> RecencyWindow:
    """Each batch (one reading chunk) is a list of events (length, kept); the one cut comes with the last batch."""
    flat = [event for batch in batches for event in batch]
    capacity = sum(kept for _, kept in flat)
    draws = [KEEP if kept else DROP for _, kept in flat]
    window = RecencyWindow(
        capacity,
        slack=len(flat) - capacity - 1,
        rng=ScriptedDraws(draws),  # type: ignore[arg-type]
        run_compaction=run_inline,  # the cut compacts at once
    )
    offset = 0
    for batch in batches:
        window.insert_batch(events([length for length, _ in batch], first_offset=offset))
        offset += len(batch)
    kept = [i for i, (_, keep) in enumerate(flat) if keep]
    snap = window.snapshot()
    assert sorted(snap.offsets.tolist()) == kept
    for values, offset_ in zip(snap.values, snap.offsets):  # every item still reads its own readings
        assert values.shape[0] == flat[offset_][0] and np.all(values == offset_)
    return window


def chunk_sizes(window: RecencyWindow) -> list[int]:
    return [chunk.shape[0] for chunk in window.snapshot().flat_values]


def test_compaction_merges_the_emptiest_chunks_until_they_hold_at_most_1_1x_the_live_readings() -> None:
    """Chunks of 50k, 100k, 200k and 10k readings (1,000 per event) keep 60%, 90%, 25% and 10% of them and
    a fifth chunk none: 171k live in 360k held (> 1.25x + 64k). Merging the emptiest first (10%, then 25%,
    then 60%) until at most 1.1x is held leaves the 90% chunk and one merged chunk of 81k readings."""

    def chunk(events_: int, kept: int) -> list[tuple[int, bool]]:
        return [(1000, i < kept) for i in range(events_)]

    window = window_of_chunks([chunk(50, 30), chunk(100, 90), chunk(200, 50), chunk(10, 1), chunk(50, 0)])
    assert chunk_sizes(window) == [100_000, 81_000]


@pytest.mark.parametrize(("dropped", "expected"), [(66_537, [4000, 66_541]), (66_538, [4000, 4])])
def test_compaction_starts_only_past_1_25x_the_live_readings_plus_64k(dropped: int, expected: list[int]) -> None:
    """4,004 live readings: held 1.25 · 4004 + 65536 = 70,541 is not compacted, one reading more is
    (the sparse chunk is merged down to its one live event); the chunk of a dropped event is freed either way."""
    full = [(4, True)] * 1000
    sparse = [(4, True), (dropped, False)]
    window = window_of_chunks([full, sparse, [(1, False)]])
    assert chunk_sizes(window) == expected


# ---------------------------------------------------------------- the sensor vocabulary


def churning_fleet(capacity: int, slack: int, half_life: float, events_: int, batch: int = 100) -> RecencyWindow:
    """Every event from a sensor never seen before; each item must still read back its own id."""
    window = RecencyWindow(capacity, half_life, slack=slack, rng=np.random.default_rng(capacity))
    for start in range(0, events_, batch):
        window.insert_batch(events([1] * batch, first_offset=start))
        snap = window.snapshot()
        assert snap.sensor_ids.tolist() == [f"s{o}" for o in snap.offsets.tolist()], start
        # ids no item uses are forgotten: at most 2 W (or 1024) after a cut, plus what was stored since
        assert window._vocabulary_n <= max(1024, 2 * capacity) + capacity + slack + batch
    return window


@pytest.mark.parametrize(
    ("capacity", "slack", "half_life", "events_"),
    [(301, 800, math.inf, 6000), (301, 800, 50.0, 6000), (1100, 2000, math.inf, 3200)],
)
def test_a_changing_fleet_keeps_every_id_and_a_bounded_vocabulary(capacity, slack, half_life, events_) -> None:
    churning_fleet(capacity, slack, half_life, events_)


def test_the_vocabulary_is_pruned_past_1024_ids_once_unused_ones_are_most_of_it() -> None:
    """After a cut the ids no item uses are forgotten once they are most of the vocabulary, and it holds more
    than 1,024 ids; each case is one batch of distinct sensors and one cut (ids > W + S stored)."""
    for capacity, ids, after_cut in ((100, 1024, 1024), (100, 1025, 100), (600, 1200, 1200), (500, 1200, 500)):
        window = RecencyWindow(capacity, slack=ids - capacity - 1, rng=np.random.default_rng(0))
        window.insert_batch(events([1] * ids))
        assert len(window) == capacity and window._vocabulary_n == after_cut, (capacity, ids)


def test_a_cut_that_expires_every_item_forgets_every_id() -> None:
    window = RecencyWindow(100, max_age_s=10.0, slack=1000, rng=np.random.default_rng(0), clock=lambda: 100.0)
    window.insert_batch(events([1] * 1101, ts=[0.0] * 1101))  # all expired already: the cut keeps none
    assert len(window) == 0 and window._vocabulary_n == 0
    window.insert_batch(events([1], ts=[99.0], first_offset=5000))
    assert window.snapshot().sensor_ids.tolist() == ["s5000"]


# ---------------------------------------------------------------- restoring


def test_a_state_without_its_optional_fields_restores_with_their_defaults() -> None:
    """A state of only the item arrays (what older checkpoints hold): the window's own settings, the counters
    of its items, arrival numbers 0..n−1 that new events continue without a collision."""
    old = RecencyWindow(10, 30.0, rng=np.random.default_rng(0))
    old.insert_batch(events([1, 2, 3, 1, 2, 3]), {0: 6}, rejected={"schema": 1}, held_out=2)
    items = ("values", "lengths", "ts", "labels", "keys", "sensor_ids", "partitions", "offsets")
    bare = {name: old.state_dict()[name] for name in items}
    window = RecencyWindow(10, 30.0, rng=np.random.default_rng(1))
    window.load_state_dict(bare)
    assert (len(window), window.accepted_total, window.rejected_total) == (6, 6, {})
    assert (window.held_out_total, window.version, window.next_offsets) == (0, 0, {})
    assert sorted(window.snapshot().seq.tolist()) == list(range(6))
    window.insert_batch(events([1, 1, 1], first_offset=6))
    seq = window.snapshot().seq
    assert sorted(seq.tolist()) == list(range(9))
    # and the optional fields, when present, are what they say
    full = RecencyWindow(10, 30.0, rng=np.random.default_rng(2))
    full.load_state_dict(old.state_dict())
    assert (full.accepted_total, full.rejected_total, full.held_out_total, full.version) == (6, {"schema": 1}, 2, 1)
    state = old.state_dict()
    assert (state["capacity"], state["half_life_s"], state["channels"]) == (10, 30.0, 1)


def test_a_state_whose_lengths_do_not_match_its_readings_is_refused() -> None:
    window = RecencyWindow(10, rng=np.random.default_rng(0))
    window.insert_batch(events([2, 3]))
    state = dict(window.state_dict(), lengths=np.array([2, 4]))
    with pytest.raises(ValueError) as refused:
        RecencyWindow(10).load_state_dict(state)
    assert str(refused.value) == "window state is inconsistent: lengths do not sum to the stored values"


def test_a_restored_window_adopts_contiguous_float32_readings_and_converts_others() -> None:
    window = RecencyWindow(10, rng=np.random.default_rng(0))
    window.insert_batch(events([2, 3]))
    state = window.state_dict()
    adopted = RecencyWindow(10, rng=np.random.default_rng(1))
    adopted.load_state_dict(state)
    assert np.shares_memory(adopted.snapshot().flat_values[0], state["values"])  # no copy
    converted = RecencyWindow(10, rng=np.random.default_rng(1))
    converted.load_state_dict(dict(state, values=state["values"].astype(np.float64)))
    assert converted.snapshot().all_values().dtype == np.float32
    assert [chunk.dtype for chunk in converted.snapshot().flat_values] == [np.float32]
    assert converted.snapshot().all_values().tolist() == state["values"].tolist()


def test_after_a_restore_only_a_full_window_drops_events_below_its_lowest_key() -> None:
    """A restored full window knows its threshold (keys below its lowest can never enter); a window with
    room, or one with MAX_AGE_S (whose winners expire), must take every event."""

    def restored(capacity: int, kept: int, max_age_s: float | None = None) -> RecencyWindow:
        old = RecencyWindow(capacity, rng=ScriptedDraws([0.01, 0.02, 0.03][:kept]), clock=lambda: 10.0)  # type: ignore[arg-type]
        old.insert_batch(events([1] * kept, ts=[5.0] * kept))
        window = RecencyWindow(
            capacity,
            max_age_s=max_age_s,
            slack=5,
            rng=ScriptedDraws([5.0]),
            clock=lambda: 10.0,  # type: ignore[arg-type]
        )
        window.load_state_dict(old.state_dict())
        return window

    full, room, aging = restored(2, 2), restored(3, 2), restored(2, 2, max_age_s=100.0)
    low = events([1], ts=[6.0], first_offset=9)  # key −ln 5 = −1.6, below every restored key
    assert full.insert_batch(low).dropped == 1
    assert room.insert_batch(low).stored == 1 and len(room) == 3
    assert aging.insert_batch(low).stored == 1


def test_windows_with_and_without_a_generator_state_restore_each_other() -> None:
    """A window drawing from a source without a bit generator saves no RNG state; restoring it, or into it, works."""
    scripted = RecencyWindow(5, rng=ScriptedDraws([1.0, 2.0]))  # type: ignore[arg-type]
    scripted.insert_batch(events([1, 1]))
    assert scripted.state_dict()["rng_state"] is None
    seeded = RecencyWindow(5, rng=np.random.default_rng(3))
    before = np.random.default_rng(3).bit_generator.state
    seeded.load_state_dict(scripted.state_dict())
    assert len(seeded) == 2 and seeded.state_dict()["rng_state"] == before  # its own stream, untouched
    into_scripted = RecencyWindow(5, rng=ScriptedDraws([]))  # type: ignore[arg-type]
    into_scripted.load_state_dict(seeded.state_dict())
    assert len(into_scripted) == 2


def test_restoring_under_the_same_half_life_keeps_every_key_bit_for_bit(caplog: pytest.LogCaptureFixture) -> None:
    window = RecencyWindow(50, 7.0, rng=np.random.default_rng(0))
    window.insert_batch(events([1] * 80, ts=list(1.7e9 + np.arange(80) * 0.3)))
    restored = RecencyWindow(50, 7.0, rng=np.random.default_rng(1))
    with caplog.at_level("WARNING", logger="streamtrain.window"):
        restored.load_state_dict(window.state_dict())
    assert caplog.text == ""
    assert restored.snapshot().keys.tobytes() == window.snapshot().keys.tobytes()


def test_the_rekey_warning_says_what_happened(caplog: pytest.LogCaptureFixture) -> None:
    old = RecencyWindow(5, 60.0, rng=np.random.default_rng(0))
    old.insert_batch(events([1, 1, 1]))
    with caplog.at_level("WARNING", logger="streamtrain.window"):
        RecencyWindow(5, math.inf).load_state_dict(old.state_dict())
    assert [record.getMessage() for record in caplog.records] == [
        "the checkpoint's window was keyed with HALF_LIFE_S=60; re-keyed its 3 items for HALF_LIFE_S=inf "
        "(each keeps its own random draw; the items kept are the ones the old half-life chose, new "
        "events compete under the new one)"
    ]


def test_rekey_measures_ages_from_the_saved_reference_or_else_the_first_item() -> None:
    keys, ts = np.array([1.0, 2.0, 3.0]), np.array([10.0, 30.0, 70.0])
    old, new = math.log(2) / 10.0, math.log(2) / 40.0
    for reference, age in ((None, ts - 10.0), (0.0, ts), (5.0, ts - 5.0)):
        np.testing.assert_allclose(rekey(keys, ts, reference, 10.0, 40.0), keys - old * age + new * age, atol=1e-12)


def test_sorted_member() -> None:
    values = np.array([4, 1, 9, 7])
    assert sorted_member(values, np.array([1, 7, 8])).tolist() == [False, True, False, True]
    assert sorted_member(values, np.array([9])).tolist() == [False, False, True, False]
    empty = sorted_member(values, np.array([], dtype=np.int64))
    assert empty.dtype == np.bool_ and empty.tolist() == [False] * 4


# ---------------------------------------------------------------- cuts write the columns of the cut before last again


def cut(window: RecencyWindow, start: int, batch: int = 10) -> int:
    """Insert batches of events from ``start`` until the window cuts (its columns are replaced); the next start."""
    columns = weakref.ref(window._cols["keys"])
    while window._cols["keys"] is columns():
        window.insert_batch(make_batch(start, batch), {0: start + batch})
        start += batch
    return start


def test_a_cut_writes_the_columns_of_the_cut_before_last_when_nobody_holds_them() -> None:
    window = RecencyWindow(100, 30.0, rng=np.random.default_rng(3), slack=20)
    start = cut(window, cut(window, 0))  # the columns now are a cut's: of the size every cut takes
    columns = {name: weakref.ref(column) for name, column in window._cols.items()}
    addresses = {name: column.__array_interface__["data"][0] for name, column in window._cols.items()}
    assert window.stats().size == 100  # a read caches the state it read: the cut does not wait for that to go
    start = cut(window, start)
    assert not any(window._cols[name] is ref() for name, ref in columns.items())
    cut(window, start)
    assert all(window._cols[name] is ref() for name, ref in columns.items())
    assert {name: column.__array_interface__["data"][0] for name, column in window._cols.items()} == addresses


ITEM_FIELDS = ("offsets", "keys", "ts", "seq", "lengths", "labels", "partitions", "values")


def items_now(window: RecencyWindow) -> dict[str, np.ndarray]:
    """The window's items as copies of their own (what a reader must keep seeing)."""
    state = window.state_dict()
    return {name: np.array(state[name], copy=True) for name in ITEM_FIELDS}


def hold_snapshot(window: RecencyWindow) -> Callable[[], dict[str, Any]]:
    snap = window.snapshot()
    return lambda: {name: getattr(snap, name) for name in ITEM_FIELDS[:-1]} | {"values": snap.all_values()}


def hold_pass_source(window: RecencyWindow) -> Callable[[], dict[str, Any]]:
    source = window.pass_source()  # a pass holds it while it trains; its items are gathered later
    return hold_snapshot(SimpleNamespace(snapshot=lambda: source.whole))  # type: ignore[arg-type]


def hold_column_view(window: RecencyWindow) -> Callable[[], dict[str, Any]]:
    keys = window.snapshot().keys  # only the view: the snapshot is gone
    return lambda: {"keys": keys}


def hold_capture(window: RecencyWindow) -> Callable[[], dict[str, Any]]:
    capture = window.capture_state()  # a checkpoint holds its published state for seconds, then builds
    return lambda: {name: value for name, value in capture().items() if name in ITEM_FIELDS}


@pytest.mark.parametrize("hold", [hold_snapshot, hold_pass_source, hold_column_view, hold_capture])
def test_what_a_reader_holds_is_never_written_by_later_cuts(
    hold: Callable[[RecencyWindow], Callable[[], dict[str, Any]]],
) -> None:
    window = RecencyWindow(100, 30.0, rng=np.random.default_rng(4), slack=20)
    start = cut(window, cut(window, cut(window, 0)))
    assert np.shares_memory(window.snapshot().keys, window._cols["keys"])  # the state needs no cut: views
    expected = items_now(window)
    read = hold(window)
    for _ in range(6):  # the held columns are the spare of the second of these cuts
        start = cut(window, start)
    assert all(np.array_equal(array, expected[name]) for name, array in read().items())


def same_state(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return a.keys() == b.keys() and all(
        np.array_equal(np.asarray(a[k]), np.asarray(b[k])) if isinstance(a[k], np.ndarray) else a[k] == b[k] for k in a
    )


@settings(max_examples=60, deadline=None)
@given(
    capacity=st.integers(5, 120),
    slack=st.integers(1, 40),
    max_age=st.sampled_from([None, 150.0]),
    steps=st.lists(
        st.tuples(st.integers(1, 50), st.sampled_from(["", "snapshot", "pass_source", "capture", "drop"])), max_size=60
    ),
)
def test_a_window_that_reuses_cut_columns_holds_what_one_taking_new_columns_holds(
    capacity: int, slack: int, max_age: float | None, steps: list[tuple[int, str]]
) -> None:
    now = [0.0]
    shared: dict[str, Any] = {"slack": slack, "max_age_s": max_age, "clock": lambda: now[0]}
    reusing, fresh = (RecencyWindow(capacity, 40.0, rng=np.random.default_rng(1), **shared) for _ in range(2))
    fresh.reuse_cut_columns = False
    held: list[tuple[Callable[[], dict[str, Any]], dict[str, np.ndarray]]] = []
    start = 0
    for n, action in steps:
        batch = make_batch(start, n)
        start += n
        now[0] = float(start)
        for window in (reusing, fresh):
            window.insert_batch(batch, {0: start})
        assert same_state(reusing.state_dict(), fresh.state_dict())
        if action in ("snapshot", "pass_source", "capture"):
            holds = {"snapshot": hold_snapshot, "pass_source": hold_pass_source, "capture": hold_capture}
            held.append((holds[action](reusing), items_now(reusing)))
        elif action == "drop" and held:
            held.pop(0)
    for read, expected in held:
        assert all(np.array_equal(array, expected[name]) for name, array in read().items())


def test_captures_held_by_another_thread_across_cuts_stay_whole() -> None:
    """This thread holds each capture while the writer's thread cuts, then builds it (as the
    checkpointer does): every item's readings are its own (``make_batch`` writes its offset
    into them) and the offsets are those of the captured state."""
    window = RecencyWindow(200, 30.0, rng=np.random.default_rng(6), slack=20)
    feed(window, 400, 40)
    with inserting_in_another_thread(window, start=400, pause_s=0.001):  # every insert cuts (40 events, slack 20)
        for _ in range(60):
            capture = window.capture_state()
            time.sleep(0.005)  # the writer cuts meanwhile
            state = capture()
            offsets, lengths = state["offsets"], state["lengths"]
            owners = np.repeat(offsets, lengths).astype(np.float32)
            assert np.array_equal(np.asarray(state["values"]).reshape(-1), owners)
            assert len(set(offsets.tolist())) == len(offsets) <= 200
            assert offsets.max() < int(state["next_offsets"]["0"])


# ---------------------------------------------------------------- what a pass chooses from

ITEM_COLUMNS = ("lengths", "ts", "labels", "keys", "partitions", "offsets", "seq")


def same_items(a: Any, b: Any) -> bool:
    """Two snapshots hold the same items, readings and columns, in the same order."""
    columns = all(np.array_equal(getattr(a, name), getattr(b, name)) for name in ITEM_COLUMNS)
    values = len(a.values) == len(b.values) and all(np.array_equal(x, y) for x, y in zip(a.values, b.values))
    header = (a.version, a.next_offsets) == (b.version, b.next_offsets)
    return columns and values and header and a.sensor_ids.tolist() == b.sensor_ids.tolist()


@pytest.mark.parametrize("over", [0, 300], ids=["rows_stored_are_the_window", "between_cuts"])
def test_a_pass_source_gives_what_the_snapshot_gives_for_the_items_a_pass_takes(over: int) -> None:
    window = RecencyWindow(1000, 50.0, rng=np.random.default_rng(0), slack=400)
    feed(window, 1000 + over, 100)
    source, snapshot = window.pass_source(), window.snapshot()
    assert len(source) == len(snapshot) == 1000
    for name in ("lengths", "labels", "seq"):
        assert np.array_equal(getattr(source, name), getattr(snapshot, name))
    assert source.sensor_ids.tolist() == snapshot.sensor_ids.tolist()
    rng = np.random.default_rng(1)
    mask, negative = rng.random(1000) < 0.1, np.array([-1, -1000, 5])
    for index in (np.sort(rng.choice(1000, 64, replace=False)), np.arange(0), rng.choice(1000, 10), mask, negative):
        assert same_items(source.subset(index), snapshot.subset(index))
    for bad in (np.array([1000]), np.array([-1001]), np.ones(999, dtype=bool)):
        with pytest.raises(IndexError):
            snapshot.subset(bad)
        with pytest.raises(IndexError):  # the stored rows past the window's items are never read
            source.subset(bad)
    assert same_items(source.whole, snapshot) and np.array_equal(source.ts, snapshot.ts)
    assert source.whole.taken_at == source.subset(np.arange(3)).taken_at == source.taken_at
    flat, lengths = source.gather_values(np.array([3, 1]))
    assert np.array_equal(flat, np.concatenate([snapshot.values[3], snapshot.values[1]]))
    assert lengths.tolist() == [len(snapshot.values[3]), len(snapshot.values[1])]


def test_a_pass_source_gathers_the_other_columns_only_for_the_items_taken(monkeypatch: pytest.MonkeyPatch) -> None:
    window = RecencyWindow(2000, 50.0, rng=np.random.default_rng(0), slack=500)
    feed(window, 2300, 100)
    gathered: dict[str, int] = {}
    column = RecencyWindow._column

    def counting(state: Any, rows: np.ndarray | None, name: str) -> np.ndarray:
        out = column(state, rows, name)
        gathered[name] = max(gathered.get(name, 0), out.shape[0])
        return out

    monkeypatch.setattr(RecencyWindow, "_column", staticmethod(counting))
    source = window.pass_source()
    assert set(gathered) == {"lengths", "labels", "sensors", "seq"} and max(gathered.values()) == 2000
    gathered.clear()
    source.subset(np.arange(0, 2000, 50))
    assert max(gathered.values()) == 40 and {"ts", "keys", "partitions", "offsets", "starts"} <= set(gathered)
