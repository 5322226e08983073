"""What a forecaster's next tries reach on the real series: exponential smoothing and ARIMA.

Issue 20 asks the service for 0.85x AR(p)'s error in the geometric mean over real series. After
AR(p), a practitioner reaches for statsmodels' ETS (error, trend and season chosen by AICc:
none / additive / damped trend; an additive season of 12 months, 4 quarters or 24 hours where
the training part holds three) and ARIMA(p, d, q) (p <= 3, d <= 1, q <= 2 by AICc; a constant
when d = 0). Each is fitted per channel on the training part of ``real_series.py``'s split (the
first 70%), and forecasts the last 30% one step ahead with its parameters fixed (the state
filtered through the whole series, so unlike the service it remembers more than the 24
readings of an event). Scored as ``real_series.py`` scores the service: MSE in the training
part's standard units over AR(p)'s; then the geometric means, and an oracle's that picks per
series the best of AR(p), ETS and ARIMA on the test part itself (no method can do better by
choosing among these three).

    python bench/classical_forecasters.py                  # the 11 tuning series, a minute or two
    python bench/classical_forecasters.py --series all     # tuning, unseen, fresh and late, a few minutes
    python bench/classical_forecasters.py --json

Needs the bench extra (statsmodels, matplotlib: the series' files); no broker, no torch.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

import numpy as np
from statsmodels.tsa.exponential_smoothing.ets import ETSModel  # imported first: it sets its own warning filters
from statsmodels.tsa.statespace.sarimax import SARIMAX

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _series import series_groups  # noqa: E402
from _table import Row, emit  # noqa: E402
from real_series import TARGET_GEOMEAN_AR, baselines, geomean  # noqa: E402

BENCH = "classical_forecasters"
SEASONS = {"monthly": 12, "quarterly": 4, "hourly": 24}  # by the series' period, its first word


def ets_one_step(x: np.ndarray, cut: int, season: int | None) -> tuple[np.ndarray, str]:
    """One-step forecasts of ``x[cut:]`` by the ETS model AICc picks on ``x[:cut]`` (additive errors)."""
    specs: list[tuple[str | None, bool, int | None]] = [(None, False, None), ("add", False, None), ("add", True, None)]
    if season and cut >= 3 * season:
        specs += [(trend, damped, season) for trend, damped, _ in specs]
    best: tuple[float, tuple[str | None, bool, int | None], np.ndarray] | None = None
    for trend, damped, period in specs:
        options = {"trend": trend, "damped_trend": damped, "seasonal": "add" if period else None}
        try:
            fitted = ETSModel(x[:cut], error="add", seasonal_periods=period, **options).fit(disp=False, maxiter=200)
        except (ValueError, np.linalg.LinAlgError):
            continue
        if best is None or fitted.aicc < best[0]:
            best = (float(fitted.aicc), (trend, damped, period), np.asarray(fitted.params))
    assert best is not None, "no ETS model could be fitted"
    _, (trend, damped, period), params = best
    model = ETSModel(x, error="add", trend=trend, damped_trend=damped, seasonal="add" if period else None,
                     seasonal_periods=period)  # fmt: skip
    name = f"ETS({'A' + ('d' if damped else '') if trend else 'N'},{'A' if period else 'N'})"
    return np.asarray(model.smooth(params).fittedvalues)[cut:], name


def arima_one_step(x: np.ndarray, cut: int) -> tuple[np.ndarray, str]:
    """One-step forecasts of ``x[cut:]`` by the ARIMA(p, d, q) AICc picks on ``x[:cut]``."""
    best: tuple[float, tuple[int, int, int], object] | None = None
    for d in (0, 1):
        for p in range(4):
            for q in range(3):
                model = SARIMAX(x[:cut], order=(p, d, q), trend="c" if d == 0 else "n")
                try:
                    fitted = model.fit(disp=False, maxiter=100)
                except (ValueError, np.linalg.LinAlgError):
                    continue
                if best is None or fitted.aicc < best[0]:
                    best = (float(fitted.aicc), (p, d, q), fitted)
    assert best is not None, "no ARIMA model could be fitted"
    _, order, fitted = best
    return np.asarray(fitted.apply(x).fittedvalues)[cut:], f"ARIMA{order}"  # type: ignore[attr-defined]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--series", default="tuning", help="tuning, unseen, fresh, late, all, or comma-separated names")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    groups = series_groups(args.series)
    rows: list[Row] = []
    for group, makers in groups.items():
        ets_ratios, arima_ratios, oracle = [], [], []
        for name, make in makers.items():
            series = make()
            values = np.asarray(series.values, dtype=np.float64)
            base = baselines(values)
            season = SEASONS.get(series.period.split()[0])
            ets, arima = [], []
            for c in range(values.shape[1]):
                with warnings.catch_warnings():  # statsmodels' start-parameter and convergence warnings, per fit
                    warnings.simplefilter("ignore")
                    ets.append(ets_one_step(values[:, c], base.cut, season))
                    arima.append(arima_one_step(values[:, c], base.cut))
            mse_ar = base.mse(base.ar)
            ets_ar = base.mse(np.stack([f for f, _ in ets], axis=1)) / mse_ar
            arima_ar = base.mse(np.stack([f for f, _ in arima], axis=1)) / mse_ar
            ets_ratios.append(ets_ar)
            arima_ratios.append(arima_ar)
            oracle.append(min(1.0, ets_ar, arima_ar))
            rows.append(Row(BENCH, f"{group} {name}: last value / AR(p)", base.mse(base.last) / mse_ar))
            rows.append(Row(BENCH, f"{group} {name}: ETS / AR(p) [{' '.join(n for _, n in ets)}]", ets_ar))
            rows.append(Row(BENCH, f"{group} {name}: ARIMA / AR(p) [{' '.join(n for _, n in arima)}]", arima_ar))
        rows.append(Row(BENCH, f"{group} geometric mean: ETS / AR(p)", geomean(ets_ratios)))
        rows.append(Row(BENCH, f"{group} geometric mean: ARIMA / AR(p)", geomean(arima_ratios)))
        target = f"<= {TARGET_GEOMEAN_AR}"
        rows.append(Row(BENCH, f"{group} geometric mean: best of AR(p), ETS, ARIMA per series (oracle) / AR(p)",
                        geomean(oracle), None, target))  # fmt: skip
    emit(rows, args.json)


if __name__ == "__main__":
    main()
