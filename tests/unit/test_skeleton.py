"""The state-dict skeleton: describe/build round trips with DCP's own leaf paths, JSON
round trips, the union of rank-local skeletons, and subtrees."""

import json

import pytest
import torch
from torch.distributed.checkpoint._nested_dict import flatten_state_dict

from lightning_elastic.core.format.skeleton import build, describe, merge, subtree


def rich_state() -> dict:
    return {
        "model": {"w": torch.ones(2, 2), "b": torch.zeros(2)},
        "optim": {
            "state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.ones(2)}, 1: {}},
            "param_groups": [{"lr": 0.1, "params": [0, 1]}],
        },
        "empty": {},
        "nested_lists": [[torch.ones(1), [torch.zeros(1), "x"]], [1, 2]],
        "tensors": [torch.ones(1), torch.full((2,), 2.0)],
        "plain_list": [1, "a", None],
        "tuple": (torch.ones(1), 2),
        "mixed_keys": {0: "zero", "one": 1, 2: [torch.ones(1)], -3: {}},
        "scalar": 7,
    }


def dcp_leaves(state: dict) -> dict[tuple, object]:
    """DCP's own flattening: leaf path (as DCP addresses it) -> value."""
    flat, mappings = flatten_state_dict(state)
    return {tuple(mappings[name]): value for name, value in flat.items()}


def assert_same(a, b) -> None:
    assert type(a) is type(b), (a, b)
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b)
    elif isinstance(a, dict):
        assert list(a) == list(b)  # same keys, same key types, same order
        for k in a:
            assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert_same(x, y)
    else:
        assert a == b


def test_build_of_describe_rebuilds_the_state_from_dcp_leaf_paths() -> None:
    state = rich_state()
    leaves = dcp_leaves(state)
    visited = []

    def leaf(path):
        visited.append(path)
        return leaves[path]

    rebuilt = build(describe(state), leaf)
    assert_same(rebuilt, state)
    assert sorted(map(str, visited)) == sorted(map(str, leaves))  # exactly DCP's leaves


def test_int_keys_and_empty_dicts_survive_where_dcp_paths_lose_them() -> None:
    state = {"state": {0: {"m": torch.ones(1)}, 1: {}}, "empty": {}}
    leaves = dcp_leaves(state)
    assert set(leaves) == {("state", "0", "m")}  # DCP alone: string keys, empties gone
    rebuilt = build(describe(state), leaves.__getitem__)
    assert list(rebuilt["state"]) == [0, 1] and rebuilt["state"][1] == {}
    assert rebuilt["empty"] == {}


def test_skeleton_encoding_is_exact() -> None:
    skeleton = describe({"a": {1: torch.ones(1)}, "l": [torch.ones(1), [1]], "e": {}, "x": 3})
    assert skeleton == {
        "d": [
            ["a", {"d": [[1, None]]}],
            ["l", {"l": [None, None]}],
            ["e", {"d": []}],
            ["x", None],
        ]
    }


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ([1, 2, "x"], None),  # a list without tensors is one object leaf (DCP's rule)
        ([torch.ones(1), 1], {"l": [None, None]}),
        ([[1], [torch.ones(1)]], {"l": [None, {"l": [None]}]}),
        ([{}], {"l": [{"d": []}]}),
        ([], None),
        ((torch.ones(1),), None),  # tuples are leaves
        (torch.ones(3), None),
        ({}, {"d": []}),
    ],
)
def test_describe_follows_dcps_traversal_rules(value, expected) -> None:
    assert describe(value) == expected


def test_keys_that_are_neither_str_nor_int_are_stringified() -> None:
    skeleton = describe({1.5: 1, True: 2, ("t", 1): 3, "s": 4, 7: 5})
    assert [k for k, _ in skeleton["d"]] == ["1.5", "True", "('t', 1)", "s", 7]


def test_skeleton_survives_json_with_int_and_str_keys_apart() -> None:
    skeleton = describe(rich_state())
    back = json.loads(json.dumps(skeleton))
    assert back == skeleton
    keys = [k for k, _ in subtree(back, ("mixed_keys",))["d"]]
    assert keys == [0, "one", 2, -3]
    rebuilt = build(back, lambda path: path)
    assert list(rebuilt["mixed_keys"]) == [0, "one", 2, -3]
    assert rebuilt["mixed_keys"][2] == [("mixed_keys", "2", 0)]  # DCP path: str key, int index


def test_build_hands_leaves_dcp_paths_with_str_keys_and_int_indices() -> None:
    paths = []
    build(describe({"a": [{3: torch.ones(1)}]}), lambda p: paths.append(p))
    assert paths == [("a", 0, "3")]


def test_merge_is_the_union_of_rank_local_subtrees() -> None:
    rank0 = describe({"shared": torch.ones(1), "_rank": {"0": {"rng": torch.ones(1)}}})
    rank1 = describe({"shared": torch.ones(1), "_rank": {"1": {"rng": torch.ones(1), "x": 1}}})
    merged = merge(rank0, rank1)
    assert merged == describe(
        {
            "shared": torch.ones(1),
            "_rank": {"0": {"rng": torch.ones(1)}, "1": {"rng": torch.ones(1), "x": 1}},
        }
    )


def test_merge_keeps_int_and_str_keys_apart() -> None:
    merged = merge(describe({1: torch.ones(1)}), describe({"1": {"a": 1}}))
    assert merged == {"d": [[1, None], ["1", {"d": [["a", None]]}]]}


def test_merge_fills_empty_dicts_and_merges_equal_length_lists() -> None:
    a = describe({"state": {}, "l": [{"x": 1}, torch.ones(1)]})
    b = describe({"state": {0: {"m": 1}}, "l": [{"y": 2}, torch.ones(1)]})
    assert merge(a, b) == describe({"state": {0: {"m": 1}}, "l": [{"x": 1, "y": 2}, torch.ones(1)]})


def test_merge_with_none_or_mismatched_shapes_keeps_what_is_known() -> None:
    a = describe({"x": 1})
    assert merge(None, a) == a and merge(a, None) == a and merge(None, None) is None
    short, long = describe([torch.ones(1)]), describe([torch.ones(1), torch.ones(1)])
    assert merge(short, long) == short  # lists of different lengths: first wins
    assert merge(a, long) == a  # a mapping against a list: first wins


def test_merge_is_idempotent_and_does_not_change_its_inputs() -> None:
    a = describe(rich_state())
    snapshot = json.dumps(a)
    assert merge(a, a) == a
    merge(a, describe({"new": {"k": 1}}))
    assert json.dumps(a) == snapshot


def test_subtree_finds_keys_by_their_string_form() -> None:
    skeleton = describe(rich_state())
    assert subtree(skeleton, ()) == skeleton
    assert subtree(skeleton, ("optim", "state", 0)) == describe(
        {"step": torch.ones(1), "exp_avg": torch.ones(1)}
    )
    assert subtree(skeleton, ("optim", "state", "0")) == subtree(skeleton, ("optim", "state", 0))
    assert subtree(skeleton, ("optim", "state", 1)) == {"d": []}
    assert subtree(skeleton, ("scalar",)) is None


@pytest.mark.parametrize(
    "keys", [("missing",), ("model", "nope"), ("scalar", "below_a_leaf"), ("tensors", 0)]
)
def test_subtree_of_an_absent_key_raises_key_error(keys) -> None:
    with pytest.raises(KeyError):
        subtree(describe(rich_state()), keys)
