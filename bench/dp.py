"""DP-SGD step time and utility: ours vs Opacus ``make_private`` (Poisson) vs non-DP training.

Part 1, step time. All three train the same :class:`~streamtrain.model.network.SensorModel` from the same initial
weights on the same logical batches: Poisson samples of the training set (rate q, so the
expected batch is ``--expected-batch``), drawn once with a fixed seed and shared.

* ours: :meth:`streamtrain.privacy.DPEngine.noisy_step` — token-budget micro-batches
  (length-bucketed), torch.func per-sample gradients clipped over the whole gradient,
  hardened CSPRNG noise, public divisor;
* Opacus 1.6: ``PrivacyEngine.make_private(poisson_sampling=True, grad_sample_mode="hooks")``
  with the same σ and C; each logical batch is padded to its own longest item (what a
  collate function gives it; Opacus splits physical batches by count only);
* non-DP: token-budget micro-batches at the service's default budget (8192), loss
  normalized by real tokens, plain backward with gradient-norm clipping, as the service's
  trainer does; also timed at the DP path's smaller budget (1024), which it does not need.

Step time is the median over steps ``--warmup`` .. ``--timed-steps``, the three methods
interleaved step by step so machine load hits them alike. Loss is the forecast MSE on
held-out sequences after ``--steps`` steps of ours and of non-DP on the same batches, next
to the naive last-value baseline (Opacus, the slow one, only runs the timed steps).

Part 2, utility on the simulator's stream (``--utility-steps``, 0 to skip). The service's
DP path with its default settings — :class:`DPEngine` admitting arrivals of the simulated
sensor fleet (``streamtrain simulate``'s generator, 100 events/s) on its public clock (2 Hz:
1200 steps = 10 minutes of stream), the service's model and optimizer — against the same
model trained without DP on the same arrivals (each step on that step's arrivals, as the
service's trainer favours fresh events). Rows give the held-out forecast MSE of both over
the last-value forecast's, with the ε per event spent so far, at points along the way: the
loss-vs-ε curve (ε grows over the first K steps, then stays at its cap while learning goes on).

Run: ``python bench/dp.py [--steps N] [--timed-steps N] [--utility-steps N] [--json]``.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _table import Row, emit  # noqa: E402

from streamtrain.config import Settings  # noqa: E402
from streamtrain.data import TokenBudget, collate, plan_batches  # noqa: E402
from streamtrain.data.randomness import SeededRandomness  # noqa: E402
from streamtrain.events import EventLimits, decode_batch  # noqa: E402
from streamtrain.model.losses import forecast_loss, naive_last_value_loss  # noqa: E402
from streamtrain.model.network import SensorModel, build_model  # noqa: E402
from streamtrain.privacy import DPConfig, DPEngine  # noqa: E402
from streamtrain.tools.sensor_fleet import SensorFleet  # noqa: E402
from streamtrain.tools.simulation_config import SimulationConfig  # noqa: E402

BENCH = "dp"


def synthetic_sequences(n: int, max_len: int, rng: np.random.Generator) -> list[np.ndarray]:
    """Noisy sinusoids with random period and phase; lognormal lengths (median 40, 2..max_len)."""
    lengths = np.clip(np.round(rng.lognormal(np.log(40), 0.8, size=n)), 2, max_len).astype(int)
    items = []
    for length in lengths:
        t = np.arange(length)
        period, phase = rng.uniform(8, 40), rng.uniform(0, 2 * np.pi)
        wave = np.sin(2 * np.pi * t / period + phase) + 0.1 * rng.normal(size=length)
        items.append(wave[:, None].astype(np.float32))
    return items


def holdout_loss(model: SensorModel, items: list[np.ndarray]) -> float:
    batch = collate(items)
    model.eval()
    with torch.no_grad():
        loss = forecast_loss(model(batch.values, batch.mask), batch.values, batch.mask)
    model.train()
    return float(loss)


def make_ours(model: SensorModel, args: argparse.Namespace, train_size: int) -> DPEngine:
    q = args.expected_batch / train_size
    config = DPConfig(
        noise_multiplier=args.sigma, clip_norm=args.clip, q0=q, eligible_steps=args.steps,
        admit_per_step=max(1, train_size // args.steps), target_epsilon=1e6,
        expected_batch_size=float(args.expected_batch),
    )  # fmt: skip
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    return DPEngine(model, optimizer, config, TokenBudget(args.dp_token_budget, max_sequences=args.max_micro_batch))


def make_opacus(
    model: SensorModel, args: argparse.Namespace, train: list[np.ndarray]
) -> Callable[[list[np.ndarray]], None]:
    from opacus import PrivacyEngine

    whole = collate(train)
    dataset = torch.utils.data.TensorDataset(whole.values, whole.mask)
    loader = torch.utils.data.DataLoader(dataset, batch_size=args.expected_batch)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    warnings.filterwarnings("ignore", module="opacus")
    warnings.filterwarnings("ignore", message="Full backward hook is firing")
    module, dp_optimizer, _ = PrivacyEngine().make_private(
        module=model, optimizer=optimizer, data_loader=loader, noise_multiplier=args.sigma,
        max_grad_norm=args.clip, poisson_sampling=True, grad_sample_mode="hooks",
        batch_first=True, loss_reduction="sum",
    )  # fmt: skip

    def step(items: list[np.ndarray]) -> None:
        batch = collate(items)  # padded to this logical batch's longest item
        output = module(batch.values, batch.mask)
        forecast_loss(output, batch.values, batch.mask, reduction="per_sample").sum().backward()
        dp_optimizer.step()
        dp_optimizer.zero_grad(set_to_none=True)

    return step


def make_plain(model: SensorModel, args: argparse.Namespace, token_budget: int) -> Callable[[list[np.ndarray]], None]:
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    budget = TokenBudget(token_budget, max_sequences=args.max_micro_batch)
    randomness = SeededRandomness(args.seed)

    def step(items: list[np.ndarray]) -> None:
        lengths = np.array([len(v) for v in items])
        target_tokens = max(1, int((lengths - 1).sum()))
        for group in plan_batches(lengths, budget, randomness, pool_size=len(items)).batches:
            batch = collate([items[i] for i in group])
            output = model(batch.values, batch.mask)
            per_sample = forecast_loss(output, batch.values, batch.mask, reduction="per_sample")
            # per-sample means back to token sums, normalized by the logical batch's tokens
            (per_sample * (batch.lengths - 1).clamp_min(1)).sum().div(target_tokens).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def run(args: argparse.Namespace) -> list[Row]:
    torch.set_num_threads(args.threads)
    rng = np.random.default_rng(args.seed)
    items = synthetic_sequences(args.items + args.holdout, args.max_len, rng)
    train, holdout = items[: args.items], items[args.items :]
    q = args.expected_batch / len(train)
    batches = [np.flatnonzero(rng.random(len(train)) < q) for _ in range(args.steps)]

    torch.manual_seed(args.seed)
    initial = SensorModel(1, d_model=args.d_model, n_layers=args.layers, max_len=args.max_len)
    models = {name: copy.deepcopy(initial) for name in ("ours", "opacus", "plain", "plain_dp_budget")}
    engine = make_ours(models["ours"], args, len(train))
    labels = np.full(len(train), -1, dtype=np.int64)
    steps: dict[str, Callable[[list[np.ndarray]], object]] = {
        "ours": lambda chosen: engine.noisy_step(chosen, labels[: len(chosen)]),
        "opacus": make_opacus(models["opacus"], args, train),
        "plain": make_plain(models["plain"], args, args.token_budget),
        "plain_dp_budget": make_plain(models["plain_dp_budget"], args, args.dp_token_budget),
    }
    timed_only = {"opacus", "plain_dp_budget"}  # timed, not trained to the end
    seconds: dict[str, list[float]] = {name: [] for name in steps}
    real = padded_ours = padded_opacus = 0
    for index, chosen in enumerate(batches):
        chosen_items = [train[i] for i in chosen]
        timed = args.warmup <= index < args.timed_steps
        for name, step in steps.items():
            if name in timed_only and index >= args.timed_steps:
                continue
            started = time.perf_counter()
            result = step(chosen_items)
            if timed:
                seconds[name].append(time.perf_counter() - started)
            if name == "ours" and index < args.timed_steps:
                padded_ours += result.padded_tokens
                real += result.sampled_tokens
        if index < args.timed_steps:
            padded_opacus += len(chosen_items) * max(len(v) for v in chosen_items)

    median = {name: statistics.median(values) for name, values in seconds.items()}
    loss = {name: holdout_loss(models[name], holdout) for name in ("ours", "plain")}
    whole = collate(holdout)
    naive = float(naive_last_value_loss(whole.values, whole.mask))
    initial_loss = holdout_loss(initial, holdout)
    mean_batch = float(np.mean([len(b) for b in batches]))
    return [
        Row(BENCH, "dp_step_s ours vs opacus make_private", median["ours"], median["opacus"], "<= 1.0x"),
        Row(BENCH, "dp_step_s ours vs non-DP step", median["ours"], median["plain"], "<= 2.5x"),
        Row(BENCH, "dp_step_s ours vs non-DP at the DP token budget", median["ours"], median["plain_dp_budget"]),
        Row(BENCH, "opacus_step_s vs non-DP step", median["opacus"], median["plain"]),
        Row(BENCH, f"holdout_loss after {args.steps} steps: DP (ours) vs non-DP", loss["ours"], loss["plain"]),
        Row(BENCH, "holdout_loss DP (ours) vs naive last value", loss["ours"], naive),
        Row(BENCH, "holdout_loss non-DP vs naive last value", loss["plain"], naive),
        Row(BENCH, "holdout_loss at init vs naive last value", initial_loss, naive),
        Row(BENCH, "padding_share ours vs opacus (1 - real/padded)", 1 - real / padded_ours, 1 - real / padded_opacus),
        Row(BENCH, "mean logical batch (sequences)", mean_batch, float(args.expected_batch)),
    ]


def utility(args: argparse.Namespace) -> list[Row]:
    """Part 2: held-out loss over the last value's, DP (service defaults) vs non-DP, along the stream."""
    torch.set_num_threads(args.threads)
    settings = Settings(
        dp="on", shuffle="crypto", learning_rate=args.utility_lr or Settings.model_fields["learning_rate"].default
    )
    fleet = SensorFleet(SimulationConfig(rate=args.rate, sensors=16, seed=args.seed + 7, max_len=settings.max_len))
    limits = EventLimits.from_settings(settings)
    torch.manual_seed(settings.seed)
    private_model = build_model(settings)
    plain_model = copy.deepcopy(private_model)
    config = DPConfig.from_settings(settings)
    engine = DPEngine(private_model, torch.optim.AdamW(private_model.parameters(), lr=settings.learning_rate,
                      weight_decay=settings.weight_decay), config, settings.dp_token_budget)  # fmt: skip
    plain_optimizer = torch.optim.AdamW(
        plain_model.parameters(), lr=settings.learning_rate, weight_decay=settings.weight_decay
    )
    budget = TokenBudget(settings.token_budget, max_sequences=settings.max_batch_sequences)
    rng = np.random.default_rng(args.seed)

    def arrivals(count: int, now: float, first_offset: int) -> list[np.ndarray]:
        raw = fleet.generate_batch(count, now=now)
        events = decode_batch(
            raw.values, limits, now + 2.0, [0] * count, list(range(first_offset, first_offset + count))
        ).events
        return events, [events.values[a : a + n] for a, n in zip(events.starts, events.lengths, strict=True)]

    held_events, held = arrivals(512, 9_000.0, 0)
    held_batch = collate(held)
    x_held = engine.norm.normalize(held_batch.values).float() * held_batch.mask[..., None]
    naive = float(naive_last_value_loss(x_held, held_batch.mask))

    def ratio(model: SensorModel) -> float:
        model.eval()
        with torch.no_grad():
            loss = float(forecast_loss(model(x_held, held_batch.mask), x_held, held_batch.mask))
        model.train()
        return loss / naive

    def plain_step(items: list[np.ndarray]) -> None:
        lengths = np.array([len(v) for v in items])
        target_tokens = max(1, int((lengths - 1).sum()))
        for group in plan_batches(
            lengths, budget, SeededRandomness(int(rng.integers(1 << 30))), pool_size=len(items)
        ).batches:
            batch = collate([items[i] for i in group])
            x_norm = engine.norm.normalize(batch.values).float() * batch.mask[..., None]
            per_sample = forecast_loss(plain_model(x_norm, batch.mask), x_norm, batch.mask, reduction="per_sample")
            (per_sample * (batch.lengths - 1).clamp_min(1)).sum().div(target_tokens).backward()
        torch.nn.utils.clip_grad_norm_(plain_model.parameters(), settings.grad_clip_norm)
        plain_optimizer.step()
        plain_optimizer.zero_grad(set_to_none=True)

    rate = config.step_rate_hz
    k = config.eligible_steps  # ε grows over the first K steps, then stays at its cap
    early = {int(round(k * f)) for f in (1 / 8, 1 / 4, 1 / 2, 1.0)}
    late = {int(round(args.utility_steps * f)) for f in (1 / 6, 1 / 3, 1 / 2, 2 / 3, 1.0)}
    marks = sorted(m for m in (early | late) if 0 < m <= args.utility_steps)
    rows: list[Row] = []
    now, offset = 10_000.0, 512
    engine.step(now)
    started = time.perf_counter()
    for step in range(1, args.utility_steps + 1):
        count = int(rng.poisson(args.rate / rate))
        events, items = arrivals(count, now, offset)
        offset += count
        engine.admit(events, now=now + 0.5 / rate)
        now = 10_000.0 + step / rate + 1e-3
        engine.step(now)
        if items:
            plain_step(items)
        if step in marks:
            minutes = step / rate / 60
            epsilon = engine.epsilon_spent()
            rows.append(
                Row(
                    BENCH,
                    f"stream {minutes:.1f} min (step {step}): DP holdout_loss vs last value, eps {epsilon:.2f}",
                    ratio(private_model) * naive,
                    naive,
                    "<= 0.9x at 10 min, eps <= 8" if step == marks[-1] else "",
                )
            )
            rows.append(
                Row(
                    BENCH,
                    f"stream {minutes:.1f} min (step {step}): non-DP holdout_loss vs last value",
                    ratio(plain_model) * naive,
                    naive,
                )
            )
            print(
                f"# utility step {step}/{args.utility_steps} after {time.perf_counter() - started:.0f}s",
                file=sys.stderr,
            )
    rows.append(
        Row(
            BENCH,
            "epsilon per event (cap, DP defaults) vs target",
            engine.epsilon_cap,
            config.target_epsilon,
            "<= 1.0x",
        )
    )
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--items", type=int, default=2048, help="training sequences")
    parser.add_argument("--holdout", type=int, default=256)
    parser.add_argument("--max-len", type=int, default=256)
    parser.add_argument("--expected-batch", type=int, default=64, help="expected Poisson batch (q = B / items)")
    parser.add_argument("--steps", type=int, default=40, help="logical steps of ours and non-DP (loss rows)")
    parser.add_argument("--timed-steps", type=int, default=12, help="first steps, all three methods (time rows)")
    parser.add_argument("--warmup", type=int, default=2, help="first steps left out of the timing")
    parser.add_argument("--sigma", type=float, default=1.0)
    parser.add_argument("--clip", type=float, default=1.0)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--token-budget", type=int, default=8192, help="non-DP micro-batch budget (service default)")
    parser.add_argument("--dp-token-budget", type=int, default=1024, help="DP micro-batch budget (per-sample memory)")
    parser.add_argument("--max-micro-batch", type=int, default=128, help="sequences per micro-batch, both")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--utility-steps", type=int, default=1200, help="part 2: DP clock steps (2 Hz: 1200 = 10 min); 0 skips"
    )
    parser.add_argument("--utility-lr", type=float, default=None, help="part 2: learning rate (default: the service's)")
    parser.add_argument("--rate", type=float, default=100.0, help="part 2: simulated events per second")
    parser.add_argument("--skip-timing", action="store_true", help="run part 2 only")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if not args.warmup < args.timed_steps <= args.steps:
        parser.error("need --warmup < --timed-steps <= --steps")
    rows = [] if args.skip_timing else run(args)
    if args.utility_steps > 0:
        rows += utility(args)
    emit(rows, args.json)


if __name__ == "__main__":
    main()
