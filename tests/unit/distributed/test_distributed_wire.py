"""The rows ranks exchange, decoded in one process from hand-made rows: of the rollbacks
asked at one step one wins, the same on every rank (an admin's before an automatic one,
then the lowest rank's); flags are ORed and counts summed; a rank out of step, or started
with another setting, is named in one line."""

from __future__ import annotations

import zlib

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


SIGNALS_ON_THE_WIRE = "stop,checkpoint_due,publish_due,has_data,reset_optimizer"


def test_a_row_is_written_field_by_field_as_the_module_says() -> None:
    """step | layout | number of counts | flags | rollback | counts (by name) | payload, all float64:
    a rank of another release that wrote its row otherwise would be misread, not caught."""
    counts = {"tokens": 2**53 - 1, "labelled": 0}  # the largest count float64 holds exactly, and the smallest
    row = StepRow.encode(
        9,
        StepSignals(stop=True, has_data=True, rollback=AskedRollback(3, "automatic", 4)),
        counts,
        np.array([0.1, 2], dtype=np.float64),
    )
    layout = zlib.crc32(f"labelled,tokens|2|{SIGNALS_ON_THE_WIRE}".encode())
    expected = [9, layout, 2, 1, 0, 0, 1, 0, 2, 3, 4, 0, 2**53 - 1, 0.1, 2]
    assert row.values.dtype == torch.float64
    assert row.values.tolist() == expected  # exact: a float32 anywhere rounds the layout, the count or 0.1
    assert (row.step, row.count_names, row.payload_size) == (9, ("labelled", "tokens"), 2)
    assert StepRow.encode(0, StepSignals(), payload=torch.tensor([0.1], dtype=torch.float64)).values[-1] == 0.1
    assert StepRow.encode(0, StepSignals(), payload=[0.1]).values[-1] == 0.1
    assert StepRow.encode(0, StepSignals()).payload_size == 0


@pytest.mark.parametrize("value", [-1, 2**53])
def test_a_count_float64_cannot_hold_exactly_is_refused(value: int) -> None:
    with pytest.raises(ValueError, match=rf"^count tokens={value} must be in \[0, 2\*\*53\)$"):
        StepRow.encode(1, StepSignals(), {"tokens": value})


def test_rollback_versions_count_from_one_and_stay_exact() -> None:
    for version in (1, 2**53 - 1):
        assert AskedRollback(version, "automatic", version).version == version
    for version, from_version in ((0, None), (2**53, None), (2, 0), (2, 2**53)):
        trigger = "admin" if from_version is None else "automatic"
        with pytest.raises(
            ValueError, match=rf"^rollback versions count from 1, got {version} \(from {from_version}\)$"
        ):
            AskedRollback(version, trigger, from_version)
    with pytest.raises(ValueError, match=r"^rollback trigger must be one of \('admin', 'automatic'\), got 'cron'$"):
        AskedRollback(2, "cron")


@pytest.mark.parametrize("flag", ["stop", "checkpoint_due", "publish_due", "reset_optimizer"])
def test_each_flag_of_one_rank_reaches_every_rank_on_its_own(flag: str) -> None:
    raised = StepRow.encode(3, StepSignals(has_data=True, **{flag: True}))
    quiet = StepRow.encode(3, StepSignals(has_data=True))
    for rows in ([quiet.values, raised.values], [raised.values, quiet.values]):
        agreement = quiet.decode(torch.stack(rows))
        decided = {
            "stop": agreement.stop,
            "checkpoint_due": agreement.checkpoint,
            "publish_due": agreement.publish,
            "reset_optimizer": agreement.reset_optimizer,
        }
        assert decided == {name: name == flag for name in decided}
        assert agreement.ranks_with_data == 2 and agreement.rollback is None


def test_a_rank_out_of_step_is_named_with_every_ranks_step() -> None:
    mine = StepRow.encode(4, StepSignals(), {"tokens": 1}, [0.0])
    rows = torch.stack([mine.values, StepRow.encode(6, StepSignals(), {"tokens": 1}, [0.0]).values])
    with pytest.raises(LockstepError) as err:
        mine.decode(rows)
    assert str(err.value) == (
        "ranks are out of lockstep (rank 0: step 4, rank 1: step 6; count names ['tokens'], payload 1); "
        "every rank must run the same steps with the same row layout"
    )


def test_a_settings_row_is_the_crc_of_the_names_then_one_per_setting() -> None:
    row = settings_checksums({"seed": 7, "amp": "off"})
    assert row.dtype == torch.float64
    assert row.tolist() == [zlib.crc32(b"amp,seed"), zlib.crc32(b"amp='off'"), zlib.crc32(b"seed=7")]
    check_settings_checksums(row.unsqueeze(0), {"seed": 7, "amp": "off"}, 0)  # a world of one agrees with itself


def test_the_settings_check_names_every_rank_that_differs_in_one_line() -> None:
    values = {"d_model": 64}
    rows = torch.stack(
        [settings_checksums(values), settings_checksums({"d_model": 32}), settings_checksums({"d_model": 16})]
    )
    with pytest.raises(SettingsMismatch) as err:
        check_settings_checksums(rows, values, 0)
    assert str(err.value) == (
        "D_MODEL differs between the ranks of one group (rank 1, 2 vs rank 0; here, rank 0: 64); "
        "every rank must run with the same D_MODEL: give them one config"
    )
    other_list = torch.stack([rows[0], settings_checksums({"n_heads": 4})])
    with pytest.raises(SettingsMismatch) as err:
        check_settings_checksums(other_list, values, 1)
    assert str(err.value) == (
        "the ranks check different lists of settings: every rank must run the same streamtrain release"
    )
