"""The replica check with small tensors compared a batch at a time, and the walk the save
shares between the replica check and the plan: two "ranks" as two threads of one process,
each with its own :class:`ReplicationCheck`, exchanging through an in-memory coordinator."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch

from lightning_elastic.core.format.skeleton import describe
from lightning_elastic.core.save.digest import BATCH_BYTES
from lightning_elastic.core.save.replicated import ReplicationCheck, Split, state_nodes
from lightning_elastic.core.save.statedigest import StateDigest
from lightning_elastic.core.save.walk import walk_state
from lightning_elastic.errors import ConfigError

SMALL = 1024  # float32 elements: 4 KB a tensor
PER_BATCH = BATCH_BYTES // (SMALL * 4)  # tensors in one full batch


class Exchange:
    """What two threads' coordinators share: one slot per rank and a barrier."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.slots: list[Any] = [None] * world
        self.barrier = threading.Barrier(world, timeout=30)
        self.gathers = 0

    def swap(self, rank: int, value: Any) -> list[Any]:
        self.slots[rank] = value
        self.barrier.wait()
        out = list(self.slots)
        self.barrier.wait()
        return out


class ThreadCoordinator:
    """The two collectives the replica check uses, between threads."""

    distributed = True

    def __init__(self, rank: int, exchange: Exchange) -> None:
        self.rank = rank
        self.world_size = exchange.world
        self.is_coordinator = rank == 0
        self.exchange = exchange

    def max_ints(self, values: list[int], phase: Any = None, **_: Any) -> list[int]:
        return [
            max(column) for column in zip(*self.exchange.swap(self.rank, list(values)), strict=True)
        ]

    def all_gather(self, phase: Any, fn: Callable[[], Any], **_: Any) -> list[Any]:
        if self.rank == 0:
            self.exchange.gathers += 1
        return self.exchange.swap(self.rank, fn())


class Ranks:
    """Two ranks, each with its engine-lifetime check; :meth:`split` runs one save."""

    def __init__(self, world: int = 2) -> None:
        self.exchange = Exchange(world)
        self.checks = [ReplicationCheck() for _ in range(world)]

    def split(self, states: list[dict[str, Any]]) -> list[Split]:
        out: list[Any] = [None] * len(states)
        errors: list[BaseException] = []

        def run(rank: int) -> None:
            try:
                coord = ThreadCoordinator(rank, self.exchange)
                out[rank] = self.checks[rank].split(coord, states[rank])  # type: ignore[arg-type]
            except BaseException as exc:  # pragma: no cover - shown by the assert below
                errors.append(exc)

        threads = [threading.Thread(target=run, args=(r,)) for r in range(len(states))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors, errors
        return out


def model(count: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"layer{i}.weight": torch.randn(SMALL, generator=g) for i in range(count)}


def two_states(count: int) -> list[dict[str, Any]]:
    return [{"model": model(count), "step": 3} for _ in range(2)]


# ---------------------------------------------------------------- batches and per-rank entries


@pytest.mark.parametrize("index", [0, PER_BATCH - 1, PER_BATCH, PER_BATCH + 7])
def test_one_differing_tensor_in_a_batch_is_found_and_kept_per_rank_alone(index) -> None:
    """Two batches of small tensors; one tensor differs on rank 1 (either side of the batch
    boundary): its batch's digest differs, and the entries are then compared one by one, so
    exactly that entry - not its batch - is saved per rank."""
    ranks = Ranks()
    states = two_states(PER_BATCH + 8)
    assert len(ranks.checks[0].digest._layouts) == 0
    name = f"layer{index}.weight"
    states[1]["model"][name] = states[1]["model"][name] + 1
    splits = ranks.split(states)
    assert ranks.exchange.gathers == 1
    assert [s.per_rank for s in splits] == [(("model", name),)] * 2
    assert name not in splits[1].state["model"] and torch.equal(
        splits[1].values["0"], states[1]["model"][name]
    )
    layout = ranks.checks[0].digest._layouts["model"]
    assert [len(indices) for indices, _, _ in layout.batches] == [PER_BATCH, 8]

    states[1]["model"]["layer1.weight"].add_(1)  # a second one, later, in the other batch
    splits = ranks.split(states)
    assert ranks.exchange.gathers == 2
    assert {p for s in splits for p in s.per_rank} == {
        ("model", name),
        ("model", "layer1.weight"),
    }


def test_a_per_rank_entry_no_rank_holds_any_more_is_forgotten_without_a_gather() -> None:
    ranks = Ranks()
    states = two_states(10)
    states[1]["model"]["layer4.weight"] = states[1]["model"]["layer4.weight"] + 1
    states[0]["cb"], states[1]["cb"] = {"n": 1}, {"n": 2}
    splits = ranks.split(states)
    assert set(splits[0].per_rank) == {("model", "layer4.weight"), ("cb", "n")}
    for state in states:
        del state["model"]["layer4.weight"]
    splits = ranks.split(states)
    assert [s.per_rank for s in splits] == [(("cb", "n"),)] * 2
    assert ranks.exchange.gathers == 1


def test_equal_states_cost_one_all_reduce_and_stay_batched() -> None:
    ranks = Ranks()
    for step in range(3):
        states = two_states(PER_BATCH + 8)
        for state in states:
            state["model"]["layer5.weight"].fill_(float(step))  # new values, still equal
        splits = ranks.split(states)
        assert [s.per_rank for s in splits] == [(), ()]
    assert ranks.exchange.gathers == 0
    assert all(c.digest.batched for c in ranks.checks)


def test_two_tensors_that_swapped_values_between_batches_are_both_found() -> None:
    ranks = Ranks()
    states = two_states(PER_BATCH + 8)
    rank1 = states[1]["model"]
    rank1["layer0.weight"], rank1[f"layer{PER_BATCH}.weight"] = (
        rank1[f"layer{PER_BATCH}.weight"],
        rank1["layer0.weight"],
    )
    splits = ranks.split(states)
    assert set(splits[0].per_rank) == {
        ("model", "layer0.weight"),
        ("model", f"layer{PER_BATCH}.weight"),
    }


def test_ranks_holding_equal_entries_in_another_order_fall_back_to_entry_sums() -> None:
    """Batches see the order of entries, per-entry sums do not: the full comparison finds
    nothing per rank, every rank stops batching, and later saves cost one all-reduce again."""
    ranks = Ranks()
    states = two_states(50)
    states[1]["model"] = dict(reversed(list(states[1]["model"].items())))
    splits = ranks.split(states)
    assert [s.per_rank for s in splits] == [(), ()]
    assert ranks.exchange.gathers == 1
    assert not any(c.digest.batched for c in ranks.checks)
    ranks.split(states)
    ranks.split(states)
    assert ranks.exchange.gathers == 1


def test_a_tensor_that_changes_shape_on_every_rank_is_not_per_rank() -> None:
    ranks = Ranks()
    states = two_states(20)
    ranks.split(states)
    for state in states:
        state["model"]["layer3.weight"] = torch.ones(4, 8)
    splits = ranks.split(states)
    assert [s.per_rank for s in splits] == [(), ()]
    states[1]["model"]["layer3.weight"] = torch.ones(8, 4)  # same bytes, another shape
    splits = ranks.split(states)
    assert splits[0].per_rank == (("model", "layer3.weight"),)


def test_a_batch_digest_sees_logical_values_not_memory_layout() -> None:
    """A transposed copy, a conjugate view and a negative view with the same values digest
    as the plain tensors do (the per-entry digests agree too)."""
    g = torch.Generator().manual_seed(1)
    base = torch.randn(6, 4, generator=g)
    z = torch.randn(5, dtype=torch.complex64, generator=g)
    plain = {"a": base.clone(), "z": z.conj().resolve_conj(), "n": -base[0].clone()}
    views = {
        "a": base.t().contiguous().t(),
        "z": z.conj(),
        "n": torch._neg_view(base[0].clone()),
    }
    assert not views["a"].is_contiguous() and views["z"].is_conj() and views["n"].is_neg()
    one, other = StateDigest(), StateDigest()
    assert one(walk_state({"s": plain}), frozenset()) == other(
        walk_state({"s": views}), frozenset()
    )
    assert state_nodes({"s": plain}) == state_nodes({"s": views})
    changed = dict(plain, n=plain["n"] + 1)
    assert one(walk_state({"s": changed}), frozenset()) != other(
        walk_state({"s": views}), frozenset()
    )


def test_a_changed_value_changes_the_digest_with_the_layout_reused() -> None:
    digest = StateDigest()
    state = {"model": model(30)}
    first = digest(walk_state(state), frozenset())
    layout = digest._layouts["model"]
    assert digest(walk_state(state), frozenset()) == first
    assert digest._layouts["model"] is layout  # same paths and properties: reused
    state["model"]["layer29.weight"][-1] += 1
    assert digest(walk_state(state), frozenset()) != first
    assert digest._layouts["model"] is layout


def test_skipped_entries_are_left_out_of_the_digest() -> None:
    digest = StateDigest()
    a = {"model": model(5), "cb": {"count": 1}}
    b = {"model": model(5), "cb": {"count": 2}}
    b["model"]["layer2.weight"] = b["model"]["layer2.weight"] * 2
    skip = frozenset({("cb", "count"), ("model", "layer2.weight")})
    assert digest(walk_state(a), skip) == StateDigest()(walk_state(b), skip)
    assert digest(walk_state(a), frozenset()) != StateDigest()(walk_state(b), frozenset())


# ---------------------------------------------------------------- the shared walk


STATES = [
    {"a": {"b": 1, "c": [torch.ones(1), 2]}, "d": [1, 2], "e": [{"f": 3}], "g": {}},
    {0: torch.zeros(2), "opt": {"state": {0: {"m": torch.ones(2)}}, "groups": [{"lr": 0.1}]}},
    {"t": (torch.ones(1), 2), "x": None, "nested": [[torch.ones(1)], []]},
    {"p": torch.nn.Parameter(torch.ones(2)), 3: {"k": "v"}},
]


@pytest.mark.parametrize("state", STATES)
def test_the_walk_gives_the_skeleton_describe_gives(state) -> None:
    assert walk_state(state).skeleton() == describe(state)


@pytest.mark.parametrize("key", [(1, 2), None, 1.5, True])
@pytest.mark.parametrize("leaf", [torch.ones(1), "v"])
def test_the_walk_refuses_keys_that_would_load_back_as_strings(key, leaf) -> None:
    # DCP and the skeleton keep str and int keys only: {(1, 2): x} loaded back as {"(1, 2)": x}
    with pytest.raises(ConfigError, match=r"cannot save the key .* of opt\.state"):
        walk_state({"opt": {"state": {key: leaf}}})


def test_a_branch_is_reused_only_for_the_very_object_walked() -> None:
    inner = {"w": torch.ones(2)}
    first = walk_state({"model": inner, "other": {"n": 1}})
    again = walk_state({"model": inner, "other": {"n": 1}}, reuse=first)
    assert again.branches["model"] is first.branches["model"]
    assert again.branches["other"] is not first.branches["other"]
    assert again.paths() == [("model", "w"), ("other", "n")]


def test_a_walk_is_freed_by_reference_counting_alone() -> None:
    """No reference cycle keeps a walk's lists alive until the collector runs (a recursive
    closure did: 60,000 objects scanned at the end of every save of 20,000 tensors)."""
    import gc
    import sys

    was = gc.isenabled()
    gc.disable()
    try:
        walk = walk_state({"model": {"a": {"b": torch.ones(1)}, "l": [torch.ones(1), 2]}})
        lists = [walk.branches["model"].props, walk.branches["model"].paths]
        del walk
        # held by ``lists`` and by the call's argument, nothing else
        counts = (sys.getrefcount(lists[0]), sys.getrefcount(lists[1]))
        assert counts == (2, 2)
    finally:
        if was:
            gc.enable()
