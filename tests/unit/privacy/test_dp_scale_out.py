"""DP scaled out, in one process: the DP lockstep loop, the DP state cut for a sharded checkpoint.

The mechanism across real processes (one exact sum, one noise draw, rank 0's clock, 2 -> 1 -> 2
on one record) is tests/unit/distributed/test_dp_group.py; the whole service on the broker,
tests/integration/test_dp_scale_out.py.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from test_dp_operator_plane import DP, arrivals, make_service, run_until_decided

from streamtrain.checkpoint.incremental import WindowChain
from streamtrain.checkpoint.manifest import read_manifest, write_manifest
from streamtrain.checkpoint.rescale import RestoredShare, restore_share
from streamtrain.checkpoint.sharded_store import ShardedCheckpointStore
from streamtrain.checkpoint.shards import shard_present, write_common, write_shard
from streamtrain.config import load_settings
from streamtrain.distributed.collectives import Collectives
from streamtrain.distributed.launch import DistContext
from streamtrain.distributed.ownership import Ownership
from streamtrain.metrics import Metrics
from streamtrain.privacy import trainer as dp_trainer_module
from streamtrain.privacy.trainer import DPLockstepLoop, DPTrainer
from streamtrain.runtime.service import Service
from streamtrain.training.protocol import RestoredParts
from streamtrain.window.reservoir import RecencyWindow

torch.set_num_threads(1)


class Cuts:
    """Stands in for the group's checkpoint cut: records (final, step) and the state as it would be cut."""

    def __init__(self, trainer: DPTrainer) -> None:
        self.trainer = trainer
        self.calls: list[tuple[bool, int]] = []

    def __call__(self, final: bool) -> None:
        parts = self.trainer.checkpoint_parts(self.trainer.state_dict())
        assert parts.by_partition is not None and "window" not in parts.shared["dp"]
        self.calls.append((final, self.trainer.step))


def dp_trainer(tmp_path: Path, **overrides: Any) -> tuple[DPTrainer, Cuts]:
    """A DP trainer of a one-rank group (local collectives) with its lockstep loop."""
    settings = load_settings(**{**DP, "checkpoint_dir": tmp_path / "ckpt", "publish_interval_s": 0.2, **overrides})
    cuts: list[Cuts] = []

    def loop(trainer: DPTrainer) -> DPLockstepLoop:
        cuts.append(Cuts(trainer))
        return DPLockstepLoop(trainer, Collectives(DistContext()), checkpoint=cuts[0])

    trainer = DPTrainer(
        settings, RecencyWindow(100, 60.0), Metrics(), collectives=Collectives(DistContext()), loop=loop
    )
    return trainer, cuts[0]


def wait(condition: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def test_a_step_due_during_a_tick_waits_for_the_publication_of_the_model_before_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each reading of the trainer's clock moves it 0.3 of a step on: a tick that read the clock
    again for its step ran a step that came due after its publication check, before the model
    waiting for that step was published (which then held one step more than its public time says)."""
    clock = [time.time()]

    def readings() -> float:
        clock[0] += 0.3 / DP["dp_step_rate_hz"]  # type: ignore[operator]
        return clock[0]

    fake = SimpleNamespace(time=readings, sleep=time.sleep, monotonic=time.monotonic, perf_counter=time.perf_counter)
    monkeypatch.setattr(dp_trainer_module, "time", fake)
    trainer, _ = dp_trainer(tmp_path)
    loop = trainer.loop
    assert isinstance(loop, DPLockstepLoop)
    trainer.resume_after_restore()
    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    try:
        trainer.admit(arrivals(0, range(40)), {0: 40})
        wait(lambda: trainer.published is not None and trainer.published.version >= 10, 60, "publications")
    finally:
        loop.stop_requested.set()
        thread.join(30)
    for version in trainer.registry.versions():
        model = trainer.registry.get(version)
        assert model.step % trainer.publish_every_steps == 0 or model.version == 1, (model.version, model.step)
        assert model.published_at == trainer.engine.due_at(model.step + 1, clock[0])


def test_the_dp_loop_publishes_on_the_public_clock_cuts_checkpoints_and_stops_when_agreed(tmp_path: Path) -> None:
    trainer, cuts = dp_trainer(tmp_path)
    loop = trainer.loop
    assert isinstance(loop, DPLockstepLoop) and trainer.engine.group is not None
    trainer.resume_after_restore()
    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    for start in range(0, 40, 10):
        trainer.admit(arrivals(0, range(start, start + 10)), {0: start + 10})
        time.sleep(0.1)
    wait(lambda: trainer.step >= 12 and trainer.published is not None and trainer.published.version >= 3, 60,
         "steps and publications")  # fmt: skip
    published = [trainer.registry.get(v) for v in trainer.registry.versions()]
    for model in published:  # the model after step t, published when step t + 1 was due, stamped with that time
        assert model.published_at == trainer.engine.due_at(model.step + 1, time.time())
        assert model.step % trainer.publish_every_steps == 0 or model.version == 1
    assert trainer.record.synced_step >= published[-1].step  # the record covered it before it was published
    outcome = loop.request_rollback(published[0].version, reason="test").wait(30)  # taken at an agreed tick
    assert outcome is not None and outcome.applied and loop.rollbacks[-1] == outcome
    loop.checkpoint_due.set()
    wait(lambda: cuts.calls, 30, "a checkpoint")
    assert cuts.calls[0][0] is False and not loop.checkpoint_due.is_set()
    loop.stop_requested.set()
    thread.join(30)
    assert not thread.is_alive() and loop.finished.is_set()
    assert cuts.calls[-1] == (True, trainer.step) and trainer.record.synced_step == trainer.step
    assert loop.tick > trainer.step  # ticks without a due step go on (a stop or checkpoint is heard there)
    assert trainer.engine.window.admitted_total > 0


def test_a_dp_state_cut_in_parts_comes_back_whole_or_shared_by_partition(tmp_path: Path) -> None:
    # R = 24 admits all 4 x 6 arrivals of the step: with R = 8 drawn by random keys, some partition had
    # none admitted in about one run of five (C(18,8)/C(24,8) = 6% for each), and the shares below need all
    service = make_service(tmp_path, dp_admit_per_step=24)
    service.restore()
    trainer = service.trainer
    for partition in range(4):
        trainer.admit(arrivals(partition, range(0, 6)), {partition: 6})
    for partition in range(4):
        run_until_decided(service, partition, 6)
    state = trainer.state_dict()
    parts = trainer.checkpoint_parts(state)
    assert parts.by_partition is not None and set(parts.rank_local) == {"dp_totals"}
    assert not {"window", "published", "running"} & set(parts.shared["dp"])

    def back(owns: Any, unchanged: bool, by_partition: list[dict[str, Any]]) -> dict[str, Any]:
        return trainer.state_from_parts(RestoredParts(parts.shared, parts.rank_local if unchanged else None,
                                                      by_partition, owns, unchanged))  # fmt: skip

    whole = back(lambda p: True, True, [parts.by_partition])
    assert (
        whole["dp"]["window"] is parts.by_partition["dp_window"]
        and whole["dp"]["published"] == state["dp"]["published"]
    )
    eligible = state["dp"]["window"]["eligible"]
    held = sorted(zip(eligible["partitions"].tolist(), eligible["offsets"].tolist()))
    assert {p for p, _ in held} == {0, 1, 2, 3}
    shares = [back(lambda p, r=rank: p % 2 == r, False, [parts.by_partition]) for rank in range(2)]
    for rank, share in enumerate(shares):
        window = share["dp"]["window"]
        assert set(window["eligible"]["partitions"].tolist()) == {rank, rank + 2}
        assert share["dp"]["clock"] == state["dp"]["clock"] and share["step"] == state["step"]
        assert share["dp"]["published"]["steps"] == 0  # operator-plane totals start again under another ownership
    again = sorted(
        (p, o)
        for share in shares
        for p, o in zip(
            share["dp"]["window"]["eligible"]["partitions"].tolist(),
            share["dp"]["window"]["eligible"]["offsets"].tolist(),
            strict=True,
        )
    )
    assert again == held
    # a one-file checkpoint (another world size) holds its one window in the shared state: the whole state
    from_one_file = trainer.state_from_parts(RestoredParts(state, None, [], lambda p: p % 2 == 1, False))
    assert set(from_one_file["dp"]["window"]["eligible"]["partitions"].tolist()) == {1, 3}


def dp_ranks(tmp_path: Path, count: int) -> list[Service]:
    """``count`` one-process DP services standing in for the ranks of a group (rank r: partition r)."""
    ranks = []
    for rank in range(count):
        service = make_service(tmp_path / f"rank{rank}")
        service.restore()
        ranks.append(service)
    return ranks


def admit_and_align(ranks: list[Service], offsets: range) -> int:
    """Each rank admits ``offsets`` of its partition into its DP window and its recency window (as
    ingest does), until decided; then all run to one clock step (one cut). Returns that step."""
    for rank, service in enumerate(ranks):
        service.window.insert_batch(arrivals(rank, offsets), {rank: offsets.stop})
        service.trainer.admit(arrivals(rank, offsets), {rank: offsets.stop})
        run_until_decided(service, rank, offsets.stop)
    step = max(service.trainer.step for service in ranks)
    for service in ranks:
        while service.trainer.step < step:
            service.trainer._work()
    return step


def cut_group_checkpoint(
    ranks: list[Service], root: Path, step: int, chains: list[WindowChain]
) -> tuple[Path, list[dict[str, Any]]]:
    """The group's sharded checkpoint of ``step``, as the ranks cut it together: each rank's shard
    a delta on its last one where its chain allows; returns it and each rank's DP window as cut."""
    ownership = Ownership(world_size=len(ranks), partition_count=len(ranks))
    directory = ShardedCheckpointStore(root).create_directory(step, 1000 + step)
    pending, receipts, windows, shared = [], [], [], None
    for rank, service in enumerate(ranks):
        parts = service.trainer.checkpoint_parts(service.trainer.state_dict())
        assert parts.by_partition is not None
        shared = shared or parts.shared
        windows.append(parts.by_partition["dp_window"])
        window = chains[rank].next_window(service.window.capture_state(),
                                          parent_present=lambda parent: shard_present(root, parent),
                                          scope=(rank, ownership))  # fmt: skip
        pending.append(window)
        receipts.append(write_shard(directory, step=step, rank=rank, ownership=ownership, topic="sensor-events",
                                    window_state=window, rank_state=parts.rank_local,
                                    partitioned_state=parts.by_partition))  # fmt: skip
    common = write_common(directory, {"trainer": shared}, step=step)
    write_manifest(directory, step=step, topic="sensor-events", ownership=ownership, common=common, shards=receipts)
    for chain, window, receipt in zip(chains, pending, receipts, strict=True):
        chain.linked(window, receipt.parent_ref(directory.name), receipt.size)
    return directory, windows


def dp_records(windows: list[dict[str, Any]]) -> list[tuple[int, int, int]]:
    """The eligible records of DP window states: (admission step, partition, offset), sorted."""
    records: list[tuple[int, int, int]] = []
    for window in windows:
        eligible = window["eligible"]
        columns = (eligible[name].tolist() for name in ("steps", "partitions", "offsets"))
        records += zip(*columns, strict=True)
    return sorted(records)


def test_one_process_restores_a_sharded_dp_checkpoint_of_two_ranks(tmp_path: Path) -> None:
    """2 -> 1: the DP windows of both ranks' shards, the group's clock and record step (rank 0's common state)."""
    ranks = dp_ranks(tmp_path, 2)
    step = admit_and_align(ranks, range(0, 8))
    root = tmp_path / "rank0" / "ckpt"  # the group's directory: rank 0's record and clock log are there
    directory, _ = cut_group_checkpoint(ranks, root, step, [WindowChain(by_partition=True) for _ in ranks])

    one = make_service(tmp_path / "one", checkpoint_dir=root)
    one.restore()
    engine = one.trainer.engine
    eligible = engine.window.eligible()
    held = [(ranks[r].trainer.engine.window.eligible(), r) for r in range(2)]
    assert len(eligible) == sum(len(e) for e, _ in held) > 0  # every record of both ranks, once
    restored = sorted(np.concatenate([v.ravel() for v in eligible.values]).tolist())
    expected = sorted(np.concatenate([v.ravel() for e, _ in held for v in e.values]).tolist())
    assert restored == expected
    assert engine.steps == step and one.restored_from == directory
    assert one.trainer.published is not None and one.trainer.published.step == step


def test_a_sharded_dp_checkpoint_of_base_and_delta_shards_restores_the_newest_cuts_dp_records(tmp_path: Path) -> None:
    """Every shard, a delta too, carries its own cut's DP window whole: a restore (and a rescale 2 -> 1,
    and a rank owning none of the shards' partitions) takes each shard's newest one; the recency
    window's items come from the chain. Fails when the DP window is taken from the base a delta builds on."""
    ranks = dp_ranks(tmp_path, 2)
    root = tmp_path / "rank0" / "ckpt"
    chains = [WindowChain(by_partition=True) for _ in ranks]
    base, base_windows = cut_group_checkpoint(ranks, root, admit_and_align(ranks, range(0, 8)), chains)
    step = admit_and_align(ranks, range(8, 16))
    newest, windows = cut_group_checkpoint(ranks, root, step, chains)
    manifest = read_manifest(newest)
    assert [shard["chain"] for shard in manifest.shards] == [[base.name]] * 2
    assert all(shard["partitioned_state"] for shard in manifest.shards)
    assert dp_records(windows) != dp_records(base_windows)  # the cuts' DP windows differ: the test can tell

    def share(rank: int, world_size: int) -> RestoredShare:
        return restore_share(manifest, rank=rank, world_size=world_size, partition_count=2, topic="sensor-events")

    for rank in range(2):  # unchanged ownership: its own shard's, newest
        assert dp_records([part["dp_window"] for part in share(rank, 2).partitioned_states]) == dp_records(
            [windows[rank]]
        )
    nothing_owned = share(2, 3)  # owns no partition: still every shard's, newest
    assert nothing_owned.window_state["lengths"].size == 0
    assert dp_records([part["dp_window"] for part in nothing_owned.partitioned_states]) == dp_records(windows)

    one = make_service(tmp_path / "one", checkpoint_dir=root)
    one.restore()  # 2 -> 1
    assert one.restored_from == newest and one.trainer.engine.steps == step
    assert dp_records([one.trainer.engine.window.state_dict()]) == dp_records(windows)
    snapshot = one.window.snapshot()  # the recency window's items, through the chain
    assert sorted(zip(snapshot.partitions.tolist(), snapshot.offsets.tolist(), strict=True)) == [
        (rank, offset) for rank in range(2) for offset in range(16)
    ]


def test_a_revocation_in_a_group_stops_admitting_and_leaves_the_sync_to_the_agreed_ticks(tmp_path: Path) -> None:
    """Scaled out no other process takes a partition over, and the record is synced by every rank
    together: a revocation (ingest's watchdog, the stop) neither syncs on its own nor fences."""
    trainer, _ = dp_trainer(tmp_path, dp_admission_dir=tmp_path / "record")
    trainer.resume_after_restore()
    fenced: list[str] = []
    trainer.on_fenced = fenced.append
    trainer.on_partitions_assigned([0])
    trainer.admit(arrivals(0, range(0, 10)), {0: 10})
    wait(lambda: trainer.run_step(time.time()) and trainer.engine.window.watermarks.get(0) == 10, 30, "a decision")
    assert trainer.record.pending  # decided, not yet durable
    (tmp_path / "record").mkdir(exist_ok=True)
    (tmp_path / "record").rename(tmp_path / "record-away")
    (tmp_path / "record").write_text("not a directory: a sync here would fail")
    trainer.on_partitions_revoked([0])
    assert fenced == [] and trainer.fenced is None and trainer.record_error is None
    arrived = trainer.engine.window.arrived_total
    trainer.admit(arrivals(0, range(10, 20)), {0: 20})  # no longer admitted from
    assert trainer.engine.window.arrived_total == arrived == 10
