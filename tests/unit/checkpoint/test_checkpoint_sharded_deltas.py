"""Deltas in sharded checkpoints: each rank's shard a delta on its shard of the last checkpoint,
restored (and rescaled) from base + deltas, never mixed, pruned by what the kept ones build on."""

from __future__ import annotations

import math
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from sharded_cluster import TOPIC, Cluster, Topic, assert_exact, flip, receipts, resealed, save_chain
from stalled_child import kill_when_stalled

from streamtrain.checkpoint import collective
from streamtrain.checkpoint import manifest as manifest_module
from streamtrain.checkpoint.collective import DistributedCheckpointer
from streamtrain.checkpoint.format import CorruptCheckpoint
from streamtrain.checkpoint.incremental import WindowChain
from streamtrain.checkpoint.manifest import read_manifest
from streamtrain.checkpoint.rescale import restore_share
from streamtrain.checkpoint.sharded_store import ShardedCheckpointStore
from streamtrain.checkpoint.shards import read_shard_index
from streamtrain.distributed.collectives import Collectives
from streamtrain.distributed.launch import DistContext
from streamtrain.events import EventBatch
from streamtrain.window.reservoir import RecencyWindow

COUNTERS = ("accepted_total", "rejected_total", "version")


def by_seq(state: dict[str, Any]) -> dict[int, tuple]:
    """Every item of a window state by its arrival number: its columns and its own readings."""
    lengths = np.asarray(state["lengths"], dtype=np.int64)
    readings = np.split(np.asarray(state["values"]).reshape(-1), np.cumsum(lengths)[:-1]) if lengths.size else []
    columns = zip(
        *(np.asarray(state[name]).tolist() for name in ("partitions", "offsets", "keys", "ts", "labels", "sensor_ids"))
    )
    return {
        int(seq): (*row, values.tobytes())
        for seq, row, values in zip(np.asarray(state["seq"]).tolist(), columns, readings, strict=True)
    }


def assert_same_share(restored: dict[str, Any], expected: dict[str, Any]) -> None:
    assert by_seq(restored) == by_seq(expected)
    assert {str(p): o for p, o in restored["next_offsets"].items()} == {
        str(p): o for p, o in expected["next_offsets"].items()
    }
    for name in COUNTERS:
        assert restored[name] == expected[name], name


def shard_kinds(directory: Path) -> list[str]:
    return ["delta" if "delta_of" in shard else "base" for shard in read_manifest(directory).shards]


def chained_cluster(tmp_path: Path, steps: int, **chain: Any) -> tuple[Topic, Cluster, list[Path], list[list[dict]]]:
    """Two ranks over three partitions of a recency window that evicts: ``steps`` checkpoints, each
    rank's states at every cut recorded."""
    topic = Topic(partitions=3, seed=11)
    cluster = Cluster(2, 60, 30.0, **chain)
    directories, states = [], []
    for step in range(steps):
        topic.produce(40)
        cluster.consume(topic)
        directories.append(cluster.save(tmp_path, step=step, partition_count=3, incremental=True))
        states.append([window.state_dict() for window in cluster.windows])
    return topic, cluster, directories, states


def test_every_sharded_checkpoint_of_a_chain_restores_each_rank_exactly_at_its_cut(tmp_path: Path) -> None:
    _, _, directories, states = chained_cluster(tmp_path, 6, compaction_ratio=100.0)
    assert [shard_kinds(d) for d in directories] == [["base", "base"]] + [["delta", "delta"]] * 5
    newest = read_manifest(directories[-1])
    assert [shard["chain"] for shard in newest.shards] == [[d.name for d in reversed(directories[:-1])]] * 2
    for directory, expected in zip(directories, states, strict=True):
        for rank in range(2):
            share = restore_share(read_manifest(directory), rank=rank, world_size=2, partition_count=3, topic=TOPIC)
            assert_same_share(share.window_state, expected[rank])
            window = RecencyWindow(30, 30.0)
            window.load_state_dict(share.window_state)
            assert by_seq(window.state_dict()) == by_seq(expected[rank])


def test_a_delta_shard_costs_what_changed(tmp_path: Path) -> None:
    topic = Topic(partitions=3, seed=6)
    cluster = Cluster(2, 4000, 30.0)
    sizes = []
    for produced in (4000, 100):
        topic.produce(produced)
        cluster.consume(topic)
        directory = cluster.save(tmp_path, step=produced, partition_count=3, incremental=True)
        sizes.append(sum(path.stat().st_size for path in directory.glob("shard-*")))
    assert shard_kinds(directory) == ["delta", "delta"]
    assert sizes[1] < sizes[0] / 10  # about 100 items entered and 100 left, of 4000


def test_rescale_two_to_one_from_base_and_deltas_loses_and_duplicates_nothing(tmp_path: Path) -> None:
    topic = Topic(partitions=5, seed=3)
    capacity = 10_000  # larger than the stream: the window must hold exactly what was sent
    two = Cluster(2, capacity, math.inf, compaction_ratio=100.0)
    for step in range(3):
        topic.produce(150)
        two.consume(topic)
        newest = two.save(tmp_path, step=step, partition_count=5, incremental=True)
    assert shard_kinds(newest) == ["delta", "delta"]
    one, shares = Cluster.restore(newest, 1, capacity, math.inf, partition_count=5)
    assert shares[0].topology_changed and shares[0].source_ranks == [0, 1]
    assert_exact(one, topic)
    topic.produce(100)
    one.consume(topic)  # resumes every partition from the restored offsets
    assert_exact(one, topic)


def test_rescale_two_to_one_from_deltas_keeps_the_windows_and_their_race_draws(tmp_path: Path) -> None:
    """With evictions: the one window holds exactly the union of the two ranks' windows."""
    topic, two, directories, _ = chained_cluster(tmp_path, 5, compaction_ratio=100.0)
    items, draws = sorted(two.items()), two.race_draws()
    one, _ = Cluster.restore(directories[-1], 1, 60, 30.0, partition_count=3, compaction_ratio=100.0)
    assert sorted(one.items()) == items
    assert one.race_draws() == pytest.approx(draws, abs=1e-9)
    assert one.next_offsets() == two.next_offsets()
    # the restored window lists its items by partition, not by arrival: its own chain still restores exactly
    for step in range(5, 8):
        topic.produce(40)
        one.consume(topic)
        newest = one.save(tmp_path, step=step, partition_count=3, incremental=True)
    assert shard_kinds(newest) == ["delta"]
    again = restore_share(read_manifest(newest), rank=0, world_size=1, partition_count=3, topic=TOPIC)
    assert_same_share(again.window_state, one.windows[0].state_dict())


def flip_in_a_section(shard: Path) -> None:
    """Flip a byte in the middle of a shard's first partition section."""
    manifest = read_manifest(shard.parent)
    entry = next(e for e in manifest.shards if e["file"] == shard.name)
    index = read_shard_index(shard, entry)
    section = index["sections"][0]
    flip(shard, (index["_data_start"] + section["start"] + section["length"] // 2) / shard.stat().st_size)


def _replace_with_another_checkpoint(directory: Path) -> None:
    """A checkpoint of the same name from another run: sound, but not the one the deltas name."""
    other_root = directory.parent / "other"
    other = Cluster(2, 60, 30.0, seed=5)
    topic = Topic(partitions=3, seed=99)
    topic.produce(20)
    other.consume(topic)
    step = int(directory.name.split("-")[1])
    written = other.save(other_root, step=step, partition_count=3)
    for path in directory.iterdir():
        path.unlink()
    for path in written.iterdir():
        (directory / path.name).write_bytes(path.read_bytes())


@pytest.mark.parametrize("damage", ["flip a byte of a shard", "lose the manifest", "replace"])
def test_a_damaged_delta_shard_falls_back_to_the_last_sound_cut_and_names_the_link(tmp_path: Path, damage: str) -> None:
    _, _, directories, states = chained_cluster(tmp_path, 5, compaction_ratio=100.0)
    victim = directories[2]
    if damage == "flip a byte of a shard":
        flip_in_a_section(victim / "shard-00001.stsh")
    elif damage == "lose the manifest":
        (victim / "manifest.json").unlink()
    else:
        _replace_with_another_checkpoint(victim)
    reported: list[tuple[Path, str]] = []
    store = ShardedCheckpointStore(tmp_path, on_corrupt=lambda path, reason: reported.append((path, reason)))
    share = DistributedCheckpointer(store, Collectives(DistContext()), topic=TOPIC).restore(partition_count=3)
    assert share is not None
    if damage == "replace":  # the replacement is a sound checkpoint of its own, the newer deltas are not
        assert share.path == victim and share.topology_changed
    else:  # a world of one restores the last cut before the damage (both ranks' shards, rescaled)
        assert share.path == directories[1]
        held = {(p, o) for state in states[1] for p, o in zip(state["partitions"].tolist(), state["offsets"].tolist())}
        restored = share.window_state
        assert set(zip(restored["partitions"].tolist(), restored["offsets"].tolist())) == held
    refused = {path for path, _ in reported}
    assert {directories[3], directories[4]} <= refused
    assert all(victim.name in reason for path, reason in reported if path in (directories[3], directories[4]))


def test_a_rank_whose_last_shard_is_gone_writes_a_base_and_compaction_bounds_the_chain(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def full_disk(*args: object, **kwargs: object) -> None:
        raise OSError(28, "No space left on device")

    topic = Topic(partitions=3, seed=2)
    store = ShardedCheckpointStore(tmp_path, keep=10)
    checkpointer = DistributedCheckpointer(
        store,
        Collectives(DistContext()),
        topic=TOPIC,
        chain=WindowChain(by_partition=True, compaction_ratio=1e9, max_chain=2),
    )
    window = RecencyWindow(60, 30.0, rng=np.random.default_rng(1))
    kinds = []
    for step in range(6):
        topic.produce(30)
        Cluster.consume_into(window, topic, rank=0, world_size=1)
        if step == 4:
            store.delete(store.scan()[0].path)  # the checkpoint its next shard would build on
        if step == 5:  # its shard written, not sealed: the next shard still builds on the last sealed one
            monkeypatch.setattr(collective, "write_common", full_disk)
            failed = checkpointer.save(
                step=step, partition_count=3, window_state=window.capture_state(), common_state={}
            )
            assert not failed.ok and failed.kind == "delta" and (failed.path / "shard-00000.stsh").exists()
            monkeypatch.undo()
            topic.produce(10)
            Cluster.consume_into(window, topic, rank=0, world_size=1)
        result = checkpointer.save(
            step=step, partition_count=3, window_state=window.capture_state(), common_state={"trainer": {}}
        )
        assert result.ok
        kinds.append(result.kind)
        restored = checkpointer.restore(partition_count=3)
        assert restored is not None and restored.step == step
        assert_same_share(restored.window_state, window.state_dict())
    assert kinds == ["base", "delta", "delta", "base", "base", "delta"]
    assert checkpointer.chain.report().written == {"base": 3, "delta": 3}


def test_pruning_keeps_what_kept_shards_build_on_and_a_restore_point_beside_one_base(tmp_path: Path) -> None:
    topic = Topic(partitions=3, seed=4)
    window = RecencyWindow(60, 30.0, rng=np.random.default_rng(2))

    def save_all(keep: int, steps: int) -> tuple[ShardedCheckpointStore, list[Path], list[str]]:
        store = ShardedCheckpointStore(tmp_path / f"keep{keep}", keep=keep)

        def only_the_newest_chain(chain: WindowChain) -> None:  # the newest and what it builds on, nothing else
            assert len(store.scan()) == chain.report().chain_length + 1

        paths, kinds = save_chain(store, topic, window, steps, only_the_newest_chain if keep == 1 else None)
        return store, paths, kinds

    _, _, kinds = save_all(keep=1, steps=9)
    assert kinds == ["base", "delta", "delta", "delta"] * 2 + ["base"]
    store, paths, kinds = save_all(keep=2, steps=7)  # base, 3 deltas, base, 2 deltas
    assert kinds == ["base", "delta", "delta", "delta", "base", "delta", "delta"]
    assert [info.path for info in store.scan()] == paths[::-1]  # all still needed: the older chain is the spare
    flip(paths[4] / "shard-00000.stsh", 0.9)  # the new chain's base
    share = DistributedCheckpointer(store, Collectives(DistContext()), topic=TOPIC).restore(partition_count=3)
    assert share is not None and share.step == 3


@pytest.mark.parametrize(
    "chain", [["../chk-000000000000-1000"], [], ["chk-000000000000-1000", "chk-000000000000-1000"]]
)
def test_a_manifest_that_names_a_chain_it_cannot_have_is_refused(tmp_path: Path, chain: list[str]) -> None:
    """Even with its digest made to match: a chain names sealed checkpoints beside it, the parent first."""
    _, _, directories, _ = chained_cluster(tmp_path, 2)
    resealed(directories[-1], lambda record: record["shards"][0].update(chain=chain))
    with pytest.raises(CorruptCheckpoint, match="malformed"):
        read_manifest(directories[-1])


# A child that cuts sharded checkpoints of a deterministic stream (a world of one rank) and stalls
# in the middle of writing a shard of the kind asked for, so the test can SIGKILL it there.
_CHILD = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    import streamtrain.checkpoint.shards as shards_module
    sys.path.insert(0, sys.argv[3])
    from stalled_child import stall_writes
    from test_checkpoint_sharded_deltas import stream_checkpointer, stream_step

    directory, kill_at = Path(sys.argv[1]), sys.argv[2]
    current = {}
    stall_writes(
        shards_module,
        lambda path, i: f"{current['kind']} {current['step']}"
        if i == 1 and path.name.startswith("shard-") and current["kind"] == kill_at and current["step"] >= 4
        else None,
    )
    checkpointer, window, topic = stream_checkpointer(directory)
    next_window = checkpointer.chain.next_window

    def recording(*args, **kwargs):
        pending = next_window(*args, **kwargs)
        current["kind"] = pending.kind
        return pending

    checkpointer.chain.next_window = recording
    for step in range(100):
        stream_step(topic, window, step)
        current["step"] = step
        assert checkpointer.save(
            step=step, partition_count=3, window_state=window.capture_state(), common_state={"trainer": {}}
        ).ok
    """
)


def stream_checkpointer(root: Path) -> tuple[DistributedCheckpointer, RecencyWindow, Topic]:
    """The deterministic stream of the SIGKILL test, and the checkpointer that cuts it."""
    chain = WindowChain(by_partition=True, compaction_ratio=0.9)
    store = ShardedCheckpointStore(root, keep=1)
    checkpointer = DistributedCheckpointer(store, Collectives(DistContext()), topic=TOPIC, chain=chain)
    return checkpointer, RecencyWindow(60, 30.0, rng=np.random.default_rng(8)), Topic(partitions=3, seed=8)


def stream_step(topic: Topic, window: RecencyWindow, step: int) -> None:
    topic.produce(25)
    Cluster.consume_into(window, topic, rank=0, world_size=1)


@pytest.mark.parametrize("kill_at", ["delta", "base"])
def test_sigkill_in_the_middle_of_a_shard_write_restores_the_last_cut_nothing_lost_nothing_twice(
    tmp_path: Path, kill_at: str
) -> None:
    """``base`` is a compaction: a new base shard written while the old chain is still the newest."""
    killed_step = kill_when_stalled(_CHILD, tmp_path, kill_at, "chk-*/.shard-*.tmp")
    checkpointer, window, topic = stream_checkpointer(tmp_path)
    share = checkpointer.restore(partition_count=3)
    assert share is not None and share.step == killed_step - 1  # the cut before the write in flight
    for step in range(killed_step):  # the same stream, replayed here up to that cut
        stream_step(topic, window, step)
    assert_same_share(share.window_state, window.state_dict())
    restored = RecencyWindow(60, 30.0)
    restored.load_state_dict(share.window_state)
    seq = restored.state_dict()["seq"]
    assert np.unique(seq).size == seq.size  # nothing twice
    assert by_seq(restored.state_dict()) == by_seq(window.state_dict())


def reseal_again(directory: Path, topic: str = TOPIC) -> None:
    """Seal ``directory`` again from its own receipts (what rank 0 does last)."""
    step, ownership, common, shards = receipts(directory)
    manifest_module.write_manifest(directory, step=step, topic=topic, ownership=ownership, common=common, shards=shards)


def test_a_delta_is_sealed_only_on_the_shards_and_topic_it_builds_on(tmp_path: Path) -> None:
    _, _, (base, delta), _ = chained_cluster(tmp_path, 2, compaction_ratio=100.0)
    reseal_again(delta)  # as it was: sealed again without a complaint
    with pytest.raises(ValueError) as refused:
        reseal_again(delta, topic="other-events")
    assert str(refused.value) == f"a delta builds on {base.name}, of another topic or ownership"
    shard_file = read_manifest(base).shards[1]["file"]
    resealed(base, lambda record: record["shards"][1].update(sha256="0" * 64))  # rank 1's shard replaced
    with pytest.raises(ValueError) as refused:
        reseal_again(delta)
    assert str(refused.value) == f"the shard {base.name}/{shard_file} a delta builds on was replaced"
    resealed(base, lambda record: record["shards"][1].update(file="shard-00009.stsh"))  # or gone from its list
    with pytest.raises(ValueError, match="a delta builds on was replaced$"):
        reseal_again(delta)


@pytest.mark.parametrize("offsets", [True, False], ids=["consumed", "no-offsets"])
def test_a_partition_whose_items_all_left_is_carried_by_the_delta_as_empty(tmp_path: Path, offsets: bool) -> None:
    """After the base only partition 0 gets events, newer by far: every item of partition 1 leaves the
    window and none enters it. The delta must still say so (and keep partition 1's offset), also for a
    window fed without Kafka offsets (nothing but its items names the partitions)."""
    topic = Topic(partitions=2, seed=3)
    topic.produce(12)
    window = RecencyWindow(6, 1.0, rng=np.random.default_rng(0))
    store = ShardedCheckpointStore(tmp_path, keep=100)
    chain = WindowChain(by_partition=True, compaction_ratio=1e9, max_chain=3)
    checkpointer = DistributedCheckpointer(store, Collectives(DistContext()), topic=TOPIC, chain=chain)

    fed = [0, 0]

    def cut(step: int) -> Path:
        if offsets:
            Cluster.consume_into(window, topic, rank=0, world_size=1)
        else:
            for p in (0, 1):
                events = topic.events[p][fed[p] :]
                if events:
                    window.insert_batch(EventBatch.from_events(events, [p] * len(events), range(len(events))))
                fed[p] = len(topic.events[p])
        result = checkpointer.save(
            step=step, partition_count=2, window_state=window.capture_state(), common_state={"trainer": {}}
        )
        assert result.ok
        return result.path

    cut(0)
    assert set(window.state_dict()["partitions"].tolist()) == {0, 1}
    later = Topic(partitions=1, seed=4)
    later.clock = topic.clock + 1000.0  # a thousand half-lives newer
    later.produce(30)
    topic.events[0] += later.events[0]
    delta = cut(1)
    assert shard_kinds(delta) == ["delta"]
    assert set(window.state_dict()["partitions"].tolist()) == {0}
    share = restore_share(read_manifest(delta), rank=0, world_size=1, partition_count=2, topic=TOPIC)
    assert by_seq(share.window_state) == by_seq(window.state_dict())
    restored = {int(p): int(o) for p, o in share.window_state["next_offsets"].items()}
    assert restored == window.next_offsets == ({0: len(topic.events[0]), 1: len(topic.events[1])} if offsets else {})


def test_a_delta_keeps_partitions_that_did_not_change_and_those_that_only_moved_their_offset(
    tmp_path: Path,
) -> None:
    """Fed without offsets (items alone name partitions 0 and 1), partition 1 gets nothing after the
    base and keeps its items; partition 2 holds no item, only an offset that moved."""
    topic = Topic(partitions=2, seed=5)
    topic.produce(12)
    window = RecencyWindow(100, math.inf, rng=np.random.default_rng(0))
    store = ShardedCheckpointStore(tmp_path, keep=100)
    chain = WindowChain(by_partition=True, compaction_ratio=1e9, max_chain=3)
    checkpointer = DistributedCheckpointer(store, Collectives(DistContext()), topic=TOPIC, chain=chain)

    def feed(p: int, events: list) -> None:
        window.insert_batch(EventBatch.from_events(events, [p] * len(events), range(len(events))))

    def cut(step: int) -> Path:
        result = checkpointer.save(
            step=step, partition_count=3, window_state=window.capture_state(), common_state={"trainer": {}}
        )
        assert result.ok
        return result.path

    feed(0, topic.events[0])
    feed(1, topic.events[1])
    cut(0)
    later = Topic(partitions=1, seed=6)
    later.produce(5)
    feed(0, later.events[0])
    window.insert_batch(EventBatch.from_events([], [], []), {2: 7})
    delta = cut(1)
    assert shard_kinds(delta) == ["delta"]
    share = restore_share(read_manifest(delta), rank=0, world_size=1, partition_count=3, topic=TOPIC)
    assert by_seq(share.window_state) == by_seq(window.state_dict())
    assert {int(p): int(o) for p, o in share.window_state["next_offsets"].items()} == {2: 7}
