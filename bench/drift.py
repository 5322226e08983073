"""Learning under drift: the recency window against the alternatives, prequentially.

Streams, replayed in event-time order: the simulator's abrupt and recurring regimes, a
fleet whose sensors send at very different rates (Zipf), and real sensor series River
ships (the office room of ``river.drift.datasets.Occupancy``, with its annotated change
points; nothing is downloaded). Every arm sees the same events in the same order, scores
each event with its current model before training on it (test-then-train), inserts it,
trains the same number of steps of the same model with the same budget (the service's
Trainer, in-process: no Kafka), and publishes. Arms:

* ``recency_2hl`` / ``recency_3hl``: the recency window, capacity = 2 or 3 half-lives of arrivals;
* ``recency+reset``: recency (2.5 half-lives) that clears AdamW's moments on an ADWIN drift;
* ``uniform``: the uniform reservoir (infinite half-life), same capacity;
* ``sliding``: a sliding window of the same capacity (the newest W events);
* ``river``: River's online regressors on 8 lag features, test-then-train on every step;
  the best of linear regression (standardized lags) and a Hoeffding adaptive tree.

Errors are per step and channel in the stream's own standardized units (one fixed scale
for every arm). Metrics: prequential MSE; the time to recover after each change (event
seconds until the rolling error is back within 10% of its level before the change);
the error on a returning regime (first quarter of each revisit); steady-state error (last
quarter of each regime). ``--plot`` writes the error-over-time figure.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _series import SERIES, sliding_windows  # noqa: E402
from _table import Row, emit  # noqa: E402

from streamtrain.config import load_settings  # noqa: E402
from streamtrain.events import EventBatch, EventLimits, decode_batch  # noqa: E402
from streamtrain.metrics import Metrics  # noqa: E402
from streamtrain.model.normalization import RunningNorm  # noqa: E402
from streamtrain.quality.drift import DriftMonitor  # noqa: E402
from streamtrain.quality.scoring import score_events  # noqa: E402
from streamtrain.tools.sensor_fleet import SensorFleet  # noqa: E402
from streamtrain.tools.simulation_config import SimulationConfig  # noqa: E402
from streamtrain.training.trainer import Trainer  # noqa: E402
from streamtrain.window.reservoir import RecencyWindow  # noqa: E402

LAGS = 8


@dataclass
class Stream:
    """Events in chunks of one event-time tick, with the regime of each chunk."""

    name: str
    chunks: list[EventBatch]
    regimes: list[int]  # regime index per chunk
    tick_s: float  # event seconds per chunk
    rate: float  # events per event-second
    channels: int
    simulated: bool
    changes: list[int] | None = None  # chunk indices where a regime starts (derived from regimes)

    def __post_init__(self) -> None:
        if self.changes is None:
            self.changes = [i for i in range(1, len(self.regimes)) if self.regimes[i] != self.regimes[i - 1]]


def _decode(fleet: SensorFleet, n: int, elapsed: float, now: float) -> EventBatch:
    batch = fleet.generate_batch(n, now=now, elapsed_s=elapsed)
    return decode_batch(
        batch.values, EventLimits(max_len=512, channels=fleet.config.channels), now + 10, [0] * n, list(range(n))
    ).events


def simulated(name: str, args: argparse.Namespace, drift: str, skewed: bool = False) -> Stream:
    duration = args.duration_s
    cfg = SimulationConfig(
        seed=args.seed, sensors=16, process="mixed", length_median=24, length_sigma=0.3, drift=drift,
        drift_at_s=(duration / 3, 2 * duration / 3) if drift == "abrupt" else (),
        drift_period_s=duration / 6, drift_regimes=2,
    )  # fmt: skip
    fleet = SensorFleet(cfg)
    keep = None
    if skewed:  # Zipf sensor rates: sensor k sends ~1/(k+1) as often as sensor 0
        keep = 1.0 / np.arange(1, cfg.sensors + 1)
    rng = np.random.default_rng(args.seed + 7)
    start = 1.7e9
    chunks, regimes = [], []
    for tick in range(int(duration)):
        n = int(args.rate * (2.2 if skewed else 1.0))
        batch = _decode(fleet, n, float(tick), start + tick)
        if keep is not None:
            sensor = np.array([int(s.split("-")[1]) for s in batch.sensor_ids])
            rows = np.flatnonzero(rng.random(len(batch)) < keep[sensor])
            batch = batch.take(rows)
        chunks.append(batch)
        regimes.append(fleet.drift_regime(float(tick)))
    return Stream(name, chunks, regimes, 1.0, args.rate, cfg.channels, True)


def real(name: str, args: argparse.Namespace) -> Stream:
    series = SERIES[name]()
    windows = sliding_windows(series.values, 24)
    ts = series.ts[23:]
    per_chunk = 8
    chunks, regimes = [], []
    from streamtrain.events import SensorEvent

    for start in range(0, len(windows), per_chunk):
        items = [
            SensorEvent("room", float(ts[i]), windows[i], -1)
            for i in range(start, min(start + per_chunk, len(windows)))
        ]
        chunks.append(EventBatch.from_events(items, channels=series.values.shape[1]))
        regimes.append(0)
    tick = float(np.median(np.diff(series.ts))) * per_chunk
    # The annotated change points (occupancy has 14 in 500 readings) are too close together
    # to time recoveries: real streams report prequential and steady-state error only.
    return Stream(f"real:{name}", chunks, regimes, tick, per_chunk / tick, series.values.shape[1], False, changes=[])


# ------------------------------------------------------------------ arms


def trainer_arm(
    stream: Stream, args: argparse.Namespace, half_life_s: float, reset_on_drift: bool = False
) -> np.ndarray:
    """Per-chunk (sse, naive_sse, steps) of one window kind, scored before training."""
    overrides: dict[str, Any] = dict(
        channels=stream.channels, d_model=32, n_heads=2, n_layers=1, max_len=512, token_budget=args.token_budget,
        min_window_items=16, warmup_steps=5, learning_rate=3e-3, pass_max_items=256, pass_fresh_share=0.5,
        publish_interval_s=1e9, seed=args.seed, checkpoint_dir="unused", window_capacity=args.capacity,
        quality_max_events_per_s=0.0,  # the bench scores every event itself; the monitor only splits off the holdout
    )  # fmt: skip
    if args.sampling:
        overrides["sampling"] = args.sampling
    settings = load_settings(**overrides)
    window = RecencyWindow(args.capacity, half_life_s, channels=stream.channels, rng=np.random.default_rng(args.seed))
    trainer = Trainer(settings, window, Metrics())
    units = stream_units(stream)
    detector = DriftMonitor("adwin") if reset_on_drift else None
    batches: Iterator[Any] | None = None
    out = np.zeros((len(stream.chunks), 3))
    for i, chunk in enumerate(stream.chunks):
        served = trainer.published
        values = [chunk.event(j).values for j in range(len(chunk))]
        if served is not None and values:
            s = score_events(
                served.served, served.norm, values, None, 4096, units
            )  # what serves: the chosen forecaster
            out[i] = s.sse.sum(), s.naive_sse.sum(), s.steps.sum()
            if detector is not None:
                for e in (s.sse[s.steps > 0] / s.steps[s.steps > 0]).tolist():
                    if detector.update(e):
                        trainer.optimizer.state.clear()
        else:
            s = score_events(_Naive(), units, values, None, 4096, units)  # before any model: the last value
            out[i] = s.naive_sse.sum(), s.naive_sse.sum(), s.steps.sum()
        to_window = trainer.quality.observe(chunk) if len(chunk) else chunk  # as ingest does: the holdout first
        if len(to_window):
            window.insert_batch(to_window)
        if len(window) >= settings.min_window_items:
            if batches is None:
                batches = iter(trainer.dataset)
            for _ in range(args.steps_per_tick):
                trainer.train_step(next(batches))
            trainer.publish()
    return out


class _Naive(torch.nn.Module):
    def forward(self, x_norm: torch.Tensor, mask: torch.Tensor) -> Any:
        from streamtrain.model.network import ModelOutput

        return ModelOutput(forecast=x_norm * mask[..., None], logits=None)


def stream_units(stream: Stream) -> RunningNorm:
    flat = np.concatenate([c.values for c in stream.chunks if len(c)]).astype(np.float64)
    return RunningNorm.from_public(flat.mean(0).tolist(), np.maximum(flat.std(0), 1e-6).tolist())


def river_arm(stream: Stream, make: Any) -> np.ndarray:
    """River test-then-train on every step: lags of the same event predict the next reading."""
    units = stream_units(stream)
    mean, std = units.mean.numpy(), units.std.numpy()
    c = stream.channels
    models = [make() for _ in range(c)]
    out = np.zeros((len(stream.chunks), 3))
    for i, chunk in enumerate(stream.chunks):
        sse = naive = steps = 0.0
        for j in range(len(chunk)):
            x = (chunk.event(j).values.astype(np.float64) - mean) / std
            for t in range(1, len(x)):
                lags = [x[max(t - 1 - k, 0)] for k in range(LAGS)]
                features = {f"c{ch}l{k}": float(lags[k][ch]) for k in range(LAGS) for ch in range(c)}
                err = 0.0
                for ch, model in enumerate(models):
                    guess = model.predict_one(features)
                    guess = float(guess) if guess is not None and math.isfinite(guess) else float(x[t - 1, ch])
                    err += (guess - x[t, ch]) ** 2
                    model.learn_one(features, float(x[t, ch]))
                sse += err / c
                naive += float(((x[t] - x[t - 1]) ** 2).mean())
                steps += 1
        out[i] = sse, naive, steps
    return out


def river_makers() -> dict[str, Any]:
    from river import linear_model, preprocessing, tree

    return {
        "linear": lambda: preprocessing.StandardScaler() | linear_model.LinearRegression(intercept_lr=0.01),
        "hoeffding_adaptive_tree": lambda: tree.HoeffdingAdaptiveTreeRegressor(grace_period=50, seed=0),
    }


# ------------------------------------------------------------------ metrics


def rolling(per_chunk: np.ndarray, width: int) -> np.ndarray:
    sse, steps = per_chunk[:, 0], per_chunk[:, 2]
    kernel = np.ones(width)
    return np.convolve(sse, kernel, "full")[: len(sse)] / np.maximum(np.convolve(steps, kernel, "full")[: len(sse)], 1)


def mse(per_chunk: np.ndarray, rows: slice | np.ndarray = slice(None)) -> float:
    part = per_chunk[rows]
    return float(part[:, 0].sum() / max(part[:, 2].sum(), 1))


def recovery_ticks(curves: dict[str, np.ndarray], name: str, stream: Stream, width: int) -> list[float]:
    """Per change: ticks until the rolling error is within 10% of the new regime's settled level.

    The settled level is the lowest steady-state error (last quarter of the new regime) of
    any arm, so every arm is timed to the same bar; one that never reaches it is charged
    the whole regime. (Timing against the level *before* the change degenerates when a
    regime is easier or harder than the last: every arm recovers at once, or never.)
    """
    curve = rolling(curves[name], width)
    bounds = [0, *stream.changes, len(stream.chunks)]
    out = []
    for k, change in enumerate(stream.changes):
        end = bounds[k + 2]
        tail = np.arange(end - max(1, (end - change) // 4), end)
        level = min(mse(c, tail) for n, c in curves.items() if not n.startswith("river"))
        recovered = next((t - change for t in range(change + width, end) if curve[t] <= 1.1 * level), end - change)
        out.append(float(recovered))
    return out


def segments(stream: Stream) -> list[tuple[int, int, int]]:
    """(start, end, regime) of each regime stretch."""
    bounds = [0, *stream.changes, len(stream.chunks)]
    return [(a, b, stream.regimes[a]) for a, b in zip(bounds[:-1], bounds[1:])]


def returning_error(per_chunk: np.ndarray, stream: Stream) -> float | None:
    seen, rows = set(), []
    for a, b, regime in segments(stream):
        if regime in seen:
            rows.extend(range(a, a + max(1, (b - a) // 4)))
        seen.add(regime)
    return mse(per_chunk, np.array(rows)) if rows else None


def steady_error(per_chunk: np.ndarray, stream: Stream) -> float:
    rows = [t for a, b, _ in segments(stream) for t in range(b - max(1, (b - a) // 4), b)]
    return mse(per_chunk, np.array(rows))


# ------------------------------------------------------------------ main


def run_stream(stream: Stream, args: argparse.Namespace) -> tuple[dict[str, np.ndarray], dict[str, float]]:
    half_lives = {k: args.capacity / (k * stream.rate) for k in (2.0, 2.5, 3.0)}
    curves: dict[str, np.ndarray] = {}
    timings: dict[str, float] = {}
    arms = {
        "recency_2hl": lambda: trainer_arm(stream, args, half_lives[2.0]),
        "recency_3hl": lambda: trainer_arm(stream, args, half_lives[3.0]),
        "recency+reset": lambda: trainer_arm(stream, args, half_lives[2.5], reset_on_drift=True),
        "uniform": lambda: trainer_arm(stream, args, math.inf),
        "sliding": lambda: trainer_arm(stream, args, 1e-9),  # keys ~ event time: the newest W
    }
    for name, run in arms.items():
        started = time.perf_counter()
        curves[name] = run()
        timings[name] = time.perf_counter() - started
    best_name, best = None, None
    for name, make in river_makers().items():
        started = time.perf_counter()
        curve = river_arm(stream, make)
        timings[f"river:{name}"] = time.perf_counter() - started
        if best is None or mse(curve) < mse(best):
            best_name, best = name, curve
    curves[f"river:{best_name}"] = best  # type: ignore[assignment]
    return curves, timings


def rows_for(stream: Stream, curves: dict[str, np.ndarray], width: int) -> list[Row]:
    bench = f"drift/{stream.name}"
    river_name = next(n for n in curves if n.startswith("river:"))
    rows: list[Row] = []
    for name, curve in curves.items():
        rows.append(
            Row(
                bench,
                f"{name} prequential_mse",
                mse(curve),
                mse(curves[river_name]) if stream.simulated else None,
                "recency <= 0.8x river" if stream.simulated and name.startswith("recency") else "",
            )
        )
        rows.append(Row(bench, f"{name} steady_mse", steady_error(curve, stream)))
        if stream.changes:
            rec = recovery_ticks(curves, name, stream, width)
            base = recovery_ticks(curves, "uniform", stream, width)
            rows.append(
                Row(
                    bench,
                    f"{name} recovery_s (mean over {len(rec)} changes)",
                    float(np.mean(rec)) * stream.tick_s,
                    float(np.mean(base)) * stream.tick_s,
                    "recency <= 0.5x uniform" if name.startswith("recency") else "",
                )
            )
        back = returning_error(curve, stream)
        if back is not None:
            rows.append(Row(bench, f"{name} returning_regime_mse", back, returning_error(curves["sliding"], stream),
                            "recency <= 0.8x sliding" if name.startswith("recency") else ""))  # fmt: skip
    naive = next(iter(curves.values()))
    rows.append(Row(bench, "last_value prequential_mse", float(naive[:, 1].sum() / max(naive[:, 2].sum(), 1))))
    for name, curve in curves.items():
        if not name.startswith("river"):
            runs = worse_than_last_value_runs(curve, stream, width)
            rows.append(
                Row(
                    bench,
                    f"{name} worse_than_last_value_s (longest run after a change, max)",
                    max(runs) * stream.tick_s,
                    None,
                    "a few scoring periods, never the rest of the run",
                )
            )
            rows.append(Row(bench, f"{name} worse_than_last_value share of ticks", worse_share(curve, width)))
    return rows


def worse_than_last_value_runs(per_chunk: np.ndarray, stream: Stream, width: int) -> list[int]:
    """Per regime stretch: the longest run of ticks whose rolling error exceeds the last value's on the same events."""
    model = rolling(per_chunk, width)
    naive = rolling(per_chunk[:, [1, 1, 2]], width)
    worse = model > naive
    out = []
    for a, b, _ in segments(stream):
        longest = current = 0
        for t in range(a, b):
            current = current + 1 if worse[t] else 0
            longest = max(longest, current)
        out.append(longest)
    return out


def worse_share(per_chunk: np.ndarray, width: int) -> float:
    model, naive = rolling(per_chunk, width), rolling(per_chunk[:, [1, 1, 2]], width)
    return float(np.mean(model[width:] > naive[width:])) if len(model) > width else 0.0


def plot(results: list[tuple[Stream, dict[str, np.ndarray]]], path: Path, width: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(results), 1, figsize=(11, 3.2 * len(results)), squeeze=False)
    for ax, (stream, curves) in zip(axes[:, 0], results):
        t = np.arange(len(stream.chunks)) * stream.tick_s
        for name, curve in curves.items():
            ax.plot(t, rolling(curve, width), label=name, lw=1.4 if name.startswith("recency_2") else 1.0)
        for change in stream.changes:
            ax.axvline(change * stream.tick_s, color="grey", ls=":", lw=1)
        ax.set_yscale("log")
        ax.set_title(f"{stream.name}: rolling prequential MSE (dotted: regime changes)")
        ax.set_xlabel("event time (s)")
        ax.legend(fontsize=7, ncol=4)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def scoring_cost(seconds: float = 3.0) -> list[Row]:
    """What test-then-train scoring costs with the default model and event shape (one thread)."""
    from streamtrain.config import Settings
    from streamtrain.model.network import build_model

    settings = Settings()
    fleet = SensorFleet(SimulationConfig(seed=1, length_median=32))
    batch = _decode(fleet, 512, 0.0, 1.7e9)
    values = [batch.event(i).values for i in range(len(batch))]
    model, norm = build_model(settings).eval(), RunningNorm(1)
    score_events(model, norm, values[:64], None, settings.token_budget)  # warm-up
    scored, started = 0, time.perf_counter()
    while time.perf_counter() - started < seconds:
        score_events(model, norm, values[:128], None, settings.token_budget)
        scored += 128
    per_event = (time.perf_counter() - started) / scored
    cap = settings.quality_max_events_per_s
    return [
        Row("drift/scoring", "seconds per scored event (default model, 32-step events)", per_event),
        Row(
            "drift/scoring",
            f"core share at 5k events/s with the default cap ({cap:g}/s)",
            per_event * min(cap, 5000.0),
            0.10,
            "<= 0.1 of a core",
        ),
        Row("drift/scoring", "share of events scored at 5k events/s", min(cap, 5000.0) / 5000.0),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--streams",
        default="abrupt,recurring,skewed,occupancy",
        help="comma separated: abrupt, recurring, skewed, occupancy, water_flow",
    )
    parser.add_argument("--duration-s", type=float, default=180.0, help="event seconds of each simulated stream")
    parser.add_argument("--rate", type=float, default=40.0, help="simulated events per event-second")
    parser.add_argument(
        "--capacity", type=int, default=1200, help="window capacity W of every arm (events), simulated streams"
    )
    parser.add_argument(
        "--real-capacity", type=int, default=96, help="window capacity W on the real series (~480 events)"
    )
    parser.add_argument(
        "--steps-per-tick", type=int, default=4, help="training steps after each tick of events (every arm)"
    )
    parser.add_argument("--token-budget", type=int, default=1024)
    parser.add_argument("--sampling", default=None, help="pass policy (the SAMPLING setting), when the service has one")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--plot", type=Path, default=Path("var/bench/drift.png"))
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    results = []
    rows: list[Row] = []
    for name in args.streams.split(","):
        if name in ("abrupt", "recurring"):
            stream = simulated(f"sim_{name}", args, name)
        elif name == "skewed":
            stream = simulated("sim_skewed_rates", args, "abrupt", skewed=True)
        else:
            stream = real(name, args)
        width = 5 if stream.simulated else 4
        curves, timings = run_stream(
            stream,
            argparse.Namespace(**{**vars(args), "capacity": args.capacity if stream.simulated else args.real_capacity}),
        )
        results.append((stream, curves))
        rows.extend(rows_for(stream, curves, width))
        rows.extend(Row(f"drift/{stream.name}", f"{arm} seconds", t) for arm, t in timings.items())
    rows.extend(scoring_cost())
    emit(rows, args.json)
    if args.plot:
        plot(results, args.plot, 5)
        if not args.json:
            print(f"plot: {args.plot}")


if __name__ == "__main__":
    main()
