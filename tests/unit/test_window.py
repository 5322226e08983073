"""The recency reservoir: exactness, inclusion probabilities, state round trips."""

from __future__ import annotations

import math
import threading

import numpy as np
import pytest
from scipy import optimize, stats

from streamtrain.events import EventBatch, SensorEvent
from streamtrain.window import RecencyWindow, token_positions


def make_batch(start: int, n: int, *, ts: np.ndarray | None = None, rng=None, channels: int = 1) -> EventBatch:
    rng = rng or np.random.default_rng(start)
    lengths = rng.integers(1, 6, n)
    events = [
        SensorEvent(f"s{(start + i) % 7}", float(start + i if ts is None else ts[i]),
                    np.full((lengths[i], channels), start + i, np.float32), (start + i) % 3)
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
    keys = np.concatenate([
        decay * (np.arange(s, min(s + batch, total), dtype=float) - 0.0) - np.log(rng.standard_exponential(min(batch, total - s)))
        for s in range(0, total, batch)
    ])
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


def test_weighted_inclusion_by_age_matches_theory() -> None:
    """π(a) = 1 − exp(−e^(c − λa)), with c fixed by Σπ = W (event time = arrival index)."""
    capacity, total, trials, half_life = 50, 400, 400, 40.0
    lam = math.log(2) / half_life
    counts = np.zeros(total)
    for trial in range(trials):
        window = RecencyWindow(capacity, half_life, rng=np.random.default_rng(1000 + trial), slack=17)
        for start in range(0, total, 64):
            window.insert_batch(make_batch(start, min(64, total - start)))
        counts[window.snapshot().offsets] += 1
    age = (total - 1) - np.arange(total)
    c = optimize.brentq(lambda c: (1 - np.exp(-np.exp(c - lam * age))).sum() - capacity, -50, 50)
    theory = 1 - np.exp(-np.exp(c - lam * age))
    observed = counts / trials
    # binomial standard error per item; allow 5 sigma (plus a little for the approximation)
    se = np.sqrt(theory * (1 - theory) / trials) + 1e-3
    assert np.all(np.abs(observed - theory) <= 5 * se + 0.03)
    # recent items are kept more often than old ones
    assert observed[-50:].mean() > 3 * observed[:100].mean()


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
    assert [x.tolist() for x in np.array(a.values, dtype=object)[order_a]] == [x.tolist() for x in np.array(b.values, dtype=object)[order_b]]
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


def test_snapshot_is_consistent_under_concurrent_inserts() -> None:
    window = RecencyWindow(500, 30.0, rng=np.random.default_rng(0), slack=50)
    stop = threading.Event()

    def writer() -> None:
        start = 0
        while not stop.is_set():
            window.insert_batch(make_batch(start, 40), {0: start + 40})
            start += 40

    thread = threading.Thread(target=writer)
    thread.start()
    try:
        for _ in range(200):
            snap = window.snapshot()
            assert len(snap) <= 500
            assert len(set(snap.offsets.tolist())) == len(snap)  # no duplicates
            assert all(v.shape[0] == n for v, n in zip(snap.values, snap.lengths))
            assert all(np.all(v == o) for v, o in zip(snap.values, snap.offsets))
            if len(snap):
                assert snap.offsets.max() < snap.next_offsets[0]  # state covers its offsets
    finally:
        stop.set()
        thread.join()


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
