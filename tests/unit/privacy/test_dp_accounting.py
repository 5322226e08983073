"""The per-event accountant against dp_accounting's and Opacus' own computations."""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterator

import dp_accounting as dpa
import numpy as np
import pytest
from dp_accounting.pld import privacy_loss_distribution as pld_lib
from dp_accounting.pld.pld_privacy_accountant import PLDAccountant

from streamtrain.config import load_settings
from streamtrain.model.network import build_model
from streamtrain.privacy.accounting import (
    DEFAULT_DISCRETIZATION,
    MAX_DIMENSION,
    DiscreteSlack,
    PerEventAccountant,
    SensorLifetimeAccountant,
    _composed,
    _epsilon,
    _epsilon_table,
    _lifetime_table,
    _log_theta_tail,
    _segments,
    _subsampled_gaussian,
    expected_exposures,
    grid_points,
    rate_groups,
)
from streamtrain.privacy.config import DPConfig
from streamtrain.privacy.noise import GRID
from streamtrain.privacy.validators import NOISE_MULTIPLIER_RANGE, check_dp_safety

SIGMA, Q0, K, DELTA = 1.1, 0.05, 60, 1e-6
#: The 1-D comparison below: discrete and continuous PLDs agree within this.
ONE_D_TOLERANCE = 1e-6


@pytest.fixture(autouse=True, scope="module")
def fresh_accounting_caches() -> Iterator[None]:
    """These tests compose their own PLDs: a cache filled earlier in the same process (a mutation
    run forks its mutants from one that ran the tests) would answer for code they never ran."""
    for cache in (_subsampled_gaussian, _composed, _epsilon_table, _lifetime_table):
        cache.cache_clear()
    yield


def library_epsilon(
    schedule: list[float],
    relation: dpa.NeighboringRelation,
    discretization: float = DEFAULT_DISCRETIZATION,
    sigma: float = SIGMA,
    delta: float = DELTA,
) -> float:
    """dp_accounting's PLD accountant composing the schedule step by step."""
    accountant = PLDAccountant(relation, value_discretization_interval=discretization)
    counts: dict[float, int] = {}
    for q in schedule:
        counts[q] = counts.get(q, 0) + 1
    for q, count in counts.items():
        accountant.compose(dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(sigma)), count)
    return accountant.get_epsilon(delta)


def service_dimension() -> int:
    """d of the default model: the coordinates the service adds discrete Gaussian noise to."""
    model = build_model(load_settings())
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def test_homogeneous_schedule_matches_dp_accounting() -> None:
    ours = PerEventAccountant(SIGMA, np.full(K, Q0), DELTA)
    reference = library_epsilon([Q0] * K, dpa.NeighboringRelation.REPLACE_ONE)
    assert ours.epsilon_cap == pytest.approx(reference, rel=1e-3)
    assert ours.epsilon_cap >= reference


def test_add_remove_part_agrees_with_opacus_rdp_and_prv() -> None:
    from opacus.accountants import PRVAccountant, RDPAccountant

    _, table = _epsilon_table(
        SIGMA, (Q0,) * K, DELTA, DEFAULT_DISCRETIZATION, 32, 16, dpa.NeighboringRelation.ADD_OR_REMOVE_ONE
    )
    ours = table[-1]
    rdp, prv = RDPAccountant(), PRVAccountant()
    rdp.history = [(SIGMA, Q0, K)]
    prv.history = [(SIGMA, Q0, K)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rdp_epsilon, prv_epsilon = rdp.get_epsilon(DELTA), prv.get_epsilon(DELTA)
    assert 0.75 * rdp_epsilon <= ours <= rdp_epsilon  # PLD is tight, RDP an upper bound
    assert ours == pytest.approx(prv_epsilon, rel=0.03)


def test_replace_one_bounds_add_remove() -> None:
    """The accountant reports replace-one only; that must cover add/remove (docs/privacy.md)."""
    for sigma, q, k in [(0.6, 0.2, 10), (1.1, 0.05, 60), (3.0, 0.5, 5)]:
        schedule = (q,) * k
        _, replace = _epsilon_table(
            sigma, schedule, DELTA, DEFAULT_DISCRETIZATION, 32, 16, dpa.NeighboringRelation.REPLACE_ONE
        )
        _, add_remove = _epsilon_table(
            sigma, schedule, DELTA, DEFAULT_DISCRETIZATION, 32, 16, dpa.NeighboringRelation.ADD_OR_REMOVE_ONE
        )
        assert np.all(np.asarray(replace) >= np.asarray(add_remove) - 1e-9)


def test_heterogeneous_schedule_is_an_upper_bound_close_to_exact() -> None:
    config = DPConfig(
        noise_multiplier=SIGMA, q0=0.2, half_life_steps=4.0, eligible_steps=12, delta=DELTA, expected_units=1e3
    )
    schedule = config.sampling_schedule()
    assert schedule[0] == 0.2 and schedule[4] == pytest.approx(0.1)
    ours = PerEventAccountant.for_config(config)  # 12 distinct rates, 12 bands: no rounding
    exact = library_epsilon(schedule.tolist(), dpa.NeighboringRelation.REPLACE_ONE)
    coupled = library_epsilon(
        schedule.tolist(), dpa.NeighboringRelation.REPLACE_ONE, sigma=ours.slack.accounted_multiplier
    )
    assert ours.epsilon_cap == pytest.approx(max(exact, coupled), rel=1e-9)
    coarse = PerEventAccountant(SIGMA, schedule, DELTA, max_rate_levels=3)  # rates rounded up in bands
    assert exact < coarse.epsilon_cap <= 1.3 * exact
    constant = PerEventAccountant(SIGMA, np.full(12, 0.2), DELTA)
    assert ours.epsilon_cap < constant.epsilon_cap  # decaying q costs less than constant q0


def test_rate_groups_round_up_only_within_bands() -> None:
    schedule = 0.1 * np.exp2(-np.arange(200) / 20.0)
    groups = rate_groups(schedule, max_levels=32)
    assert np.all(np.diff(groups) >= 0)
    for g in np.unique(groups):
        band = schedule[groups == g]
        assert band.max() / band.min() <= 2 ** (10 / 32) + 1e-12  # 10 octaves over 32 levels


def test_spent_epsilon_grows_with_steps_and_caps_at_k() -> None:
    accountant = PerEventAccountant(SIGMA, np.full(K, Q0), DELTA)
    spent = [accountant.epsilon_after(n) for n in range(0, 2 * K)]
    assert spent[0] == 0.0 and spent[1] > 0
    assert all(b >= a for a, b in zip(spent, spent[1:], strict=False))
    assert spent[K] == spent[-1] == accountant.epsilon_cap
    for n in (1, 7, 30):  # a grid read is never below the exact prefix composition
        assert accountant.epsilon_after(n) >= library_epsilon([Q0] * n, dpa.NeighboringRelation.REPLACE_ONE) * (
            1 - 1e-3
        )


def test_state_dict_round_trip_and_mismatch() -> None:
    accountant = PerEventAccountant(SIGMA, np.full(K, Q0), DELTA)
    clone = PerEventAccountant(SIGMA, np.full(K, Q0), DELTA)
    clone.load_state_dict(accountant.state_dict())
    assert clone.epsilon_cap == accountant.epsilon_cap
    other = PerEventAccountant(SIGMA * 2, np.full(K, Q0), DELTA)
    with pytest.raises(ValueError, match="schedule"):
        other.load_state_dict(accountant.state_dict())


def test_rejects_bad_schedules() -> None:
    with pytest.raises(ValueError):
        PerEventAccountant(SIGMA, [0.1, 0.2], DELTA)  # increasing
    with pytest.raises(ValueError):
        PerEventAccountant(SIGMA, [], DELTA)
    with pytest.raises(ValueError):
        PerEventAccountant(0.0, [0.1], DELTA)
    assert math.isfinite(PerEventAccountant(SIGMA, [1.0], DELTA).epsilon_cap)


@pytest.mark.parametrize("scale", [8, 64])
def test_discrete_gaussian_accounts_like_the_continuous_one(scale: int) -> None:
    """The discretization: where dp_accounting has the discrete Gaussian's own PLD (one
    dimension, integer sensitivity), its subsampled, composed ε agrees with the continuous
    Gaussian's (a sanity check; the bound itself is the coupling, tested below)."""
    for sensitivity in (scale, scale // 2):
        common = dict(sampling_prob=0.05, value_discretization_interval=1e-4, use_connect_dots=True)
        discrete = pld_lib.from_discrete_gaussian_mechanism(scale, sensitivity=sensitivity, **common).self_compose(100)
        continuous = pld_lib.from_gaussian_mechanism(scale, sensitivity=sensitivity, **common).self_compose(100)
        gap = discrete.get_epsilon_for_delta(DELTA) - continuous.get_epsilon_for_delta(DELTA)
        assert abs(gap) < ONE_D_TOLERANCE, gap


def test_sensor_lifetime_is_the_composition_of_its_groups() -> None:
    record = PerEventAccountant(3.0, np.full(20, 0.1), DELTA)
    lifetime = SensorLifetimeAccountant(record, target_epsilon=2.0)
    assert lifetime.max_groups >= 2
    assert lifetime.epsilon_cap <= 2.0
    assert lifetime.epsilon_after(1) == pytest.approx(record.epsilon_cap, abs=1e-9)
    # one more group would break the target: the lifetime budget is as large as allowed, no larger
    accountant = PLDAccountant(
        dpa.NeighboringRelation.REPLACE_ONE, value_discretization_interval=DEFAULT_DISCRETIZATION
    )
    accountant.compose(dpa.PoissonSampledDpEvent(0.1, dpa.GaussianDpEvent(3.0)), 20 * (lifetime.max_groups + 1))
    assert accountant.get_epsilon(DELTA) > 2.0 - 0.02
    spent = [lifetime.epsilon_after(g) for g in range(lifetime.max_groups + 1)]
    assert spent[0] == 0 and all(b >= a for a, b in zip(spent, spent[1:], strict=False))
    assert SensorLifetimeAccountant(record, target_epsilon=record.epsilon_cap / 2).max_groups == 0


def test_expected_exposures_is_delta_times_units() -> None:
    assert expected_exposures(1e-12, 1e10) == pytest.approx(0.01)


# --- the discrete Gaussian in d dimensions: the coupling bound (docs/privacy.md, Noise) ---


def test_theta_tail_bound_is_tight_and_above_the_poisson_sum() -> None:
    """θ_r(x)/(√(2π)·r) − 1 ranges over [−ε_r, ε_r] (Poisson summation), ε_r = 2·Σ e^{−2π²r²n²}."""
    mp = pytest.importorskip("mpmath")
    mp.mp.dps = 40
    for r in (0.35, 0.6, 1.0):
        bound = math.exp(_log_theta_tail(r))
        exact = 2 * mp.fsum(mp.e ** (-2 * mp.pi**2 * r**2 * n**2) for n in range(1, 40))
        assert float(exact) <= bound <= float(exact) * (1 + 1e-6)
        for x in np.linspace(0.0, 1.0, 11):
            theta = mp.fsum(mp.e ** (-((m - x) ** 2) / (2 * r**2)) for m in range(-60, 61))
            assert abs(float(theta / (mp.sqrt(2 * mp.pi) * r)) - 1) <= bound * (1 + 1e-9)
        theta0 = mp.fsum(mp.e ** (-(m**2) / (2 * r**2)) for m in range(-60, 61))
        assert float(theta0 / (mp.sqrt(2 * mp.pi) * r)) - 1 == pytest.approx(bound, rel=1e-6)  # attained at x = 0


def test_coupling_lemma_holds_pointwise_at_a_small_scale() -> None:
    """P(K = k) for X ~ N(0, s²−r²), K | X ~ N_Z(X, r²) is within e^{±η} of N_Z(0, s²)(k)."""
    from scipy import integrate

    s, r = 2.0, 0.6
    log_eps = _log_theta_tail(r)
    eta = math.log1p(math.exp(log_eps)) - math.log1p(-math.exp(log_eps))
    s_aux = math.sqrt(s**2 - r**2)
    lattice = np.arange(-60, 61, dtype=np.float64)

    def density(x: float, k: int) -> float:
        theta = float(np.exp(-((lattice + math.floor(x) - x) ** 2) / (2 * r**2)).sum())
        gauss = math.exp(-(x**2) / (2 * s_aux**2)) / (math.sqrt(2 * math.pi) * s_aux)
        return gauss * math.exp(-((k - x) ** 2) / (2 * r**2)) / theta

    normal = float(np.exp(-(lattice**2) / (2 * s**2)).sum())
    worst = 0.0
    for k in range(-8, 9):
        mass, _ = integrate.quad(density, k - 12 * r, k + 12 * r, args=(k,), epsabs=0.0, epsrel=1e-12, limit=200)
        worst = max(worst, abs(math.log(mass / (math.exp(-(k**2) / (2 * s**2)) / normal))))
    assert 0 < worst <= eta


def test_slack_at_the_service_dimension_and_sigma_range() -> None:
    d = service_dimension()
    assert d > 50_000  # the default model: ~100k trainable parameters, every one noised
    low, high = NOISE_MULTIPLIER_RANGE
    default = DPConfig()
    for sigma in (low, default.noise_multiplier, high):
        slack = DiscreteSlack.compute(sigma, d)
        s = sigma * GRID
        assert slack.radius == pytest.approx(s / 1024)
        assert slack.accounted_multiplier < sigma
        assert slack.accounted_multiplier == pytest.approx(sigma * math.sqrt(1 - 2**-20), rel=1e-11)
        # at σ = 0.3: ln η ≈ ln 4 − 2π²(s/1024)² ≈ −7276, so T·d·η ≈ 10^-3153; it underflows in float
        assert slack.log10_slack(default.eligible_steps) < -3000
        assert math.exp(slack.log_slack(default.eligible_steps)) == 0.0
    low_slack = DiscreteSlack.compute(low, d).log10_slack(100)
    assert low_slack == pytest.approx(
        (math.log(100 * d) + math.log(4) - 2 * math.pi**2 * (low * GRID / 1024) ** 2) / math.log(10), abs=1e-3
    )


def test_slack_grows_with_dimension_and_shrinks_with_sigma() -> None:
    sigmas = [0.3, 0.5, 1.1, 3.0, 30.0, 1000.0]
    for sigma in sigmas:
        by_d = [DiscreteSlack.compute(sigma, d).log10_slack(100) for d in (1, 1000, 100_353, MAX_DIMENSION)]
        assert all(b > a for a, b in zip(by_d, by_d[1:], strict=False))
        linear = by_d[2] - by_d[1]  # log10 of the d ratio; ln η is ~σ²·1e5, so allow its float resolution
        assert linear == pytest.approx(math.log10(100.353), abs=1e-9 + 1e-15 * abs(by_d[2]))
    by_sigma = [DiscreteSlack.compute(sigma, 100_353).log10_slack(100) for sigma in sigmas]
    assert all(b < a for a, b in zip(by_sigma, by_sigma[1:], strict=False))
    by_steps = [DiscreteSlack.compute(0.3, 100_353).log10_slack(t) for t in (1, 100, 10_000)]
    assert by_steps[1] - by_steps[0] == pytest.approx(2.0) and by_steps[2] - by_steps[1] == pytest.approx(2.0)


def test_slack_enters_epsilon_and_delta_where_it_is_visible() -> None:
    """At s = 2 grid units (r = 1) the slack is ~1e-8 per coordinate-step: the bound must carry it."""
    slack = DiscreteSlack.compute(2 / GRID, 100_000)
    x = math.exp(slack.log_slack(100))
    assert 0.05 < x < 0.5
    assert slack.epsilon(1.0, 100) >= 1.0 + 2 * x
    assert slack.pld_delta(1e-6, 100) <= 1e-6 * math.exp(-x)
    pld = pld_lib.from_gaussian_mechanism(2.0, sampling_prob=0.05, value_discretization_interval=1e-3)
    plain, bounded = _epsilon(pld, 1e-6), _epsilon(pld, 1e-6, slack, 100)
    assert bounded >= pld.get_epsilon_for_delta(1e-6 * math.exp(-x)) + 2 * x > plain + 2 * x
    assert _epsilon(pld, 1e-6, DiscreteSlack.compute(2 / GRID, 10), 100) < bounded  # smaller d, smaller bound


@pytest.mark.parametrize("sigma", [NOISE_MULTIPLIER_RANGE[0], 1.1, 5.0])
def test_reported_epsilon_bounds_the_coupled_and_the_continuous_pld(sigma: float) -> None:
    d = 100_353
    ours = PerEventAccountant(sigma, np.full(20, 0.05), 1e-12, dimension=d)
    continuous = library_epsilon([0.05] * 20, dpa.NeighboringRelation.REPLACE_ONE, sigma=sigma, delta=1e-12)
    coupled = library_epsilon(
        [0.05] * 20, dpa.NeighboringRelation.REPLACE_ONE, sigma=ours.slack.accounted_multiplier, delta=1e-12
    )
    assert ours.slack.dimension == d and ours.slack.accounted_multiplier < sigma
    assert ours.epsilon_cap >= continuous
    assert ours.epsilon_cap >= coupled  # the bound proper: the PLD at σ' (the slack itself is below 1e-3000)
    assert ours.epsilon_cap == pytest.approx(max(continuous, coupled), rel=1e-3)  # our grid composes in pieces
    lifetime = SensorLifetimeAccountant(ours, target_epsilon=ours.epsilon_cap * 3)
    assert lifetime.epsilon_after(1) >= ours.epsilon_cap - 1e-9


def test_the_service_accountant_gets_the_model_dimension() -> None:
    settings = load_settings()
    model = build_model(settings)
    accountant = check_dp_safety(DPConfig.from_settings(settings), "crypto", model)
    assert accountant.dimension == service_dimension()
    assert accountant.log10_slack < -3000
    assert "log10(T·d·η)" in accountant.describe()
    assert PerEventAccountant.for_config(DPConfig()).dimension == MAX_DIMENSION  # no model: the upper bound


# --- what the first mutation run of the accountant asked (docs/testing.md) ---


@pytest.mark.parametrize(
    ("sigma", "schedule", "delta", "reason"),
    [
        (SIGMA, [0.0], DELTA, r"rates in \(0, 1\]"),
        (SIGMA, [1.5], DELTA, r"rates in \(0, 1\]"),
        (SIGMA, [0.1, -0.1], DELTA, r"rates in \(0, 1\]"),
        (SIGMA, [], DELTA, r"needs K >= 1 rates"),
        (SIGMA, [0.05, 0.1], DELTA, "must not increase with age"),
        (0.0, [0.1], DELTA, r"need σ > 0 and 0 < δ < 1, got 0.0, 1e-06"),
        (SIGMA, [0.1], 0.0, r"need σ > 0 and 0 < δ < 1"),
        (SIGMA, [0.1], 1.0, r"need σ > 0 and 0 < δ < 1"),
        (SIGMA, [0.1], 1.5, r"need σ > 0 and 0 < δ < 1"),
    ],
)
def test_an_accountant_refuses_bad_settings_with_their_reason(
    sigma: float, schedule: list[float], delta: float, reason: str
) -> None:
    with pytest.raises(ValueError, match=f"^PerEventAccountant: .*{reason}"):
        PerEventAccountant(sigma, schedule, delta)


@pytest.mark.parametrize(("sigma", "dimension"), [(-1.0, 10), (0.0, 10), (SIGMA, 0), (SIGMA, MAX_DIMENSION + 1)])
def test_the_slack_refuses_a_sigma_or_dimension_out_of_range(sigma: float, dimension: int) -> None:
    with pytest.raises(ValueError, match=r"^DiscreteSlack: need σ > 0 and 1 <= d <= 2\^40, got σ="):
        DiscreteSlack.compute(sigma, dimension)


@pytest.mark.parametrize(("s", "shown"), [(0.0655, "0.0655"), (0.46, "0.46")])
def test_the_slack_refuses_a_noise_too_small_for_the_coupling(s: float, shown: str) -> None:
    """ε_r ≥ 1/2 is refused: far past it (s = 0.07 grid units) and just past it (s = 0.46, ε_r ≈ 0.7)."""
    with pytest.raises(ValueError, match=rf"^DiscreteSlack: s = {shown}\d* grid units is too small for the coupling"):
        DiscreteSlack.compute(s / GRID, 10)


def test_a_schedule_given_as_a_column_is_read_as_its_rates() -> None:
    column = PerEventAccountant(SIGMA, [[0.1], [0.05]], DELTA)
    flat = PerEventAccountant(SIGMA, [0.1, 0.05], DELTA)
    assert column.schedule.shape == (2,) and column.epsilon_cap == flat.epsilon_cap


def test_the_log_theta_tail_is_rounded_up_by_a_relative_1e12() -> None:
    """The documented margin, neither dropped nor grown: at |ln ε_r| < 1 and far above it."""
    for r in (0.25, 3.0):
        a = 2.0 * math.pi**2 * r**2
        raw = math.log(2.0) - a - math.log1p(-math.exp(-3.0 * a))
        margin = _log_theta_tail(r) - raw
        assert margin == pytest.approx(1e-12 * max(1.0, abs(raw)), rel=1e-3, abs=0)


def test_the_slack_per_coordinate_is_above_the_exact_eta_and_sigma_prime_below_the_exact_one() -> None:
    """η = 2·atanh(ε_r) is bounded by 2ε_r/(1 − ε_r²), rounded up by 1e-9 relative; σ' is rounded down."""
    mp = pytest.importorskip("mpmath")
    mp.mp.dps = 50
    for s in (0.6, 2.0):  # grid units: r = s/2; ε_r ≈ 0.34 (ln η ≈ −0.27) and ≈ 5e−9 (ln η ≈ −18.4)
        slack = DiscreteSlack.compute(s / GRID, 10)
        r = s / 2
        assert slack.noise_multiplier == s / GRID and slack.dimension == 10 and slack.radius == pytest.approx(r)
        eps = 2 * mp.fsum(mp.e ** (-2 * mp.pi**2 * mp.mpf(r) ** 2 * n**2) for n in range(1, 30))
        assert float(mp.log(2 * mp.atanh(eps))) < slack.log_eta  # ln η itself
        tail = mp.e ** mp.mpf(_log_theta_tail(r))  # the tail's own bound (tested above)
        bound = float(mp.log(2 * tail / (1 - tail**2)))
        assert slack.log_eta - bound == pytest.approx(1e-9 * max(1.0, abs(bound)), rel=1e-3, abs=0)
    sigma = 1.1
    served = DiscreteSlack.compute(sigma, 100_000)
    exact_prime = mp.mpf(sigma) * mp.sqrt(1 - (mp.mpf(served.radius) / (mp.mpf(sigma) * GRID)) ** 2)
    assert served.accounted_multiplier < float(exact_prime)
    assert float(exact_prime) - served.accounted_multiplier == pytest.approx(
        float(exact_prime) * 1e-12, rel=1e-2, abs=0
    )


def test_the_slack_enters_epsilon_and_delta_as_documented_neither_more_nor_less() -> None:
    """ε + 2x and δ·e^{−x}, x = T·d·η, each rounded the safe way by a hair (docstrings above)."""
    slack = DiscreteSlack.compute(2 / GRID, 100_000)
    x = math.exp(slack.log_slack(100))
    assert slack.epsilon(1.0, 100) == pytest.approx(1.0 + 2 * x, rel=1e-12)
    assert slack.pld_delta(1e-6, 100) == pytest.approx(1e-6 * math.exp(-x), rel=1e-12)
    served = DiscreteSlack.compute(1.1, 100_000)  # x underflows: the δ is the same, one ulp down
    assert served.pld_delta(1e-6, 100) == float(np.nextafter(1e-6 * math.exp(-1e-15), 0.0))
    assert 1e-6 * (1 - 1e-14) < served.pld_delta(1e-6, 100) < 1e-6
    pld = pld_lib.from_gaussian_mechanism(2.0, sampling_prob=0.05, value_discretization_interval=1e-3)
    one_step = math.exp(slack.log_slack(1))  # a call without steps is one step
    assert _epsilon(pld, 1e-6, slack) == pytest.approx(
        pld.get_epsilon_for_delta(1e-6 * math.exp(-one_step)) + 2 * one_step, rel=1e-12
    )


def test_rate_groups_are_bands_of_a_sixteenth_octave_anchored_at_the_first_rate() -> None:
    rng = np.random.default_rng(7)
    octaves = np.concatenate([[0.0], np.sort(rng.uniform(0.0, 1.0, 60)), [1.0]])  # one octave: 16 bands
    groups = rate_groups(0.2 * np.exp2(-octaves), max_levels=32)
    assert groups.dtype.kind == "i"
    np.testing.assert_array_equal(groups, np.floor(octaves * 16))
    assert len(np.unique(groups)) == 17  # the last rate starts band 16
    wide = np.concatenate([[0.0], np.sort(rng.uniform(0.0, 10.0, 200)), [10.0]])  # 10 octaves, 32 levels
    np.testing.assert_array_equal(rate_groups(0.1 * np.exp2(-wide), max_levels=32), np.floor(wide / (10 / 32)))
    constant = rate_groups(np.full(5, 0.3))
    assert constant.dtype.kind == "i" and constant.tolist() == [0] * 5


def test_describe_names_the_first_and_last_rates() -> None:
    accountant = PerEventAccountant(SIGMA, [0.08, 0.04, 0.02], DELTA, dimension=1000)
    text = accountant.describe()
    assert "σ=1.1, K=3, q_0=0.08, q_K-1=0.02, δ=1e-06: ε ≤ " in text and "d=1000" in text


def test_state_dict_names_what_the_table_was_computed_for() -> None:
    accountant = PerEventAccountant(SIGMA, [0.08, 0.04], DELTA, dimension=1000)
    state = accountant.state_dict()
    assert state["noise_multiplier"] == SIGMA and state["delta"] == DELTA and state["dimension"] == 1000
    np.testing.assert_array_equal(state["schedule"], [0.08, 0.04])
    np.testing.assert_array_equal(state["grid"], accountant.grid)
    with pytest.raises(
        ValueError,
        match="this run's; restore the checkpoint's DP settings or start from an empty checkpoint directory$",
    ):
        PerEventAccountant(SIGMA, [0.08, 0.03], DELTA).load_state_dict(state)
    with pytest.raises(ValueError, match=r"^PerEventAccountant.load_state_dict: the checkpoint's DP schedule"):
        PerEventAccountant(SIGMA, [0.08, 0.04], DELTA / 2).load_state_dict(state)
    larger = dict(state, epsilons=state["epsilons"] + 1.0)  # a checkpoint's larger bound is kept
    restored = PerEventAccountant(SIGMA, [0.08, 0.04], DELTA, dimension=1000)
    restored.load_state_dict(larger)
    np.testing.assert_array_equal(restored.epsilons, accountant.epsilons + 1.0)


def test_a_lifetime_keeps_its_record_and_an_operator_cap_on_its_groups() -> None:
    record = PerEventAccountant(3.0, np.full(20, 0.1), DELTA)
    free = SensorLifetimeAccountant(record, target_epsilon=4.0)
    assert free.record is record and free.delta == DELTA and free.max_groups == 7
    capped = SensorLifetimeAccountant(record, target_epsilon=4.0, max_groups=3)
    assert capped.max_groups == 3 and capped.epsilon_cap < free.epsilon_cap
    np.testing.assert_array_equal(capped.grid, [1, 2, 3])
    spent = [capped.epsilon_after(g) for g in range(6)]
    assert spent[0] == 0.0 and spent[3] == spent[4] == spent[5] == capped.epsilon_cap  # past the cap: the cap
    assert spent[1] < spent[2] < spent[3]
    assert SensorLifetimeAccountant(record, target_epsilon=record.epsilon_cap / 2).epsilon_cap == math.inf


def test_segments_are_runs_of_one_group_cut_at_every_grid_point() -> None:
    groups = np.array([0, 0, 1, 1, 1, 2, 2])
    assert _segments(groups, np.array([2, 4, 7])) == [(0, 2), (2, 4), (4, 5), (5, 7)]
    assert _segments(np.zeros(5, dtype=np.int64), np.array([1, 5])) == [(0, 1), (1, 5)]


def test_grid_points_are_about_as_many_as_asked_and_hold_both_ends() -> None:
    grid = grid_points(1000, 16)
    assert grid[0] == 1 and grid[-1] == 1000 and len(grid) == 16  # geometric: 1, 2, 3, 4, 6, 10, ..., 631
    assert grid_points(5, 16).tolist() == [1, 2, 3, 5]  # five geometric points, two rounded together
    assert grid_points(1000, 4).tolist() == [1, 10, 100, 1000]


def test_fewer_rate_levels_round_up_more_and_fewer_grid_points_tabulate_fewer_steps() -> None:
    schedule = 0.2 * np.exp2(-np.arange(40) / 8.0)  # five octaves
    fine = PerEventAccountant(SIGMA, schedule, DELTA)
    coarse = PerEventAccountant(SIGMA, schedule, DELTA, max_rate_levels=2, grid_points=4)
    assert coarse.grid.tolist() == [1, 3, 12, 40] and len(fine.grid) == 13  # 16 asked, 3 rounded together
    assert coarse.epsilon_cap > fine.epsilon_cap * 1.05  # two bands of 2.5 octaves, each at its largest rate


def synthetic_slack(sigma: float, x_per_step: float) -> DiscreteSlack:
    """A slack as large as ``x_per_step`` per step (the real one underflows at the service's σ), at σ' = 0.99σ."""
    return DiscreteSlack(sigma, 1000, 1.0, 0.99 * sigma, math.log(x_per_step / 1000))


def coupled_bound(sigma_prime: float, q: float, steps: int, x: float) -> float:
    """ε of ``steps`` steps of the subsampled Gaussian at σ', at δ·e^{−x}, plus 2x."""
    return (
        library_epsilon([q] * steps, dpa.NeighboringRelation.REPLACE_ONE, sigma=sigma_prime, delta=DELTA * math.exp(-x))
        + 2 * x
    )


def test_the_table_adds_each_step_counts_own_slack_to_the_coupled_pld() -> None:
    """Where the slack is visible, the table is the coupled PLD at σ' at its step count, plus 2·n·d·η."""
    slack = synthetic_slack(SIGMA, 0.01)
    grid, table = _epsilon_table(
        SIGMA, (Q0,) * 20, DELTA, DEFAULT_DISCRETIZATION, 32, 16, dpa.NeighboringRelation.REPLACE_ONE, slack
    )
    for n, epsilon in zip(grid, table, strict=True):
        assert epsilon == pytest.approx(coupled_bound(0.99 * SIGMA, Q0, n, 0.01 * n), rel=2e-3), n
    assert table[-1] > library_epsilon([Q0] * 20, dpa.NeighboringRelation.REPLACE_ONE) + 0.3  # 2x at 20 steps: 0.4


def test_a_lifetime_adds_the_slack_of_all_its_groups_steps() -> None:
    record = PerEventAccountant(3.0, np.full(10, 0.1), DELTA)
    slack = synthetic_slack(3.0, 0.002)
    groups, grid, table = _lifetime_table(3.0, (0.1,) * 10, DELTA, 1e9, 4, DEFAULT_DISCRETIZATION, slack)
    assert groups == 4 and list(grid) == [1, 2, 3, 4]
    for g, epsilon in zip(grid, table, strict=True):
        assert epsilon == pytest.approx(coupled_bound(2.97, 0.1, 10 * g, 0.002 * 10 * g), rel=2e-3), g
    assert record.epsilon_cap < table[0]


def exact_lifetime(record: PerEventAccountant, groups: int) -> float:
    """ε after ``groups`` groups exactly as the lifetime accountant computes it (capped there)."""
    return SensorLifetimeAccountant(record, target_epsilon=1e9, max_groups=groups).epsilon_cap


def test_the_lifetime_budget_is_the_largest_group_count_within_the_target_even_at_equality() -> None:
    record = PerEventAccountant(3.0, 0.1 * 0.97 ** np.arange(20), DELTA)  # a decaying schedule
    eps = {g: exact_lifetime(record, g) for g in (1, 2, 3, 4)}
    assert eps[1] == pytest.approx(record.epsilon_cap, rel=1e-9)
    assert eps[1] < eps[2] < eps[3] < eps[4]
    for target, expected in [
        (eps[1], 1),
        ((eps[1] + eps[2]) / 2, 1),
        (eps[2], 2),
        (eps[3], 3),
        ((eps[3] + eps[4]) / 2, 3),
        (eps[4], 4),
    ]:
        assert SensorLifetimeAccountant(record, target_epsilon=target).max_groups == expected, target
    for cap in (1, 2, 3):
        assert SensorLifetimeAccountant(record, target_epsilon=1e9, max_groups=cap).max_groups == cap
    none = SensorLifetimeAccountant(record, target_epsilon=eps[1] * 0.999)
    assert none.max_groups == 0 and none.grid.tolist() == [1] and none.epsilons.tolist() == [eps[1]]
