"""One-run privacy audit of the DP path (Steinke, Nasr & Jagielski 2023, "Privacy auditing with one (1) training run").

m canary events are drawn; each is put into the stream with probability 1/2, independently
(S_i = +1) or kept out (S_i = -1). The service's real DP path — :class:`DPEngine` with its
DP window (admission, K-step eligibility), Poisson sampling from the OS CSPRNG, per-record
clipping on the integer grid, exact discrete Gaussian noise and the public divisor — trains
on the simulator's stream with the in-canaries mixed in, on a simulated public clock.
Canary i is a length-1 event labelled with its own class i of the model's classification
head (a mislabelled-example canary, SNJ23): only canary i ever pulls class i's row. From
the final model alone (white box) the auditor scores every canary by how far its class's
row moved along the direction its own gradient points at the public initial model,
guesses "in" for the k highest
scores and "out" for the k lowest, abstains on the rest, and counts the correct guesses.

For an (ε, δ)-DP mechanism, the number of correct guesses out of r is stochastically
dominated by Binomial(r, e^ε / (1 + e^ε)) plus a δ term (SNJ23, Theorem 3.3 and their
Algorithm for δ > 0); the empirical lower bound is the largest ε that the observed count
rejects at confidence 1 - β (several k are tried, Bonferroni-corrected). It must stay below
the claimed ε. Two deliberately broken variants show that the audit can fail:

* ``no_noise``: the same path without the noise;
* ``readmit``: the admission record disabled, as if the service crashed and restarted
  ``--crashes`` times and admitted the re-read events again each time.

With ``--ranks N`` (N > 1) the same audit runs on the group path: N processes join a gloo
group on 127.0.0.1 and train one model with ``DPEngine(group=DPGroup(...))`` on rank 0's
public clock. The stream and the in-canaries are split by event offset mod N, so each canary
lives on exactly one rank; the integer sums are all-reduced, rank 0 alone draws the noise, and
each rank admits its share of R. Rank 0's final model (checked equal to every rank's, bit for
bit) is audited. The broken variants break the group path: ``no_noise`` leaves the group's sum
with no draw at all, ``readmit`` clears every rank's admission watermarks at each "crash".

Run: ``python bench/dp_audit.py [--canaries M] [--ranks N] [--json]`` (a few minutes on a CPU).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from scipy import stats

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _table import Row, emit  # noqa: E402

from streamtrain.data.collate import collate  # noqa: E402
from streamtrain.distributed.collectives import Collectives  # noqa: E402
from streamtrain.distributed.launch import DistContext, free_port  # noqa: E402
from streamtrain.events import EventBatch, EventLimits, SensorEvent, decode_batch  # noqa: E402
from streamtrain.model.network import SensorModel  # noqa: E402
from streamtrain.privacy import DPConfig, DPEngine  # noqa: E402
from streamtrain.privacy.group import DPGroup  # noqa: E402
from streamtrain.tools.sensor_fleet import SensorFleet  # noqa: E402
from streamtrain.tools.simulation_config import SimulationConfig  # noqa: E402

BENCH = "dp_audit"
CANARY_PARTITION = 1  # canaries and background come from different partitions of the audit stream


# --------------------------------------------------------------------------------------------
# the bound (SNJ23): a p-value for "the mechanism is (ε, δ)-DP" given v correct of r guesses
# --------------------------------------------------------------------------------------------


def p_value(m: int, r: int, v: int, epsilon: float, delta: float) -> float:
    """P[at least v of r guesses correct] for any (ε, δ)-DP mechanism, m canaries (upper bound).

    The pure-ε part is the binomial tail at p = e^ε / (1 + e^ε); the δ part adds
    ``2 m δ α`` with ``α = max_i P[v - i <= Binomial < v] / i`` (SNJ23, Section 5).
    """
    if v <= 0:
        return 1.0
    q = 1.0 / (1.0 + math.exp(-epsilon))
    tail = float(stats.binom.sf(v - 1, r, q))
    below = stats.binom.pmf(np.arange(v - 1, -1, -1), r, q)  # P[Binomial = v - i], i = 1..v
    alpha = float(np.max(np.cumsum(below) / np.arange(1, v + 1)))
    return min(1.0, tail + 2.0 * m * delta * alpha)


def epsilon_lower_bound(m: int, r: int, v: int, delta: float, beta: float) -> float:
    """The largest ε rejected at level β by v correct guesses out of r (0 if none is)."""
    if r == 0 or p_value(m, r, v, 0.0, delta) >= beta:
        return 0.0
    low, high = 0.0, 1.0
    while p_value(m, r, v, high, delta) < beta:
        low, high = high, high * 2
        if high > 200:
            return float("inf")
    for _ in range(50):
        middle = (low + high) / 2
        low, high = (middle, high) if p_value(m, r, v, middle, delta) < beta else (low, middle)
    return low


# --------------------------------------------------------------------------------------------
# the audited run
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class AuditResult:
    variant: str
    claimed_epsilon: float
    lower_bound: float
    best_k: int
    correct: int
    guesses: int
    canaries_in: int
    seconds: float


class NoNoise:
    """The broken variant's noise: none at all."""

    def sample(self, sigma_squared: object, n: int) -> np.ndarray:
        return np.zeros(n, dtype=np.int64)


def canary_events(chunk: np.ndarray, length: int, now: float) -> EventBatch:
    """Canary i: a flat event labelled with class i, its own class (a mislabelled-example
    canary, as in SNJ23): only canary i ever asks for class i. Length 1: no forecast loss,
    so its whole clipped gradient is the classification term."""
    flat = np.zeros((length, 1), np.float32)
    events = [SensorEvent(f"canary-{i}", now, flat, label=int(i)) for i in chunk.tolist()]
    return EventBatch.from_events(events, partitions=[CANARY_PARTITION] * chunk.size, offsets=chunk.tolist())


def rank_share(batch: EventBatch, rank: int, ranks: int) -> EventBatch:
    """The events of ``batch`` that rank ``rank`` of ``ranks`` admits: offset mod ``ranks``."""
    if ranks == 1:
        return batch
    rows = np.flatnonzero(batch.offsets % ranks == rank)
    return EventBatch.from_events([batch.event(int(i)) for i in rows], batch.partitions[rows], batch.offsets[rows])


def hidden(model: SensorModel, engine: DPEngine, length: int) -> torch.Tensor:
    """The canaries' (shared) last hidden state under ``model``: what the class head reads."""
    batch = collate([np.zeros((length, 1), np.float32)])
    captured: list[torch.Tensor] = []
    handle = model.final_norm.register_forward_hook(lambda module, inputs, output: captured.append(output.detach()))
    try:
        with torch.no_grad():
            model(engine.norm.normalize(batch.values).float(), batch.mask)
    finally:
        handle.remove()
    return captured[0][0, length - 1].double()


def head(model: SensorModel) -> torch.Tensor:
    """[classes, d + 1]: each class's weight row and bias."""
    assert model.class_head is not None
    return torch.cat([model.class_head.weight.detach(), model.class_head.bias.detach()[:, None]], dim=1).double()


def run_audit(
    args: argparse.Namespace, variant: str, seed: int, group: DPGroup | None = None
) -> tuple[AuditResult, torch.Tensor]:
    """One audited training run (on this rank of ``group``, if any); the result and the final flat parameters."""
    rank, ranks = (0, 1) if group is None else (group.rank, group.world_size)
    started = time.perf_counter()
    torch.manual_seed(args.seed)  # the initial model is public
    rng = np.random.default_rng(
        seed
    )  # the auditor's randomness (which canaries go in); the mechanism's is the OS CSPRNG
    m = args.canaries
    model = SensorModel(1, n_classes=m, d_model=args.d_model, n_heads=2, n_layers=1, max_len=64)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    config = DPConfig(
        noise_multiplier=args.sigma, clip_norm=args.clip, q0=args.q0, eligible_steps=args.eligible_steps,
        admit_per_step=args.admit_per_step, step_rate_hz=2.0, delta=args.delta, expected_units=args.expected_units,
        target_epsilon=100.0,
    )  # fmt: skip
    engine = DPEngine(model, optimizer, config, args.token_budget, max_micro_batch_sequences=512, group=group)
    if variant == "no_noise":
        engine.noise = NoNoise()  # on every rank: in a group, rank 0's (the only) draw is gone
    member = rng.random(m) < 0.5
    inserted = np.flatnonzero(member)
    direction = torch.cat([hidden(model, engine, args.canary_length), torch.ones(1, dtype=torch.float64)])
    direction /= direction.norm()  # where a canary's own class row moves when it is trained on (public: initial model)
    before = head(model)
    fleet = SensorFleet(
        SimulationConfig(sensors=16, seed=seed, length_median=args.canary_length, length_sigma=0.3, max_len=64)
    )
    limits = EventLimits(max_len=64)
    rounds = args.crashes + 1 if variant == "readmit" else 1
    now, offset, step = 1000.0, 0, 0
    engine.step(now)
    for _ in range(rounds):
        # all in-canaries arrive for one step (R leaves room for every one), then K steps of eligibility
        for k in range(args.eligible_steps):
            background = args.background if k else max(0, min(args.background, args.admit_per_step - inserted.size))
            fleet_batch = fleet.generate_batch(background, now=now)
            stream = decode_batch(
                fleet_batch.values, limits, now + 2, [0] * background, list(range(offset, offset + background))
            )
            offset += background
            engine.admit(rank_share(stream.events, rank, ranks), now=now + 0.1)
            if k == 0:  # canary i is offset i: it lives on rank i mod N only
                mine = inserted[inserted % ranks == rank]
                engine.admit(canary_events(mine, args.canary_length, now), now=now + 0.2)
            step += 1
            now = 1000.0 + step / 2.0 + 1e-3
            engine.step(now)
        if variant == "readmit":
            engine.window.watermarks.clear()  # the bug: no admission record survives the "crash" (every rank)
    scores = ((head(model) - before) @ direction).numpy()  # how far each class's row moved toward its canary
    order = np.argsort(-scores)  # the highest (most likely "in") first
    best = (0.0, 0, 0, 0)
    beta = args.beta / len(args.k)  # Bonferroni over the guess counts tried
    for k in args.k:  # guess "in" for the k highest scores, abstain on the rest
        correct = int(member[order[:k]].sum())
        bound = epsilon_lower_bound(m, k, correct, args.delta, beta)
        if bound > best[0] or best[2] == 0:
            best = (bound, k, correct, k)
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return AuditResult(variant, engine.accountant.epsilon_cap, best[0], best[3], best[2], best[1], int(member.sum()),
                       time.perf_counter() - started), flat  # fmt: skip


def rank_worker(args: argparse.Namespace) -> None:
    """One rank of ``--ranks N`` (launched by :func:`run_ranks` through ``env://``): every variant on
    the group path; writes its final parameters per variant, and rank 0 its audit results."""
    out = Path(args.worker)
    collectives = Collectives(DistContext.from_env(), backend="gloo", timeout_s=600).start()
    try:
        group = DPGroup(collectives)
        results = {}
        for variant in args.variants:
            result, flat = run_audit(args, variant, args.seed + 1, group)
            np.save(out / f"{variant}-rank{group.rank}.npy", flat.numpy())
            results[variant] = result.__dict__
        if group.rank == 0:
            (out / "results.json").write_text(json.dumps(results))
    finally:
        collectives.close()


def run_ranks(args: argparse.Namespace, argv: list[str]) -> tuple[dict[str, AuditResult], dict[str, bool]]:
    """Spawn ``args.ranks`` processes in one gloo group on 127.0.0.1; rank 0's results, and per
    variant whether every rank's final parameters equal rank 0's bit for bit."""
    root = Path(__file__).resolve().parents[1]
    port = free_port()
    python_path = os.pathsep.join([str(root / "src"), os.environ.get("PYTHONPATH", "")])
    with tempfile.TemporaryDirectory(prefix="dp-audit-") as tmp:
        out = Path(tmp)
        processes = []
        for rank in range(args.ranks):
            env = dict(os.environ, WORLD_SIZE=str(args.ranks), RANK=str(rank), LOCAL_RANK=str(rank),
                       LOCAL_WORLD_SIZE=str(args.ranks), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                       PYTHONPATH=python_path)  # fmt: skip
            command = [sys.executable, str(Path(__file__).resolve()), *argv, "--worker", tmp]
            processes.append(subprocess.Popen(command, env=env))
        try:
            codes = [p.wait() for p in processes]
        finally:
            for p in processes:
                if p.poll() is None:
                    p.kill()
        if any(codes):
            raise SystemExit(f"dp_audit --ranks {args.ranks}: rank exit codes {codes}")
        results = {v: AuditResult(**r) for v, r in json.loads((out / "results.json").read_text()).items()}
        identical = {}
        for variant in args.variants:
            flats = [np.load(out / f"{variant}-rank{r}.npy") for r in range(args.ranks)]
            identical[variant] = all(np.array_equal(flats[0], f) for f in flats[1:])
    return results, identical


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--canaries", type=int, default=600, help="m: canaries, each in with probability 1/2")
    parser.add_argument("--canary-length", type=int, default=1)
    parser.add_argument("--background", type=int, default=32, help="simulator events per step beside the canaries")
    parser.add_argument("--sigma", type=float, default=4.0)
    parser.add_argument("--clip", type=float, default=1.0)
    parser.add_argument("--q0", type=float, default=0.5)
    parser.add_argument("--eligible-steps", type=int, default=4)
    parser.add_argument("--admit-per-step", type=int, default=400, help="R: room for every canary in one step")
    parser.add_argument("--token-budget", type=int, default=4096)
    parser.add_argument("--delta", type=float, default=1e-6)
    parser.add_argument("--expected-units", type=float, default=1e4)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--d-model", type=int, default=8)
    parser.add_argument(
        "--crashes", type=int, default=599, help="readmit variant: restarts without the admission record"
    )
    parser.add_argument("--k", type=int, nargs="+", default=[25, 50, 100, 200], help="guess counts tried")
    parser.add_argument("--beta", type=float, default=0.05, help="1 - confidence of the lower bound")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--variants", nargs="+", default=["dp", "no_noise", "readmit"])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--ranks", type=int, default=1, help="N: ranks of one DP group (gloo, 127.0.0.1)")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # internal: one rank of --ranks N
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.worker is not None:
        rank_worker(args)
        return
    identical: dict[str, bool] = {}
    if args.ranks > 1:
        results, identical = run_ranks(args, sys.argv[1:] if argv is None else list(argv))
    else:
        results = {variant: run_audit(args, variant, args.seed + 1)[0] for variant in args.variants}
    claimed = next(iter(results.values())).claimed_epsilon
    rows = []
    for variant, result in results.items():
        target = "< claimed" if variant == "dp" else "> claimed (the audit can fail)"
        rows.append(
            Row(
                BENCH,
                f"empirical epsilon lower bound, {variant} vs claimed epsilon",
                result.lower_bound,
                claimed,
                target,
            )
        )
        rows.append(
            Row(
                BENCH,
                f"{variant}: correct of {result.guesses} guesses (k={result.best_k}, {result.canaries_in} canaries in)",
                float(result.correct),
                float(result.guesses),
            )
        )
        if variant in identical:
            rows.append(
                Row(
                    BENCH,
                    f"{variant}: final parameters identical on all {args.ranks} ranks (1 = yes)",
                    float(identical[variant]),
                    1.0,
                    "1",
                )
            )
    emit(rows, args.json)


if __name__ == "__main__":
    main()
