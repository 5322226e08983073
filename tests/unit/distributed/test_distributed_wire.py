"""The rows ranks exchange, decoded in one process from hand-made rows: of the rollbacks
asked at one step one wins, the same on every rank (an admin's before an automatic one,
then the lowest rank's); flags are ORed and counts summed; a rank out of step, or started
with another setting, is named in one line."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from streamtrain.distributed.collectives import Collectives
from streamtrain.distributed.launch import DistContext
from streamtrain.distributed.wire import (
    AgreedRollback,
    AskedRollback,
    LockstepError,
    SettingsMismatch,
    StepRow,
    StepSignals,
    _rollback_fields,
    _winning_rollback,
    check_settings_checksums,
    settings_checksums,
)


def test_rollback_requests_one_wins_per_step() -> None:
    def row(request: AskedRollback | None) -> list[float]:
        return _rollback_fields(request)

    auto = AskedRollback(3, "automatic", 5)
    admin = AskedRollback(2, "admin")
    assert _winning_rollback(np.array([row(None), row(None)])) is None
    assert _winning_rollback(np.array([row(auto), row(admin)])) == AgreedRollback(1, admin)  # admin first
    assert _winning_rollback(np.array([row(None), row(auto), row(AskedRollback(4, "automatic", 6))])) == AgreedRollback(
        1, auto
    )
    assert _winning_rollback(np.array([row(AskedRollback(7)), row(admin)])) == AgreedRollback(0, AskedRollback(7))
    one = Collectives(DistContext()).agree(0, StepSignals(rollback=auto))
    assert one.rollback == AgreedRollback(0, auto)
    for bad in (
        {"version": 0},
        {"version": 2, "trigger": "cron"},
        {"version": 2, "trigger": "automatic", "from_version": 0},
    ):
        with pytest.raises(ValueError):
            AskedRollback(**bad)  # type: ignore[arg-type]


def test_rows_of_two_ranks_decode_to_one_agreement() -> None:
    mine = StepRow.encode(4, StepSignals(has_data=True, checkpoint_due=True), {"tokens": 7, "labelled": 1}, [0.5])
    theirs = StepRow.encode(
        4, StepSignals(has_data=True, rollback=AskedRollback(2)), {"labelled": 2, "tokens": 5}, [1.5]
    )
    agreement = mine.decode(torch.stack([mine.values, theirs.values]))
    assert (agreement.step, agreement.checkpoint, agreement.stop, agreement.ranks_with_data) == (4, True, False, 2)
    assert agreement.totals == {"labelled": 3, "tokens": 12}
    np.testing.assert_array_equal(agreement.per_rank, [[0.5], [1.5]])
    assert agreement.rollback == AgreedRollback(1, AskedRollback(2))


@pytest.mark.parametrize(
    "other",
    [
        StepRow.encode(5, StepSignals(), {"tokens": 1}),  # another step
        StepRow.encode(4, StepSignals(), {"sequences": 1}),  # another count
        StepRow.encode(4, StepSignals(), {"tokens": 1}, [0.0]),  # another payload length
    ],
    ids=["step", "counts", "payload"],
)
def test_a_rank_out_of_lockstep_is_caught_not_misread(other: StepRow) -> None:
    mine = StepRow.encode(4, StepSignals(), {"tokens": 1})
    rows = torch.stack([mine.values, other.values[: mine.values.numel()]])  # the gather keeps this rank's length
    with pytest.raises(LockstepError, match="out of lockstep") as err:
        mine.decode(rows)
    assert "\n" not in str(err.value)


def test_a_setting_that_differs_is_named_on_every_rank() -> None:
    rows = torch.stack(
        [settings_checksums({"d_model": 64, "amp": "off"}), settings_checksums({"d_model": 32, "amp": "off"})]
    )
    for rank, value in ((0, 64), (1, 32)):
        with pytest.raises(SettingsMismatch, match="^D_MODEL differs .*rank 1 vs rank 0") as err:
            check_settings_checksums(rows, {"d_model": value, "amp": "off"}, rank)
        assert f"rank {rank}: {value}" in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(SettingsMismatch, match="different lists of settings"):
        check_settings_checksums(torch.stack([rows[0], settings_checksums({"d_model": 64, "dp": "off"})]), {}, 0)
