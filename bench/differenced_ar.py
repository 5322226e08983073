"""Would a practitioner's next linear try beat AR(p)? Autoregressions on lag-d differences, on real series.

Issue 20 asks for 0.85x AR(p)'s error in the geometric mean over real series, and the linear
forecaster the service serves reaches ~0.92x. Seasonal and trend models are what a
forecaster tries after AR(p) (SARIMA's seasonal difference, ARIMA's first difference): for
each channel of each series of ``bench/_series.py``, an autoregression of order q with
intercept on the changes ``x[t] - x[t-d]`` (d = 1 a first difference, d = 4, 12, ... a
season's) forecasts ``x[t] = x[t-d] + change``; d and q (d + q < 24, the events' context)
are chosen on the training part's last 20% after fitting on its first 80%, as
``real_series.py`` chooses AR(p)'s order, then refitted on the whole training part. Scored
on the last 30% as ``real_series.py`` scores the service (MSE in standard units / AR(p)'s),
alone and averaged half and half with AR(p); then the geometric means, and an oracle's that
picks per series the best of AR(p), the differenced model and their average.

    python bench/differenced_ar.py           # 11 series, seconds
    python bench/differenced_ar.py --json

Needs the bench extra (statsmodels, matplotlib: the series' files); no broker, no torch.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _series import SERIES  # noqa: E402
from _table import Row, emit  # noqa: E402
from real_series import CONTEXT, SELECT_SHARE, baselines, geomean  # noqa: E402

BENCH = "differenced_ar"


def fit_differenced(x: np.ndarray, d: int, q: int) -> np.ndarray:
    """Least squares [intercept, c_1..c_q] of ``y[t] = x[t] - x[t-d]`` on y's q lags."""
    y = x[d:] - x[:-d]
    targets = np.arange(q, len(y))
    design = np.stack([np.ones(len(targets))] + [y[targets - k] for k in range(1, q + 1)], axis=1)
    return np.linalg.lstsq(design, y[targets], rcond=None)[0]


def forecast_differenced(coef: np.ndarray, d: int, contexts: np.ndarray) -> np.ndarray:
    """One step ahead from each row of ``contexts`` [N, L > d + q] (readings in time order)."""
    q, length = len(coef) - 1, contexts.shape[1]
    changes = [contexts[:, length - k] - contexts[:, length - k - d] for k in range(1, q + 1)]
    lags = np.stack(changes, axis=1) if changes else np.zeros((len(contexts), 0))
    return contexts[:, length - d] + coef[0] + lags @ coef[1:]


def choose_differenced(x: np.ndarray) -> tuple[int, int, np.ndarray]:
    """(d, q, coefficients): picked on the last 20% of ``x`` after fitting on the first 80%, refitted on all."""
    split = int(SELECT_SHARE * len(x))
    targets = np.arange(max(split, CONTEXT), len(x))
    contexts = np.stack([x[t - CONTEXT : t] for t in targets])
    best: tuple[float, int, int] | None = None
    for d in range(1, CONTEXT):
        for q in range(CONTEXT - d):
            if split - d - q < 3 * (q + 2):  # at least three targets per coefficient
                continue
            error = float(
                np.mean((forecast_differenced(fit_differenced(x[:split], d, q), d, contexts) - x[targets]) ** 2)
            )
            if best is None or error < best[0]:
                best = (error, d, q)
    assert best is not None, "a series too short to choose on"
    _, d, q = best
    return d, q, fit_differenced(x, d, q)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--series", default=",".join(SERIES), help="comma separated names of bench/_series.py")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    rows: list[Row] = []
    alone, averaged, oracle = [], [], []
    for name in args.series.split(","):
        values = np.asarray(SERIES[name]().values, dtype=np.float64)
        base = baselines(values)
        train = values[: base.cut]
        picks = [choose_differenced(train[:, c]) for c in range(values.shape[1])]
        forecast = np.stack(
            [forecast_differenced(coef, d, base.contexts[:, :, c]) for c, (d, _, coef) in enumerate(picks)], axis=1
        )
        mse_ar = base.mse(base.ar)
        ratios = (base.mse(forecast) / mse_ar, base.mse(0.5 * (forecast + base.ar)) / mse_ar)
        alone.append(ratios[0])
        averaged.append(ratios[1])
        oracle.append(min(1.0, *ratios))
        chosen = " ".join(f"d={d},q={q}" for d, q, _ in picks)
        rows.append(Row(BENCH, f"{name}: differenced / AR(p) [{chosen}; AR orders {base.orders}]", ratios[0]))
        rows.append(Row(BENCH, f"{name}: half differenced, half AR(p) / AR(p)", ratios[1]))
    rows.append(Row(BENCH, "geometric mean: differenced / AR(p)", geomean(alone)))
    rows.append(Row(BENCH, "geometric mean: half and half / AR(p)", geomean(averaged)))
    best = "geometric mean: best of the three per series (an oracle) / AR(p)"
    rows.append(Row(BENCH, best, geomean(oracle), None, "<= 0.85"))
    emit(rows, args.json)


if __name__ == "__main__":
    main()
