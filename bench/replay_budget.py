"""How many replays per event generalize: fixed budgets against early stopping, on real series.

Issue 20 asks which bound on training a small stream generalizes: a replay budget per event
(``MAX_REPLAYS_PER_EVENT``) or early stopping on held-out error. Offline and without the
service: for each series of ``bench/_series.py``, the service's network (``SensorModel``, the
default size) is trained on the sliding windows (24 readings) of the first 70%, less a final
held-out block of a tenth of them and the 23 windows before it that share readings with it, by
a plain loop (AdamW, learning rate 1e-3, weight decay 0.01, batches of 64 windows, gradients
clipped to 1; not the service's trainer, its batches or its schedule). At 4, 8, 16, 32 and 64
replays per training window (cumulative, one model per seed) its one-step forecasts of the last
30% are scored as real_series.py scores the service (MSE / AR(p)'s), and so is early stopping:
the replay count whose model forecast the held-out block best. Beside them, at each replay
count, the seeds' networks averaged (``ensemble_R``: the mean of their forecasts, one network
per seed) and that average blended half and half with AR(p) (``ensemble_R+ar``): does
averaging networks, alone or with the linear forecast, add what one network does not? With
``--hybrid``, also the network trained as a correction on AR(p) (``hybrid_R``: AR(p)'s forecast,
fitted on the training part, plus the network's change to the last value, trained where every
channel's AR(p) has its lags in the window): does the network add to the linear forecast what
it cannot learn alone? Then the geometric means.

    python bench/replay_budget.py                   # 11 series x 3 seeds, ~7 min on one core
    python bench/replay_budget.py --series sunspots,goog --seeds 0,1 --json
    python bench/replay_budget.py --n-heads 1    # the same network with one head of 64 (issue 24)
    python bench/replay_budget.py --hybrid       # and the network as a correction on AR(p), ~2x the time
    python bench/replay_budget.py --dropout 0.1  # the network with dropout in training (the service trains without)
    python bench/replay_budget.py --d-model 32 --n-layers 1  # a smaller network (the service's: 64, 2)
    python bench/replay_budget.py --weight-decay 0.1  # stronger AdamW weight decay (the service's: 0.01)
    python bench/replay_budget.py --level-inputs  # the level and step scale as inputs too
    python bench/replay_budget.py --choose-level  # both networks, the held-out block choosing (~2x the time)
    python bench/replay_budget.py --choose-range  # the same with the level clipped to the range seen

Needs the bench extra (statsmodels, matplotlib: the series' files); no broker.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _series import Series, series_groups, sliding_windows  # noqa: E402
from _table import _fmt, print_columns  # noqa: E402
from real_series import CONTEXT, baselines, fit_ar  # noqa: E402

from streamtrain.model.network import ModelOutput, SensorModel, level_free_features  # noqa: E402

REPLAYS = (4, 8, 16, 32, 64)
BATCH = 64
HELD_OUT_SHARE = 0.1


class LevelAwareModel(SensorModel):
    """The service's network with what its level-free encoding discards given back as inputs: per
    channel, the reading itself (in the series' standard units, as the model sees it) and the log of
    the instance's step scale, beside the centred reading and the step. The output is the service's
    (the last value plus a change in the step scale), so untrained it is still the last value."""

    def __init__(self, channels: int, **network: Any) -> None:
        super().__init__(channels, **network)
        self.input = torch.nn.Linear(4 * channels, self.input.out_features)

    def forward(self, x_norm: torch.Tensor, mask: torch.Tensor, row_multiple: int = 1) -> ModelOutput:
        batch, length, channels = x_norm.shape
        real = mask.bool()[..., None]
        x = x_norm.masked_fill(~real, 0.0)
        features, scale = level_free_features(x, real)
        inputs = torch.cat([features, x, torch.log(scale) * real], dim=-1)
        hidden = self.input(inputs.reshape(batch * length, -1)) + self.positions[:length].repeat(batch, 1)
        for block in self.blocks:
            hidden = block(hidden, batch, length)
        change = self.forecast_head(self.final_norm(hidden)).view(batch, length, channels)
        return ModelOutput(forecast=(x + scale * change) * real, logits=None)


class RangeAwareModel(SensorModel):
    """:class:`LevelAwareModel` whose level cannot leave the range seen: per channel, the reading
    clipped to the range of the readings before its instance, and a flag that says only whether it
    lies above (1), below (-1) or inside (0) that range. Its input is
    ``[readings, range low, range high]`` along the channels (the range constant along the
    instance); its output the service's, so untrained it is still the last value."""

    def __init__(self, channels: int, **network: Any) -> None:
        super().__init__(channels, **network)
        self.channels = channels
        self.input = torch.nn.Linear(5 * channels, self.input.out_features)

    def forward(self, x_norm: torch.Tensor, mask: torch.Tensor, row_multiple: int = 1) -> ModelOutput:
        batch, length, _ = x_norm.shape
        readings, low, high = x_norm.split(self.channels, dim=-1)
        real = mask.bool()[..., None]
        x = readings.masked_fill(~real, 0.0)
        features, scale = level_free_features(x, real)
        clipped = torch.minimum(torch.maximum(x, low), high)
        outside = (x > high).float() - (x < low).float()
        inputs = torch.cat([features, clipped * real, torch.log(scale) * real, outside * real], dim=-1)
        hidden = self.input(inputs.reshape(batch * length, -1)) + self.positions[:length].repeat(batch, 1)
        for block in self.blocks:
            hidden = block(hidden, batch, length)
        change = self.forecast_head(self.final_norm(hidden)).view(batch, length, self.channels)
        return ModelOutput(forecast=(x + scale * change) * real, logits=None)


def with_range_seen(z: np.ndarray, starts: np.ndarray, normalized: np.ndarray) -> np.ndarray:
    """``z`` [N, L, C] (instances starting at ``starts`` in the series ``normalized`` [T, C]) with
    the range of the readings before each instance (its first reading's own, for the first)
    appended along the channels, as :class:`RangeAwareModel` reads it. The range ends where the
    instance begins, so that training sees readings outside it wherever the series set a record,
    as it will when it forecasts (a range that ended one reading short of an instance's newest
    one would leave only that newest reading outside it, whose forecast no loss reads)."""
    low, high = np.minimum.accumulate(normalized), np.maximum.accumulate(normalized)
    seen = np.maximum(starts - 1, 0)  # the reading before the instance's first
    along = [np.repeat(bound[seen][:, None, :], z.shape[1], axis=1) for bound in (low, high)]
    return np.concatenate([z, *along], axis=-1).astype(np.float32)


def forecast_last(model: SensorModel, z: np.ndarray) -> np.ndarray:
    """The model's forecast after each context of ``z`` [N, L, C] (normalized units)."""
    model.eval()
    with torch.no_grad():
        x = torch.tensor(z, dtype=torch.float32)
        out = model(x, torch.ones(x.shape[:2], dtype=torch.bool)).forecast[:, -1].numpy().astype(np.float64)
    model.train()
    return out


def ar_bases(z: np.ndarray, coefficients: Sequence[np.ndarray]) -> np.ndarray:
    """AR(p)'s forecast of the next reading at every position of ``z`` [N, L, C] whose p lags are
    all in the window (one coefficient vector per channel: intercept, then x[t], x[t-1], ...);
    the last value at earlier positions, where no AR(p) forecast exists."""
    out = z.astype(np.float64)
    for c, coef in enumerate(coefficients):
        p = len(coef) - 1
        for t in range(p - 1, z.shape[1]):
            out[:, t, c] = coef[0] + z[:, t - p + 1 : t + 1, c][:, ::-1] @ coef[1:]
    return out.astype(np.float32)


def held_out_choice(
    held: dict[str, dict[int, float]], test: dict[str, dict[int, float]]
) -> tuple[dict[int, float], float]:
    """The test score of the family (``held``'s keys: family -> replay count -> held-out MSE) that
    forecast the held-out block best, at each replay count; and of the best (family, replay count)
    over all of them (early stopping across families). A tie goes to the family listed first."""
    families = list(held)
    at_each = {}
    for r in next(iter(held.values())):
        best = min(families, key=lambda f: held[f][r])
        at_each[r] = test[best][r]
    family, r = min(((f, r) for f in families for r in held[f]), key=lambda fr: held[fr[0]][fr[1]])
    return at_each, test[family][r]


def run_series(
    make: Callable[[], Series],
    seeds: list[int],
    network: dict[str, Any] | None = None,
    hybrid: bool = False,
    weight_decay: float = 0.01,
    level_inputs: bool = False,
    choose: str | None = None,
) -> dict[str, float]:
    """Test MSE / AR(p)'s per replay count and for early stopping (averaged over seeds), the seeds'
    networks averaged, and the mean pick; with ``hybrid``, also the network trained as a correction
    on AR(p)'s forecast (``hybrid_R``). ``network``: ``SensorModel``'s size and dropout (its defaults,
    the service's, where absent); ``weight_decay``: AdamW's; ``level_inputs``: train
    :class:`LevelAwareModel` instead of the service's network; ``choose``: train the service's
    network and a second family, ``level`` (:class:`LevelAwareModel`, its scores ``level_R``) or
    ``range`` (:class:`RangeAwareModel`, ``range_R``), and let the held-out block choose, per seed,
    which one forecasts (``chosen_R``; with early stopping, ``chosen_early``: the best of both
    networks at every replay count), as a service holding both families would."""
    values = make().values.astype(np.float64)
    base = baselines(values)
    mean, std = base.mean, base.std
    windows = np.stack(sliding_windows(values, CONTEXT, base.cut))
    z = ((windows - mean) / std).astype(np.float32)
    held = max(8, len(z) // int(1 / HELD_OUT_SHARE))
    train, holdout = z[: len(z) - held - (CONTEXT - 1)], z[len(z) - held :]
    contexts = (base.contexts - mean) / std
    channels = values.shape[1]
    data = {"train": train, "holdout": holdout, "contexts": contexts}
    if choose == "range":  # the same instances with the range of the readings before each one
        series = (values - mean) / std
        starts = {"train": np.arange(len(train)), "holdout": np.arange(len(z) - held, len(z))}
        starts["contexts"] = np.arange(base.cut, len(values)) - CONTEXT
        ranged = {k: with_range_seen(v.astype(np.float32), starts[k], series) for k, v in data.items()}
    mse_ar = base.mse(base.ar)
    # AR(p) in normalized units (the same fit as base.ar's: least squares with an intercept is
    # unchanged by the scaling); the hybrid learns only where every channel has its AR forecast
    normalized = (values[: base.cut] - mean) / std
    ar_coefficients = [fit_ar(normalized[:, c], p) for c, p in enumerate(base.orders)]
    train_bases = ar_bases(train, ar_coefficients)
    first = max(len(coef) for coef in ar_coefficients) - 2
    ar_test = (base.ar - mean) / std
    test: dict[int, list[float]] = {r: [] for r in REPLAYS}
    forecasts: dict[int, list[np.ndarray]] = {r: [] for r in REPLAYS}  # per seed, in data units
    corrected: dict[int, list[float]] = {r: [] for r in REPLAYS}
    stopped, picks = [], []
    second_test: dict[int, list[float]] = {r: [] for r in REPLAYS}  # the second family's, with choose
    chosen: dict[int, list[float]] = {r: [] for r in REPLAYS}
    chosen_early: list[float] = []
    arms = ("network",) + ((choose,) if choose else ()) + (("hybrid",) if hybrid else ())
    for seed in seeds:
        held_by_arm: dict[str, dict[int, float]] = {}
        for arm in arms:
            rng = np.random.default_rng(seed)
            torch.manual_seed(seed)
            aware = arm == "level" or (arm == "network" and level_inputs)
            family = RangeAwareModel if arm == "range" else LevelAwareModel if aware else SensorModel
            model = family(channels, **(network or {}))
            train, holdout, contexts = (ranged if arm == "range" else data).values()
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=weight_decay)
            done, held_mse = 0, {}
            for replays in REPLAYS:
                steps = max(1, round(replays * len(train) / BATCH))
                for _ in range(steps - done):
                    rows = rng.choice(len(train), size=min(BATCH, len(train)), replace=False)
                    x = torch.tensor(train[rows])
                    out = model(x, torch.ones(x.shape[:2], dtype=torch.bool)).forecast
                    if arm == "hybrid":  # the network's change to the last value, added to AR(p)'s forecast
                        out = torch.tensor(train_bases[rows]) + (out - x)
                        loss = ((out[:, first:-1] - x[:, first + 1 :]) ** 2).mean()
                    else:
                        loss = ((out[:, :-1] - x[:, 1:, :channels]) ** 2).mean()
                    optimizer.zero_grad()
                    loss.backward()
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                    optimizer.step()
                done = steps
                if arm == "hybrid":
                    forecast = ar_test + forecast_last(model, contexts) - contexts[:, -1]
                    corrected[replays].append(base.mse(forecast * std + mean) / mse_ar)
                    continue
                held_mse[replays] = float(
                    ((forecast_last(model, holdout[:, :-1]) - holdout[:, -1, :channels]) ** 2).mean()
                )
                if arm == choose:
                    second_test[replays].append(base.mse(forecast_last(model, contexts) * std + mean) / mse_ar)
                    continue
                forecasts[replays].append(forecast_last(model, contexts) * std + mean)
                test[replays].append(base.mse(forecasts[replays][-1]) / mse_ar)
            held_by_arm[arm] = held_mse
            if arm == "network":
                pick = min(held_mse, key=held_mse.__getitem__)
                stopped.append(test[pick][-1])
                picks.append(pick)
        if choose:  # the held-out block's choice between the two networks, this seed's
            seed_test = {"network": {r: test[r][-1] for r in REPLAYS}, choose: {r: second_test[r][-1] for r in REPLAYS}}
            at_each, early = held_out_choice(held_by_arm, seed_test)
            for r in REPLAYS:
                chosen[r].append(at_each[r])
            chosen_early.append(early)
    out = {f"replays_{r}": float(np.mean(v)) for r, v in test.items()}
    if choose:
        out.update({f"{choose}_{r}": float(np.mean(v)) for r, v in second_test.items()})
        out.update({f"chosen_{r}": float(np.mean(v)) for r, v in chosen.items()})
        out["chosen_early"] = float(np.mean(chosen_early))
    out["early_stopping"] = float(np.mean(stopped))
    for r, each in forecasts.items():
        averaged = np.mean(each, axis=0)
        out[f"ensemble_{r}"] = base.mse(averaged) / mse_ar
        out[f"ensemble_{r}+ar"] = base.mse(0.5 * averaged + 0.5 * base.ar) / mse_ar
    if hybrid:
        out.update({f"hybrid_{r}": float(np.mean(v)) for r, v in corrected.items()})
    out["early_stopping_pick"] = float(np.mean(picks))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--series", default="tuning", help="tuning (the default), unseen, fresh, late, all, or comma-separated names"
    )
    parser.add_argument("--seeds", default="0,1,2", help="comma-separated seeds; each series' figures are their mean")
    parser.add_argument("--json", action="store_true", help="one JSON object per series, then the geometric means")
    parser.add_argument("--n-heads", type=int, default=4, help="the network's heads (default 4)")
    parser.add_argument("--hybrid", action="store_true", help="also the network as a correction on AR(p)")
    parser.add_argument("--dropout", type=float, default=0.0, help="the network's dropout in training (default 0)")
    parser.add_argument("--d-model", type=int, default=64, help="the network's width (default 64)")
    parser.add_argument("--n-layers", type=int, default=2, help="the network's blocks (default 2)")
    parser.add_argument("--weight-decay", type=float, default=0.01, help="AdamW's weight decay (default 0.01)")
    parser.add_argument(
        "--level-inputs", action="store_true", help="give the network the level and scale its encoding discards"
    )
    parser.add_argument(
        "--choose-level",
        action="store_true",
        help="train both networks (level-free and level-aware) and let the held-out block choose, ~2x the time",
    )
    parser.add_argument(
        "--choose-range",
        action="store_true",
        help="as --choose-level, the level clipped to the range seen before and a flag outside it",
    )
    args = parser.parse_args(argv)
    makers = {name: make for group in series_groups(args.series).values() for name, make in group.items()}
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    torch.set_num_threads(1)
    choose = "range" if args.choose_range else "level" if args.choose_level else None
    rows: dict[str, dict[str, float]] = {}
    for name, make in makers.items():
        started = time.monotonic()
        network = {"d_model": args.d_model, "n_heads": args.n_heads, "n_layers": args.n_layers, "dropout": args.dropout}
        rows[name] = run_series(make, seeds, network, args.hybrid, args.weight_decay, args.level_inputs, choose)
        print(f"[replay_budget] {name}: {time.monotonic() - started:.0f} s", file=sys.stderr)
    arms = [k for k in next(iter(rows.values())) if k != "early_stopping_pick"]
    geomean = {k: math.exp(float(np.mean([math.log(r[k]) for r in rows.values()]))) for k in arms}
    if args.json:
        for name, row in rows.items():
            print(json.dumps({"bench": "replay_budget", "series": name, **row}))
        print(json.dumps({"bench": "replay_budget", "series": "geometric mean", **geomean}))
        return 0
    header = ["series (MSE / AR(p))", *arms, "early stopping picked"]
    body = [[name, *(_fmt(row[k]) for k in arms), _fmt(row["early_stopping_pick"])] for name, row in rows.items()]
    body.append(["geometric mean", *(_fmt(geomean[k]) for k in arms), ""])
    print_columns(header, body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
