"""The checkpoint blob format: the documented layout, and crafted files refused without unpickling."""

from __future__ import annotations

import hashlib
import io
import json
import pickle
import struct
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch

from streamtrain.checkpoint.format import FORMAT_NAME, FORMAT_VERSION, MAGIC, CorruptCheckpoint
from streamtrain.checkpoint.store import CheckpointStore, read_checkpoint

torch.set_num_threads(1)

PREFIX = struct.Struct("<8sQQ32s")  # the layout the module docstring documents


def frame(header: dict[str, Any], payload: bytes) -> bytes:
    """Build a checkpoint file by hand from the documented layout."""
    header_bytes = json.dumps(header).encode()
    digest = hashlib.sha256(header_bytes + payload).digest()
    return PREFIX.pack(MAGIC, len(header_bytes), len(payload), digest) + header_bytes + payload


_unpickled: list[str] = []


def _record_unpickling() -> None:
    _unpickled.append("code ran")


class _Evil:
    def __reduce__(self):
        return (_record_unpickling, ())


@pytest.fixture
def forbid_unpickling(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("checkpoint loading tried to unpickle")

    for name in ("loads", "load", "Unpickler"):
        monkeypatch.setattr(pickle, name, refuse)
    monkeypatch.setattr(torch, "load", refuse)
    _unpickled.clear()


def _valid_header(**overrides: Any) -> dict[str, Any]:
    header = {"format": FORMAT_NAME, "version": FORMAT_VERSION, "step": 4, "created_at": 1.0, "skeleton": {"$dict": []}}
    header.update(overrides)
    return header


def _torch_save_bytes() -> bytes:
    buffer = io.BytesIO()
    torch.save({"w": torch.ones(2), "evil": _Evil()}, buffer)
    return buffer.getvalue()


EVIL_PICKLE = pickle.dumps({"evil": _Evil()})


GOOD_PAYLOAD = safetensors.torch.save({"0": torch.ones(2)})


@pytest.mark.parametrize(
    ("data", "reason"),
    [
        pytest.param(_torch_save_bytes(), "magic bytes", id="torch.save file"),
        pytest.param(EVIL_PICKLE, "magic bytes", id="bare pickle"),
        pytest.param(
            frame(_valid_header(skeleton={"$tensor": "0"}), EVIL_PICKLE), "not valid safetensors", id="pickle payload"
        ),
        pytest.param(frame(_valid_header(format="torch.save"), EVIL_PICKLE), "unsupported format", id="unknown format"),
        pytest.param(frame(_valid_header(version=2), GOOD_PAYLOAD), "unsupported format", id="unknown version"),
        pytest.param(
            frame(_valid_header(skeleton={"$pickle": "0"}), GOOD_PAYLOAD), "no single known", id="unknown tag"
        ),
        pytest.param(
            frame(
                _valid_header(skeleton={"$ndarray": "0", "dtype": "|O", "shape": [1]}),
                safetensors.torch.save({"0": torch.zeros(8, dtype=torch.uint8)}),
            ),
            "Python objects",
            id="object dtype smuggled as raw bytes",
        ),
        pytest.param(
            frame(_valid_header(skeleton={"$tensor": "1"}), GOOD_PAYLOAD), "does not hold", id="missing tensor"
        ),
        pytest.param(frame(_valid_header(skeleton=None), GOOD_PAYLOAD), "never names", id="unused tensor"),
        pytest.param(
            frame(_valid_header(skeleton=[1]), safetensors.torch.save({})), "expected a dict", id="non-dict state"
        ),
    ],
)
def test_crafted_files_are_refused_without_unpickling(
    tmp_path: Path, forbid_unpickling: None, data: bytes, reason: str
) -> None:
    path = tmp_path / "ckpt-000000000004-1000.stck"
    path.write_bytes(data)
    with pytest.raises(CorruptCheckpoint, match=reason):
        read_checkpoint(path)
    reports: list[str] = []
    assert CheckpointStore(tmp_path, on_corrupt=lambda p, why: reports.append(why)).load_latest() is None
    assert len(reports) == 1 and reason in reports[0]
    assert _unpickled == []


def test_a_crafted_valid_file_still_loads_without_pickle(tmp_path: Path, forbid_unpickling: None) -> None:
    path = tmp_path / "ckpt-000000000004-1000.stck"
    path.write_bytes(frame(_valid_header(skeleton={"$dict": [["w", {"$tensor": "0"}]]}), GOOD_PAYLOAD))
    loaded = read_checkpoint(path)
    assert loaded.step == 4 and torch.equal(loaded.state["w"], torch.ones(2))
