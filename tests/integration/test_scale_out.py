"""Scale-out end to end: the ranks of one group as real processes, the real broker, gloo.

Ranks are launched as torchrun launches them (``WORLD_SIZE``, ``RANK``, ``MASTER_ADDR``,
``MASTER_PORT`` per process; one test goes through ``torchrun`` itself), each with its
own HTTP port, all sharing one checkpoint directory. What a test checks about the
windows it checks twice: live, through ``/v1/window`` (sizes and offsets), and exactly,
through the final checkpoint (every event once, by partition and offset, with its own
readings).
"""

from __future__ import annotations

import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from kafka.admin import KafkaAdminClient, NewPartitions
from kafka_helpers import Placements, assert_window_holds_exactly, free_port, free_ports, wait_for
from service_process import FAST_MODEL, ServiceProcess, wait_until

from streamtrain.checkpoint.collective import DistributedCheckpointer
from streamtrain.checkpoint.sharded_store import ShardedCheckpointStore
from streamtrain.checkpoint.store import CheckpointStore
from streamtrain.config import load_settings
from streamtrain.distributed.collectives import Collectives
from streamtrain.distributed.launch import DistContext
from streamtrain.ingest.ingestor import Ingestor
from streamtrain.metrics import Metrics
from streamtrain.tools.export import fetch_bundle
from streamtrain.window.reservoir import RecencyWindow

pytestmark = pytest.mark.integration

TOKEN = "scale-out-token"
DIST_TIMEOUT_S = 20
SCALE = {
    "max_len": 64,
    "window_capacity": 20000,
    "half_life_s": "inf",
    "admin_token": TOKEN,
    "decode_workers": 0,
    "checkpoint_interval_s": 300,
    "dist_timeout_s": DIST_TIMEOUT_S,
}
EXIT_COLLECTIVE_FAILURE = 17


class Group:
    """``world`` ranks of one service; ``plain``: one process without WORLD_SIZE (as before scale-out)."""

    def __init__(
        self,
        world: int,
        bootstrap: str,
        topic: str,
        checkpoint_dir: Path,
        logs: Path,
        *,
        plain: bool = False,
        **settings: Any,
    ) -> None:
        master = free_port()
        self.world = world
        self.ranks = []
        for rank in range(world):
            service = ServiceProcess(
                bootstrap, topic, checkpoint_dir, logs / f"world{world}-rank{rank}.log", **{**SCALE, **settings}
            )
            if not plain:
                service.env.update(
                    WORLD_SIZE=str(world), RANK=str(rank), LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                    MASTER_ADDR="127.0.0.1", MASTER_PORT=str(master),
                )  # fmt: skip
            self.ranks.append(service)

    def start(self) -> Group:
        for service in self.ranks:
            service.spawn()
        for service in self.ranks:  # each answers once all have met and restored
            service.wait_healthy(180)
        return self

    def wait_holding(self, placements: Placements, timeout_s: float = 90) -> list[dict[str, Any]]:
        return wait_holding(self.ranks, placements, timeout_s)

    def terminate_all(self, timeout_s: float = 90) -> list[int]:
        """SIGTERM to every rank at once (as torchrun and a redeploy send it); their exit codes."""
        for service in self.ranks:
            assert service.process is not None
            service.process.send_signal(signal.SIGTERM)
        codes = []
        for service in self.ranks:
            assert service.process is not None
            codes.append(service.process.wait(timeout_s))
            service.client.close()
        return codes


def wait_holding(ranks: list[Any], placements: Placements, timeout_s: float = 90) -> list[dict[str, Any]]:
    """Until the ranks' windows together cover exactly what was sent (sizes and offsets)."""
    ends = placements.end_offsets()

    def holding() -> list[dict[str, Any]] | None:
        windows = [rank.get("/v1/window") for rank in ranks]
        merged: dict[int, int] = {}
        for window in windows:
            merged.update({int(p): o for p, o in window["next_offsets"].items()})
        return windows if merged == ends and sum(w["size"] for w in windows) == len(placements.placed) else None

    return wait_until(holding, timeout_s, f"{len(ranks)} windows to hold the {len(placements.placed)} events sent")


def send(placements: Placements, per_partition: int, partitions: int) -> None:
    for partition in range(partitions):
        placements.events(per_partition, partition=partition)


def assert_ownership(ranks: list[Any], partitions: int) -> None:
    """Rank r consumes the partitions p with p mod WORLD_SIZE == r (once its consumer is up), and holds no other."""
    world = len(ranks)
    owned = [[p for p in range(partitions) if p % world == rank] for rank in range(world)]
    windows = wait_until(
        lambda: (ws := [r.get("/v1/window") for r in ranks]) and [w["partitions"] for w in ws] == owned and ws,
        60,
        f"ranks to consume {owned}",
    )
    for rank, window in enumerate(windows):
        assert {int(p) for p in window["next_offsets"]} <= set(owned[rank]), (
            f"rank {rank} holds {window['next_offsets']}"
        )


def assert_checkpoint_exact(checkpoint_dir: Path, topic: str, placements: Placements) -> Any:
    """The newest checkpoint (either kind) holds every event sent once, with its own readings."""
    checkpointer = DistributedCheckpointer(
        ShardedCheckpointStore(checkpoint_dir), Collectives(DistContext()), topic=topic
    )
    share = checkpointer.restore(partition_count=None, single_file=CheckpointStore(checkpoint_dir))
    assert share is not None
    window = RecencyWindow(10**6, math.inf)
    window.load_state_dict(share.window_state)
    assert_window_holds_exactly(window, placements.placed)
    return share


def newest_manifest(checkpoint_dir: Path) -> Any:
    manifests = ShardedCheckpointStore(checkpoint_dir).manifests()
    assert manifests, f"no complete sharded checkpoint in {checkpoint_dir}"
    return manifests[0]


def assert_one_model(ranks: list[Any], min_step: int = 20) -> None:
    """After ``min_step`` steps every rank serves the same parameters and predictions for a version."""
    wait_until(
        lambda: all(r.get("/v1/model")["training"]["live_step"] >= min_step for r in ranks), 120, f"{min_step} steps"
    )
    reports = [r.get("/v1/model") for r in ranks]
    assert [(m["world_size"], m["rank"]) for m in reports] == [(len(ranks), rank) for rank in range(len(ranks))]
    version = min(m["version"] for m in reports)  # kept by every rank (MODEL_VERSIONS_KEEP)
    bundles = [fetch_bundle(f"http://127.0.0.1:{r.port}", str(version), TOKEN) for r in ranks]
    assert len({b.step for b in bundles}) == 1, "one version, one step, on every rank"
    reference = bundles[0].model.state_dict()
    for bundle in bundles[1:]:
        worst = max(float((reference[name] - tensor).abs().max()) for name, tensor in bundle.model.state_dict().items())
        assert worst <= 1e-6, f"parameters of version {version} differ by {worst}"
        assert bundle.norm.state_dict()["count"] == bundles[0].norm.state_dict()["count"]
    rng = np.random.default_rng(3)
    values = rng.normal(size=(4, 6, 1)).round(3).astype(np.float32)
    body = {
        "inputs": [{"name": "values", "shape": list(values.shape), "datatype": "FP32", "data": values.ravel().tolist()}]
    }
    answers = []
    for r in ranks:
        response = r.client.post(f"/v2/models/streamtrain/versions/{version}/infer", json=body)
        assert response.status_code == 200, response.text
        answers.append({o["name"]: np.asarray(o["data"], dtype=np.float64) for o in response.json()["outputs"]})
    for answer in answers[1:]:
        for name, data in answer.items():
            assert np.abs(data - answers[0][name]).max() <= 1e-5, name


class Endpoint:
    """The HTTP API of one rank that torchrun started."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30)

    def get(self, path: str) -> Any:
        response = self.client.get(path)
        response.raise_for_status()
        return response.json()

    def healthy(self, launcher: subprocess.Popen[bytes]) -> bool:
        if launcher.poll() is not None:
            raise AssertionError(f"torchrun exited with {launcher.returncode}")
        try:
            return self.client.get("/healthz").status_code == 200
        except httpx.HTTPError:
            return False


@pytest.mark.expected_seconds(35)
def test_torchrun_two_ranks_train_one_model_over_three_partitions(
    kafka_bootstrap: str, make_topic: Any, tmp_path: Path
) -> None:
    """The README's launch: torchrun, one config file, rank r on HTTP_PORT + LOCAL_RANK."""
    topic = make_topic(partitions=3)
    port = free_ports(2)  # torchrun's two ranks bind HTTP_PORT + LOCAL_RANK
    checkpoint_dir = tmp_path / "ckpt"
    settings = {
        **{k.lower(): v for k, v in FAST_MODEL.items()},
        **SCALE,
        "kafka_bootstrap": kafka_bootstrap,
        "topic": topic,
        "group_id": f"g-{topic}",
        "http_host": "127.0.0.1",
        "http_port": port,
        "checkpoint_dir": checkpoint_dir,
    }
    config = tmp_path / "rank.toml"
    config.write_text(
        "".join(f'{name} = "{value}"\n' for name, value in settings.items())
    )  # pydantic parses the strings
    env = {k: v for k, v in os.environ.items() if not k.startswith("STREAMTRAIN_")}
    # torchrun itself exits non-zero when it is signalled, whatever its ranks did: each rank
    # runs the CLI's main() and leaves its exit status in a file, to be checked below.
    env["EXIT_STATUS_DIR"] = str(tmp_path)
    rank_main = ("import os, sys; from streamtrain.cli import main; status = main(sys.argv[1:]); "
                 "open(os.path.join(os.environ['EXIT_STATUS_DIR'], 'exit-rank' + os.environ['RANK']), 'w')"
                 ".write(str(status)); "
                 "sys.exit(status)")  # fmt: skip
    log_path = tmp_path / "torchrun.log"
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
               "--master-port", str(free_port()), "--no-python", sys.executable, "-c", rank_main,
               "serve", "--config", str(config)]  # fmt: skip
    with open(log_path, "ab") as log:
        launcher = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    ranks = [Endpoint(port), Endpoint(port + 1)]
    placements = Placements(kafka_bootstrap, topic)
    try:
        for rank in ranks:
            wait_until(lambda r=rank: r.healthy(launcher), 180, f"a rank on :{rank.port} (log {log_path})")
        send(placements, 120, 3)
        wait_holding(ranks, placements)
        assert_ownership(ranks, 3)
        assert_one_model(ranks)
        launcher.send_signal(signal.SIGTERM)  # torchrun passes it on to every rank
        launcher.wait(90)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait(10)
        placements.close()
        for rank in ranks:
            rank.client.close()
    text = log_path.read_text()
    assert text.count("final checkpoint chk-") == 2, text[-3000:]
    statuses = [(tmp_path / f"exit-rank{rank}").read_text() if (tmp_path / f"exit-rank{rank}").exists() else None
                for rank in range(2)]  # fmt: skip
    assert statuses == ["0", "0"], (
        f"SIGTERM through torchrun: each rank exits 0 after the final checkpoint ({text[-3000:]})"
    )
    manifest = newest_manifest(checkpoint_dir)
    assert manifest.world_size == 2 and [s["partitions"] for s in manifest.shards] == [[0, 2], [1]]
    assert_checkpoint_exact(checkpoint_dir, topic, placements)


@pytest.mark.expected_seconds(50)
def test_a_killed_rank_stops_the_others_and_a_restart_restores_exactly_once(
    kafka_bootstrap: str, make_topic: Any, tmp_path: Path
) -> None:
    topic = make_topic(partitions=3)
    checkpoint_dir = tmp_path / "ckpt"
    placements = Placements(kafka_bootstrap, topic)
    group = Group(2, kafka_bootstrap, topic, checkpoint_dir, tmp_path, checkpoint_interval_s=1).start()
    try:
        send(placements, 100, 3)
        group.wait_holding(placements)
        wait_until(lambda: ShardedCheckpointStore(checkpoint_dir).manifests(), 60, "a complete checkpoint")
        survivor, victim = group.ranks
        wait_until(lambda: survivor.get("/v1/model")["training"]["live_step"] >= 10, 60, "training")
        killed_at = time.monotonic()
        victim.kill()  # SIGKILL in the middle of training (and of checkpoints every second)
        assert survivor.process is not None
        code = survivor.process.wait(DIST_TIMEOUT_S + 15)
        took = time.monotonic() - killed_at
        assert code == EXIT_COLLECTIVE_FAILURE, survivor.log_path.read_text()[-2000:]
        assert took <= DIST_TIMEOUT_S, f"the survivor took {took:.1f} s to leave"
        assert "leaving the training group (exit 17)" in survivor.log_path.read_text()
    finally:
        for service in group.ranks:
            if service.process is not None and service.process.poll() is None:
                service.kill()

    # a half-written checkpoint (shards, no manifest) newer than everything: never restored
    newest = newest_manifest(checkpoint_dir)
    half = checkpoint_dir / f"chk-{newest.step + 1000:012d}-{int(time.time() * 1000)}"
    shutil.copytree(newest.directory, half)
    (half / "manifest.json").unlink()
    send(placements, 60, 3)  # produced while the group is down
    again = Group(2, kafka_bootstrap, topic, checkpoint_dir, tmp_path, checkpoint_interval_s=300).start()
    try:
        windows = again.wait_holding(placements)
        assert_ownership(again.ranks, 3)
        assert all(w["accepted_total"] == w["size"] for w in windows)
        # SIGTERM to one rank only: the stop is agreed, both cut the final checkpoint and exit 0
        signalled, other = again.ranks
        assert signalled.process is not None and other.process is not None
        signalled.process.send_signal(signal.SIGTERM)
        assert [signalled.process.wait(90), other.process.wait(90)] == [0, 0]
    finally:
        for service in again.ranks:
            if service.process is not None and service.process.poll() is None:
                service.kill()
        placements.close()
    restored = [line for line in again.ranks[0].log_path.read_text().splitlines() if "restored chk-" in line]
    assert restored and half.name not in restored[0], restored
    assert_checkpoint_exact(checkpoint_dir, topic, placements)
    assert newest_manifest(checkpoint_dir).world_size == 2


@pytest.mark.expected_seconds(75)
def test_rescale_two_to_one_to_three_loses_and_duplicates_nothing(
    kafka_bootstrap: str, make_topic: Any, tmp_path: Path
) -> None:
    """One checkpoint directory, four partitions: 2 ranks (their last checkpoint base + deltas), then one
    plain process, then 3 ranks."""
    topic = make_topic(partitions=4)
    checkpoint_dir = tmp_path / "ckpt"
    placements = Placements(kafka_bootstrap, topic)
    try:
        two = Group(2, kafka_bootstrap, topic, checkpoint_dir, tmp_path).start()
        send(placements, 100, 4)
        two.wait_holding(placements)
        assert_ownership(two.ranks, 4)
        assert_one_model(two.ranks)
        response = two.ranks[0].client.post("/v1/admin/checkpoint", headers={"Authorization": f"Bearer {TOKEN}"})
        assert response.status_code == 200, response.text  # every rank's shard whole: the base
        assert [r.get("/v1/window")["checkpoints"]["last_kind"] for r in two.ranks] == ["base", "base"]
        send(placements, 20, 4)
        two.wait_holding(placements)
        assert two.terminate_all() == [0, 0], "SIGTERM to every rank ends each with status 0"
        manifest = newest_manifest(checkpoint_dir)
        assert manifest.world_size == 2
        assert all("delta_of" in shard for shard in manifest.shards), "the final shards are deltas on the base"
        assert_checkpoint_exact(checkpoint_dir, topic, placements)

        one = Group(1, kafka_bootstrap, topic, checkpoint_dir, tmp_path, plain=True).start()
        one.wait_holding(placements)  # the sharded checkpoint restored into one process
        send(placements, 50, 4)
        one.wait_holding(placements)
        # a consumer group: assigned by Kafka (and briefly nothing while it rebalances)
        wait_until(lambda: one.ranks[0].get("/v1/window")["partitions"] == [0, 1, 2, 3], 30, "all partitions assigned")
        assert one.terminate_all() == [0], "one process: SIGTERM ends it with status 0 too"
        share = assert_checkpoint_exact(checkpoint_dir, topic, placements)
        assert share.loaded is not None, "one process writes one-file checkpoints"

        three = Group(3, kafka_bootstrap, topic, checkpoint_dir, tmp_path).start()
        three.wait_holding(placements)  # the one-file checkpoint split over 3 ranks
        assert_ownership(three.ranks, 4)
        send(placements, 50, 4)
        three.wait_holding(placements)
        assert three.terminate_all() == [0, 0, 0]
        manifest = newest_manifest(checkpoint_dir)
        assert manifest.world_size == 3 and [s["partitions"] for s in manifest.shards] == [[0, 3], [1], [2]]
        assert_checkpoint_exact(checkpoint_dir, topic, placements)
    finally:
        placements.close()


def test_an_owning_rank_resumes_from_its_window_and_picks_up_new_partitions(
    kafka_bootstrap: str, make_topic: Any
) -> None:
    """Rank 0 of 2 at the ingest level: only even partitions, from the window's offsets, not the group's."""
    topic = make_topic(partitions=2)
    placements = Placements(kafka_bootstrap, topic)
    settings = load_settings(
        kafka_bootstrap=kafka_bootstrap, topic=topic, group_id=f"g-{topic}", decode_workers=0, max_len=64,
        window_capacity=10_000, half_life_s="inf",
    )  # fmt: skip
    window = RecencyWindow(10_000, math.inf)

    def rank_zero() -> Ingestor:
        return Ingestor(settings, window, Metrics(), owned_partitions=lambda count: list(range(0, count, 2)))

    def mine() -> dict[tuple[int, int], Any]:
        return {po: label for po, label in placements.placed.items() if po[0] % 2 == 0}

    try:
        send(placements, 30, 2)
        first = rank_zero()
        first.start()
        try:
            wait_for(lambda: window.next_offsets == {0: 30}, 60, "partition 0 consumed")
            assert first.assigned == frozenset({0})
        finally:
            first.stop()
        # as after a restore: the window holds partition 0 up to offset 30, the group has no commit
        send(placements, 20, 2)
        second = rank_zero()
        second.start()
        try:
            wait_for(lambda: window.next_offsets == {0: 50}, 60, "partition 0 resumed")
            assert_window_holds_exactly(window, mine())  # from offset 30, not from the earliest
            admin = KafkaAdminClient(bootstrap_servers=kafka_bootstrap, request_timeout_ms=15000)
            try:
                admin.create_partitions({topic: NewPartitions(total_count=3)})
            finally:
                admin.close()
            placements.placed.update(produce_to_new_partition(kafka_bootstrap, topic, 2, 10))
            wait_for(lambda: window.next_offsets == {0: 50, 2: 10}, 60, "the added partition 2 picked up")
            assert second.assigned == frozenset({0, 2}) and second.partition_count == 3
            assert_window_holds_exactly(window, mine())
        finally:
            second.stop()
    finally:
        placements.close()


def produce_to_new_partition(bootstrap: str, topic: str, partition: int, count: int) -> dict[tuple[int, int], Any]:
    """Events for a partition just added (a fresh producer, once its metadata shows the partition)."""

    def sent() -> dict[tuple[int, int], Any] | None:
        producer = Placements(bootstrap, topic)
        producer.next_id = 10_000
        try:
            producer.events(count, partition=partition)
            return producer.placed
        except ValueError:  # "Unrecognized partition": the metadata is not there yet
            return None
        finally:
            producer.close()

    return wait_until(sent, 60, f"a producer that knows partition {partition}")
