"""A rank of a DP group in one process (the engine, and DPGroup itself): the other rank is a double.

The group's own tests (``tests/unit/distributed/test_dp_group.py``) run real ranks in
processes of their own; these check, where a mutation run can see them, what a rank does
with what the group tells it: rank 0's clock and writer name, the sum over the ranks, one
noise draw, one reduce per step, a record that only rank 0's clock log completes.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from streamtrain.events import EventBatch, SensorEvent
from streamtrain.model.network import SensorModel
from streamtrain.privacy import AdmissionRecord, DPConfig, DPEngine
from streamtrain.privacy.config import DPConfigError
from streamtrain.privacy.group import DPGroup, GroupError

CONFIG = dict(noise_multiplier=1.0, clip_norm=0.5, q0=0.2, eligible_steps=6, admit_per_step=9,
              step_rate_hz=10.0, delta=1e-6, target_epsilon=30.0, expected_units=1e3)  # fmt: skip
LEADER = "a1b2c3d4e5f60718"  # rank 0's writer name


class OtherRank:
    """Collectives of ``rank`` in a group of two whose other rank is simulated.

    Rank 0's broadcasts (the due step and clock origin, its writer name) arrive as ``leader_*``;
    the other rank's int64 vector in a sum is ``peer_sum`` everywhere; it is at ``peer_step``
    (None: the same clock step), at ``peer_last_step`` on a resume, and ``peer_ok`` in an agreement.
    """

    def __init__(self, rank: int, *, leader_due: bool = True, leader_origin: float = 0.0, peer_sum: int = 0,
                 peer_ok: bool = True, peer_last_step: int = 0, peer_step: float | None = None) -> None:  # fmt: skip
        self.rank, self.world_size = rank, 2
        self.peer_step = peer_step  # None: at this rank's step
        self.leader_due, self.leader_origin, self.peer_sum = leader_due, leader_origin, peer_sum
        self.peer_ok, self.peer_last_step = peer_ok, peer_last_step
        self.calls: list[str] = []

    def all_reduce_(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        assert op in ("sum", "max"), op  # what the group asks of torch.distributed
        self.calls.append(f"all_reduce {op} {tensor.dtype}")
        if op == "sum":
            tensor += self.peer_sum
        elif tensor.dtype == torch.int64:  # the last step on a resume
            tensor.copy_(torch.maximum(tensor, torch.tensor([self.peer_last_step])))
        elif self.peer_step is not None:  # the clock steps' agreement: max of (step, -step)
            tensor.copy_(torch.maximum(tensor, torch.tensor([self.peer_step, -self.peer_step], dtype=tensor.dtype)))
        return tensor

    def broadcast_(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        assert src == 0, src  # every broadcast of the group is rank 0's
        self.calls.append(f"broadcast {tensor.dtype}")
        if self.rank == 0:
            return tensor
        if tensor.dtype == torch.uint8:
            tensor.zero_()
            tensor[: len(LEADER)] = torch.tensor(list(LEADER.encode("ascii")), dtype=torch.uint8)
        else:
            tensor[0], tensor[1] = float(self.leader_due), self.leader_origin
        return tensor

    def agree_all(self, ok: bool) -> bool:
        self.calls.append(f"agree_all {ok}")
        return ok and self.peer_ok


class ConstantNoise:
    """Test double: every coordinate's draw is ``value``; counts the draws."""

    def __init__(self, value: int) -> None:
        self.value, self.draws = value, 0

    def sample(self, sigma_squared: object, n: int) -> np.ndarray:
        self.draws += 1
        return np.full(n, self.value, dtype=np.int64)


def rank_engine(collectives: OtherRank, record: AdmissionRecord | None = None, **overrides: float) -> DPEngine:
    torch.manual_seed(0)
    model = SensorModel(1, d_model=16, n_heads=2, n_layers=1, max_len=32)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    config = DPConfig(**{**CONFIG, **overrides})
    return DPEngine(model, optimizer, config, 256, record=record, group=DPGroup(collectives))


def record_in(directory: Path, name: str) -> AdmissionRecord:
    return AdmissionRecord(directory / "admissions", directory / "checkpoints" / "dp-clock.jsonl", writer=name)


def test_each_rank_admits_its_share_of_r() -> None:
    assert [rank_engine(OtherRank(rank)).window.admit_per_step for rank in (0, 1)] == [5, 4]


def test_rank_0_anchors_the_groups_clock_at_its_own_and_runs_its_due_steps() -> None:
    engine = rank_engine(OtherRank(0))
    assert engine.step(100.0) is None  # anchored here: step 1 is due at 100.1
    assert engine.clock.origin == 100.0
    assert engine.step(100.05) is None
    report = engine.step(100.101)
    assert report is not None and report.step == 1 and engine.clock.origin == 100.0


def test_another_rank_runs_the_step_rank_0_says_is_due_from_rank_0s_origin() -> None:
    engine = rank_engine(OtherRank(1, leader_due=True, leader_origin=50.0))
    report = engine.step(0.0)  # not due by this rank's own clock (anchored now)
    assert report is not None and report.step == 1 and engine.clock.origin == 50.0
    assert engine.due_at(2, 0.0) == pytest.approx(50.2)
    idle = rank_engine(OtherRank(1, leader_due=False, leader_origin=50.0))
    assert idle.step(1e6) is None and idle.steps == 0  # due here, but not at rank 0


def test_only_rank_0_draws_noise_and_every_rank_releases_the_groups_sum() -> None:
    released = {}
    for rank in (0, 1):
        engine = rank_engine(OtherRank(rank, peer_sum=5))
        engine.noise = noise = ConstantNoise(3)
        engine.on_update = lambda flat, rank=rank: released.__setitem__(rank, flat.clone())
        engine.step(0.0)
        engine.step(0.101)  # empty window: this rank's sum is zero
        assert noise.draws == (1 if rank == 0 else 0)
    assert bool((released[0] == 3 + 5).all()) and bool((released[1] == 5).all())


def test_a_failure_after_the_ranks_summed_is_raised_not_reduced_a_second_time() -> None:
    """A noise-only step after the reduce would be a second collective the other ranks never join."""
    collectives = OtherRank(0)
    engine = rank_engine(collectives)
    failures = iter([RuntimeError("optimizer state lost")])

    def step_once_failing(*_: object) -> None:
        error = next(failures, None)
        if error is not None:
            raise error

    engine.optimizer.step = step_once_failing  # type: ignore[method-assign]
    engine.step(0.0)
    with pytest.raises(RuntimeError, match="optimizer state lost"):
        engine.step(0.101)
    assert [c for c in collectives.calls if c.startswith("all_reduce sum")] == ["all_reduce sum torch.int64"]
    assert engine.steps == 1  # the step is consumed: the clock and the window stay consistent
    report = engine.step(0.201)
    assert report is not None and report.step == 2 and not report.failed


def test_another_rank_records_its_decisions_and_leaves_the_clock_log_to_rank_0(tmp_path: Path) -> None:
    engine = rank_engine(OtherRank(1), record_in(tmp_path, "mine000000000000"))
    assert engine.record is not None
    engine.resume(engine.record.load())
    batch = EventBatch.from_events([SensorEvent("s", 0.0, np.ones((4, 1), np.float32))], partitions=[1], offsets=[0])
    engine.admit(batch, now=0.0)
    assert engine.step(0.0) is not None and engine.step(0.0) is not None  # due twice, as rank 0 says
    assert engine.sync_record() == 2  # its own decisions durable up to step 2
    assert (tmp_path / "admissions" / "partition-1.jsonl").exists()
    assert not (tmp_path / "checkpoints" / "dp-clock.jsonl").exists()  # rank 0 writes the group's clock
    assert engine.state_dict()["record_synced_step"] == 2


def test_rank_0_writes_the_clock_log_only_once_every_rank_has_synced(tmp_path: Path) -> None:
    clock_log = tmp_path / "checkpoints" / "dp-clock.jsonl"
    for peer_ok in (False, True):
        engine = rank_engine(OtherRank(0, peer_ok=peer_ok), record_in(tmp_path / str(peer_ok), LEADER))
        assert engine.record is not None
        engine.resume(engine.record.load())
        engine.step(0.0)
        engine.step(0.101)
        if not peer_ok:
            with pytest.raises(OSError) as raised:
                engine.sync_record()
            assert str(raised.value) == "another rank of the DP group could not sync its record"
            assert not (tmp_path / str(peer_ok) / clock_log.relative_to(tmp_path)).exists()
        else:
            assert engine.sync_record() == 1
            assert (tmp_path / str(peer_ok) / clock_log.relative_to(tmp_path)).exists()


def test_a_rank_that_cannot_sync_raises_its_own_error_after_telling_the_others(tmp_path: Path) -> None:
    collectives = OtherRank(0)
    engine = rank_engine(collectives, record_in(tmp_path, LEADER))
    assert engine.record is not None
    engine.resume(engine.record.load())

    def disk_full(*, clock: bool = True) -> int:
        raise OSError("disk full")

    engine.record.sync = disk_full  # type: ignore[method-assign]
    with pytest.raises(OSError, match="^disk full$"):
        engine.sync_record()
    assert collectives.calls[-1] == "agree_all False"  # the others learn it before this rank raises


def test_every_rank_writes_the_record_under_rank_0s_name_taken_once(tmp_path: Path) -> None:
    collectives = OtherRank(1, peer_last_step=3)
    record = record_in(tmp_path, "mine000000000000")
    engine = rank_engine(collectives, record)
    assert record.writer == "mine000000000000"  # not in the constructor: the ranks have not met yet
    engine.take_group_writer()
    assert record.writer == record.ledger.writer == LEADER
    engine.take_group_writer()
    assert engine.resume(record.load()) == 3  # the group's last step, not this rank's
    assert collectives.calls.count("broadcast torch.uint8") == 1
    fresh = rank_engine(OtherRank(1), record_in(tmp_path / "fresh", "mine000000000000"))
    assert fresh.record is not None
    fresh.resume(fresh.record.load())  # resume takes it if nobody did
    assert fresh.record.writer == LEADER


# --- DPGroup itself (its mutation run) ---


def test_r_equal_to_the_world_size_gives_each_rank_one_admission_and_less_is_refused_in_full() -> None:
    assert [DPGroup(OtherRank(rank)).admit_share(2) for rank in (0, 1)] == [1, 1]
    with pytest.raises(DPConfigError) as raised:
        DPGroup(OtherRank(0)).admit_share(1)
    assert str(raised.value) == (
        "DP_ADMIT_PER_STEP=1 with WORLD_SIZE=2: the ranks share R, and each needs at least one admission per step; "
        "raise DP_ADMIT_PER_STEP to at least WORLD_SIZE"
    )


def test_rank_0s_clock_origin_and_step_cross_the_group_exactly() -> None:
    """An epoch origin (~1.7e9 s) or a step past 2^24 would not survive float32."""
    origin = 1_765_000_000.123
    assert DPGroup(OtherRank(1, leader_due=True, leader_origin=origin)).agree_due(False, 0.0, 2**24 + 1) == (
        True,
        origin,
    )
    assert DPGroup(OtherRank(0)).agree_due(True, origin, 2**24 + 1) == (True, origin)
    with pytest.raises(GroupError) as raised:
        DPGroup(OtherRank(0, peer_step=2.0**24)).agree_due(True, origin, 2**24 + 1)
    assert str(raised.value) == (
        "DP group rank 0: ranks are at different clock steps (16777216 to 16777217); every rank must run every step"
    )


def test_the_sum_over_ranks_takes_the_integer_grid_only() -> None:
    group = DPGroup(OtherRank(0, peer_sum=2))
    assert group.sum_exactly(torch.tensor([1, -3], dtype=torch.int64)).tolist() == [3, -1]
    with pytest.raises(TypeError) as raised:
        group.sum_exactly(torch.tensor([1.5]))
    assert str(raised.value) == "DPGroup.sum_exactly needs int64 (the integer grid), got torch.float32"


def test_the_last_step_is_the_largest_over_the_ranks() -> None:
    assert DPGroup(OtherRank(0, peer_last_step=9)).last_step(4) == 9
    assert DPGroup(OtherRank(0, peer_last_step=2)).last_step(4) == 4


@pytest.mark.parametrize("name", ["a1b2c3d4e5f60718", "X" * 64, "node-7-X"])
def test_a_writer_name_of_up_to_64_ascii_bytes_crosses_the_group_unchanged(name: str) -> None:
    assert DPGroup(OtherRank(0)).writer(name) == name
    with pytest.raises(ValueError) as raised:
        DPGroup(OtherRank(0)).writer("y" * 65)
    assert str(raised.value) == f"writer name {'y' * 65!r} is longer than 64 bytes"
