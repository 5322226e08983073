"""Checkpoints written by the previous release restore: a one-file one and a sharded one of 2 ranks.

The files under fixtures/ were written by the release before the package move
(fixtures/README.md says how, fixtures/write_fixtures.py is the writer); expected.json
holds what the writer put in them. Today's code must read them back unchanged, and a
service must restore them, whatever the world size.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

from streamtrain.checkpoint.manifest import read_manifest, verify_checkpoint
from streamtrain.checkpoint.rescale import restore_share
from streamtrain.checkpoint.shards import read_shard_blob, read_shard_index
from streamtrain.checkpoint.store import CheckpointStore
from streamtrain.config import load_settings
from streamtrain.runtime.service import Service

torch.set_num_threads(1)

FIXTURES = Path(__file__).parent / "fixtures"
EXPECTED: dict[str, Any] = json.loads((FIXTURES / "expected.json").read_text())
SHARDED = EXPECTED["sharded"]
SINGLE_FILE = EXPECTED["single_file"]


def tensor_sha256(tensor: torch.Tensor) -> str:
    """SHA-256 of a tensor's dtype, shape and bytes, as the writer computed it."""
    plain = tensor.detach().cpu().contiguous()
    digest = hashlib.sha256(f"{plain.dtype}{list(plain.shape)}".encode())
    digest.update(plain.reshape(-1).view(torch.uint8).numpy().tobytes() if plain.numel() else b"")
    return digest.hexdigest()


def model_sha256(state: dict[str, torch.Tensor]) -> dict[str, str]:
    return {name: tensor_sha256(tensor) for name, tensor in state.items()}


def window_summary(state: dict[str, Any]) -> dict[str, Any]:
    """The items of a window state in (partition, offset) order, as the writer summarized them."""
    partitions, offsets = np.asarray(state["partitions"]), np.asarray(state["offsets"])
    lengths = np.asarray(state["lengths"])
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    values = np.asarray(state["values"], dtype=np.float32)
    order = np.lexsort((offsets, partitions))
    readings = b"".join(values[starts[i] : starts[i] + lengths[i]].tobytes() for i in order.tolist())
    return {
        "items": [[int(partitions[i]), int(offsets[i])] for i in order.tolist()],
        "lengths": lengths[order].tolist(),
        "values_sha256": hashlib.sha256(readings).hexdigest(),
        "next_offsets": {str(p): int(o) for p, o in state["next_offsets"].items()},
        "accepted_total": int(state["accepted_total"]),
    }


def all_ranks(key: str) -> Any:
    """One rank's view of what both ranks of the sharded fixture held together."""
    if key == "items":
        return sorted(item for rank in SHARDED["ranks"] for item in rank["items"])
    return {p: o for rank in SHARDED["ranks"] for p, o in rank["next_offsets"].items()}


def service_over(tmp_path: Path, fixture: str) -> Service:
    shutil.copytree(FIXTURES / fixture, tmp_path / "ckpt")
    return Service(load_settings(**EXPECTED["settings"], checkpoint_dir=tmp_path / "ckpt"))


def test_the_previous_releases_one_file_checkpoint_reads_back_as_written() -> None:
    loaded = CheckpointStore(FIXTURES / "single-file").load_latest()
    assert loaded is not None and loaded.path.name == SINGLE_FILE["file"] and loaded.step == SINGLE_FILE["step"]
    assert loaded.state["trainer"]["step"] == SINGLE_FILE["step"]
    assert window_summary(loaded.state["window"]) == SINGLE_FILE["window"]
    assert model_sha256(loaded.state["trainer"]["model"]) == SINGLE_FILE["model_sha256"]


def test_a_service_restores_the_previous_releases_one_file_checkpoint(tmp_path: Path) -> None:
    service = service_over(tmp_path, "single-file")
    assert service.restore() is not None
    assert service.trainer.step == SINGLE_FILE["step"]
    assert window_summary(service.window.state_dict()) == SINGLE_FILE["window"]
    assert model_sha256(service.trainer.model.state_dict()) == SINGLE_FILE["model_sha256"]


def test_the_previous_releases_sharded_checkpoint_restores_under_its_ownership_and_rescaled() -> None:
    directory = FIXTURES / "sharded" / SHARDED["directory"]
    manifest = verify_checkpoint(directory)
    assert (manifest.step, manifest.world_size, manifest.partition_count) == (
        SHARDED["step"],
        SHARDED["world_size"],
        SHARDED["partition_count"],
    )
    for rank, expected in enumerate(SHARDED["ranks"]):
        share = restore_share(
            manifest, rank=rank, world_size=2, partition_count=SHARDED["partition_count"], topic=SHARDED["topic"]
        )
        assert not share.topology_changed and share.step == SHARDED["step"] and share.source_ranks == [rank]
        assert window_summary(share.window_state) == expected
        assert share.common["trainer"]["step"] == SHARDED["step"]
        assert model_sha256(share.common["trainer"]["model"]) == SHARDED["model_sha256"]
    one = restore_share(read_manifest(directory), rank=0, world_size=1, partition_count=None, topic=SHARDED["topic"])
    assert one.topology_changed and one.source_ranks == [0, 1]
    restored = window_summary(one.window_state)
    assert restored["items"] == all_ranks("items") and restored["next_offsets"] == all_ranks("next_offsets")


def test_the_sections_fields_nothing_filled_are_read_past(tmp_path: Path) -> None:
    """The previous release wrote ``dead_letters`` and ``accepted_total`` into every section."""
    manifest = read_manifest(FIXTURES / "sharded" / SHARDED["directory"])
    entry = manifest.shards[0]
    path = manifest.directory / entry["file"]
    index = read_shard_index(path, entry)
    section = read_shard_blob(path, index["_data_start"], index["sections"][0]).state
    assert section["dead_letters"] == {"acked_through": 3} and section["accepted_total"] == 15
    share = restore_share(manifest, rank=0, world_size=2, partition_count=None, topic=SHARDED["topic"])
    assert not hasattr(share, "dead_letters")


def test_a_service_of_one_process_restores_the_previous_releases_sharded_checkpoint(tmp_path: Path) -> None:
    service = service_over(tmp_path, "sharded")
    assert service.restore() is not None
    assert service.trainer.step == SHARDED["step"]
    restored = window_summary(service.window.state_dict())
    assert restored["items"] == all_ranks("items") and restored["next_offsets"] == all_ranks("next_offsets")
    assert model_sha256(service.trainer.model.state_dict()) == SHARDED["model_sha256"]
