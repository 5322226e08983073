"""Scale-out machinery: launch context, ownership, lockstep, the data-parallel step.

The multi-process tests start real processes the way torchrun does (WORLD_SIZE, RANK,
LOCAL_RANK, MASTER_ADDR, MASTER_PORT in the environment; gloo over localhost), running
``dist_worker.py``; every rank writes what it saw and this file checks it.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import dist_worker
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from streamtrain.config import load_settings
from streamtrain.data import collate
from streamtrain.distributed.data_parallel import (
    DataParallelStep,
    LossCounts,
    Moments,
    apply_moments,
    batch_moments,
    merge_all,
)
from streamtrain.distributed.launch import (
    EXIT_COLLECTIVE_FAILURE,
    OWNERSHIP_VERSION,
    Collectives,
    DistConfigError,
    DistContext,
    Ownership,
    StepSignals,
    capacity_share,
    free_port,
    http_port,
    owner,
    resolve_backend,
)
from streamtrain.metrics import Metrics
from streamtrain.model.network import RunningNorm
from streamtrain.training.trainer import Trainer
from streamtrain.window import RecencyWindow

REPO = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("dist_worker.py")


# ----------------------------------------------------------------------------------------
# launch context


def test_no_world_size_means_one_process() -> None:
    ctx = DistContext.from_env({})
    assert (ctx.rank, ctx.world_size, ctx.distributed) == (0, 1, False)
    assert Collectives(ctx).start().active is False


def test_context_reads_torchrun_variables() -> None:
    env = {
        "WORLD_SIZE": "4",
        "RANK": "3",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "2",
        "MASTER_ADDR": "trainer-0.trainer",
        "MASTER_PORT": "29500",
        "TORCHELASTIC_RESTART_COUNT": "2",
    }
    ctx = DistContext.from_env(env)
    assert ctx == DistContext(3, 4, 1, 2, "trainer-0.trainer", 29500, 2)
    assert ctx.owned_partitions(10) == [3, 7]
    assert ctx.is_primary is False
    assert ctx.agent_store is False  # a StatefulSet: rank 0 hosts the store
    assert (
        DistContext.from_env({**env, "TORCHELASTIC_USE_AGENT_STORE": "True"}).agent_store is True
    )  # torchrun's agent does


@pytest.mark.parametrize(
    ("env", "names"),
    [
        ({"WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1"}, "RANK"),
        ({"WORLD_SIZE": "2", "RANK": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1"}, "RANK=2"),
        ({"WORLD_SIZE": "two"}, "WORLD_SIZE"),
        ({"WORLD_SIZE": "0"}, "WORLD_SIZE"),
        ({"WORLD_SIZE": "2", "RANK": "1"}, "MASTER_ADDR"),
        ({"WORLD_SIZE": "2", "RANK": "1", "MASTER_ADDR": "h", "MASTER_PORT": "70000"}, "MASTER_PORT"),
    ],
)
def test_bad_launch_environment_is_one_line(env: dict[str, str], names: str) -> None:
    with pytest.raises(DistConfigError) as err:
        DistContext.from_env(env)
    assert names in str(err.value) and "\n" not in str(err.value)


def test_http_port_rule() -> None:
    two_local = DistContext(rank=3, world_size=4, local_rank=1, local_world_size=2, master_addr="h", master_port=1)
    pod = DistContext(rank=3, world_size=4, local_rank=0, local_world_size=1, master_addr="h", master_port=1)
    assert http_port(8000, two_local, explicit=False) == 8001  # configured + LOCAL_RANK
    assert http_port(0, two_local, explicit=False) == 0  # ephemeral stays ephemeral
    assert http_port(9000, pod, explicit=True) == 9000  # set for this process alone
    with pytest.raises(DistConfigError, match="share this host"):
        http_port(9000, two_local, explicit=True)
    with pytest.raises(DistConfigError, match="65535"):
        http_port(65535, two_local, explicit=False)


def test_rank_device_gives_each_local_rank_its_own_gpu() -> None:
    from streamtrain.distributed.launch import rank_device

    two_local = [DistContext(r, 4, r % 2, 2, "h", 1) for r in range(4)]
    assert [rank_device("cuda:0", ctx, cuda_count=lambda: 2) for ctx in two_local] == [
        (torch.device("cuda", 0), False), (torch.device("cuda", 1), False),
    ] * 2  # fmt: skip
    assert rank_device("cuda:0", two_local[1], cuda_count=lambda: 1) == (torch.device("cuda", 0), True)
    assert rank_device("cuda:1", DistContext(1, 2, 0, 1, "h", 1), cuda_count=lambda: 2) == (
        torch.device("cuda", 1),
        False,
    )
    assert rank_device("cpu", two_local[1], cuda_count=lambda: 2) == (torch.device("cpu"), False)


def test_backend_choice() -> None:
    assert resolve_backend("auto", "cpu") == "gloo"
    assert resolve_backend("gloo", "cpu") == "gloo"
    with pytest.raises(DistConfigError, match="CUDA"):
        resolve_backend("nccl", "cpu")
    with pytest.raises(DistConfigError, match="auto"):
        resolve_backend("mpi", "cpu")
    if torch.distributed.is_nccl_available():
        assert resolve_backend("auto", "cuda") == "nccl"
        # ranks that share a GPU: NCCL refuses two ranks of one communicator on one GPU
        assert resolve_backend("auto", "cuda", gpus_shared=True) == "gloo"
        with pytest.raises(
            DistConfigError, match="^DIST_BACKEND=nccl with more ranks on this host than GPUs.*DIST_BACKEND=gloo"
        ):
            resolve_backend("nccl", "cuda", gpus_shared=True)


# ----------------------------------------------------------------------------------------
# ownership


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 64), st.integers(0, 300))
def test_ownership_partitions_the_partitions(world_size: int, partition_count: int) -> None:
    rule = Ownership(world_size=world_size, partition_count=partition_count)
    shares = [rule.partitions_of(rank) for rank in range(world_size)]
    flat = sorted(p for share in shares for p in share)
    assert flat == list(range(partition_count))  # every partition exactly once
    for rank, share in enumerate(shares):
        assert share == sorted(share)
        assert all(owner(p, world_size) == rank == p % world_size for p in share)
        assert len(share) in (partition_count // world_size, partition_count // world_size + 1)
    assert rule.idle_ranks() == [r for r in range(world_size) if not shares[r]]
    # growing the topic never moves an existing partition
    grown = Ownership(world_size=world_size, partition_count=partition_count + 5)
    assert all(grown.owner(p) == rule.owner(p) for p in range(partition_count))


def test_ownership_is_versioned() -> None:
    rule = Ownership(world_size=3, partition_count=8)
    record = rule.as_dict()
    assert record == {"rule": "modulo", "version": OWNERSHIP_VERSION, "world_size": 3, "partition_count": 8}
    assert Ownership.from_dict(record) == rule
    with pytest.raises(ValueError, match="unknown"):
        Ownership.from_dict({**record, "version": OWNERSHIP_VERSION + 1})
    with pytest.raises(ValueError, match="negative"):
        owner(-1, 2)


@given(st.integers(1, 10**7), st.integers(1, 64))
def test_capacity_shares_add_up(capacity: int, world_size: int) -> None:
    shares = [capacity_share(capacity, rank, world_size) for rank in range(world_size)]
    if capacity >= world_size:
        assert sum(shares) == capacity
    assert max(shares) - min(shares) <= 1 and min(shares) >= 1


# ----------------------------------------------------------------------------------------
# normalization statistics


def _moments_of(values: np.ndarray) -> tuple[int, np.ndarray, np.ndarray]:
    real = values.astype(np.float64)
    mean = real.mean(axis=0)
    return real.shape[0], mean, ((real - mean) ** 2).sum(axis=0)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 40), min_size=1, max_size=6), st.integers(0, 2**31 - 1), st.floats(-1e4, 1e4))
def test_chan_merge_equals_the_union(sizes: list[int], seed: int, center: float) -> None:
    rng = np.random.default_rng(seed)
    parts = [rng.normal(center, 3.0, (n, 2)) for n in sizes]
    merged = merge_all(
        [
            Moments(n, torch.from_numpy(m), torch.from_numpy(m2)) if n else Moments.empty(2)
            for n, m, m2 in (_moments_of(p) if len(p) else (0, None, None) for p in parts)
        ]
    )
    union = np.concatenate(parts)
    assert merged.count == union.shape[0]
    if union.shape[0]:
        count, mean, m2 = _moments_of(union)
        np.testing.assert_allclose(merged.mean.numpy(), mean, rtol=1e-12, atol=1e-9)
        np.testing.assert_allclose(merged.m2.numpy(), m2, rtol=1e-9, atol=1e-7)


def test_batch_moments_then_apply_is_running_norm_update() -> None:
    rng = np.random.default_rng(1)
    reference, ours = RunningNorm(2, warmup_count=50), RunningNorm(2, warmup_count=50)
    for step in range(6):
        items = [rng.normal(3.0, 2.0, (int(rng.integers(1, 30)), 2)).astype(np.float32) for _ in range(8)]
        if step == 4:
            items[0][0] = 1e30  # an outlier after warm-up: clamped by the running band
        batch = collate(items)
        reference.update(batch.values, batch.mask)
        before = ours.state_dict()
        moments = batch_moments(ours, batch.values, batch.mask)
        assert ours.state_dict()["count"] == before["count"] and ours.clipped == before["clipped"]
        apply_moments(ours, moments)
    for key, value in reference.state_dict().items():
        other = ours.state_dict()[key]
        assert torch.equal(value, other) if isinstance(value, torch.Tensor) else value == other, key
    assert ours.clipped >= 1


def test_moments_payload_round_trip() -> None:
    moments = Moments(
        5, torch.tensor([1.5, -2.0], dtype=torch.float64), torch.tensor([3.0, 4.0], dtype=torch.float64), 2
    )
    back = Moments.from_payload(moments.as_payload(), 2)
    assert back.count == 5 and back.clipped == 2
    assert torch.equal(back.mean, moments.mean) and torch.equal(back.m2, moments.m2)
    with pytest.raises(ValueError, match="6 numbers"):
        Moments.from_payload(np.zeros(5), 2)


def test_loss_counts() -> None:
    batch = collate([np.ones((3, 1), np.float32), np.ones((1, 1), np.float32)], labels=[2, -1])
    assert LossCounts.of(batch) == LossCounts(
        real_tokens=4, forecast_targets=2, labelled=1, sequences=2, padded_tokens=6
    )
    assert LossCounts.of(None) == LossCounts(0, 0, 0, 0, 0)


# ----------------------------------------------------------------------------------------
# one rank: the step is the single-process step


def _trainer(**overrides: object) -> Trainer:
    return Trainer(load_settings(window_capacity=1000, seed=3, **overrides), RecencyWindow(1000, math.inf), Metrics())


def test_one_rank_step_is_trainer_train_step_bit_for_bit() -> None:
    torch.set_num_threads(1)
    reference, ours = _trainer(n_classes=3), _trainer(n_classes=3)
    dp = DataParallelStep(
        Collectives(DistContext()),
        ours.model,
        ours.norm,
        ours.optimizer,
        grad_clip_norm=ours.settings.grad_clip_norm,
        scheduler=ours.scheduler,
    )
    rng = np.random.default_rng(0)
    for step in range(5):
        items = [rng.normal(2, 3, (int(rng.integers(1, 60)), 1)).astype(np.float32) for _ in range(12)]
        batch = collate(items, labels=rng.integers(-1, 3, len(items)))
        nan = step == 2
        reference.fault_injector = ours_injector = (lambda loss: loss * math.nan) if nan else None
        dp.fault_injector = ours_injector
        expected = reference.train_step(batch)
        report = dp.step(batch, step=step)
        assert report.applied == expected.applied
        assert report.skipped_reason == expected.skipped_reason
        if expected.applied:
            assert report.loss == pytest.approx(expected.loss, rel=1e-6)
    for (name, a), b in zip(reference.model.named_parameters(), ours.model.parameters()):
        assert torch.equal(a, b), name
    assert torch.equal(reference.norm.mean, ours.norm.mean) and reference.norm.count == ours.norm.count


@pytest.mark.parametrize("staged", [False, True], ids=["host-batch", "staged-batch"])
def test_one_rank_step_under_bf16_autocast_is_trainer_train_step_bit_for_bit(staged: bool) -> None:
    """AMP=bf16 (CPU autocast runs bf16): the step's forward runs under the same autocast as
    Trainer.train_step's, with the batch as the lockstep loop stages it or as a host batch."""
    from streamtrain.data.prefetch import stage_batch

    torch.set_num_threads(1)
    reference, ours = _trainer(amp="bf16"), _trainer(amp="bf16")
    dp = DataParallelStep(
        Collectives(DistContext()), ours.model, ours.norm, ours.optimizer,
        grad_clip_norm=ours.settings.grad_clip_norm, scheduler=ours.scheduler, amp="bf16",
    )  # fmt: skip
    rng = np.random.default_rng(4)
    for step in range(4):
        batch = collate([rng.normal(1, 2, (int(rng.integers(2, 50)), 1)).astype(np.float32) for _ in range(10)])
        expected = reference.train_step(batch)
        report = dp.step(stage_batch(batch, torch.device("cpu")).ready() if staged else batch, step=step)
        assert report.applied and report.loss == pytest.approx(expected.loss, rel=1e-6)
    for (name, a), b in zip(reference.model.named_parameters(), ours.model.parameters()):
        assert torch.equal(a, b), name
        assert b.dtype == torch.float32  # master weights stay float32
    plain = _trainer()
    DataParallelStep(Collectives(DistContext()), plain.model, plain.norm, plain.optimizer, grad_clip_norm=1.0).step(
        batch, step=0
    )
    assert not torch.equal(next(plain.model.parameters()), next(_trainer().model.parameters()))


def test_an_agreed_optimizer_reset_clears_adamw_at_that_step() -> None:
    trainer = _trainer()
    dp = DataParallelStep(
        Collectives(DistContext()), trainer.model, trainer.norm, trainer.optimizer, grad_clip_norm=1.0
    )
    batch = collate([np.arange(12, dtype=np.float32)[:, None]])
    dp.step(batch, step=0)
    assert trainer.optimizer.state
    report = dp.step(None, step=1, signals=StepSignals(reset_optimizer=True))
    assert report.agreement.reset_optimizer and report.skipped_reason == "no_data" and not trainer.optimizer.state
    dp.step(batch, step=2)
    assert trainer.optimizer.state and not dp.step(batch, step=3).agreement.reset_optimizer


def test_rollback_requests_one_wins_per_step() -> None:
    from streamtrain.distributed.launch import AgreedRollback, RollbackRequest, _winning_rollback

    def row(request: RollbackRequest | None) -> list[float]:
        from streamtrain.distributed.launch import _rollback_fields

        return _rollback_fields(request)

    auto = RollbackRequest(3, "automatic", 5)
    admin = RollbackRequest(2, "admin")
    assert _winning_rollback(np.array([row(None), row(None)])) is None
    assert _winning_rollback(np.array([row(auto), row(admin)])) == AgreedRollback(1, admin)  # admin first
    assert _winning_rollback(
        np.array([row(None), row(auto), row(RollbackRequest(4, "automatic", 6))])
    ) == AgreedRollback(1, auto)
    assert _winning_rollback(np.array([row(RollbackRequest(7)), row(admin)])) == AgreedRollback(0, RollbackRequest(7))
    one = Collectives(DistContext()).agree(0, StepSignals(rollback=auto))
    assert one.rollback == AgreedRollback(0, auto)
    for bad in (
        {"version": 0},
        {"version": 2, "trigger": "cron"},
        {"version": 2, "trigger": "automatic", "from_version": 0},
    ):
        with pytest.raises(ValueError):
            RollbackRequest(**bad)  # type: ignore[arg-type]


def test_one_rank_sums_and_settings_checks_are_local() -> None:
    c = Collectives(DistContext())
    np.testing.assert_array_equal(c.sum_rows([1.5, 2.0, math.inf]), [1.5, 2.0, math.inf])
    c.agree_settings({"d_model": 64, "amp": "off"})  # one rank agrees with itself


def test_one_rank_collectives_are_local() -> None:
    c = Collectives(DistContext())
    agreement = c.agree(7, StepSignals(stop=True, has_data=True), {"real_tokens": 12}, [1.0, 2.0])
    assert agreement.stop and not agreement.checkpoint and agreement.ranks_with_data == 1
    assert agreement.totals == {"real_tokens": 12}
    np.testing.assert_array_equal(agreement.per_rank, [[1.0, 2.0]])
    layer = torch.nn.Linear(2, 1)
    tail = c.allreduce_gradients(layer.parameters(), torch.tensor([3.0]))
    assert tail is not None and float(tail) == 3.0
    assert all(p.grad is not None and not p.grad.any() for p in layer.parameters())  # zeros, not None
    assert c.agree_all(True) and c.max_int(5) == 5 and c.broadcast_ints([4]) == [4]
    with pytest.raises(ValueError, match="2\\*\\*53"):
        c.agree(0, StepSignals(), {"tokens": 2**60})


def test_no_data_anywhere_is_an_idle_step() -> None:
    trainer = _trainer()
    dp = DataParallelStep(
        Collectives(DistContext()), trainer.model, trainer.norm, trainer.optimizer, grad_clip_norm=1.0
    )
    before = [p.detach().clone() for p in trainer.model.parameters()]
    report = dp.step(None, step=0, signals=StepSignals(publish_due=True))
    assert (report.applied, report.skipped_reason, report.agreement.publish) == (False, "no_data", True)
    assert all(torch.equal(a, b) for a, b in zip(before, trainer.model.parameters()))
    assert dp.step(None, step=1, signals=StepSignals(stop=True)).skipped_reason == "stop"


# ----------------------------------------------------------------------------------------
# real processes


def _launch(
    scenario: str, out: Path, *, timeout_s: float, world: int = 2, late_s: float = 0.0
) -> list[subprocess.Popen[bytes]]:
    """Start ``world`` ranks of ``dist_worker.py`` as torchrun would on one host; the last
    one joins ``late_s`` seconds late."""
    out.mkdir(parents=True, exist_ok=True)
    port = free_port()
    python_path = os.pathsep.join([str(REPO / "src"), str(WORKER.parent), os.environ.get("PYTHONPATH", "")])
    processes = []
    for rank in range(world):
        env = dict(
            os.environ,
            WORLD_SIZE=str(world),
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            LOCAL_WORLD_SIZE=str(world),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            TEST_DIST_TIMEOUT_S=str(timeout_s),
            TEST_START_DELAY_S=str(late_s if rank == world - 1 else 0.0),
            PYTHONPATH=python_path,
        )
        log = open(out / f"rank{rank}.log", "wb")  # noqa: SIM115 - closed with the process
        processes.append(
            subprocess.Popen([sys.executable, str(WORKER), scenario, str(out)], env=env, stdout=log, stderr=log)
        )
    return processes


def _logs(out: Path) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}" for p in sorted(out.glob("rank*.log")))


def _stop(processes: list[subprocess.Popen[bytes]]) -> None:
    for process in processes:
        if process.poll() is None:
            process.kill()
        process.wait(30)


def _reference_params() -> tuple[dict[str, np.ndarray], RunningNorm, list[float]]:
    """One process, the union of both ranks' batches per step, the same optimizer.

    The one-rank DataParallelStep is Trainer.train_step bit for bit (tested above), so
    this is the service's single-process step. Both sides run in float64: in float32
    Adam turns rounding noise in gradients that are zero in exact arithmetic (the
    attention key biases) into ~1e-6 moves, which would measure float32, not the method.
    """
    trainer = dist_worker.double_trainer()
    dp = DataParallelStep(
        Collectives(DistContext()),
        trainer.model,
        trainer.norm,
        trainer.optimizer,
        grad_clip_norm=trainer.settings.grad_clip_norm,
        scheduler=trainer.scheduler,
    )
    losses = []
    for step, per_rank in enumerate(dist_worker.schedule()):
        union = [item for items in per_rank if items for item in items]
        if step == dist_worker.NAN_STEP or not union:
            losses.append(math.nan)  # the ranks skip these steps together (NaN loss; no data)
            continue
        losses.append(dp.step(collate(union), step=step).loss)
    return {n: p.detach().numpy() for n, p in trainer.model.named_parameters()}, trainer.norm, losses


@pytest.fixture(scope="module")
def worlds(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, tuple[Path, list[subprocess.Popen[bytes]]]]]:
    """All three multi-process scenarios, started at once: their start-up (imports,
    rendezvous) and the hang's timeout overlap instead of adding up."""
    root = tmp_path_factory.mktemp("worlds")
    started = {
        "train": (root / "train", _launch("train", root / "train", timeout_s=60)),
        # rank 1 joins later than DIST_TIMEOUT_S: a slow start is not a failure
        "kill": (
            root / "kill",
            _launch("kill", root / "kill", timeout_s=FAILURE_TIMEOUT_S, late_s=FAILURE_TIMEOUT_S + 2),
        ),
        "hang": (root / "hang", _launch("hang", root / "hang", timeout_s=FAILURE_TIMEOUT_S)),
        "quality": (root / "quality", _launch("quality", root / "quality", timeout_s=60)),
    }
    try:
        yield started
    finally:
        for _, processes in started.values():
            _stop(processes)


FAILURE_TIMEOUT_S = 4.0


def test_two_ranks_train_one_model(worlds: dict[str, tuple[Path, list[subprocess.Popen[bytes]]]]) -> None:
    tmp_path, processes = worlds["train"]
    codes = [p.wait(240) for p in processes]
    assert codes == [0, 0], _logs(tmp_path)
    seen = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    params = [dict(np.load(tmp_path / f"rank{r}-params.npz")) for r in range(2)]

    # lockstep: every rank took the same decisions, flags ORed over the ranks
    strip = [[{k: v for k, v in r.items() if k != "local_real_tokens"} for r in s["reports"]] for s in seen]
    assert json.dumps(strip[0]) == json.dumps(strip[1])
    reports = seen[0]["reports"]
    assert [r["checkpoint"] for r in reports] == [step == 1 for step in range(dist_worker.STEPS)]
    assert [r["publish"] for r in reports] == [step == 3 for step in range(dist_worker.STEPS)]
    assert [r["skipped"] for r in reports] == [None, None, None, "non_finite_loss", None, "no_data", None]
    assert [r["ranks_with_data"] for r in reports] == [2, 2, 1, 2, 1, 0, 2]
    for step, per_rank in enumerate(dist_worker.schedule()):
        union_tokens = sum(len(item) for items in per_rank if items for item in items)
        assert reports[step]["real_tokens"] == union_tokens
        assert sum(s["reports"][step]["local_real_tokens"] for s in seen) == union_tokens
    assert all(s["stop_agreed"] for s in seen)
    assert all(s["lockstep_error"] and "out of lockstep" in s["lockstep_error"] for s in seen)
    assert seen[0]["in_sync"] == 0.0

    # one model: the ranks agree, and equal one process trained on the union of their batches
    expected, norm, losses = _reference_params()
    worst_between_ranks = max(float(np.abs(params[0][n] - params[1][n]).max()) for n in expected)
    worst_vs_union = max(float(np.abs(params[0][n] - expected[n]).max()) for n in expected)
    assert worst_between_ranks <= 1e-6
    assert worst_vs_union <= 1e-6
    moved = max(
        float(np.abs(params[0][n] - dist_worker.double_trainer().model.state_dict()[n].numpy()).max()) for n in expected
    )
    assert moved > 1e-3  # the comparison is not vacuous: training moved the weights
    for step, loss in enumerate(losses):
        if not math.isnan(loss):
            assert reports[step]["loss"] == pytest.approx(loss, rel=1e-9)
    assert int(params[0]["norm_count"]) == norm.count
    np.testing.assert_allclose(params[0]["norm_mean"], norm.mean.numpy(), rtol=1e-12)
    np.testing.assert_allclose(params[0]["norm_m2"], norm.state_dict()["m2"].numpy(), rtol=1e-10)
    np.testing.assert_array_equal(params[0]["norm_mean"], params[1]["norm_mean"])

    # collective checkpoints: the damaged newest one is skipped by every rank together
    union = set()
    for rank, s in enumerate(seen):
        ckpt = s["checkpoints"]
        assert ckpt["saved"]["10"]["ok"] and ckpt["saved"]["20"]["ok"]
        assert ckpt["restored_step"] == 10 and ckpt["topology_changed"] is False
        assert ckpt["restored_items"] == ckpt["saved"]["10"]["items"]
        assert ckpt["restored_offsets"] == ckpt["saved"]["10"]["next_offsets"]
        assert all(int(p) % 2 == rank for p in ckpt["restored_offsets"])
        union |= {tuple(item) for item in ckpt["restored_items"]}
    assert union == {(p, o) for p in range(3) for o in range(25)}


def test_a_dead_or_hung_rank_makes_the_others_fail_within_the_timeout(
    worlds: dict[str, tuple[Path, list[subprocess.Popen[bytes]]]],
) -> None:
    codes = {mode: worlds[mode][1][0].wait(240) for mode in ("kill", "hang")}
    killed = worlds["kill"][1][1].wait(30)
    for mode in ("kill", "hang"):
        out = worlds[mode][0]
        assert (out / "rank1.ready").exists(), _logs(out)
        assert codes[mode] == EXIT_COLLECTIVE_FAILURE, _logs(out)  # the survivor left with its own code
        outcome = json.loads((out / "rank0.json").read_text())
        assert outcome["error"].startswith("CollectiveFailure: rank 0 of 2"), outcome
        assert f"DIST_TIMEOUT_S={FAILURE_TIMEOUT_S:g}" in outcome["error"]
        # detected within the timeout (plus scheduling slack on a loaded machine)
        assert outcome["seconds_after_last_step"] <= FAILURE_TIMEOUT_S + 5.0, outcome
        assert "leaving the training group" in (out / "rank0.log").read_text()
    assert killed == -9
    hang = json.loads((worlds["hang"][0] / "rank0.json").read_text())
    assert hang["seconds_after_last_step"] >= FAILURE_TIMEOUT_S * 0.9  # a hang is noticed by the timeout, not sooner


def test_two_ranks_agree_on_the_gate_rollbacks_and_drift_reactions(
    worlds: dict[str, tuple[Path, list[subprocess.Popen[bytes]]]],
) -> None:
    """Quality decisions that one rank could take alone are taken by all ranks at one step."""
    tmp_path, processes = worlds["quality"]
    codes = [p.wait(240) for p in processes]
    assert codes == [0, 0], _logs(tmp_path)
    seen = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]

    # ranks started with different settings stop with one line naming the setting, on every rank
    for rank, s in enumerate(seen):
        assert s["mismatch"].startswith("D_MODEL differs between the ranks of one group (rank 1 vs rank 0; here, rank ")
        assert f"rank {rank}: {32 if rank == 1 else 64}" in s["mismatch"] and "\n" not in s["mismatch"]

    # one rollback per step: admin before automatic, then the lowest rank; reset ORed
    assert (
        seen[0]["agreed"]
        == seen[1]["agreed"]
        == [
            {"rollback": [1, {"version": 2, "trigger": "admin", "from_version": None}], "reset": False},
            {"rollback": [0, {"version": 3, "trigger": "automatic", "from_version": 5}], "reset": False},
            {"rollback": [1, {"version": 4, "trigger": "automatic", "from_version": 5}], "reset": False},
            {"rollback": None, "reset": True},
        ]
    )

    # the gate and the forecaster judge the union of the holdouts: what one process holding both would decide
    serving, worse, same = dist_worker.gate_models()
    union = dist_worker.gate_monitor([v for rank in range(2) for v in dist_worker.holdout_events(rank)])
    union_training = [v for rank in range(2) for v in dist_worker.training_events(rank)]
    for name, candidate in (("worse", worse), ("same", same)):
        expected = dist_worker.selection_dict(union.select(candidate, serving, lambda: union_training))
        for s in seen:
            got = s["gate"][name]
            assert [got[k] for k in ("publish", "reason", "holdout_events", "kind")] == [
                expected[k] for k in ("publish", "reason", "holdout_events", "kind")
            ]
            assert got["candidate_mse"] == pytest.approx(
                expected["candidate_mse"], rel=1e-6
            )  # float32 forwards, batched otherwise
            assert got["serving_mse"] == pytest.approx(expected["serving_mse"], rel=1e-6)
            if expected["coefficients"] is not None:
                np.testing.assert_allclose(got["coefficients"], expected["coefficients"], rtol=1e-6, atol=1e-9)
        assert seen[0]["gate"][name] == seen[1]["gate"][name]
    assert seen[0]["gate"]["same"]["kind"] != "network"  # on random walks an untrained network does not serve
    assert seen[0]["gate"]["worse"]["publish"] is False and seen[0]["gate"]["same"]["publish"] is True
    # alone, neither rank's holdout is large enough to judge: each would have let the worse one serve
    assert all(
        s["gate"]["worse_alone"]["publish"] is True and "of the 32 events" in s["gate"]["worse_alone"]["reason"]
        for s in seen
    )

    # the lockstep loop: rank 1's admin rollback and rank 0's automatic one, taken by both at the same ticks
    rollbacks = [s["rollbacks"] for s in seen]
    assert rollbacks[0] == rollbacks[1] and len(rollbacks[0]) == 2, rollbacks
    assert {r["trigger"]: r["rank"] for r in rollbacks[0]} == {"admin": 1, "automatic": 0}
    admin = next(r for r in rollbacks[0] if r["trigger"] == "admin")
    assert admin["applied"] and seen[1]["ticket"] == admin and seen[0]["ticket"] is None
    assert seen[0]["registry"] == seen[1]["registry"] and seen[0]["serving"] == seen[1]["serving"]
    assert seen[0]["last_gate"] == seen[1]["last_gate"] and seen[0]["last_gate"]["holdout_events"] == 20
    # rank 0's drift reaction cleared AdamW's moments on both ranks at one tick: still one model
    assert seen[0]["resets"] == seen[1]["resets"] and len(seen[0]["resets"]) == 1
    assert seen[0]["in_sync"] == 0.0 and seen[0]["steps"] == seen[1]["steps"] > 0
    assert seen[0]["answers"] == seen[1]["answers"]  # the serving version answers alike on every rank
    assert all(s["staged_ahead"] > 0 for s in seen)  # batches were staged one tick ahead (CPU: the same path)
