"""WindowBatchDataset: exactly once per pass (also under concurrent inserts), seeds, ranks, workers, state."""

from __future__ import annotations

import gc
import logging
import multiprocessing
import threading
import weakref
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, get_worker_info

from streamtrain.data import dataset as dataset_module
from streamtrain.data.bucketing import PassDiagnostics, TokenBudget
from streamtrain.data.collate import Batch, BatchPosition
from streamtrain.data.dataset import WindowBatchDataset
from streamtrain.data.passes import PassSampler
from streamtrain.data.policies import SensorBalancedPolicy
from streamtrain.data.randomness import derive_seed
from streamtrain.window.reservoir import RecencyWindow
from streamtrain.window.snapshot import WindowSnapshot

BUDGET = TokenBudget(max_tokens=1024, pad_to_multiple_of=4)


def run_passes(
    dataset: WindowBatchDataset, passes: int, between_passes: Callable[[PassDiagnostics], None] | None = None
) -> list[list[Batch]]:
    """Iterate ``passes`` passes and return the batches of each, cut where on_pass_end fires."""
    per_pass: list[list[Batch]] = []
    current: list[Batch] = []

    def close_pass(diagnostics: PassDiagnostics) -> None:
        nonlocal current
        per_pass.append(current)
        current = []
        if between_passes is not None:
            between_passes(diagnostics)

    dataset.on_pass_end = close_pass
    dataset.max_passes = passes
    for batch in dataset:
        current.append(batch)
    return per_pass


def item_ids(batches: list[Batch]) -> np.ndarray:
    """The items of some batches, identified by their unique event times (one per batch row)."""
    return np.concatenate([b.ts.numpy() for b in batches]) if batches else np.zeros(0)


def test_each_pass_yields_every_item_exactly_once(make_snapshot: Callable, lognormal: Callable) -> None:
    snapshot = make_snapshot(lognormal(3000), channels=2)
    dataset = WindowBatchDataset(lambda: snapshot, BUDGET, seed=3)
    for batches in run_passes(dataset, 3):
        ids = item_ids(batches)
        assert ids.size == len(snapshot) and np.array_equal(np.sort(ids), np.sort(snapshot.ts))
        for batch in batches:
            assert batch.padded_tokens <= BUDGET.max_tokens or batch.batch_size == 1
            assert batch.values.shape[1] % 4 == 0
    assert dataset.last_diagnostics is not None and dataset.last_diagnostics.pass_index == 2


def test_batches_carry_the_snapshot_readings_labels_and_times(make_snapshot: Callable) -> None:
    snapshot = make_snapshot(np.array([3, 1, 5, 2]), channels=3)
    (batches,) = run_passes(WindowBatchDataset(lambda: snapshot, TokenBudget(64)), 1)
    by_ts = {float(t): i for i, t in enumerate(snapshot.ts)}
    for batch in batches:
        for row in range(batch.batch_size):
            item = by_ts[float(batch.ts[row])]
            length = int(batch.lengths[row])
            assert length == snapshot.lengths[item] and int(batch.labels[row]) == snapshot.labels[item]
            assert np.array_equal(batch.values[row, :length].numpy(), snapshot.values[item])
            assert int(batch.mask[row].sum()) == length


def test_exactly_once_under_concurrent_inserts(make_event_batch: Callable, lognormal: Callable) -> None:
    window = RecencyWindow(capacity=2000, half_life_s=600.0, rng=np.random.default_rng(0))
    window.insert_batch(make_event_batch(lognormal(2000, seed=1), first_id=0))
    taken: list[WindowSnapshot] = []

    def snapshot_fn() -> WindowSnapshot:
        taken.append(window.snapshot())
        return taken[-1]

    stop = threading.Event()

    def writer() -> None:
        first_id = 10_000
        while not stop.is_set():
            window.insert_batch(make_event_batch(lognormal(50, seed=first_id), first_id=first_id))
            first_id += 50

    thread = threading.Thread(target=writer)
    thread.start()
    try:
        per_pass = run_passes(WindowBatchDataset(snapshot_fn, BUDGET, seed=1), 6)
    finally:
        stop.set()
        thread.join()
    assert len(taken) == 6
    for batches, snapshot in zip(per_pass, taken, strict=True):
        ids = item_ids(batches)
        assert np.unique(ids).size == ids.size, "an item was yielded twice in one pass"
        assert np.array_equal(np.sort(ids), np.sort(snapshot.ts)), "a pass must cover exactly its snapshot"
    assert taken[0].version < taken[-1].version, "the writer never got in; the test proved nothing"


def test_new_events_appear_in_the_next_pass(make_event_batch: Callable) -> None:
    window = RecencyWindow(capacity=100)
    window.insert_batch(make_event_batch(np.full(10, 4), first_id=0))

    def insert_after_first_pass(diagnostics: PassDiagnostics) -> None:
        if diagnostics.pass_index == 0:
            window.insert_batch(make_event_batch(np.full(5, 4), first_id=500))

    first, second = run_passes(WindowBatchDataset(window.snapshot, TokenBudget(64)), 2, insert_after_first_pass)
    assert item_ids(first).size == 10
    assert np.array_equal(np.sort(item_ids(second)), np.sort(window.snapshot().ts)) and item_ids(second).size == 15


def test_seeded_passes_repeat_and_crypto_passes_do_not(make_snapshot: Callable, lognormal: Callable) -> None:
    snapshot = make_snapshot(lognormal(800))

    def orders(shuffle: str, seed: int) -> list[np.ndarray]:
        dataset = WindowBatchDataset(lambda: snapshot, BUDGET, shuffle=shuffle, seed=seed)
        return [item_ids(batches) for batches in run_passes(dataset, 2)]

    first, again, other = orders("seeded", 5), orders("seeded", 5), orders("seeded", 6)
    assert all(np.array_equal(a, b) for a, b in zip(first, again, strict=True))
    assert not np.array_equal(first[0], other[0])
    assert not np.array_equal(first[0], first[1]), "passes must be shuffled afresh"
    crypto_a, crypto_b = orders("crypto", 5), orders("crypto", 5)
    assert not np.array_equal(crypto_a[0], crypto_b[0])


def test_ranks_get_disjoint_covering_shards_with_equal_counts(make_snapshot: Callable, lognormal: Callable) -> None:
    snapshot = make_snapshot(lognormal(1500))
    world_size = 3
    shards = [
        run_passes(WindowBatchDataset(lambda: snapshot, BUDGET, rank=r, world_size=world_size), 2)
        for r in range(world_size)
    ]
    for pass_index in range(2):
        counts = {len(shards[r][pass_index]) for r in range(world_size)}
        assert len(counts) == 1, f"ranks got different batch counts {counts}"
        ids = np.concatenate([item_ids(shards[r][pass_index]) for r in range(world_size)])
        assert ids.size == len(snapshot) and np.array_equal(np.sort(ids), np.sort(snapshot.ts))


def test_too_small_windows_wait_without_using_a_pass(make_snapshot: Callable) -> None:
    snapshots = iter([make_snapshot(np.array([4])), make_snapshot(np.array([4, 4])), make_snapshot(np.full(6, 4))])
    dataset = WindowBatchDataset(lambda: next(snapshots), TokenBudget(64), rank=0, world_size=3, idle_wait_s=0.0)
    (batches,) = run_passes(dataset, 1)
    assert dataset.last_diagnostics is not None
    assert dataset.last_diagnostics.items == 6 and dataset.last_diagnostics.pass_index == 0
    assert len(batches) == dataset.last_diagnostics.batches // 3


def test_state_dict_resumes_at_the_next_pass(make_snapshot: Callable, lognormal: Callable) -> None:
    snapshot = make_snapshot(lognormal(600))
    original = WindowBatchDataset(lambda: snapshot, BUDGET, seed=9)
    run_passes(original, 2)
    state = original.state_dict()
    assert (state["next_pass"], state["seed"], state["skip_batches"]) == (2, 9, 0)
    resumed = WindowBatchDataset(lambda: snapshot, BUDGET, seed=9)
    assert resumed.load_state_dict(state) == 9
    continued = run_passes(original, 1)[0]
    assert np.array_equal(item_ids(run_passes(resumed, 1)[0]), item_ids(continued))
    with pytest.raises(ValueError, match="next_pass"):
        resumed.load_state_dict({"seed": 1})


def test_a_changed_seed_wins_over_the_saved_one_and_says_so(
    make_snapshot: Callable, lognormal: Callable, caplog: pytest.LogCaptureFixture
) -> None:
    snapshot = make_snapshot(lognormal(600))
    original = WindowBatchDataset(lambda: snapshot, BUDGET, seed=9)
    run_passes(original, 2)
    state = original.state_dict()
    reseeded = WindowBatchDataset(lambda: snapshot, BUDGET, seed=10)
    with caplog.at_level(logging.WARNING, logger="streamtrain.data.dataset"):
        assert reseeded.load_state_dict(state) == 9
    assert "SEED=9" in caplog.text and "SEED=10" in caplog.text
    assert reseeded.seed == 10 and reseeded.next_pass == 2
    fresh_with_new_seed = WindowBatchDataset(lambda: snapshot, BUDGET, seed=10)
    fresh_with_new_seed.next_pass = 2
    after_restore = item_ids(run_passes(reseeded, 1)[0])
    assert np.array_equal(after_restore, item_ids(run_passes(fresh_with_new_seed, 1)[0]))
    assert not np.array_equal(after_restore, item_ids(run_passes(original, 1)[0]))


def test_diagnostics_reach_the_callback_once_per_pass(make_snapshot: Callable, lognormal: Callable) -> None:
    snapshot = make_snapshot(lognormal(2000), version=7)
    seen: list[PassDiagnostics] = []
    dataset = WindowBatchDataset(lambda: snapshot, BUDGET, max_passes=2, on_pass_end=seen.append)
    batches = list(dataset)
    assert [d.pass_index for d in seen] == [0, 1] and all(d.snapshot_version == 7 for d in seen)
    assert sum(d.batches for d in seen) == len(batches)
    assert sum(d.padded_tokens for d in seen) == sum(b.padded_tokens for b in batches)


def test_worker_processes_are_refused_unless_allowed(make_snapshot: Callable, monkeypatch: pytest.MonkeyPatch) -> None:
    # Pretend to be DataLoader worker 0 of 2 (a real worker run is the next test).
    monkeypatch.setattr(dataset_module, "get_worker_info", lambda: SimpleNamespace(id=0, num_workers=2))
    snapshot = make_snapshot(np.full(20, 4))
    for kwargs, message in (({}, "fork time"), ({"shuffle": "crypto", "allow_worker_processes": True}, "crypto")):
        dataset = WindowBatchDataset(lambda: snapshot, TokenBudget(16), max_passes=1, **kwargs)
        with pytest.raises(RuntimeError, match=message):
            next(iter(dataset))


def test_allowed_workers_split_one_plan_and_seed_torch_per_worker(
    make_snapshot: Callable, lognormal: Callable, tmp_path: Path
) -> None:
    snapshot = make_snapshot(lognormal(500))

    def record_worker_seed(diagnostics: PassDiagnostics) -> None:  # runs inside each worker
        worker = get_worker_info().id
        (tmp_path / f"worker{worker}").write_text(str(torch.initial_seed()))

    dataset = WindowBatchDataset(
        lambda: snapshot, BUDGET, seed=2, max_passes=1, allow_worker_processes=True, on_pass_end=record_worker_seed
    )
    loaded = list(DataLoader(dataset, batch_size=None, num_workers=2))
    ids = item_ids(loaded)
    assert ids.size == len(snapshot) and np.array_equal(np.sort(ids), np.sort(snapshot.ts))
    in_process = WindowBatchDataset(lambda: snapshot, BUDGET, seed=2, max_passes=1)
    assert sorted(b.ts[0].item() for b in loaded) == sorted(b.ts[0].item() for b in in_process)
    seeds = [int((tmp_path / f"worker{w}").read_text()) for w in range(2)]
    assert seeds == [derive_seed(2, 0, 0, w) for w in range(2)] and seeds[0] != seeds[1]


def test_crypto_across_ranks_needs_a_process_group(make_snapshot: Callable) -> None:
    snapshot = make_snapshot(np.full(8, 4))
    dataset = WindowBatchDataset(
        lambda: snapshot, TokenBudget(16), shuffle="crypto", rank=0, world_size=2, max_passes=1
    )
    with pytest.raises(RuntimeError, match="torch.distributed"):
        list(dataset)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"shuffle": "random"}, "shuffle"),
        ({"rank": 0}, "both rank and world_size"),
        ({"rank": 2, "world_size": 2}, "rank must be"),
        ({"min_items": 0}, "min_items"),
    ],
)
def test_bad_arguments_are_named(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        WindowBatchDataset(lambda: None, BUDGET, **kwargs)  # type: ignore[arg-type, return-value]


def _crypto_rank(rank: int, world_size: int, store: str, snapshot: WindowSnapshot, out: Path) -> None:
    torch.distributed.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world_size)
    try:
        dataset = WindowBatchDataset(lambda: snapshot, BUDGET, shuffle="crypto")
        per_pass = run_passes(dataset, 2)
        np.savez(
            out / f"rank{rank}.npz", *[item_ids(batches) for batches in per_pass], counts=[len(b) for b in per_pass]
        )
    finally:
        torch.distributed.destroy_process_group()


def test_crypto_plan_is_shared_by_rank_zero(make_snapshot: Callable, lognormal: Callable, tmp_path: Path) -> None:
    snapshot = make_snapshot(lognormal(700))
    world_size = 2
    context = multiprocessing.get_context("fork")
    ranks = [
        context.Process(target=_crypto_rank, args=(r, world_size, str(tmp_path / "store"), snapshot, tmp_path))
        for r in range(world_size)
    ]
    for process in ranks:
        process.start()
    for process in ranks:
        process.join(60)
        assert process.exitcode == 0
    shards = [np.load(tmp_path / f"rank{r}.npz") for r in range(world_size)]
    assert np.array_equal(shards[0]["counts"], shards[1]["counts"]), "ranks must step in lockstep"
    passes = []
    for key in ("arr_0", "arr_1"):
        ids = [shard[key] for shard in shards]
        together = np.concatenate(ids)
        assert together.size == len(snapshot) and np.array_equal(np.sort(together), np.sort(snapshot.ts))
        passes.append(together)
    assert not np.array_equal(passes[0], passes[1])


# ---------------------------------------------------------------------- resuming after the last trained batch
def tracked(window: RecencyWindow, **kwargs) -> WindowBatchDataset:  # type: ignore[no-untyped-def]
    sampler = PassSampler(50, 0.5, "seeded", 1)
    return WindowBatchDataset(window.snapshot, TokenBudget(256), seed=1, sampler=sampler, track_trained=True, **kwargs)


def take(batches, count: int, dataset: WindowBatchDataset | None = None) -> list[Batch]:  # type: ignore[no-untyped-def]
    """``count`` batches; each is marked trained when ``dataset`` is given."""
    out = []
    for _ in range(count):
        batch = next(batches)
        if dataset is not None:
            dataset.mark_trained(batch)
        out.append(batch)
    return out


def test_a_moved_window_redraws_the_interrupted_pass_and_keeps_its_fresh_events_fresh(
    make_event_batch: Callable, lognormal: Callable
) -> None:
    window = RecencyWindow(capacity=2000, rng=np.random.default_rng(0))
    window.insert_batch(make_event_batch(lognormal(200), first_id=0))
    dataset = tracked(window)
    batches = iter(dataset)
    first = take(batches, 1, dataset)
    take(batches, first[0].position.batches - 1, dataset)  # the rest of pass 0, trained
    window.insert_batch(make_event_batch(lognormal(20, seed=1), first_id=1000))  # 20 fresh events
    take(batches, 1, dataset)  # pass 1 is drawn (the 20 fresh in it) and its first batch trained
    take(batches, 2)  # planned ahead, never trained
    state = dataset.state_dict()
    assert state["next_pass"] == 1 and state["skip_batches"] == 1
    assert state["sampler"]["watermark"] == 200, "the events of the interrupted pass must still count as fresh"

    window.insert_batch(make_event_batch(lognormal(5, seed=2), first_id=2000))  # the window moves on
    restored = RecencyWindow(capacity=2000)
    restored.load_state_dict(window.state_dict())
    resumed = tracked(restored)
    resumed.load_state_dict(state)
    redrawn: list[Batch] = []
    resumed.on_pass_end = lambda _: redrawn.append(None)  # type: ignore[arg-type, func-returns-value]
    pass_batches = []
    for batch in resumed:
        if redrawn:
            break
        pass_batches.append(batch)
    assert pass_batches[0].position.pass_index == 1 and pass_batches[0].position.index == 0, "redrawn from its start"
    ids = set(item_ids(pass_batches).tolist())
    new_ts = 1.7e9 + np.concatenate([1000 + np.arange(20), 2000 + np.arange(5)])
    assert set(new_ts.tolist()) <= ids, "every fresh event not yet trained is in the redrawn pass"


def test_a_new_iteration_continues_right_after_the_last_trained_batch(
    make_event_batch: Callable, lognormal: Callable
) -> None:
    window = RecencyWindow(capacity=2000, rng=np.random.default_rng(0))
    window.insert_batch(make_event_batch(lognormal(300), first_id=0))
    uninterrupted = take(iter(tracked(window)), 12)
    dataset = tracked(window)
    first_try = iter(dataset)
    before = take(first_try, 7, dataset)
    take(first_try, 3)  # handed out, then the consumer failed before training them
    after = take(iter(dataset), 5, dataset)  # the trainer restarts its loop: a new iteration
    assert np.array_equal(item_ids(before + after), item_ids(uninterrupted))
    with pytest.raises(StopIteration):
        next(first_try)  # the old generator retired


def test_untracked_states_resume_at_the_next_pass(make_event_batch: Callable, lognormal: Callable) -> None:
    window = RecencyWindow(capacity=2000, rng=np.random.default_rng(0))
    window.insert_batch(make_event_batch(lognormal(300), first_id=0))
    dataset = WindowBatchDataset(window.snapshot, TokenBudget(256), sampler=PassSampler(50, 0.5, "seeded", 0))
    batches = iter(dataset)
    take(batches, 1)
    state = dataset.state_dict()
    assert state["next_pass"] == 1 and state["skip_batches"] == 0 and state["sampler"]["passes"] == 1


def test_track_trained_refuses_worker_processes(make_snapshot: Callable, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dataset_module, "get_worker_info", lambda: SimpleNamespace(id=0, num_workers=2))
    snapshot = make_snapshot(np.full(20, 4))
    dataset = WindowBatchDataset(
        lambda: snapshot, TokenBudget(16), max_passes=1, allow_worker_processes=True, track_trained=True
    )
    with pytest.raises(RuntimeError, match="track_trained"):
        next(iter(dataset))


def test_a_sampler_must_share_the_dataset_randomness() -> None:
    with pytest.raises(ValueError, match="same"):
        WindowBatchDataset(lambda: None, BUDGET, seed=1, sampler=PassSampler(10, 0.5, "seeded", 2))  # type: ignore[arg-type, return-value]


@pytest.mark.parametrize("change", ["budget", "policy", "pass_size"])
def test_changed_settings_redraw_the_interrupted_pass_whole(
    make_event_batch: Callable, lognormal: Callable, change: str
) -> None:
    window = RecencyWindow(capacity=2000, rng=np.random.default_rng(0))
    window.insert_batch(make_event_batch(lognormal(300), first_id=0))
    dataset = tracked(window)
    trained = take(iter(dataset), 2, dataset)
    state = dataset.state_dict()
    assert state["skip_batches"] == 2
    same = tracked(window)
    same.load_state_dict(state)
    assert next(iter(same)).position == BatchPosition(0, 2, trained[0].position.batches)
    sampler = PassSampler(
        40 if change == "pass_size" else 50, 0.5, "seeded", 1,
        SensorBalancedPolicy(2.0) if change == "policy" else None,
    )  # fmt: skip
    budget = TokenBudget(512 if change == "budget" else 256)
    changed = WindowBatchDataset(window.snapshot, budget, seed=1, sampler=sampler, track_trained=True)
    changed.load_state_dict(state)
    first = next(iter(changed)).position
    assert first is not None and (first.pass_index, first.index) == (0, 0)


@pytest.mark.parametrize("max_items", [300, 0], ids=["bounded", "whole_window"])
def test_passes_over_a_pass_source_are_the_passes_over_snapshots(
    make_event_batch: Callable, lognormal: Callable, max_items: int
) -> None:
    """The trainer reads ``window.pass_source``: the same seed must give the same batches."""
    window = RecencyWindow(capacity=1000, half_life_s=600.0, rng=np.random.default_rng(0), slack=300)
    window.insert_batch(make_event_batch(lognormal(1200, seed=1), first_id=0))
    runs = []
    for source in (window.snapshot, window.pass_source):
        sampler = PassSampler(max_items, 0.5, "seeded", 3, SensorBalancedPolicy(2.0)) if max_items else None
        runs.append(run_passes(WindowBatchDataset(source, BUDGET, seed=3, sampler=sampler), 2))
    for fields in ("values", "lengths", "labels", "ts", "mask"):
        left = [getattr(b, fields) for p in runs[0] for b in p]
        right = [getattr(b, fields) for p in runs[1] for b in p]
        assert len(left) == len(right) > 0 and all(torch.equal(a, b) for a, b in zip(left, right)), fields


def test_a_bounded_pass_in_training_no_longer_holds_the_window_it_chose_from(
    make_event_batch: Callable, lognormal: Callable
) -> None:
    """A pass source refers to the window's columns; held for a whole pass, it would keep the
    window's cuts from writing them again (they would take new memory instead)."""
    window = RecencyWindow(capacity=1000, half_life_s=600.0, rng=np.random.default_rng(0), slack=300)
    window.insert_batch(make_event_batch(lognormal(1200, seed=1), first_id=0))
    sources: list[weakref.ref] = []

    def pass_source() -> Any:
        source = window.pass_source()
        sources.append(weakref.ref(source))
        return source

    sampler = PassSampler(300, 0.5, "seeded", 3)
    batches = iter(WindowBatchDataset(pass_source, BUDGET, seed=3, sampler=sampler))
    next(batches)  # the first pass is in training
    gc.collect()
    assert len(sources) == 1 and sources[0]() is None


# ---------------------------------------------------------------------- what the first mutation run asked
# (docs/testing.md, "dataset"): the crypto plan shared from rank 0 as each rank sees it, the
# resume point in every place a consumer can stop, the saved state's keys and bounds, the
# digest that decides a skip, the pass budget at its edges, and the messages a user reads.


class FakeBroadcast:
    """torch.distributed as two ranks of one process see it: rank 0's payload is what rank 1 receives."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.sent: list[list[Any]] = []
        self.sources: list[int] = []
        monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
        monkeypatch.setattr(torch.distributed, "get_world_size", lambda: 2)
        monkeypatch.setattr(torch.distributed, "broadcast_object_list", self.broadcast)

    def broadcast(self, payload: list[Any], src: int) -> None:
        self.sources.append(src)
        if payload[0] is None and payload[1] is None:  # a receiving rank: rank 0's last payload
            payload[:] = self.sent[-1]
        else:
            self.sent.append(list(payload))


def crypto_rank(snapshot: WindowSnapshot, rank: int, sampler: PassSampler | None = None) -> WindowBatchDataset:
    return WindowBatchDataset(
        lambda: snapshot, TokenBudget(256), shuffle="crypto", rank=rank, world_size=2, max_passes=1, sampler=sampler
    )


@pytest.mark.parametrize("policy", [None, "stratified"])
def test_a_crypto_plan_from_rank_zero_is_what_rank_one_trains(
    make_snapshot: Callable, monkeypatch: pytest.MonkeyPatch, policy: str | None
) -> None:
    from streamtrain.data.policies import StratifiedPolicy

    fake = FakeBroadcast(monkeypatch)
    snapshot = make_snapshot(np.full(400, 8), seed=4)  # 32 items a batch: room to stratify by label

    def sampler() -> PassSampler | None:
        return None if policy is None else PassSampler(120, 0.5, "crypto", 0, StratifiedPolicy())

    zero, one = crypto_rank(snapshot, 0, sampler()), crypto_rank(snapshot, 1, sampler())
    first, second = list(zero), list(one)
    assert fake.sources == [0, 0] and len(fake.sent) == 1
    selection, plan, size, version = fake.sent[0]
    assert (size, version) == (len(snapshot), snapshot.version)
    if policy is not None:  # each batch's label mix within 0.045 of the pass's (unstratified: 0.058-0.19 in 50 draws)
        assert plan.diagnostics.label_deviation < 0.045
    assert len(first) == len(second) == len(plan.for_rank(0))
    ids = [item_ids(first), item_ids(second)]
    assert not set(ids[0].tolist()) & set(ids[1].tolist())
    chosen = snapshot.ts if selection is None else snapshot.ts[selection.index]
    assert np.array_equal(np.sort(np.concatenate(ids)), np.sort(chosen))
    if policy is not None:  # rank 1 never selected, yet its counters moved as rank 0's did
        assert len(chosen) == 120 and zero.sampler.state_dict() == one.sampler.state_dict()  # type: ignore[union-attr]
        assert one.sampler.passes == 1  # type: ignore[union-attr]


def test_a_rank_that_read_another_snapshot_than_rank_zero_is_stopped(
    make_snapshot: Callable, monkeypatch: pytest.MonkeyPatch
) -> None:
    FakeBroadcast(monkeypatch)
    list(crypto_rank(make_snapshot(np.full(40, 8), version=3), 0))
    with pytest.raises(RuntimeError) as raised:
        list(crypto_rank(make_snapshot(np.full(41, 8), version=4), 1))
    assert str(raised.value) == (
        "WindowBatchDataset: rank 1 took a snapshot of 41 items (version 4) but rank 0 planned 40 items "
        "(version 3); every rank must read the same snapshot for a pass"
    )


def test_the_messages_of_the_refused_process_layouts_in_full(
    make_snapshot: Callable, monkeypatch: pytest.MonkeyPatch
) -> None:
    snapshot = make_snapshot(np.full(20, 4))
    with pytest.raises(RuntimeError) as raised:
        list(crypto_rank(snapshot, 0))
    assert str(raised.value) == (
        "WindowBatchDataset: shuffle='crypto' with world_size > 1 needs torch.distributed initialized, "
        "so that rank 0 can share its unpredictable plan; initialize the process group first"
    )
    monkeypatch.setattr(dataset_module, "get_worker_info", lambda: SimpleNamespace(id=0, num_workers=2))
    expected = {
        "crypto": "WindowBatchDataset: shuffle='crypto' cannot run in DataLoader worker processes, because each "
        "would draw a different plan and their batches would overlap; use num_workers=0 with "
        "streamtrain.data.Prefetcher",
        "fork": "WindowBatchDataset: a DataLoader worker process sees the window as it was at fork time, not the "
        "live one; use num_workers=0 with streamtrain.data.Prefetcher, or pass "
        "allow_worker_processes=True if snapshot_fn reads a store shared across processes",
        "tracked": "WindowBatchDataset: track_trained needs the batches in one process, in order; "
        "use num_workers=0 with streamtrain.data.Prefetcher",
    }
    layouts = {
        "crypto": {"shuffle": "crypto", "allow_worker_processes": True},
        "fork": {},
        "tracked": {"allow_worker_processes": True, "track_trained": True},
    }
    for name, kwargs in layouts.items():
        with pytest.raises(RuntimeError) as raised:
            next(iter(WindowBatchDataset(lambda: snapshot, TokenBudget(16), max_passes=1, **kwargs)))
        assert str(raised.value) == expected[name], name


def test_a_worker_takes_every_other_batch_of_the_one_plan_and_seeds_torch_for_itself(
    make_snapshot: Callable, lognormal: Callable, monkeypatch: pytest.MonkeyPatch
) -> None:
    snapshot = make_snapshot(lognormal(300))
    whole = list(WindowBatchDataset(lambda: snapshot, BUDGET, seed=2, max_passes=1))
    monkeypatch.setattr(dataset_module, "get_worker_info", lambda: SimpleNamespace(id=1, num_workers=2))
    worker = WindowBatchDataset(lambda: snapshot, BUDGET, seed=2, max_passes=1, allow_worker_processes=True)
    mine = iter(worker)
    first = next(mine)
    assert torch.initial_seed() == derive_seed(2, 0, 0, 1, purpose="worker")
    taken = [first, *mine]
    assert [b.position.index for b in taken] == list(range(1, len(whole), 2))  # type: ignore[union-attr]
    assert all(torch.equal(a.ts, b.ts) for a, b in zip(taken, whole[1::2], strict=True))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"min_items": 0}, "min_items must be an integer >= 1, got 0"),
        ({"min_batches_per_pass": 0}, "min_batches_per_pass must be an integer >= 1, got 0"),
        ({"max_passes": -1}, r"max_passes \(None: forever\) must be None or an integer >= 0, got -1"),
        ({"seed": -2}, "seed must be an integer >= 0, got -2"),
        ({"seed": 1.5}, "seed must be an integer >= 0, got 1.5"),
        ({"rank": 0}, "give both rank and world_size, or neither to take them from torch.distributed"),
    ],
)
def test_bad_arguments_are_refused_with_the_whole_reason(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=f"^{message}$"):
        WindowBatchDataset(lambda: None, BUDGET, **kwargs)  # type: ignore[arg-type, return-value]


def test_the_defaults_a_caller_relies_on(make_snapshot: Callable) -> None:
    snapshot = make_snapshot(np.array([5]))
    dataset = WindowBatchDataset(lambda: snapshot, BUDGET, max_passes=0)
    assert dataset.min_items == 1 and dataset.min_batches_per_pass == 1 and dataset.idle_wait_s == 0.05
    assert dataset.planned_steps == 0 and dataset.last_diagnostics is None and list(dataset) == []
    dataset.max_passes = 1
    assert len(list(dataset)) == 1 and dataset.planned_steps == 1  # one item is a pass
    assert dataset.pass_budget(snapshot.lengths) is BUDGET


def test_a_pass_is_planned_with_the_datasets_pool_labels_and_the_selections_stratification(
    make_snapshot: Callable, lognormal: Callable
) -> None:
    from streamtrain.data.bucketing import plan_batches
    from streamtrain.data.policies import StratifiedPolicy
    from streamtrain.data.randomness import make_randomness

    snapshot = make_snapshot(lognormal(600), seed=5)
    sampler = PassSampler(200, 0.5, "seeded", 4, StratifiedPolicy())
    dataset = WindowBatchDataset(lambda: snapshot, BUDGET, seed=4, pool_size=32, sampler=sampler, max_passes=1)
    batches = list(dataset)
    chosen = snapshot.subset(PassSampler(200, 0.5, "seeded", 4, StratifiedPolicy()).select(snapshot).index)
    plan = plan_batches(
        chosen.lengths,
        BUDGET,
        make_randomness("seeded", 4, 0, purpose="plan"),
        pool_size=32,
        labels=chosen.labels,
        stratify=True,
    )
    assert [b.ts.tolist() for b in batches] == [chosen.ts[index].tolist() for index in plan.batches]


def test_the_pass_budget_at_its_edges(make_snapshot: Callable) -> None:
    budget = TokenBudget(max_tokens=1024, pad_to_multiple_of=4)
    dataset = WindowBatchDataset(lambda: None, budget, min_batches_per_pass=2)  # type: ignore[arg-type, return-value]
    assert dataset.pass_budget(np.full(10, 10)).max_tokens == 50  # 100 tokens in at least two batches
    assert dataset.pass_budget(np.array([10, 10, 61])).max_tokens == 64  # never below the longest, padded
    assert dataset.pass_budget(np.array([30])).max_tokens == 32  # one item: its own padded length
    assert dataset.pass_budget(np.zeros(0, dtype=np.int64)) is budget  # nothing to plan
    assert dataset.pass_budget(np.full(100, 30)) is budget  # 1,500 tokens a batch: more than the budget
    three = WindowBatchDataset(lambda: None, budget, min_batches_per_pass=3)  # type: ignore[arg-type, return-value]
    assert three.pass_budget(np.full(10, 10)).max_tokens == 34  # ceil(100 / 3)
    one = WindowBatchDataset(lambda: None, budget)  # type: ignore[arg-type, return-value]
    assert one.pass_budget(np.full(10, 10)) is budget


def test_a_sampler_is_told_how_many_steps_were_planned_before_each_pass(make_snapshot: Callable) -> None:
    snapshot = make_snapshot(np.full(64, 8))
    sampler = PassSampler(20, 0.5, "seeded", 0)
    asked: list[int] = []
    select = sampler.select

    def spy(window: Any, *, planned_steps: int = -1) -> Any:
        asked.append(planned_steps)
        return select(window, planned_steps=planned_steps)

    sampler.select = spy  # type: ignore[method-assign]
    dataset = WindowBatchDataset(lambda: snapshot, TokenBudget(64), sampler=sampler, max_passes=3)
    per_pass = [d.batches for d in _diagnostics(dataset)]
    assert asked == [0, per_pass[0], per_pass[0] + per_pass[1]]
    assert dataset.planned_steps == sum(per_pass)


def _diagnostics(dataset: WindowBatchDataset) -> list[PassDiagnostics]:
    seen: list[PassDiagnostics] = []
    dataset.on_pass_end = seen.append
    list(dataset)
    return seen


def test_a_window_of_exactly_min_items_is_a_pass(make_snapshot: Callable) -> None:
    snapshot = make_snapshot(np.full(3, 4))
    batches = list(WindowBatchDataset(lambda: snapshot, TokenBudget(64), min_items=3, max_passes=1))
    assert item_ids(batches).size == 3


def test_snapshot_digest_reads_the_order_the_lengths_and_the_configuration(make_snapshot: Callable) -> None:
    from streamtrain.data.dataset import snapshot_digest

    snapshot = make_snapshot(np.array([3, 4, 5]))
    digest = snapshot_digest(snapshot, "a")
    assert len(digest) == 32 and digest == snapshot_digest(snapshot, "a") != snapshot_digest(snapshot, "b")
    moved = SimpleNamespace(seq=None, ts=snapshot.ts + 1.0, lengths=snapshot.lengths)
    assert snapshot_digest(moved, "a") != digest  # other items
    same_ts = SimpleNamespace(seq=None, ts=snapshot.ts, lengths=snapshot.lengths.astype(np.int32))
    assert snapshot_digest(same_ts, "a") == snapshot_digest(
        SimpleNamespace(ts=snapshot.ts, lengths=snapshot.lengths), "a"
    )
    assert snapshot.seq is None and snapshot_digest(same_ts, "a") == digest  # a snapshot without seq: by ts
    longer = SimpleNamespace(seq=None, ts=snapshot.ts, lengths=snapshot.lengths + 1)
    assert snapshot_digest(longer, "a") != snapshot_digest(same_ts, "a")
    with_seq = SimpleNamespace(seq=np.array([7, 8, 9]), ts=snapshot.ts, lengths=snapshot.lengths)
    reseq = SimpleNamespace(seq=np.array([7, 8, 10]), ts=snapshot.ts, lengths=snapshot.lengths)
    assert snapshot_digest(with_seq, "a") != snapshot_digest(reseq, "a")  # the window's sequence numbers, not ts
    assert snapshot_digest(with_seq, "a") == snapshot_digest(
        SimpleNamespace(seq=np.array([7, 8, 9]), ts=snapshot.ts + 5.0, lengths=snapshot.lengths), "a"
    )


def tracked_on(snapshot: WindowSnapshot, **kwargs: Any) -> WindowBatchDataset:
    """A tracking dataset without a sampler: every pass is the whole snapshot."""
    return WindowBatchDataset(lambda: snapshot, TokenBudget(64), seed=5, track_trained=True, **kwargs)


def batches_per_pass(snapshot: WindowSnapshot) -> int:
    return len(list(WindowBatchDataset(lambda: snapshot, TokenBudget(64), seed=5, max_passes=1)))


def test_the_resume_point_wherever_the_consumer_stopped(make_snapshot: Callable) -> None:
    """Nothing trained yet, mid-pass, at a pass's end with the next drawn ahead, and across many passes."""
    snapshot = make_snapshot(np.full(40, 8))  # about 5 batches of 8 items a pass
    dataset = tracked_on(snapshot)
    batches = iter(dataset)
    drawn = take(batches, 1)  # pass 0 drawn, nothing trained
    assert dataset.state_dict()["next_pass"] == 0 and dataset.state_dict()["skip_batches"] == 0
    per_pass = drawn[0].position.batches  # type: ignore[union-attr]
    assert per_pass == batches_per_pass(snapshot) > 2
    dataset.mark_trained(drawn[0].position)  # type: ignore[arg-type]  # a position does as well as a batch
    state = dataset.state_dict()
    assert (state["next_pass"], state["skip_batches"]) == (0, 1) and state["skip_digest"] is not None
    take(batches, per_pass - 1, dataset)  # pass 0 trained to its end; pass 1 not drawn yet
    state = dataset.state_dict()
    assert (state["next_pass"], state["skip_batches"], state["planned_steps"]) == (1, 0, per_pass)
    ahead = take(batches, 2)  # pass 1 drawn ahead of training
    assert ahead[0].position.pass_index == 1  # type: ignore[union-attr]
    state = dataset.state_dict()  # pass 0's end: resume at pass 1's start, not after it
    assert (state["next_pass"], state["skip_batches"], state["planned_steps"]) == (1, 0, per_pass)
    for _ in range(3):  # three more passes trained: the records of finished passes are dropped
        take(batches, per_pass, dataset)
    assert dataset.planned_steps == 5 * per_pass and len(dataset._records) <= 2


def test_a_consumer_a_pass_behind_keeps_its_pass_to_resume(make_snapshot: Callable) -> None:
    """The planner runs a pass ahead: the record of the pass being trained must survive that draw."""
    snapshot = make_snapshot(np.full(40, 8))
    dataset = tracked_on(snapshot)
    batches = iter(dataset)
    take(batches, 1, dataset)  # pass 0's first batch trained
    per_pass = batches_per_pass(snapshot)
    take(batches, per_pass)  # the rest of pass 0 and pass 1's first batch handed out: pass 1 drawn
    state = dataset.state_dict()
    assert (state["next_pass"], state["skip_batches"]) == (0, 1)
    resumed = tracked_on(snapshot)
    resumed.load_state_dict(state)
    again = next(iter(resumed))
    assert again.position == BatchPosition(0, 1, per_pass) and torch.equal(
        again.ts, take(iter(tracked_on(snapshot)), 2)[1].ts
    )


@pytest.mark.parametrize("shuffle", ["seeded", "crypto"])
def test_only_a_reproducible_pass_skips_what_was_trained(
    make_snapshot: Callable, caplog: pytest.LogCaptureFixture, shuffle: str
) -> None:
    """Seeded: the restored pass skips its trained batches. Crypto: it cannot be drawn the same way
    again, so it is drawn whole, and the log says why."""
    snapshot = make_snapshot(np.full(40, 8))
    dataset = tracked_on(snapshot, shuffle=shuffle)
    take(iter(dataset), 2, dataset)
    per_pass = batches_per_pass(snapshot)
    state = dataset.state_dict()
    assert state["skip_batches"] == 2 and (state["skip_digest"] is None) == (shuffle == "crypto")
    resumed = tracked_on(snapshot, shuffle=shuffle)
    resumed.load_state_dict(state)
    with caplog.at_level(logging.INFO, logger=dataset_module.log.name):
        first = next(iter(resumed))
    if shuffle == "seeded":
        assert first.position == BatchPosition(0, 2, per_pass) and not caplog.records
    else:
        assert first.position.pass_index == 0 and first.position.index == 0  # type: ignore[union-attr]
        assert [r.getMessage() for r in caplog.records] == [
            "pass 0 was 2 batches in when the state was saved; the window or the settings have changed since (or "
            "the plan is not reproducible), so the pass is drawn again from its start"
        ]


def test_a_saved_state_round_trips_its_counters_and_reads_old_states(
    make_snapshot: Callable, caplog: pytest.LogCaptureFixture
) -> None:
    snapshot = make_snapshot(np.full(40, 8))
    dataset = WindowBatchDataset(lambda: snapshot, TokenBudget(64), seed=5, max_passes=2)
    list(dataset)
    state = dataset.state_dict()
    per_pass = batches_per_pass(snapshot)
    assert state == {
        "next_pass": 2,
        "planned_steps": 2 * per_pass,
        "seed": 5,
        "sampler": None,
        "skip_batches": 0,
        "skip_digest": None,
    }
    restored = WindowBatchDataset(lambda: snapshot, TokenBudget(64), seed=5, max_passes=1)
    assert restored.load_state_dict(state) == 5 and restored.planned_steps == 2 * per_pass and restored.next_pass == 2
    old = WindowBatchDataset(lambda: snapshot, TokenBudget(64), seed=5, max_passes=1)
    with caplog.at_level(logging.INFO, logger=dataset_module.log.name):
        old.load_state_dict({"next_pass": 3, "seed": 5})  # a state written before the optional keys
        batches = list(old)
    assert old.planned_steps == per_pass and [b.position.index for b in batches] == list(range(per_pass))  # type: ignore[union-attr]
    assert batches[0].position.pass_index == 3 and not caplog.records  # type: ignore[union-attr]


@pytest.mark.parametrize("key", ["next_pass", "seed", "planned_steps", "skip_batches"])
def test_a_state_with_a_negative_counter_is_refused(key: str) -> None:
    state = {"next_pass": 1, "seed": 0, "planned_steps": 3, "skip_batches": 1, key: -1}
    dataset = WindowBatchDataset(lambda: None, BUDGET)  # type: ignore[arg-type, return-value]
    with pytest.raises(ValueError) as raised:
        dataset.load_state_dict(state)
    assert str(raised.value) == f"WindowBatchDataset state needs counters >= 0, got {state}"


def test_the_states_own_sampler_counters_win_over_the_legacy_argument_and_a_dataset_without_a_sampler_ignores_them(
    make_snapshot: Callable,
) -> None:
    current = {"passes": 4, "watermark": 90, "seed": 0, "policy": "uniform"}
    legacy = {"passes": 1, "watermark": 10, "seed": 0, "policy": "uniform"}
    with_sampler = WindowBatchDataset(lambda: None, BUDGET, sampler=PassSampler(10, 0.5, "seeded", 0))  # type: ignore[arg-type, return-value]
    with_sampler.load_state_dict({"next_pass": 4, "seed": 0, "sampler": current}, sampler_state=legacy)
    assert with_sampler.sampler.passes == 4 and with_sampler.sampler.watermark == 90  # type: ignore[union-attr]
    with_sampler.load_state_dict({"next_pass": 1, "seed": 0}, sampler_state=legacy)
    assert with_sampler.sampler.passes == 1 and with_sampler.sampler.watermark == 10  # type: ignore[union-attr]
    without = WindowBatchDataset(lambda: None, BUDGET)  # type: ignore[arg-type, return-value]
    without.load_state_dict({"next_pass": 4, "seed": 0, "sampler": current})  # sampling turned off since
    assert without.next_pass == 4


def test_a_changed_seed_redraws_the_interrupted_pass_without_a_second_message(
    make_snapshot: Callable, caplog: pytest.LogCaptureFixture
) -> None:
    snapshot = make_snapshot(np.full(40, 8))
    dataset = tracked_on(snapshot)
    take(iter(dataset), 2, dataset)
    reseeded = WindowBatchDataset(lambda: snapshot, TokenBudget(64), seed=6, track_trained=True)
    with caplog.at_level(logging.INFO, logger=dataset_module.log.name):
        reseeded.load_state_dict(dataset.state_dict())
        first = next(iter(reseeded))
    assert first.position.pass_index == 0 and first.position.index == 0  # type: ignore[union-attr]
    assert [r.getMessage() for r in caplog.records] == [
        "the checkpoint was trained with SEED=5; continuing with the configured SEED=6: "
        "passes from here on are drawn from the new seed"
    ]
