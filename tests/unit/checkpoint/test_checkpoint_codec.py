"""The state-tree codec: exact round trips of every supported leaf, and refusals that name the path."""

from __future__ import annotations

import collections
import json
import math
import warnings
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


# deterministic cases (the mutation run: the random trees above reach some paths only by chance) --------


def round_trip(tree: Any) -> Any:
    tensors, skeleton = flatten_state(tree)
    return unflatten_state(tensors, json.loads(json.dumps(skeleton, allow_nan=False)))


def test_tensors_safetensors_cannot_hold_travel_as_raw_bytes_with_their_dtype_and_shape() -> None:
    tree = {
        "c128": torch.tensor([[1 + 2j, -3.5j], [0.25, 7]], dtype=torch.complex128),
        "f8": torch.tensor([0.5, 1.5, -2.0]).to(torch.float8_e4m3fn),
        "one_byte": torch.tensor([-448.0]).to(torch.float8_e4m3fn),
        "empty": torch.empty((0, 3), dtype=torch.complex128),
        "plain": torch.arange(4, dtype=torch.int16),
    }
    tensors, skeleton = flatten_state(tree)
    nodes = dict(skeleton["$dict"])
    assert nodes["c128"] == {"$tensor": "0", "dtype": "complex128", "shape": [2, 2]}
    assert nodes["f8"] == {"$tensor": "1", "dtype": "float8_e4m3fn", "shape": [3]}
    assert nodes["empty"] == {"$tensor": "3", "dtype": "complex128", "shape": [0, 3]}
    assert nodes["plain"] == {"$tensor": "4"}  # a safetensors dtype is stored as itself
    assert [tensors[name].dtype for name in "0123"] == [torch.uint8] * 4 and tensors["3"].numel() == 0
    assert_tree_equal(round_trip(tree), tree)


def test_numpy_arrays_of_other_dtypes_travel_as_raw_bytes() -> None:
    tree = {"one": np.array([b"x"], dtype="|S1"), "big_endian": np.array([1.5, -2], dtype=">f4")}
    assert_tree_equal(round_trip(tree), tree)


def test_arrays_are_wrapped_without_a_copy_unless_read_only() -> None:
    writeable, read_only = np.arange(3), np.arange(4)
    read_only.flags.writeable = False
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch warns when it wraps read-only memory
        tensors, _ = flatten_state({"w": writeable, "r": read_only, "t1": torch.ones(2), "t2": torch.zeros(2)})
    assert np.shares_memory(tensors["0"].numpy(), writeable)
    assert not np.shares_memory(tensors["1"].numpy(), read_only)
    assert tensors["3"].data_ptr() != tensors["2"].data_ptr()


def test_tensors_are_copied_only_when_they_share_memory() -> None:
    first, second = torch.ones(3), torch.zeros(3)
    tensors, _ = flatten_state({"a": first, "b": second, "again": first})
    assert tensors["0"].data_ptr() == first.data_ptr() and tensors["1"].data_ptr() == second.data_ptr()
    assert tensors["2"].data_ptr() != first.data_ptr()


def test_json_safe_integers_stay_plain_and_larger_ones_are_tagged() -> None:
    edge = 2**53
    _, skeleton = flatten_state([edge, -edge, edge + 1, -edge - 1, 0, -5])
    assert skeleton == [edge, -edge, {"$int": str(edge + 1)}, {"$int": str(-edge - 1)}, 0, -5]


def test_subclasses_of_the_plain_types_come_back_as_the_base_type() -> None:
    class Name(str):
        pass

    class Count(int):
        pass

    restored = round_trip({"name": Name("abc"), "count": Count(3), "big": Count(2**60), "tuple_key": {(1, "a"): 2}})
    assert restored == {"name": "abc", "count": 3, "big": 2**60, "tuple_key": {(1, "a"): 2}}
    assert type(restored["name"]) is str and type(restored["count"]) is int


def test_string_arrays_use_the_blob_encoding_and_mixed_ones_do_not() -> None:
    _, skeleton = flatten_state({"ids": np.array(["a", "bc"], dtype=object), "mixed": np.array(["a", 1], dtype=object)})
    nodes = dict(skeleton["$dict"])
    assert set(nodes["ids"]) == {"$strarray", "lengths", "shape"} and set(nodes["mixed"]) == {"$objarray", "shape"}


def test_an_ordered_dict_without_metadata_is_a_plain_dict() -> None:
    _, skeleton = flatten_state(collections.OrderedDict(a=1))
    assert skeleton == {"$dict": [["a", 1]]}


@pytest.mark.parametrize(
    ("tree", "message"),
    [
        (
            {"when": object()},
            "state['when'] is a object, which a checkpoint cannot hold: states are dicts/lists/tuples of tensors, "
            "numpy arrays, numbers, str, bytes and None. Convert it first (e.g. its state_dict(), or a dict of its "
            "fields).",
        ),
        (
            {"d": {object: 1}},
            "state['d'] has a key of type type; checkpoint dict keys must be None, bool, int, float, str, bytes or "
            "tuples of those",
        ),
        (
            {"d": {(1, (2, frozenset())): 1}},
            "state['d'] has a key of type tuple; checkpoint dict keys must be None, bool, int, float, str, bytes or "
            "tuples of those",
        ),
        (
            {"rec": np.zeros(2, dtype=[("a", "i4")])},
            "state['rec'] is a structured numpy array ([('a', '<i4')]); save its fields as separate arrays",
        ),
        (
            {"rec": np.zeros(2, dtype=[("a", "i4")])[0]},
            "state['rec'] is a structured numpy array ([('a', '<i4')]); save its fields as separate arrays",
        ),
    ],
    ids=["leaf", "key", "tuple-key", "structured", "structured-scalar"],
)
def test_what_a_checkpoint_cannot_hold_is_refused_naming_its_path(tree: Any, message: str) -> None:
    with pytest.raises(TypeError) as refused:
        flatten_state(tree)
    assert str(refused.value) == message


def test_a_quantized_tensor_is_refused_not_saved_without_its_scale() -> None:
    """Its raw bytes came back as a qint8 tensor with no quantizer, which no operation accepts."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch marks quantize_per_tensor deprecated
        quantized = torch.quantize_per_tensor(torch.tensor([1.0, 2.0]), 0.5, 3, torch.qint8)
    with pytest.raises(TypeError) as refused:
        flatten_state({"q": quantized})
    assert str(refused.value) == (
        "state['q'] is a quantized tensor (torch.qint8); save its dequantize(), or its int_repr() with its "
        "q_scale() and q_zero_point()"
    )


def test_an_object_array_item_a_checkpoint_cannot_hold_is_named_by_its_index() -> None:
    with pytest.raises(TypeError, match=r"^state\['ids'\]\[1\] is a object, which a checkpoint cannot hold"):
        flatten_state({"ids": np.array(["a", object()], dtype=object)})
    with pytest.raises(TypeError, match=r"^state\['ids'\]\[0\]\['x'\] is a object"):
        flatten_state({"ids": np.array([{"x": object()}, 1], dtype=object)})


def test_module_metadata_is_checked_under_its_own_path() -> None:
    state = collections.OrderedDict(w=torch.ones(1))
    state._metadata = {"": {"version": object()}}  # type: ignore[attr-defined]
    with pytest.raises(TypeError, match=r"^state\['sd'\]\['_metadata'\]\[''\]\['version'\] is a object"):
        flatten_state({"sd": state})


U8, I64, F32 = (torch.zeros(3, dtype=dtype) for dtype in (torch.uint8, torch.int64, torch.float32))


@pytest.mark.parametrize(
    ("tensors", "skeleton", "message"),
    [
        (
            {"0": F32},
            {"$tensor": "0", "dtype": "complex128", "shape": [1]},
            "payload tensor '0' is torch.float32, expected torch.uint8",
        ),
        (
            {"0": F32},
            {"$ndarray": "0", "dtype": ">f4", "shape": [3]},
            "payload tensor '0' is torch.float32, expected torch.uint8",
        ),
        ({"0": F32}, {"$bytes": "0"}, "payload tensor '0' is torch.float32, expected torch.uint8"),
        (
            {"0": F32, "1": I64},
            {"$strarray": "0", "lengths": "1", "shape": [3]},
            "payload tensor '0' is torch.float32, expected torch.uint8",
        ),
        (
            {"0": U8, "1": F32},
            {"$strarray": "0", "lengths": "1", "shape": [3]},
            "payload tensor '1' is torch.float32, expected torch.int64",
        ),
        ({"0": U8}, {"$tensor": "0", "dtype": "nn", "shape": [3]}, "unknown torch dtype 'nn'"),
        ({"0": U8}, {"$tensor": "0", "dtype": "float128", "shape": [3]}, "unknown torch dtype 'float128'"),
        ({"0": U8}, [{"$tensor": "0"}, {"$tensor": "0"}], "skeleton names tensor '0' twice"),
        ({"0": I64}, {"$npscalar": {"$ndarray": "0"}}, "$npscalar must wrap a 0-d array"),
        ({}, {"$npscalar": 3}, "$npscalar must wrap a 0-d array"),
        ({}, {"$float": "1.5"}, "$float holds '1.5'; only inf, -inf and nan travel tagged"),
        ({}, ("a",), "skeleton node of type tuple is not part of the format"),
        (
            {"0": torch.tensor(list(b"abc"), dtype=torch.uint8), "1": torch.tensor([1, 1])},
            {"$strarray": "0", "lengths": "1", "shape": [2]},
            "string array lengths do not add up to its text",
        ),
        (
            {"0": torch.tensor(list(b"abc"), dtype=torch.uint8), "1": torch.tensor([-1, 4])},
            {"$strarray": "0", "lengths": "1", "shape": [2]},
            "string array lengths do not add up to its text",
        ),
        (
            {str(i): U8.clone() for i in range(5)},
            None,
            "the payload holds 5 tensors the skeleton never names (e.g. ['0', '1', '2']); the header and payload "
            "come from different saves",
        ),
    ],
)
def test_a_skeleton_that_does_not_fit_its_payload_is_refused(tensors: dict, skeleton: Any, message: str) -> None:
    with pytest.raises(ValueError) as refused:
        unflatten_state(tensors, skeleton)
    assert str(refused.value) == message


# what the mutation run of the codes for repeated strings asked (2026-12-03) ----------------------


def test_empty_arrays_of_raw_byte_dtypes_keep_their_dtype_and_shape() -> None:
    tree = {
        "big_endian": np.zeros((0, 3), dtype=">f4"),
        "dates": np.zeros(0, dtype="datetime64[s]"),
        "text": np.zeros((2, 0), dtype="<U3"),
    }
    restored = round_trip(tree)
    for name, array in tree.items():
        assert restored[name].dtype == array.dtype and restored[name].shape == array.shape, name


@pytest.mark.parametrize(
    ("items", "coded"),
    [
        (["a", "b", "c", "a", "b", "c"], True),  # half the items distinct: codes
        (["a", "b", "a", "b", "c", "a", "b", "c", "a"], True),  # a third distinct
        (["a", "b", "c", "a", "b"], False),  # more than half distinct: each item's text
        (["a", "b", "c"], False),
    ],
)
def test_strings_get_codes_once_at_most_half_the_items_are_distinct(items: list[str], coded: bool) -> None:
    array = np.array(items, dtype=object)
    tensors, skeleton = flatten_state({"ids": array})
    node = skeleton["$dict"][0][1]
    assert ("codes" in node) is coded
    assert bytes(tensors[node["$strarray"]].numpy()).decode() == "".join(dict.fromkeys(items) if coded else items)
    assert round_trip({"ids": array})["ids"].tolist() == items


def test_codes_of_many_distinct_strings_stay_int32() -> None:
    ids = np.array([f"sensor-{i % 100}" for i in range(300)], dtype=object)
    tensors, skeleton = flatten_state({"ids": ids})
    assert tensors[skeleton["$dict"][0][1]["codes"]].dtype == torch.int32


def test_one_string_repeated_decodes_through_codes_that_are_all_equal() -> None:
    ids = np.array(["only"] * 4, dtype=object).reshape(2, 2)
    tensors, skeleton = flatten_state({"ids": ids})
    assert tensors[skeleton["$dict"][0][1]["codes"]].tolist() == [0, 0, 0, 0]
    assert_tree_equal(unflatten_state(tensors, skeleton), {"ids": ids})


def test_an_object_array_of_other_leaves_keeps_its_shape() -> None:
    mixed = np.array([[1, None], ["a", 2.5], [b"x", (1, 2)]], dtype=object)
    restored = round_trip({"mixed": mixed})["mixed"]
    assert restored.shape == (3, 2) and restored.tolist() == [[1, None], ["a", 2.5], [b"x", (1, 2)]]


def test_sensor_codes_of_any_shape_and_past_a_million_items_keep_every_id_they_use() -> None:
    """Codes past the first million (the pieces bincount is run on), ids used in one piece only,
    and an unused id at the end of the table."""
    strings = np.array(["first", "middle", "last", "common", "unused"], dtype=object)
    codes = np.full((1 << 21) + 5, 3, dtype=np.int32)
    codes[0], codes[(1 << 20) + 7], codes[-1] = 0, 1, 2
    tensors, skeleton = flatten_state({"ids": SensorCodes(codes, strings)})
    node = skeleton["$dict"][0][1]
    assert bytes(tensors[node["$strarray"]].numpy()) == b"firstmiddlelastcommon"
    assert tensors[node["lengths"]].tolist() == [5, 6, 4, 6]
    assert np.array_equal(tensors[node["codes"]].numpy(), codes)  # the used ids keep their order: the same codes
    grid = SensorCodes(np.array([[4, 1, 4], [1, 1, 4]], dtype=np.int32), strings)
    restored = round_trip({"grid": grid})["grid"]
    assert restored.shape == (2, 3)
    assert restored.tolist() == [["unused", "middle", "unused"], ["middle", "middle", "unused"]]


def test_sensor_codes_naming_an_entry_that_is_not_a_string_are_refused() -> None:
    column = SensorCodes(np.array([0, 1], dtype=np.int32), np.array(["s0", 7, "unused"], dtype=object))
    with pytest.raises(TypeError) as refused:
        flatten_state({"ids": column})
    assert str(refused.value) == "sensor codes name {<class 'int'>} entries; they must be str"
