"""One rank of the DP scale-out tests in distributed/test_dp_group.py, launched as torchrun would.

``python dp_group_worker.py PHASE OUT_DIR``: the rank joins a gloo group through ``env://``,
runs the DP engine of one phase of a 2 → 1 → 2 history on a shared admission record and
clock log (``OUT_DIR/admissions``, ``OUT_DIR/checkpoints/dp-clock.jsonl``), and writes what it
saw to ``OUT_DIR/<phase>-rank<r>.json``. The one-process phase and the reference run in the
test process with the same functions. Not a test module (no ``test_`` prefix).
"""

from __future__ import annotations

import json
import logging
import math
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from streamtrain.distributed.collectives import Collectives
from streamtrain.distributed.launch import DistContext
from streamtrain.events import EventBatch, SensorEvent
from streamtrain.model.network import SensorModel
from streamtrain.privacy import AdmissionRecord, DPConfig, DPEngine
from streamtrain.privacy.group import DPGroup
from streamtrain.privacy.noise import DiscreteGaussianNoise

#: q0 = 1 with a constant schedule: every eligible record is in every batch, so which records a
#: step sums is fixed, and the one-process reference can be computed exactly.
CONFIG = dict(noise_multiplier=1.0, clip_norm=0.5, q0=1.0, half_life_steps=math.inf, eligible_steps=3,
              admit_per_step=8, step_rate_hz=10.0, delta=1e-6, target_epsilon=1e6, expected_units=1e3)  # fmt: skip
NOISE_SEED = 1234
LENGTH = 8  # every event this long: each record is its own micro-batch of one, with no padding

#: phase -> clock step -> partition -> offsets arriving for that step. Phase "two" is killed
#: (SIGKILL) after step 5, which is never synced; "one" (one process) and "again" (two ranks)
#: re-offer offsets that were decided before, which must never be admitted twice.
ARRIVALS: dict[str, dict[int, dict[int, list[int]]]] = {
    "two": {1: {0: [0, 1, 2], 1: [0, 1]}, 2: {1: [2, 3, 4]}, 5: {0: [3], 1: [5]}},
    "one": {1: {0: [2, 3, 4], 1: [4, 5, 6]}, 2: {0: [5]}},  # its steps continue after the record's last
    "again": {1: {0: [4, 5, 6, 7], 1: [6, 7]}},
}
STEPS = {"two": 5, "one": 3, "again": 4}  # clock steps each phase runs (after the one it resumed at)
SYNCED = {"two": 4, "one": 3, "again": 4}  # the record is synced after this many of them


class SeededBits:
    """A seeded bit source for the noise (the service's is the OS CSPRNG, which cannot be seeded)."""

    def __init__(self, seed: int) -> None:
        self.rng = np.random.default_rng(seed)

    def raw_uint64(self, n: int) -> np.ndarray:
        return self.rng.integers(0, 2**64, size=n, dtype=np.uint64, endpoint=False)


class RecordingNoise:
    """Records every draw: the tests count them (one per step for the whole group)."""

    def __init__(self, seed: int) -> None:
        self.inner = DiscreteGaussianNoise(SeededBits(seed))
        self.draws: list[np.ndarray] = []

    def sample(self, sigma_squared: Any, n: int) -> np.ndarray:
        draw = self.inner.sample(sigma_squared, n)
        self.draws.append(draw.copy())
        return draw


def event(partition: int, offset: int) -> SensorEvent:
    rng = np.random.default_rng(1000 * partition + offset)
    return SensorEvent(f"s{partition}-{offset}", 1e9, rng.normal(size=(LENGTH, 1)).astype(np.float32))


def batch(partitions: dict[int, list[int]]) -> EventBatch:
    pairs = [(p, o) for p in sorted(partitions) for o in partitions[p]]
    return EventBatch.from_events([event(p, o) for p, o in pairs], [p for p, _ in pairs], [o for _, o in pairs])


def engine(
    root: Path, group: DPGroup | None, writer: str | None = None, record: bool = True
) -> tuple[DPEngine, RecordingNoise, list[torch.Tensor]]:
    """A DP engine of the test model: the same initial weights on every rank and in the reference."""
    torch.manual_seed(0)
    model = SensorModel(1, d_model=16, n_heads=2, n_layers=1, max_len=32)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    admissions = (
        AdmissionRecord(root / "admissions", root / "checkpoints" / "dp-clock.jsonl", writer=writer) if record else None
    )
    dp = DPEngine(model, optimizer, DPConfig(**CONFIG), 256, max_micro_batch_sequences=1, record=admissions,
                  group=group)  # fmt: skip
    noise = RecordingNoise(NOISE_SEED)
    dp.noise = noise  # type: ignore[assignment]
    updates: list[torch.Tensor] = []
    dp.on_update = lambda flat: updates.append(flat.clone())
    return dp, noise, updates


def tick(k: int) -> float:
    """Just after step k is due on the 10 Hz clock anchored at 0 (clear of float rounding)."""
    return k / 10 + 1e-3


def run_phase(
    dp: DPEngine, phase: str, owned: list[int] | None, *, now_skew: float = 0.0,
    on_synced: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:  # fmt: skip
    """Resume from the record, then run the phase's steps, admitting its arrivals of ``owned`` partitions.

    Without a record (the reference) the engine starts at step 0 and nothing is synced.
    """
    start = dp.resume(dp.record.load()) if dp.record is not None else 0
    if owned is not None:
        dp.window.own(owned, {})
    assert dp.step(now_skew) is None  # anchors the clock: step start + 1 is due at 0.1
    writer = None if dp.record is None else dp.record.writer
    result: dict[str, Any] = {"start": start, "epsilon": [], "steps": [], "writer": writer}
    for k in range(1, STEPS[phase] + 1):
        arriving = {p: o for p, o in ARRIVALS[phase].get(k, {}).items() if owned is None or p in owned}
        if arriving:
            assert dp.admit(batch(arriving), now=tick(k - 1) + 0.05 + now_skew) == start + k
        report = dp.step(tick(k) + now_skew)
        assert report is not None and report.step == start + k and not report.failed, report
        result["steps"].append(report.step)
        result["epsilon"].append(dp.epsilon_spent())
        if k == SYNCED[phase]:
            result["synced"] = dp.sync_record() if dp.record is not None else None
            if on_synced is not None:  # what the parent checks is out before a SIGKILL
                on_synced(result)
    return result


def main() -> None:
    phase, out = sys.argv[1], Path(sys.argv[2])
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    torch.set_num_threads(1)
    ctx = DistContext.from_env()
    collectives = Collectives(ctx, backend="gloo", timeout_s=60).start()
    # rank 1 is built with a writer name of its own: the group must write under rank 0's
    dp, noise, updates = engine(out, DPGroup(collectives), writer=None if ctx.rank == 0 else "rank1-own-name")
    name = f"{phase}-rank{ctx.rank}"

    def save(result: dict[str, Any]) -> None:
        result.update(
            draws=len(noise.draws),
            admit_per_step=dp.window.admit_per_step,
            params={n: p.detach().numpy().tolist() for n, p in dp.model.named_parameters()},
        )
        np.save(out / f"{name}-updates.npy", torch.stack(updates).numpy())
        if noise.draws:
            np.save(out / f"{name}-draws.npy", np.stack(noise.draws))
        (out / f"{name}.json").write_text(json.dumps(result))

    # rank 1's clock runs 30 ms behind rank 0's: rank 0's decides
    run_phase(dp, phase, [ctx.rank], now_skew=0.03 * ctx.rank, on_synced=save)
    if phase == "two":  # a crash: step 5 ran on both ranks, but its decisions were never made durable
        os.kill(os.getpid(), signal.SIGKILL)
    collectives.close()


if __name__ == "__main__":
    main()
