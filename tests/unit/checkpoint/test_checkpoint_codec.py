"""The state-tree codec: exact round trips of every supported leaf, and refusals that name the path."""

from __future__ import annotations

import collections
import json
import math
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from state_trees import assert_tree_equal, small_model_and_optimizer

from streamtrain.checkpoint import codec
from streamtrain.checkpoint.codec import flatten_state, unflatten_state
from streamtrain.checkpoint.format import decode_checkpoint, encode_checkpoint
from streamtrain.window.storage import SensorCodes

torch.set_num_threads(1)


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


def test_repeated_strings_are_stored_once_with_a_code_per_item() -> None:
    """A window's sensor ids: a fleet's few ids over millions of items."""
    fleet = ["sensor-a", "sensor-é", "", "sensor-a2"]
    ids = np.array([fleet[i % 4] for i in range(1000)], dtype=object).reshape(10, 100)
    tensors, skeleton = flatten_state({"ids": ids})
    node = skeleton["$dict"][0][1]
    assert tensors[node["$strarray"]].numel() == len("".join(fleet).encode())  # each id once
    assert tensors[node["codes"]].dtype == torch.int32 and tensors[node["codes"]].shape == (1000,)
    assert_tree_equal(unflatten_state(tensors, skeleton), {"ids": ids})
    tensors[node["codes"]][7] = 4  # past the four ids
    with pytest.raises(ValueError, match="indices into its 4 strings"):
        unflatten_state(tensors, skeleton)


def test_sensor_codes_are_stored_as_the_ids_they_name_each_used_id_once() -> None:
    """A checkpoint capture's sensor ids: codes into the window's vocabulary, some of it unused."""
    vocabulary = np.array(["unused-a", "s1", "unused-b", "s3", "s4"], dtype=object)
    column = SensorCodes(np.array([3, 1, 3, 4, 1], dtype=np.int32), vocabulary)
    tensors, skeleton = flatten_state({"ids": column, "none": SensorCodes(np.zeros(0, np.int32), vocabulary)})
    node = skeleton["$dict"][0][1]
    assert bytes(tensors[node["$strarray"]].numpy()) == b"s1s3s4"  # only the ids used, each once
    restored = unflatten_state(tensors, skeleton)
    assert restored["ids"].tolist() == ["s3", "s1", "s3", "s4", "s1"] and restored["ids"].dtype == object
    assert restored["none"].shape == (0,)
    assert np.asarray(column, dtype=object).tolist() == restored["ids"].tolist()


def test_object_arrays_worked_on_in_pieces_come_back_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(codec, "_PIECE_ITEMS", 3)
    repeated = np.array([f"s{i % 3}" for i in range(10)], dtype=object)
    distinct = np.array([f"s{i}" for i in range(10)], dtype=object)
    late_int = np.array(["a", "b", "a", "b", 7, "a"], dtype=object)  # a non-str item in the second piece
    tree = {"repeated": repeated, "distinct": distinct, "late_int": late_int}
    tensors, skeleton = flatten_state(tree)
    assert "codes" in skeleton["$dict"][0][1] and "codes" not in skeleton["$dict"][1][1]
    assert "$objarray" in skeleton["$dict"][2][1]
    assert_tree_equal(unflatten_state(tensors, skeleton), tree)


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
