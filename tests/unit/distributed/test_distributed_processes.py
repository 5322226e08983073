"""Several ranks as real processes: one model trained by two, and a dead or hung rank.

The tests start real processes the way torchrun does (WORLD_SIZE, RANK, LOCAL_RANK,
MASTER_ADDR, MASTER_PORT in the environment; gloo over localhost), running
``tests/unit/dist_worker.py``; every rank writes what it saw and this file checks it.
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

from streamtrain.data import collate
from streamtrain.distributed.collectives import EXIT_COLLECTIVE_FAILURE, Collectives
from streamtrain.distributed.data_parallel import DataParallelStep
from streamtrain.distributed.launch import DistContext, free_port
from streamtrain.model.normalization import RunningNorm

REPO = Path(__file__).resolve().parents[3]
WORKER = Path(__file__).resolve().parents[1] / "dist_worker.py"  # tests/unit: shared with test_lockstep.py


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
        assert (ckpt["saved"]["10"]["kind"], ckpt["saved"]["20"]["kind"]) == ("base", "delta")
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
        expected = dist_worker.selection_dict(union.select(candidate, serving, lambda: (union_training, 1.0)))
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
