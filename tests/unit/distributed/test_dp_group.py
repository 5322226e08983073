"""DP on scale-out: two ranks as real processes (gloo) are one DP mechanism over the union.

A 2 → 1 → 2 history on one admission record and one clock log: two ranks (killed with
SIGKILL after a step they never made durable), one process, two ranks again
(``tests/unit/dp_group_worker.py``). Checked: the group's integer update is exactly the
one-process integer sum over the union of the ranks' records plus exactly one noise draw,
bit for bit on both ranks; ε is the same on both ranks and the one-process accountant's; the
clock continues across the rescales and no event is admitted twice or eligible more than K
steps, from the record alone.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import dp_group_worker as worker
import numpy as np
import pytest
import torch

from streamtrain.distributed.launch import free_port
from streamtrain.privacy.accounting import PerEventAccountant
from streamtrain.privacy.admissions import _read_lines, participation
from streamtrain.privacy.config import DPConfig
from streamtrain.privacy.group import DPGroup, GroupError, admit_share

REPO = Path(__file__).resolve().parents[3]
WORKER = Path(worker.__file__).resolve()
K = int(worker.CONFIG["eligible_steps"])


def _launch(phase: str, out: Path) -> list[subprocess.Popen[bytes]]:
    port = free_port()
    python_path = os.pathsep.join([str(REPO / "src"), str(WORKER.parent), os.environ.get("PYTHONPATH", "")])
    processes = []
    for rank in range(2):
        env = dict(os.environ, WORLD_SIZE="2", RANK=str(rank), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), PYTHONPATH=python_path)  # fmt: skip
        log = open(out / f"{phase}-rank{rank}.log", "wb")  # noqa: SIM115 - closed with the process
        processes.append(
            subprocess.Popen([sys.executable, str(WORKER), phase, str(out)], env=env, stdout=log, stderr=log)
        )
    return processes


def _wait(processes: list[subprocess.Popen[bytes]], out: Path, phase: str, codes: set[int]) -> None:
    # generous: each rank imports torch and dp-accounting (~11 s of CPU) on two cores shared with
    # another test worker
    deadline = time.monotonic() + 300
    returned: list[int | None] = []
    try:
        for p in processes:
            try:
                returned.append(p.wait(max(1.0, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                returned.append(None)
    finally:
        for p in processes:
            if p.poll() is None:
                p.kill()
    logs = "\n".join((out / f"{phase}-rank{r}.log").read_text(errors="replace")[-3000:] for r in range(2))
    assert set(returned) <= codes, f"{phase}: exit codes {returned} (None: still running after 300 s)\n{logs}"


def _rank(out: Path, phase: str, rank: int) -> dict:
    return json.loads((out / f"{phase}-rank{rank}.json").read_text())


@pytest.fixture(scope="module")
def history(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two ranks (SIGKILLed after an unsynced step), one process, two ranks: one record throughout."""
    out = tmp_path_factory.mktemp("dp-group")
    _wait(_launch("two", out), out, "two", {-signal.SIGKILL})
    one, noise, _ = worker.engine(out, None)
    (out / "one.json").write_text(json.dumps({**worker.run_phase(one, "one", None), "draws": len(noise.draws)}))
    _wait(_launch("again", out), out, "again", {0})
    return out


def _reference() -> tuple[list[torch.Tensor], list[np.ndarray], list[float], dict[str, np.ndarray]]:
    """One process over the union of both ranks' arrivals (R = 8), the same noise seed as rank 0."""
    dp, noise, updates = worker.engine(Path("/nonexistent"), None, record=False)
    params: dict[str, np.ndarray] = {}

    def snapshot(_: dict) -> None:  # after the steps the ranks saved (before the unsynced step 5)
        params.update({n: p.detach().numpy().copy() for n, p in dp.model.named_parameters()})

    result = worker.run_phase(dp, "two", None, on_synced=snapshot)
    return updates, noise.draws, result["epsilon"], params


def test_two_ranks_release_the_union_sum_plus_one_noise_draw(history: Path) -> None:
    ranks = [_rank(history, "two", r) for r in range(2)]
    updates = [np.load(history / f"two-rank{r}-updates.npy") for r in range(2)]
    synced = worker.SYNCED["two"]
    assert [u.shape[0] for u in updates] == [synced, synced]
    # one draw per step for the whole group: rank 0 draws, rank 1 never does
    assert ranks[0]["draws"] == synced and ranks[1]["draws"] == 0
    assert not (history / "two-rank1-draws.npy").exists()
    draws = np.load(history / "two-rank0-draws.npy")
    # every rank holds the same integer update, bit for bit
    np.testing.assert_array_equal(updates[0], updates[1])
    reference_updates, reference_draws, reference_epsilon, reference_params = _reference()
    np.testing.assert_array_equal(np.stack(reference_draws[:synced]), draws)  # the same one draw per step
    for step in range(synced):
        union_sum = reference_updates[step].numpy() - reference_draws[step]  # one process, the union, exact
        group_sum = updates[0][step] - draws[step]
        np.testing.assert_array_equal(group_sum, union_sum)  # exactly: int64 all the way
        if step < 3:  # records were in the batch: the sum is not the noise alone
            assert np.abs(union_sum).sum() > 0
    # what the ranks trained is the one-process model over the union
    for name, value in reference_params.items():
        np.testing.assert_array_equal(np.asarray(ranks[0]["params"][name], dtype=np.float32), value)
        np.testing.assert_array_equal(np.asarray(ranks[1]["params"][name], dtype=np.float32), value)
    # the ranks share R = 8 per step (4 + 4): the group admits what one process would
    assert [r["admit_per_step"] for r in ranks] == [4, 4]
    # ε: identical on both ranks, the one-process accountant's at the same clock step
    assert ranks[0]["epsilon"] == ranks[1]["epsilon"] == reference_epsilon[:synced]
    dimension = sum(np.asarray(value).size for value in ranks[0]["params"].values())
    accountant = PerEventAccountant.for_config(DPConfig(**worker.CONFIG), dimension=dimension)
    assert ranks[0]["epsilon"] == [accountant.epsilon_after(min(t, K)) for t in range(1, synced + 1)]
    # one writer for the group: rank 1 writes under rank 0's name
    assert ranks[1]["writer"] == ranks[0]["writer"] != "rank1-own-name"


def test_the_clock_and_the_record_survive_a_kill_and_rescaling_2_1_2(history: Path) -> None:
    two = [_rank(history, "two", r) for r in range(2)]
    one = json.loads((history / "one.json").read_text())
    again = [_rank(history, "again", r) for r in range(2)]
    # the clock continues after the last durable step: the killed, unsynced step 5 is run again once
    assert two[0]["steps"] == two[1]["steps"] == [1, 2, 3, 4]
    assert two[0]["synced"] == two[1]["synced"] == 4  # every rank knows the step its record is durable to
    assert one["start"] == 4 and one["steps"] == [5, 6, 7]
    assert again[0]["start"] == again[1]["start"] == 7
    assert again[0]["steps"] == again[1]["steps"] == [8, 9, 10, 11]
    assert again[0]["epsilon"] == again[1]["epsilon"]
    clock = [int(e["s"]) for e in _read_lines(history / "checkpoints" / "dp-clock.jsonl")]
    assert clock == list(range(1, 12))  # one line per step of the group: rank 1 writes none, no step twice
    # from the record alone: every event admitted once, eligible in at most K steps (here exactly K)
    record = participation(history / "admissions", history / "checkpoints" / "dp-clock.jsonl")
    admitted = dict(record.admissions)
    expected = {(0, 0): 1, (0, 1): 1, (0, 2): 1, (1, 0): 1, (1, 1): 1, (1, 2): 2, (1, 3): 2, (1, 4): 2,
                (0, 3): 5, (0, 4): 5, (1, 5): 5, (1, 6): 5, (0, 5): 6, (0, 6): 8, (0, 7): 8, (1, 7): 8}  # fmt: skip
    assert {event: steps for event, steps in admitted.items()} == {e: [s] for e, s in expected.items()}
    # K steps each, but for (0, 5): admitted at step 6, two steps before the rescale at 7, whose
    # restart (no checkpoint) makes the admissions of steps 1..7 a gap, never eligible again
    assert {e: n for e, n in record.steps.items() if n != K} == {(0, 5): 2}
    assert len(set(w for ws in record.writers.values() for w in ws)) == 1  # the group and the process: one writer


class _LocalGroup:
    """Rank ``rank`` of a group whose peers are at ``peer_step`` and ``peer_ok`` (in-process double)."""

    def __init__(self, rank: int, world_size: int, peer_step: float | None = None, peer_ok: bool = True) -> None:
        self.rank, self.world_size, self.peer_step, self.peer_ok = rank, world_size, peer_step, peer_ok

    def all_reduce_(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        if self.peer_step is not None and op == "max":
            tensor.copy_(torch.maximum(tensor, torch.tensor([self.peer_step, -self.peer_step], dtype=tensor.dtype)))
        return tensor

    def broadcast_(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        return tensor

    def agree_all(self, ok: bool) -> bool:
        return ok and self.peer_ok


def test_ranks_at_different_clock_steps_stop_instead_of_drifting() -> None:
    group = DPGroup(_LocalGroup(0, 2, peer_step=6.0))
    with pytest.raises(GroupError, match="different clock steps"):
        group.agree_due(True, 0.0, 5)
    assert DPGroup(_LocalGroup(0, 2, peer_step=5.0)).agree_due(True, 0.0, 5) == (True, 0.0)


def test_admissions_are_shared_so_the_group_admits_r_per_step() -> None:
    for r in (2, 3, 8, 64, 65):
        for world in (2, 3, 4):
            if r >= world:
                shares = [admit_share(r, rank, world) for rank in range(world)]
                assert sum(shares) == r and min(shares) >= 1
    with pytest.raises(ValueError, match="DP_ADMIT_PER_STEP=2 with WORLD_SIZE=3"):
        DPGroup(_LocalGroup(0, 3)).admit_share(2)


def test_a_rank_that_cannot_sync_its_record_stops_every_rank_before_the_clock_is_written(tmp_path: Path) -> None:
    dp, _, _ = worker.engine(tmp_path, DPGroup(_LocalGroup(0, 2, peer_ok=False)))
    assert dp.record is not None
    dp.resume(dp.record.load())
    dp.step(0.0)
    dp.admit(worker.batch({0: [0, 1]}), now=0.05)
    assert dp.step(worker.tick(1)) is not None
    with pytest.raises(OSError, match="another rank of the DP group could not sync"):
        dp.sync_record()
    assert (tmp_path / "admissions" / "partition-0.jsonl").exists()  # this rank's own part is durable
    assert not (tmp_path / "checkpoints" / "dp-clock.jsonl").exists()  # but the group's clock does not show step 1
    assert dp.record.synced_step == 0
