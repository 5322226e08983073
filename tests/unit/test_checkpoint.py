"""Checkpoints: exact round trips, atomic writes, fallback past corrupt files, no pickle."""

from __future__ import annotations

import collections
import errno
import hashlib
import io
import itertools
import json
import logging
import math
import os
import pickle
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import safetensors.torch
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from streamtrain.checkpoint.store import (
    FORMAT_NAME,
    FORMAT_VERSION,
    MAGIC,
    CheckpointStore,
    CheckpointWriteError,
    CorruptCheckpoint,
    decode_checkpoint,
    encode_checkpoint,
    flatten_state,
    read_checkpoint,
    unflatten_state,
)

torch.set_num_threads(1)

LOGGER = "streamtrain.checkpoint.store"
PREFIX = struct.Struct("<8sQQ32s")  # the layout the module docstring documents


# ---------------------------------------------------------------------------------------
# helpers


def assert_tree_equal(actual: Any, expected: Any, path: str = "state") -> None:
    """Exact equality: same types, dtypes, shapes and bits (nan == nan, -0.0 != 0.0)."""
    assert type(actual) is type(expected), f"{path}: {type(actual)} != {type(expected)}"
    if isinstance(expected, torch.Tensor):
        assert actual.dtype == expected.dtype and actual.shape == expected.shape, path
        assert torch.equal(_tensor_bytes(actual), _tensor_bytes(expected)), path
    elif isinstance(expected, np.ndarray):
        assert actual.dtype == expected.dtype and actual.shape == expected.shape, path
        if expected.dtype == object:
            for index, (a, e) in enumerate(zip(actual.reshape(-1), expected.reshape(-1))):
                assert_tree_equal(a, e, f"{path}.flat[{index}]")
        else:
            assert np.ascontiguousarray(actual).tobytes() == np.ascontiguousarray(expected).tobytes(), path
    elif isinstance(expected, np.generic):
        assert actual.dtype == expected.dtype and actual.tobytes() == expected.tobytes(), path
    elif isinstance(expected, float):
        if math.isnan(expected):
            assert math.isnan(actual), path
        else:
            assert struct.pack("<d", actual) == struct.pack("<d", expected), f"{path}: {actual} != {expected}"
    elif isinstance(expected, dict):
        assert list(actual.keys()) == list(expected.keys()), path
        for (ka, va), (ke, ve) in zip(actual.items(), expected.items()):
            assert_tree_equal(ka, ke, f"{path} key {ke!r}")
            assert_tree_equal(va, ve, f"{path}[{ke!r}]")
        assert getattr(actual, "_metadata", None) == getattr(expected, "_metadata", None), path
    elif isinstance(expected, (list, tuple)):
        assert len(actual) == len(expected), path
        for index, (a, e) in enumerate(zip(actual, expected)):
            assert_tree_equal(a, e, f"{path}[{index}]")
    else:
        assert actual == expected, f"{path}: {actual!r} != {expected!r}"


def _tensor_bytes(tensor: torch.Tensor) -> torch.Tensor:
    if tensor.numel() == 0:  # empty tensors may carry stride 0, which view() refuses
        return torch.empty(0, dtype=torch.uint8)
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8)


def make_clock(start: float = 1_700_000_000.0):
    ticks = itertools.count()
    return lambda: start + next(ticks)


def frame(header: dict[str, Any], payload: bytes) -> bytes:
    """Build a checkpoint file by hand from the documented layout."""
    header_bytes = json.dumps(header).encode()
    digest = hashlib.sha256(header_bytes + payload).digest()
    return PREFIX.pack(MAGIC, len(header_bytes), len(payload), digest) + header_bytes + payload


def small_model_and_optimizer(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: torch.Tensor) -> None:
    optimizer.zero_grad()
    torch.nn.functional.mse_loss(model(batch), batch).backward()
    optimizer.step()


def realistic_state() -> dict[str, Any]:
    model, optimizer = small_model_and_optimizer(seed=0)
    train_step(model, optimizer, torch.randn(4, 3, generator=torch.Generator().manual_seed(1)))
    rng = np.random.default_rng(7)
    lengths = rng.integers(1, 30, size=50).astype(np.int64)
    values = rng.standard_normal(int(lengths.sum()) * 2).astype(np.float32)
    values.flags.writeable = False  # snapshots hand out read-only arrays
    window = {
        "values": values,
        "lengths": lengths,
        "keys": rng.random(50),
        "ts": 1_764_412_345.125 + np.arange(50, dtype=np.float64),
        "labels": rng.integers(-1, 3, size=50),
        "sensor_ids": np.array([f"pump-{i % 7}" for i in range(47)] + ["capteur-é-😀", " padded\t", ""], dtype=object),
        "partitions": rng.integers(0, 3, size=50).astype(np.int32),
        "offsets": np.arange(50, dtype=np.int64) * 3,
        "next_offsets": {0: 148, 1: 150, 2: 3},
        "version": 17,
        "half_life_s": math.inf,
        "max_age_s": None,
    }
    generator = torch.Generator().manual_seed(11)
    return {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "step": 1,
        "norm": {"count": 3, "mean": torch.zeros(2, dtype=torch.float64), "m2": torch.ones(2, dtype=torch.float64)},
        "rng": {
            "numpy": rng.bit_generator.state,
            "torch": torch.get_rng_state(),
            "torch_generator": generator.get_state(),
            "python": __import__("random").Random(5).getstate(),
        },
        "window": window,
        "mask": torch.tensor([True, False, True]),
        "loss": {"last": float("nan"), "best": -math.inf, "zero": -0.0},
        "blob": b"\x00\xffraw",
        "note": None,
    }


# ---------------------------------------------------------------------------------------
# round trips


def test_realistic_state_round_trips_exactly_through_the_store(tmp_path: Path) -> None:
    state = realistic_state()
    store = CheckpointStore(tmp_path / "ckpt", clock=make_clock())
    path = store.save(state, step=1)
    loaded = store.load_latest()
    assert loaded is not None and loaded.path == path and loaded.step == 1
    assert loaded.created_at == 1_700_000_000.0
    assert_tree_equal(loaded.state, state)
    assert list(loaded.state["optimizer"]["state"]) == [0, 1, 2, 3]  # int keys stay ints


def test_restored_state_resumes_training_and_random_streams_identically(tmp_path: Path) -> None:
    model, optimizer = small_model_and_optimizer(seed=0)
    batch = torch.randn(4, 3, generator=torch.Generator().manual_seed(2))
    train_step(model, optimizer, batch)
    numpy_rng = np.random.default_rng(3)
    numpy_rng.random(5)
    torch_rng = torch.Generator().manual_seed(4)
    torch.rand(3, generator=torch_rng)
    store = CheckpointStore(tmp_path)
    store.save(
        {
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "numpy_rng": numpy_rng.bit_generator.state,
            "torch_rng": torch_rng.get_state(),
        },
        step=1,
    )
    loaded = store.load_latest()
    assert loaded is not None

    restored_model, restored_optimizer = small_model_and_optimizer(seed=99)
    restored_model.load_state_dict(loaded.state["model"])
    restored_optimizer.load_state_dict(loaded.state["optimizer"])
    train_step(model, optimizer, batch)
    train_step(restored_model, restored_optimizer, batch)
    for original, restored in zip(model.parameters(), restored_model.parameters()):
        assert torch.equal(original, restored)

    restored_numpy = np.random.default_rng(0)
    restored_numpy.bit_generator.state = loaded.state["numpy_rng"]
    assert np.array_equal(restored_numpy.random(8), numpy_rng.random(8))
    restored_torch = torch.Generator()
    restored_torch.set_state(loaded.state["torch_rng"])
    assert torch.equal(torch.rand(8, generator=restored_torch), torch.rand(8, generator=torch_rng))


def test_big_ints_and_non_finite_floats_travel_as_tagged_json() -> None:
    tensors, skeleton = flatten_state(
        {"big": 2**128 + 1, "small": 2**53, "neg": -(2**70), "inf": math.inf, "nan": math.nan}
    )
    assert tensors == {}
    text = json.dumps(skeleton, allow_nan=False)  # no bare NaN/Infinity, no 128-bit JSON numbers
    assert '"340282366920938463463374607431768211457"' in text
    assert_tree_equal(
        unflatten_state({}, json.loads(text)),
        {"big": 2**128 + 1, "small": 2**53, "neg": -(2**70), "inf": math.inf, "nan": math.nan},
    )


def test_string_arrays_keep_every_code_point_and_their_shape() -> None:
    tricky = ["", " lead", "trail ", "nul\x00inside", "\ud800", "é", "😀", "\u00e9\u0301"]
    array = np.empty((2, 4), dtype=object)
    array[:] = np.array(tricky, dtype=object).reshape(2, 4)
    tensors, skeleton = flatten_state({"ids": array, "none": np.empty((0, 3), dtype=object)})
    assert "$strarray" in json.dumps(skeleton)
    assert_tree_equal(unflatten_state(tensors, skeleton), {"ids": array, "none": np.empty((0, 3), dtype=object)})


def test_ordered_state_dict_keeps_its_module_metadata() -> None:
    model, _ = small_model_and_optimizer(seed=0)
    state_dict = model.state_dict()
    restored = unflatten_state(*flatten_state(state_dict))
    assert isinstance(restored, collections.OrderedDict)
    assert restored._metadata == state_dict._metadata


def test_tensors_that_share_memory_are_saved_as_separate_copies() -> None:
    base = torch.arange(10.0)
    tied = {"a": base, "b": base, "view": base[2:5], "array": np.arange(6), "array_view": None}
    tied["array_view"] = tied["array"][::2]
    data = b"".join(encode_checkpoint(tied, step=0, created_at=0.0))
    assert_tree_equal(decode_checkpoint(data).state, tied)


def test_unsupported_leaf_names_its_path_and_the_fix() -> None:
    with pytest.raises(TypeError, match=r"state\['window'\]\['when'\] is a object.*Convert it"):
        flatten_state({"window": {"when": object()}})
    with pytest.raises(TypeError, match="key of type"):
        flatten_state({"d": {frozenset(): 1}})
    with pytest.raises(TypeError, match="to_dense"):
        flatten_state({"sparse": torch.eye(2).to_sparse()})


def test_cycles_are_refused() -> None:
    tree: dict[str, Any] = {"a": []}
    tree["a"].append(tree)
    with pytest.raises(ValueError, match="contains itself"):
        flatten_state(tree)


# hypothesis: random nested trees --------------------------------------------------------

NUMPY_DTYPES = [
    "bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
    "float16", "float32", "float64", "complex64", "complex128", ">f4", ">i8", "<M8[ns]", "<U3", "|S4",
]  # fmt: skip
TORCH_DTYPES = [
    torch.bool,
    torch.uint8,
    torch.int16,
    torch.int64,
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.complex128,
]

shapes = hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=4)
numpy_arrays = st.sampled_from(NUMPY_DTYPES).flatmap(lambda dtype: hnp.arrays(np.dtype(dtype), shapes))
torch_tensors = st.tuples(
    st.sampled_from(TORCH_DTYPES), hnp.arrays(np.float64, shapes, elements=st.floats(-1e3, 1e3, allow_nan=False))
).map(lambda pair: torch.from_numpy(pair[1]).to(pair[0]))
string_arrays = st.lists(st.text(max_size=6), max_size=6).map(lambda items: _object_array(items))
mixed_object_arrays = st.lists(st.one_of(st.none(), st.integers(), st.text(max_size=3)), min_size=1, max_size=4).map(
    lambda items: _object_array(items + [None])
)
numpy_scalars = hnp.arrays(st.sampled_from(["int32", "float64", "bool", "<U2"]).map(np.dtype), ()).map(lambda a: a[()])


def _object_array(items: list[Any]) -> np.ndarray:
    array = np.empty(len(items), dtype=object)
    array[:] = items
    return array


leaves = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.integers(min_value=-(2**200), max_value=2**200),
    st.floats(),
    st.text(max_size=10),
    st.binary(max_size=20),
    numpy_arrays,
    torch_tensors,
    string_arrays,
    mixed_object_arrays,
    numpy_scalars,
)
keys = st.one_of(st.text(max_size=6), st.integers(-3, 10**20))
trees = st.recursive(
    leaves,
    lambda children: st.one_of(
        st.lists(children, max_size=4),
        st.lists(children, max_size=4).map(tuple),
        st.dictionaries(keys, children, max_size=4),
    ),
    max_leaves=16,
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tree=trees)
def test_flatten_unflatten_round_trips_random_trees(tree: Any) -> None:
    tensors, skeleton = flatten_state(tree)
    text = json.dumps(skeleton, allow_nan=False)
    assert_tree_equal(unflatten_state(tensors, json.loads(text)), tree)
    data = b"".join(encode_checkpoint({"tree": tree}, step=3, created_at=1.5))
    assert_tree_equal(decode_checkpoint(data).state, {"tree": tree})


# ---------------------------------------------------------------------------------------
# the store: ordering, pruning, listing


def test_load_latest_picks_highest_step_then_latest_time(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, keep=10, clock=make_clock())
    for step in (1, 3, 2):
        store.save({"step": step}, step=step)
    newest = store.save({"step": 3, "second": True}, step=3)
    loaded = store.load_latest()
    assert loaded is not None and loaded.path == newest and loaded.state == {"step": 3, "second": True}
    assert [info.step for info in store.list()] == [3, 3, 2, 1]
    assert store.latest_step == 3


def test_empty_or_missing_directory_loads_nothing(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path / "never-created")
    assert store.load_latest() is None
    assert store.list() == []
    assert store.latest_step is None


def test_keep_prunes_to_the_newest_files_and_removes_stale_temp_files(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, keep=2, clock=make_clock())
    store.save({"x": 0}, step=0)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale_ours = tmp_path / f".ckpt-000000000000-1.stck.{os.getpid()}.tmp"
    stale_dead = tmp_path / f".ckpt-000000000000-2.stck.{dead.pid}.tmp"
    in_flight_elsewhere = tmp_path / f".ckpt-000000000000-3.stck.{os.getppid()}.tmp"
    for temp in (stale_ours, stale_dead, in_flight_elsewhere):
        temp.write_bytes(b"partial")
    for step in range(1, 5):
        store.save({"x": step}, step=step)
    assert [info.step for info in store.list()] == [4, 3]
    assert not stale_ours.exists() and not stale_dead.exists()
    assert in_flight_elsewhere.exists()  # a live process may still be writing it


def test_pruning_counts_only_good_checkpoints(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, keep=2, clock=make_clock())
    oldest_good = store.save({"x": 1}, step=1)
    second = store.save({"x": 2}, step=2)
    _flip_byte(second, offset=-5)
    store.save({"x": 3}, step=3)
    assert oldest_good.exists() and second.exists()  # 1 is still one of the 2 newest good ones
    store.save({"x": 4}, step=4)
    assert not oldest_good.exists() and not second.exists()


def test_a_lower_step_save_is_kept_and_warned_about(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)
    store = CheckpointStore(tmp_path, keep=1, clock=make_clock())
    store.save({"run": 1}, step=100)
    restarted = store.save({"run": 2}, step=5)
    assert restarted.exists()
    assert any("prefer" in record.getMessage() for record in caplog.records)


def test_files_are_private_to_the_service_user(tmp_path: Path) -> None:
    directory = tmp_path / "fresh"
    path = CheckpointStore(directory).save({"x": 1}, step=1)
    assert path.stat().st_mode & 0o777 == 0o600
    assert directory.stat().st_mode & 0o777 == 0o700
    assert path.name.startswith("ckpt-000000000001-") and path.suffix == ".stck"


@pytest.mark.parametrize("keep", [0, -1, True, 1.5])
def test_keep_must_be_a_positive_int(tmp_path: Path, keep: Any) -> None:
    with pytest.raises(ValueError, match="keep"):
        CheckpointStore(tmp_path, keep=keep)


# ---------------------------------------------------------------------------------------
# corruption: fall back to the previous good checkpoint, log it, report it


def _flip_byte(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def _corrupt(path: Path, kind: str) -> None:
    data = path.read_bytes()
    header_length = PREFIX.unpack_from(data)[1]
    if kind == "truncated":
        path.write_bytes(data[: len(data) // 2])
    elif kind == "truncated_last_byte":
        path.write_bytes(data[:-1])
    elif kind == "truncated_inside_prefix":
        path.write_bytes(data[:20])
    elif kind == "flipped_payload_byte":
        _flip_byte(path, offset=-3)
    elif kind == "flipped_header_byte":
        _flip_byte(path, offset=PREFIX.size + header_length // 2)
    elif kind == "flipped_length_byte":
        _flip_byte(path, offset=9)
    elif kind == "wrong_checksum":
        path.write_bytes(data[:24] + hashlib.sha256(b"something else").digest() + data[56:])
    elif kind == "garbage":
        path.write_bytes(np.random.default_rng(0).integers(0, 256, len(data), dtype=np.uint8).tobytes())
    elif kind == "empty":
        path.write_bytes(b"")
    else:
        raise AssertionError(kind)


@pytest.mark.parametrize(
    ("kind", "reason"),
    [
        ("truncated", "truncated"),
        ("truncated_last_byte", "truncated"),
        ("truncated_inside_prefix", "shorter than"),
        ("flipped_payload_byte", "SHA-256 mismatch"),
        ("flipped_header_byte", "SHA-256 mismatch"),
        ("flipped_length_byte", "truncated"),
        ("wrong_checksum", "SHA-256 mismatch"),
        ("garbage", "magic bytes"),
        ("empty", "empty file"),
    ],
)
def test_corrupt_newest_falls_back_to_previous_good(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, kind: str, reason: str
) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)
    reports: list[tuple[Path, str]] = []
    store = CheckpointStore(
        tmp_path, keep=5, on_corrupt=lambda path, why: reports.append((path, why)), clock=make_clock()
    )
    good = store.save({"weights": torch.arange(100.0), "step": 1}, step=1)
    bad = store.save({"weights": torch.arange(100.0) * 2, "step": 2}, step=2)
    _corrupt(bad, kind)

    fresh = CheckpointStore(tmp_path, on_corrupt=lambda path, why: reports.append((path, why)))
    loaded = fresh.load_latest()

    assert loaded is not None and loaded.path == good and loaded.state["step"] == 1
    assert torch.equal(loaded.state["weights"], torch.arange(100.0))
    assert len(reports) == 1 and reports[0][0] == bad and reason in reports[0][1]
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING and bad.name in r.getMessage()]
    assert len(warnings) == 1 and reason in warnings[0].getMessage()
    with pytest.raises(CorruptCheckpoint, match=reason):
        read_checkpoint(bad)


def test_each_corrupt_file_is_reported_once(tmp_path: Path) -> None:
    reports: list[Path] = []
    store = CheckpointStore(tmp_path, keep=2, on_corrupt=lambda path, why: reports.append(path), clock=make_clock())
    store.save({"x": 1}, step=1)
    bad = store.save({"x": 2}, step=2)
    _corrupt(bad, "wrong_checksum")
    store.load_latest()
    store.load_latest()
    assert store.latest_step == 1
    store.save({"x": 3}, step=3)  # pruning looks at the same file again
    assert reports == [bad]


def test_all_corrupt_loads_nothing(tmp_path: Path) -> None:
    reports: list[Path] = []
    store = CheckpointStore(tmp_path, keep=3, on_corrupt=lambda path, why: reports.append(path), clock=make_clock())
    paths = [store.save({"x": step}, step=step) for step in range(3)]
    for path in paths:
        _corrupt(path, "truncated")
    assert store.load_latest() is None
    assert sorted(reports) == sorted(paths)


def test_a_renamed_file_whose_header_disagrees_is_refused(tmp_path: Path) -> None:
    reports: list[str] = []
    store = CheckpointStore(tmp_path, keep=5, on_corrupt=lambda path, why: reports.append(why), clock=make_clock())
    store.save({"x": 1}, step=1)
    two = store.save({"x": 2}, step=2)
    two.rename(tmp_path / two.name.replace("000000000002", "000000000009"))
    loaded = store.load_latest()
    assert loaded is not None and loaded.step == 1
    assert reports == ["file name says step 9, header says step 2"]


def test_a_failing_on_corrupt_callback_does_not_stop_the_fallback(tmp_path: Path) -> None:
    def broken(path: Path, reason: str) -> None:
        raise RuntimeError("metrics backend down")

    store = CheckpointStore(tmp_path, keep=5, on_corrupt=broken, clock=make_clock())
    store.save({"x": 1}, step=1)
    _corrupt(store.save({"x": 2}, step=2), "empty")
    loaded = store.load_latest()
    assert loaded is not None and loaded.step == 1


# ---------------------------------------------------------------------------------------
# never unpickle


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


# ---------------------------------------------------------------------------------------
# unwritable or full directory: a clear error, nothing partial left, the next save works


def test_directory_under_a_regular_file_raises_write_error(tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("x")
    store = CheckpointStore(blocker / "checkpoints")
    with pytest.raises(CheckpointWriteError, match="not-a-directory/checkpoints") as caught:
        store.save({"x": 1}, step=1)
    assert isinstance(caught.value.cause, OSError)
    assert store.load_latest() is None


@pytest.mark.parametrize("failing_call", ["open", "fsync", "replace"])
def test_disk_full_leaves_nothing_and_the_retry_succeeds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, failing_call: str
) -> None:
    store = CheckpointStore(tmp_path, clock=make_clock())
    previous = store.save({"x": 1}, step=1)
    real = getattr(os, failing_call)

    def disk_full(*args: Any, **kwargs: Any) -> Any:
        if failing_call == "fsync" or str(args[0]).endswith(".tmp"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(*args, **kwargs)

    monkeypatch.setattr(os, failing_call, disk_full)
    with pytest.raises(CheckpointWriteError, match="No space left on device") as caught:
        store.save({"x": 2}, step=2)
    assert caught.value.step == 2 and caught.value.directory == tmp_path
    assert sorted(p.name for p in tmp_path.iterdir()) == [previous.name]

    monkeypatch.undo()
    retried = store.save({"x": 2}, step=2)
    loaded = store.load_latest()
    assert loaded is not None and loaded.path == retried and loaded.state == {"x": 2}


def test_bad_arguments_to_save_are_refused(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    with pytest.raises(ValueError, match="step"):
        store.save({}, step=-1)
    with pytest.raises(TypeError, match="dict"):
        store.save([1, 2], step=1)  # type: ignore[arg-type]
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------------------------------
# the service's checkpoints: restore under changed settings, locks, counters


def small_service(tmp_path: Path, **overrides: Any) -> Any:
    from streamtrain.config import load_settings
    from streamtrain.runtime.service import Service

    values: dict[str, Any] = dict(
        d_model=16, n_heads=2, n_layers=1, max_len=32, token_budget=512, min_window_items=8, warmup_steps=1,
        checkpoint_dir=tmp_path / "ckpt", window_capacity=200, half_life_s=3600.0, torch_threads=1, train_nice=0,
    )  # fmt: skip
    values.update(overrides)
    return Service(load_settings(**values))


def feed(service: Any, start: int, n: int, *, ts0: float = 1.7e9, rejected: dict[str, int] | None = None) -> None:
    from streamtrain.events import EventBatch, SensorEvent

    channels = service.settings.channels
    rng = np.random.default_rng(start)
    events = [
        SensorEvent(
            f"s{i % 5}", ts0 + start + i, rng.standard_normal((int(rng.integers(2, 12)), channels)).astype(np.float32)
        )
        for i in range(n)
    ]
    batch = EventBatch.from_events(events, offsets=np.arange(start, start + n))
    service.window.insert_batch(batch, {0: start + n}, rejected=rejected)


def a_training_batch(service: Any) -> Any:
    from streamtrain.data.collate import collate

    snapshot = service.window.snapshot()
    return collate(snapshot.values[:16], ts=snapshot.ts[:16])


def test_restore_with_another_half_life_rekeys_the_window_and_keeps_training(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    old = small_service(tmp_path, half_life_s=3600.0)
    for start in range(0, 86_400, 4_320):  # a day of events, one every 20 s
        feed(old, start, 216, ts0=1.7e9 + start * 19)
    assert old.checkpoint() is not None
    kept = old.window.snapshot()

    new = small_service(tmp_path, half_life_s="inf")
    with caplog.at_level("WARNING", logger="streamtrain.window"):
        assert new.restore() is not None
    assert "keyed with HALF_LIFE_S=3600; re-keyed its 200 items for HALF_LIFE_S=inf" in caplog.text
    snap = new.window.snapshot()
    order_old, order_new = np.argsort(kept.offsets), np.argsort(snap.offsets)
    np.testing.assert_allclose(  # the random part survives, the recency part is gone
        snap.keys[order_new], (kept.keys - math.log(2) / 3600 * (kept.ts - 1.7e9))[order_old], atol=1e-9
    )
    feed(new, 100_000, 2_000, ts0=1.7e9 + 86_400 * 20)
    assert (new.window.snapshot().offsets >= 100_000).any()  # the window still takes events


def test_restore_with_other_channels_refuses_with_one_line_and_loads_nothing(tmp_path: Path) -> None:
    from streamtrain.runtime.service import IncompatibleCheckpoint

    old = small_service(tmp_path, channels=1)
    feed(old, 0, 50)
    assert old.checkpoint() is not None
    new = small_service(tmp_path, channels=2)
    with pytest.raises(IncompatibleCheckpoint) as refused:
        new.restore()
    message = str(refused.value)
    assert "\n" not in message and "CHANNELS=1" in message and "CHANNELS=2" in message
    assert "STREAMTRAIN_CHECKPOINT_DIR" in message
    assert len(new.window) == 0 and new.trainer.step == 0 and new.published is None


def test_serve_with_an_incompatible_checkpoint_exits_2_with_that_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from streamtrain import cli

    old = small_service(tmp_path, channels=1)
    feed(old, 0, 50)
    assert old.checkpoint() is not None
    for name in list(os.environ):
        if name.startswith("STREAMTRAIN_"):
            monkeypatch.delenv(name)
    config = tmp_path / "serve.toml"
    config.write_text(
        f'checkpoint_dir = "{tmp_path / "ckpt"}"\nchannels = 2\nd_model = 16\nn_heads = 2\nn_layers = 1\nmax_len = 32\n'
        'kafka_bootstrap = "127.0.0.1:1"\nlog_level = "ERROR"\n'
    )
    assert cli.main(["serve", "--config", str(config)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("streamtrain: checkpoint ") and "CHANNELS=1" in err[0], err


def test_restore_with_another_model_size_names_every_changed_setting(tmp_path: Path) -> None:
    from streamtrain.runtime.service import IncompatibleCheckpoint

    old = small_service(tmp_path)
    feed(old, 0, 50)
    assert old.checkpoint() is not None
    with pytest.raises(IncompatibleCheckpoint, match=r"D_MODEL=16, N_LAYERS=1; .* D_MODEL=32, N_LAYERS=2"):
        small_service(tmp_path, d_model=32, n_layers=2).restore()


def test_the_window_ledger_survives_a_restore_and_the_evicted_counter_starts_at_zero(tmp_path: Path) -> None:
    old = small_service(tmp_path)
    for start in range(0, 1000, 100):
        feed(old, start, 100, rejected={"schema": 2})
    assert old.checkpoint() is not None
    new = small_service(tmp_path)
    new.restore()
    stats = new.window.stats()
    assert (stats.seen_total, stats.accepted_total, stats.rejected_total, stats.evicted_total) == (
        1020,
        1000,
        {"schema": 20},
        800,
    )
    assert new.window.evicted_since_start == 0  # what streamtrain_window_evicted_total starts from


def test_a_checkpoint_waits_for_the_training_step_without_holding_ingest_back(tmp_path: Path) -> None:
    import threading

    service = small_service(tmp_path)
    feed(service, 0, 100)
    written: list[Any] = []
    with service.trainer.lock:  # a training step in progress
        writer = threading.Thread(target=lambda: written.append(service.checkpoint()))
        writer.start()
        # the checkpoint is waiting for the step; ingest must still get its lock at once
        for _ in range(5):
            assert service.ingest.apply_lock.acquire(timeout=2.0), "ingest stalled behind a checkpoint"
            feed(service, 1000 + len(written) * 10, 10)
            service.ingest.apply_lock.release()
        assert writer.is_alive() and not written
    writer.join(timeout=30)
    assert written and written[0] is not None


def test_a_checkpoint_holds_the_state_of_one_moment_while_training_goes_on(tmp_path: Path) -> None:
    """The trainer's tensors are copied under its lock: a step that runs while the file is
    written (the trainer thread does not wait for the write) must not leak into it."""
    service = small_service(tmp_path)
    feed(service, 0, 100)
    service.trainer.train_step(a_training_batch(service))
    before = {k: v.clone() for k, v in service.trainer.model.state_dict().items()}
    save = service.store.save

    def save_while_training(state: Any, step: int) -> Path:
        service.trainer.train_step(a_training_batch(service))  # in production: another thread
        return save(state, step)

    service.store.save = save_while_training  # type: ignore[method-assign]
    assert service.checkpoint() is not None
    loaded = CheckpointStore(tmp_path / "ckpt").load_latest()
    assert loaded is not None and loaded.state["trainer"]["step"] == 1
    for name, tensor in before.items():
        assert torch.equal(loaded.state["trainer"]["model"][name], tensor), name
    assert not all(torch.equal(service.trainer.model.state_dict()[k], v) for k, v in before.items())


def test_torch_threads_is_the_count_of_every_thread_the_service_starts(tmp_path: Path) -> None:
    import threading

    try:
        small_service(tmp_path, torch_threads=2)
        seen: list[int] = []
        thread = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))  # e.g. a predict worker
        thread.start()
        thread.join()
        assert seen == [2] and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(1)


def test_restore_across_dp_modes_is_refused_with_one_line(tmp_path: Path) -> None:
    from streamtrain.runtime.service import IncompatibleCheckpoint

    old = small_service(tmp_path)
    feed(old, 0, 50)
    assert old.checkpoint() is not None
    dp = small_service(tmp_path, dp="on", shuffle="crypto")
    with pytest.raises(IncompatibleCheckpoint, match=r"written with DP=off; .* DP=on") as refused:
        dp.restore()
    assert "\n" not in str(refused.value) and len(dp.window) == 0
