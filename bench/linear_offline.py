"""The service's linear forecaster offline on the real series, beside a variant of it.

``real_series.py`` runs a real service for a minute a series; this fits the service's own
``choose_linear`` directly on a series' training windows (sliding windows of 24 readings of the
first 70%, in the training part's standard units, each reading counted once as the service
counts it), in seconds, and forecasts the test part after each 24-reading context as
``real_series.py`` scores the service. A service holds fewer windows than that (the holdout and
its guards, a sample), and on a short series the choice swings with which windows it holds, so
each series is also fitted on every prefix of its windows from half to all (about 30 of them):
the geometric mean over prefixes, the worst, and on how many prefixes one variant beats the
other say more than one fit. Both in one run: the forecaster as it serves, and the baseline
variant ``--baseline`` names: ``no-smoothing`` (its smoothed family left out,
``SMOOTHING_WEIGHTS`` emptied), ``shrink-df-2`` (every family shrunk as a model of two
parameters, as before the shrink factor counted the best model's own) or ``bic`` (a family served
only where Schwarz's criterion prefers it to the last value).

    python bench/linear_offline.py                   # the 11 tuning series
    python bench/linear_offline.py --series all      # tuning, unseen, fresh and late (30), a minute
    python bench/linear_offline.py --series all --baseline shrink-df-2 --json

Needs the bench extra (statsmodels, matplotlib: the series' files); no broker.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _series import series_groups, sliding_windows  # noqa: E402
from _table import Row, emit  # noqa: E402
from real_series import CONTEXT, Baselines, baselines, geomean  # noqa: E402

from streamtrain.model import forecasters  # noqa: E402
from streamtrain.model.forecasters import LagSums, choose_linear  # noqa: E402

BENCH = "linear_offline"
PREFIXES = 30


@contextlib.contextmanager
def no_smoothing() -> Iterator[None]:
    weights = forecasters.SMOOTHING_WEIGHTS
    forecasters.SMOOTHING_WEIGHTS = ()
    try:
        yield
    finally:
        forecasters.SMOOTHING_WEIGHTS = weights


@contextlib.contextmanager
def shrink_df_2() -> Iterator[None]:
    shrink_factor = forecasters.shrink_factor

    def as_two_parameters(edge: float, distinct_targets: float, df: float) -> float:
        return shrink_factor(edge, distinct_targets, forecasters.LINEAR_SHRINK_DF)

    forecasters.shrink_factor = as_two_parameters
    try:
        yield
    finally:
        forecasters.shrink_factor = shrink_factor


@contextlib.contextmanager
def schwarz_gate() -> Iterator[None]:
    """A family's fit kept only where Schwarz's criterion (BIC) prefers it to the last value: its GCV gain
    over the last value, ``n log(last / GCV)``, above ``df (log n - 2)`` (GCV charges about 2 per
    parameter already, as AIC does; BIC charges ``log n``)."""
    averaged = forecasters.averaged

    def gated(members: Sequence[forecasters.LinearModel], sums: LagSums, channel: int) -> forecasters.FamilyFit | None:
        fit = averaged(members, sums, channel)
        if fit is None:
            return None
        best = min(members, key=lambda m: m.gcv_mse)
        _, _, yty, rows = sums.tail(channel, best.coefficients.size - 2)
        n = best.distinct_targets
        return fit if n * math.log(yty / rows / best.gcv_mse) > best.df * (math.log(n) - 2.0) else None

    forecasters.averaged = gated
    try:
        yield
    finally:
        forecasters.averaged = averaged


BASELINES: dict[str, Callable[[], contextlib.AbstractContextManager[None]]] = {
    "no-smoothing": no_smoothing,
    "shrink-df-2": shrink_df_2,
    "bic": schwarz_gate,
}


def forecast(windows: Sequence[np.ndarray], base: Baselines) -> np.ndarray:
    """The linear choice fitted on ``windows`` forecasting the test part (after full contexts)."""
    channels = base.targets.shape[1]
    std = np.where(base.std > 0, base.std, 1.0)
    sums = LagSums.of(windows, CONTEXT, channels, base.mean, std)
    choice = choose_linear(sums, CONTEXT, redundancy=float(CONTEXT))
    assert choice is not None
    contexts = (base.contexts - base.mean) / std
    out = []
    for c in range(channels):
        row = choice.coefficients[c, -1]  # every lag real: the origin after a full context
        lags = contexts[:, ::-1, c][:, : row.size - 1]
        out.append(contexts[:, -1, c] + row[0] + lags @ row[1:])
    return np.stack(out, axis=1) * std + base.mean


def ratios(values: np.ndarray) -> tuple[float, float, np.ndarray]:
    """(served / last value, served / AR(p)) on all the training windows, and served / last value on each prefix."""
    base = baselines(values)
    windows = sliding_windows(values, CONTEXT, base.cut)
    last, ar = base.mse(base.last), base.mse(base.ar)
    full = base.mse(forecast(windows, base))
    step = max(1, len(windows) // PREFIXES)
    prefixes = range(max(16, len(windows) // 2), len(windows) + 1, step)
    return full / last, full / ar, np.array([base.mse(forecast(windows[:n], base)) / last for n in prefixes])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--series", default="tuning", help="tuning, unseen, fresh, late, all, or comma-separated names")
    parser.add_argument("--baseline", choices=sorted(BASELINES), default="no-smoothing")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    groups = series_groups(args.series)
    baseline = BASELINES[args.baseline]
    rows: list[Row] = []
    for group, makers in groups.items():
        served_ar: dict[str, list[float]] = {"with": [], "without": []}
        for name, make in makers.items():
            values = np.asarray(make().values, dtype=np.float64)
            with_last, with_ar, with_prefixes = ratios(values)
            with baseline():
                without_last, without_ar, without_prefixes = ratios(values)
            served_ar["with"].append(with_ar)
            served_ar["without"].append(without_ar)
            better = int((with_prefixes < without_prefixes - 1e-9).sum())
            worse = int((with_prefixes > without_prefixes + 1e-9).sum())
            rows += [
                Row(BENCH, f"{group} {name}: linear / last value, all windows", with_last, without_last),
                Row(BENCH, f"{group} {name}: linear / AR(p), all windows", with_ar, without_ar),
                Row(BENCH, f"{group} {name}: linear / last value, geometric mean over {with_prefixes.size} prefixes",
                    geomean(with_prefixes), geomean(without_prefixes)),
                Row(BENCH, f"{group} {name}: linear / last value, worst prefix", float(with_prefixes.max()),
                    float(without_prefixes.max())),
                Row(BENCH, f"{group} {name}: prefixes where it beats {args.baseline}", better),
                Row(BENCH, f"{group} {name}: prefixes where it loses to {args.baseline}", worse),
            ]  # fmt: skip
        rows.append(Row(BENCH, f"{group} geometric mean: linear / AR(p), all windows (baseline: {args.baseline})",
                        geomean(served_ar["with"]), geomean(served_ar["without"])))  # fmt: skip
    emit(rows, args.json)


if __name__ == "__main__":
    main()
