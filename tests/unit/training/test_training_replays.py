"""The replay budget (``training/replays.py``): each accepted event buys ``MAX_REPLAYS_PER_EVENT``
item-trainings, the credit never outgrows that many passes over the window, 0 turns it off."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from streamtrain.training.replays import ReplayBudget


def test_each_accepted_event_buys_the_limit_in_item_trainings() -> None:
    budget = ReplayBudget(4.0)
    assert not budget.allows(1, accepted_total=0, window_size=10)  # nothing accepted: nothing to train
    assert budget.allows(40, accepted_total=10, window_size=10)  # 10 events x 4
    budget.spend(40)
    assert not budget.allows(1, accepted_total=10, window_size=10)
    assert budget.allows(4, accepted_total=11, window_size=11)  # one new event: four more
    assert not budget.allows(5, accepted_total=11, window_size=11)
    budget.spend(4)
    assert (budget.trained_items, budget.accepted, budget.per_event) == (44, 11, 4.0)


def test_a_fast_phase_leaves_no_credit_beyond_the_limits_passes_over_the_window() -> None:
    budget = ReplayBudget(2.0)
    assert budget.allows(10, accepted_total=1_000, window_size=5)  # 1,000 events seen, 5 kept
    assert budget.allowance == 10.0  # two passes over five items, not 2,000 item-trainings
    # a batch larger than the cap still trains once the whole cap is there (else nothing ever would)
    assert budget.allows(64, accepted_total=1_000, window_size=5)
    assert not ReplayBudget(2.0).allows(64, accepted_total=4, window_size=5)  # 8 of the cap's 10
    assert ReplayBudget(2.0).allows(3, accepted_total=1, window_size=0)  # an empty window counts as one item
    one = ReplayBudget(2.0)
    one.allows(1, accepted_total=5, window_size=1)
    assert one.allowance == 2.0  # five events into a window of one: two passes over one item


def test_an_accepted_total_seen_before_is_never_credited_twice() -> None:
    budget = ReplayBudget(1.0)
    budget.allows(0, accepted_total=10, window_size=100)
    budget.allows(0, accepted_total=7, window_size=100)  # an older reading of the counter
    budget.allows(0, accepted_total=10, window_size=100)
    assert (budget.accepted, budget.allowance, budget.accepted_seen) == (10, 10.0, 10)


def test_a_limit_of_zero_allows_everything_and_still_counts() -> None:
    budget = ReplayBudget(0.0)
    assert budget.allows(10**6, accepted_total=0, window_size=0)
    budget.spend(500)
    budget.allows(1, accepted_total=100, window_size=100)
    assert (budget.allowance, budget.trained_items, budget.accepted, budget.per_event) == (0.0, 500, 100, 5.0)
    assert ReplayBudget(3.0).per_event == 0.0  # nothing accepted yet


def test_the_budget_survives_a_checkpoint() -> None:
    budget = ReplayBudget(3.0)
    budget.allows(10, accepted_total=20, window_size=50)
    budget.spend(7)
    restored = ReplayBudget(3.0)
    restored.load_state_dict(budget.state_dict())
    assert restored.state_dict() == budget.state_dict() == {
        "allowance": 53.0, "accepted_seen": 20, "trained_items": 7, "accepted": 20,
    }  # fmt: skip
    assert restored.allows(53, accepted_total=20, window_size=50) and not restored.allows(54, 20, 50)


@given(
    limit=st.sampled_from([0.5, 1.0, 4.0, 8.0]),
    steps=st.lists(st.tuples(st.integers(0, 50), st.integers(1, 200), st.integers(1, 64)), min_size=1, max_size=60),
)
def test_a_trainer_that_trains_only_what_is_allowed_stays_within_the_limit_by_one_batch(
    limit: float, steps: list[tuple[int, int, int]]
) -> None:
    """Whatever the stream and the batches: item-trainings <= limit x accepted events + one batch."""
    budget, accepted, largest = ReplayBudget(limit), 0, 0
    for arrived, window, items in steps:
        accepted += arrived
        if budget.allows(items, accepted, window):
            budget.spend(items)
            largest = max(largest, items)
        assert budget.allowance <= limit * max(window, 1)
    assert budget.trained_items <= limit * accepted + largest
    assert budget.per_event == pytest.approx(budget.trained_items / accepted if accepted else 0.0)
