"""The per-event accountant against dp_accounting's and Opacus' own computations."""

from __future__ import annotations

import math
import warnings

import dp_accounting as dpa
import numpy as np
import pytest
from dp_accounting.pld import privacy_loss_distribution as pld_lib
from dp_accounting.pld.pld_privacy_accountant import PLDAccountant

from streamtrain.privacy.accounting import (
    DEFAULT_DISCRETIZATION,
    DISCRETE_NOISE_MARGIN,
    PerEventAccountant,
    SensorLifetimeAccountant,
    _epsilon_table,
    expected_exposures,
    rate_groups,
)
from streamtrain.privacy.config import DPConfig

SIGMA, Q0, K, DELTA = 1.1, 0.05, 60, 1e-6


def library_epsilon(
    schedule: list[float], relation: dpa.NeighboringRelation, discretization: float = DEFAULT_DISCRETIZATION
) -> float:
    """dp_accounting's PLD accountant composing the schedule step by step."""
    accountant = PLDAccountant(relation, value_discretization_interval=discretization)
    counts: dict[float, int] = {}
    for q in schedule:
        counts[q] = counts.get(q, 0) + 1
    for q, count in counts.items():
        accountant.compose(dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(SIGMA)), count)
    return accountant.get_epsilon(DELTA)


def test_homogeneous_schedule_matches_dp_accounting() -> None:
    ours = PerEventAccountant(SIGMA, np.full(K, Q0), DELTA)
    reference = library_epsilon([Q0] * K, dpa.NeighboringRelation.REPLACE_ONE)
    assert ours.epsilon_cap - DISCRETE_NOISE_MARGIN == pytest.approx(reference, rel=1e-3)
    assert ours.epsilon_cap > reference


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
    assert ours.epsilon_cap == pytest.approx(exact + DISCRETE_NOISE_MARGIN, rel=1e-9)
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
    Gaussian's far inside the margin the accountant adds (docs/privacy.md, Noise)."""
    for sensitivity in (scale, scale // 2):
        common = dict(sampling_prob=0.05, value_discretization_interval=1e-4, use_connect_dots=True)
        discrete = pld_lib.from_discrete_gaussian_mechanism(scale, sensitivity=sensitivity, **common).self_compose(100)
        continuous = pld_lib.from_gaussian_mechanism(scale, sensitivity=sensitivity, **common).self_compose(100)
        gap = discrete.get_epsilon_for_delta(DELTA) - continuous.get_epsilon_for_delta(DELTA)
        assert abs(gap) < DISCRETE_NOISE_MARGIN / 100, gap


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
