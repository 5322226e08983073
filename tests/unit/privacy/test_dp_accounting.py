"""The per-event accountant against dp_accounting's and Opacus' own computations."""

from __future__ import annotations

import math
import warnings

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
    _epsilon,
    _epsilon_table,
    _log_theta_tail,
    expected_exposures,
    rate_groups,
)
from streamtrain.privacy.config import DPConfig
from streamtrain.privacy.noise import GRID
from streamtrain.privacy.validators import NOISE_MULTIPLIER_RANGE, check_dp_safety

SIGMA, Q0, K, DELTA = 1.1, 0.05, 60, 1e-6
#: The 1-D comparison below: discrete and continuous PLDs agree within this.
ONE_D_TOLERANCE = 1e-6


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
