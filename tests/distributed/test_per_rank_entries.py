"""Entries of the "replicated" state that differ between ranks: found at save time, kept per
rank, given back to their rank at the same world size, and refused (or left to a rule) at
another one. CheckpointEngine on 2 gloo processes."""

import pytest
import torch

from lightning_elastic.core.load.load import read_full_state
from lightning_elastic.core.storage.base import Storage
from lightning_elastic.errors import PerRankStateError
from lightning_elastic.testing.spawn import run_distributed
from tests.distributed import replica_workers

pytestmark = pytest.mark.timeout(240)

PER_RANK = (
    ("cb", "count"),
    ("cb", "history"),  # a list of plain values is one leaf
    ("loader", 0, "generator"),  # an item of a dict inside a list: the list is kept whole
    ("loader", 0, "n"),
    ("model", "bn"),
)


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[str, list]:
    root = str(tmp_path_factory.mktemp("per_rank") / "ckpts")
    return root, run_distributed(replica_workers.save_twice, 2, root)


def assert_same(got, expected) -> None:
    if isinstance(expected, torch.Tensor):
        assert torch.equal(got, expected)
    elif isinstance(expected, dict):
        assert set(got) == set(expected)
        for key in expected:
            assert_same(got[key], expected[key])
    elif isinstance(expected, list):
        assert len(got) == len(expected)
        for a, b in zip(got, expected, strict=True):
            assert_same(a, b)
    else:
        assert got == expected


def test_differing_entries_are_found_once_and_then_cost_one_all_reduce(saved) -> None:
    _, results = saved
    for r in results:
        assert r["per_rank"] == PER_RANK
        assert r["gathers"] == (1, 0)  # the second save compared with the all-reduce alone


@pytest.mark.parametrize("in_place", [False, True])
def test_every_rank_gets_its_own_values_back_at_the_same_world_size(saved, in_place) -> None:
    root, results = saved
    loaded = run_distributed(replica_workers.load, 2, root, in_place=in_place)
    for rank, got in enumerate(loaded):
        assert got["per_rank"] == PER_RANK and got["same_object"] == in_place
        expected = dict(results[rank]["saved"])
        expected["owned"] = {"p0": torch.zeros(2), "p1": torch.ones(2)}  # the union
        assert_same(got["state"], expected)
        assert got["rank_state"] == {"r": rank}


def test_read_in_one_process_is_rank_0s_view(saved) -> None:
    root, results = saved
    state = read_full_state(Storage(root).child("step_000000002"))
    assert "__per_rank__" not in state and "__rank_local__" not in state
    assert state["cb"]["count"] == results[0]["saved"]["cb"]["count"] == 110
    assert torch.equal(state["model"]["bn"], torch.zeros(4))


@pytest.mark.parametrize("world", [1, 3])
def test_another_world_size_refuses_on_every_rank_what_no_rule_covers(saved, world) -> None:
    root, _ = saved
    results = run_distributed(replica_workers.load, world, root, [(("model",), "rank0")])
    for r in results:
        error = r["error"]
        assert isinstance(error, PerRankStateError)
        assert error.saved_world_size == 2 and error.world_size == world
        assert error.paths == (
            "['cb']['count']",
            "['cb']['history']",
            "['loader'][0]['generator']",
            "['loader'][0]['n']",
        )


def test_rules_decide_at_another_world_size(saved) -> None:
    root, results = saved
    rules = [(("model",), "rank0"), (("cb",), "rank0"), (("loader",), "fresh")]
    loaded = run_distributed(replica_workers.load, 3, root, rules)
    rank0 = results[0]["saved"]
    for got in loaded:
        state = got["state"]
        assert "loader" not in state
        assert state["cb"] == rank0["cb"] and torch.equal(state["model"]["bn"], torch.zeros(4))
