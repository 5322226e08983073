"""Sampling policies on a skewed fleet: per-sensor share concentration, per-batch label mix, padding, cost.

A stream from ``--sensors`` sensors whose rates follow a Zipf law (exponent ``--skew``: the
chattiest sensor sends about half the events) fills a window of ``--items`` events;
before every pass ``--arrivals`` new events arrive. Labels follow the length (short
events are mostly class 0, long ones class 2), the case where length bucketing separates
the classes. Every policy sees the same events in the same order and draws ``--passes``
bounded passes of ``--pass-items`` items (fresh share 0.5, the service's default), each
planned into token-budget batches as the service does (``PassSampler.select`` then
``plan_batches``). Figures are means over the passes:

* ``sensor_top_share``: the chattiest sensor's share of a pass (the window's, as baseline
  of the uniform row); ``sensor_hhi``: normalized Herfindahl index over the window's
  sensors, 0 = every sensor the same share, 1 = one sensor only.
* ``label_deviation``: mean over batches of the total-variation distance between a
  batch's label mix and its pass's.
* ``padding_share`` and ``ms_per_pass`` (select + plan) against the uniform policy.
* curriculum: the mean length rank (0 = shortest, 1 = longest) of the replayed items in
  the first and in the last five passes, as ``beta`` halves every
  ``--curriculum-half-life`` planned steps.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _table import Row, emit  # noqa: E402

from streamtrain.data.bucketing import TokenBudget, plan_batches  # noqa: E402
from streamtrain.data.passes import PassSampler  # noqa: E402
from streamtrain.data.policies import SamplingPolicy, concentration, make_policy  # noqa: E402
from streamtrain.data.randomness import make_randomness  # noqa: E402
from streamtrain.events import EventBatch  # noqa: E402
from streamtrain.window.reservoir import RecencyWindow  # noqa: E402

BENCH = "sampling"


@dataclass
class Outcome:
    name: str
    top_share: list[float] = field(default_factory=list)
    hhi: list[float] = field(default_factory=list)
    window_top_share: list[float] = field(default_factory=list)
    window_hhi: list[float] = field(default_factory=list)
    label_deviation: list[float] = field(default_factory=list)
    padding_share: list[float] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)
    replay_length_rank: list[float] = field(default_factory=list)

    def mean(self, name: str, part: slice = slice(None)) -> float:
        values = getattr(self, name)[part]
        return float(np.mean(values)) if values else math.nan


def fleet_events(count: int, first_seq: int, args: argparse.Namespace, rng: np.random.Generator) -> EventBatch:
    rates = np.arange(1, args.sensors + 1, dtype=np.float64) ** -args.skew
    sensors = rng.choice(args.sensors, count, p=rates / rates.sum())
    lengths = np.clip(np.round(rng.lognormal(np.log(48), 0.8, count)), 4, 512).astype(np.int64)
    length_rank = np.log(lengths / 48.0) / 0.8  # about N(0, 1)
    labels = np.digitize(length_rank + rng.normal(0, 0.5, count), [-0.5, 0.5]).astype(np.int64)
    return EventBatch(
        sensor_ids=np.array([f"sensor-{s:03d}" for s in sensors], dtype=object),
        ts=1.7e9 + first_seq + np.arange(count, dtype=np.float64),
        labels=labels,
        lengths=lengths,
        values=np.zeros((int(lengths.sum()), 1), np.float32),
        partitions=np.zeros(count, np.int32),
        offsets=first_seq + np.arange(count, dtype=np.int64),
    )


def run_policy(name: str, policy: SamplingPolicy, args: argparse.Namespace) -> Outcome:
    rng = np.random.default_rng(args.seed)  # the same stream for every policy
    window = RecencyWindow(args.items, math.inf, rng=np.random.default_rng(args.seed))
    window.insert_batch(fleet_events(args.items, 0, args, rng))
    arrived = args.items
    sampler = PassSampler(args.pass_items, 0.5, "seeded", args.seed, policy)
    budget = TokenBudget(args.budget)
    outcome = Outcome(name)
    planned_steps = 0
    for pass_index in range(args.passes):
        window.insert_batch(fleet_events(args.arrivals, arrived, args, rng))
        arrived += args.arrivals
        snapshot = window.snapshot()
        started = time.perf_counter()
        selection = sampler.select(snapshot, planned_steps=planned_steps)
        chosen = snapshot.subset(selection.index)
        plan = plan_batches(
            chosen.lengths,
            budget,
            make_randomness("seeded", args.seed, pass_index, purpose="plan"),
            labels=chosen.labels,
            stratify=selection.stratify,
        )
        outcome.seconds.append(time.perf_counter() - started)
        planned_steps += len(plan.batches)
        facts = selection.facts
        codes = np.unique(snapshot.sensor_ids.astype(str), return_inverse=True)[1]
        outcome.window_top_share.append(concentration(codes, int(codes.max()) + 1)[0])
        outcome.top_share.append(float(facts["sensor_top_share"]))
        outcome.hhi.append(float(facts["sensor_hhi"]))
        outcome.window_hhi.append(float(facts["window_sensor_hhi"]))
        outcome.label_deviation.append(plan.diagnostics.label_deviation)
        outcome.padding_share.append(plan.diagnostics.padding_share)
        rank = np.argsort(np.argsort(snapshot.lengths, kind="stable")) / max(len(snapshot) - 1, 1)
        replayed = np.setdiff1d(selection.index, selection.fresh, assume_unique=True)
        outcome.replay_length_rank.append(float(rank[replayed].mean()) if replayed.size else math.nan)
    return outcome


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--items", type=int, default=20_000, help="window size")
    parser.add_argument("--sensors", type=int, default=50)
    parser.add_argument("--skew", type=float, default=1.5, help="Zipf exponent of the sensor rates")
    parser.add_argument("--passes", type=int, default=30)
    parser.add_argument("--pass-items", type=int, default=2048, help="PASS_MAX_ITEMS")
    parser.add_argument("--arrivals", type=int, default=1000, help="new events before each pass")
    parser.add_argument("--budget", type=int, default=8192, help="TOKEN_BUDGET")
    parser.add_argument("--curriculum-half-life", type=float, default=40.0, help="steps over which beta halves")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="one JSON object per line")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    policies = {
        "uniform": make_policy("uniform"),
        "sensor_balanced_T1": make_policy("sensor_balanced", sensor_temperature=1.0),
        "sensor_balanced_T2": make_policy("sensor_balanced", sensor_temperature=2.0),
        "sensor_balanced_Tinf": make_policy("sensor_balanced", sensor_temperature=math.inf),
        "stratified": make_policy("stratified"),
        "curriculum": make_policy(
            "curriculum", curriculum_strength=3.0, curriculum_half_life_steps=args.curriculum_half_life
        ),
    }
    outcomes = {name: run_policy(name, policy, args) for name, policy in policies.items()}
    uniform = outcomes["uniform"]
    if not args.json:
        print(
            f"{args.sensors} sensors (Zipf {args.skew}), window {args.items:,}, {args.passes} passes of "
            f"{args.pass_items:,} items, {args.arrivals:,} arrivals per pass, budget {args.budget:,} tokens"
        )
        header = (
            f"{'policy':<22}{'top share':>10}{'HHI':>8}{'label dev':>11}{'padding':>9}{'ms/pass':>9}"
            f"{'replay len rank':>17}"
        )
        print(header)
        print("-" * len(header))
        print(f"{'(window)':<22}{uniform.mean('window_top_share'):>10.3f}{uniform.mean('window_hhi'):>8.3f}")
        for o in outcomes.values():
            print(
                f"{o.name:<22}{o.mean('top_share'):>10.3f}{o.mean('hhi'):>8.3f}{o.mean('label_deviation'):>11.3f}"
                f"{o.mean('padding_share'):>9.2%}{1000 * o.mean('seconds'):>9.1f}{o.mean('replay_length_rank'):>17.3f}"
            )
        print()
    rows = [
        Row(
            BENCH, "uniform/sensor_top_share", uniform.mean("top_share"), uniform.mean("window_top_share"), "~1x window"
        ),
    ]
    for name, o in outcomes.items():
        if name == "uniform":
            continue
        rows.append(Row(BENCH, f"{name}/sensor_top_share", o.mean("top_share"), uniform.mean("top_share"),
                        "<= 0.5x uniform" if name == "sensor_balanced_T2" else ""))  # fmt: skip
    rows += [
        Row(BENCH, f"{name}/sensor_hhi", o.mean("hhi"), uniform.mean("hhi"),
            "<= 0.01" if name == "sensor_balanced_Tinf" else "")
        for name, o in outcomes.items()
    ]  # fmt: skip
    stratified, curriculum = outcomes["stratified"], outcomes["curriculum"]
    rows += [
        Row(BENCH, "stratified/label_deviation", stratified.mean("label_deviation"), uniform.mean("label_deviation"),
            "<= 0.25x uniform"),
        Row(BENCH, "stratified/padding_share", stratified.mean("padding_share"), uniform.mean("padding_share")),
        Row(BENCH, "curriculum/replay_length_rank_first5", curriculum.mean("replay_length_rank", slice(0, 5)),
            uniform.mean("replay_length_rank"), "< uniform"),
        Row(BENCH, "curriculum/replay_length_rank_last5", curriculum.mean("replay_length_rank", slice(-5, None)),
            uniform.mean("replay_length_rank"), "-> uniform"),
    ]  # fmt: skip
    rows += [Row(BENCH, f"{name}/ms_per_pass", 1000 * o.mean("seconds"), 1000 * uniform.mean("seconds"))
             for name, o in outcomes.items()]  # fmt: skip
    emit(rows, args.json)
    failures = []
    if outcomes["sensor_balanced_T2"].mean("top_share") > 0.5 * uniform.mean("top_share"):
        failures.append("sensor_balanced (T=2) top share above half the uniform one")
    if stratified.mean("label_deviation") > 0.25 * uniform.mean("label_deviation"):
        failures.append("stratified label deviation above a quarter of the uniform one")
    for failure in failures:
        print(f"TARGET MISSED: {failure}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
