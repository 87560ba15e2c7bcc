"""Digests of state entries (equal across processes for equal values, different when the
values differ), the record of per-rank entries, and what a load does with them at another
world size; all in one process."""

from __future__ import annotations

import dataclasses
import enum
import json
import math
import os
import pickle
import subprocess
import sys
from collections import OrderedDict
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from lightning_elastic.core.dist.coordinator import Coordinator
from lightning_elastic.core.load.per_rank import PerRankRule, restore_per_rank
from lightning_elastic.core.save.digest import FULL_ELEMENTS, tensor_digests, value_digest
from lightning_elastic.core.save.replicated import (
    decode_paths,
    encode_paths,
    show_path,
    state_nodes,
)
from lightning_elastic.errors import (
    ConfigError,
    ManifestError,
    PerRankStateError,
    UnsupportedFormatError,
    WorldSizeError,
)


class Color(enum.Enum):
    RED = 1


@dataclasses.dataclass
class Point:
    x: float
    tags: frozenset


def sample_state() -> dict:
    """A state with every kind of leaf the digest has a rule for; built identically in any
    process (sets of strings iterate in a per-process order)."""
    g = torch.Generator().manual_seed(3)
    return {
        "model": OrderedDict(w=torch.randn(4, 3, generator=g), big=torch.arange(FULL_ELEMENTS + 5)),
        "loops": {"epoch": 2, "progress": {"ready": 7, "done": False}, "lr": 0.1, "nan": math.nan},
        "callbacks": {
            "Tally": {"names": {"alpha", "beta", "gamma", "delta"}, "color": Color.RED},
            "Point": Point(1.5, frozenset({"a", "b", "c"})),
        },
        "np": {"array": np.arange(6).reshape(2, 3), "scalar": np.float32(2.5)},
        "bytes": b"\x00\x01",
        "nested": [{"t": torch.ones(2)}, {"t": torch.zeros(2)}],
        "plain_list": [1, "two", 3.0, None],
        "generator": torch.Generator().manual_seed(11),
        "empty": torch.empty(0),
        "dtype": torch.float16,
    }


def digests_json(state: dict) -> str:
    return json.dumps(sorted((repr(p), d, m) for p, (d, m) in state_nodes(state).items()))


def test_digests_are_equal_in_another_process_with_another_hash_seed() -> None:
    code = (
        "from tests.unit.test_replicated import digests_json, sample_state\n"
        "print(digests_json(sample_state()))\n"
    )
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    outputs = set()
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": root}
        out = subprocess.run(
            [sys.executable, "-c", code],
            env=env,
            cwd=root,
            capture_output=True,
            text=True,
            check=True,
            timeout=120,
        )
        outputs.add(out.stdout.strip())
    assert outputs == {digests_json(sample_state())}


def test_digests_ignore_insertion_order_and_tell_nan_from_nan() -> None:
    assert value_digest({"a": 1, "b": 2}) == value_digest({"b": 2, "a": 1})
    assert value_digest({"x", "y", "z"}) == value_digest({"z", "y", "x"})
    assert value_digest(math.nan) == value_digest(float("nan"))
    assert value_digest(-math.nan) == value_digest(math.nan)


@pytest.mark.parametrize(
    ("a", "b"),
    [
        (1, 1.0),
        (1, True),
        (0.1, math.nextafter(0.1, 1.0)),
        ("a", b"a"),
        ([1, 2], (1, 2)),
        ({1: "x"}, {"1": "x"}),
        ({"a", "b"}, {"a", "c"}),
        (Color.RED, 1),
        (Point(1.0, frozenset()), Point(1.0, frozenset({"a"}))),
        (np.arange(3), np.arange(3).astype(np.float64)),
        (np.arange(6).reshape(2, 3), np.arange(6).reshape(3, 2)),
        (OrderedDict(a=1), {"a": 1}),
    ],
)
def test_digests_differ_when_the_values_differ(a, b) -> None:
    assert value_digest(a) != value_digest(b)


def test_tensor_digests_see_content_shape_and_dtype() -> None:
    small = torch.arange(12.0).reshape(3, 4)
    changed = small.clone()
    changed[2, 3] = 0.5
    big = torch.zeros(FULL_ELEMENTS * 4)
    big_changed = big.clone()
    big_changed[-1] = 1.0  # the last element is always sampled
    digests = tensor_digests(
        [small, changed, small.reshape(4, 3), small.double(), small.t(), big, big_changed]
    )
    assert len(set(digests)) == len(digests)
    # a non-contiguous view is hashed by its logical content, whatever its strides
    big_t = torch.zeros(512, 1024).t()
    assert tensor_digests([big_t])[0] == tensor_digests([big_t.contiguous()])[0]
    assert tensor_digests([small])[0] == tensor_digests([small.clone()])[0]
    assert (
        tensor_digests([torch.tensor([True, False])])[0]
        != tensor_digests([torch.tensor([False, True])])[0]
    )


def test_the_batched_path_for_small_host_tensors_gives_the_per_tensor_digests() -> None:
    """Small plain host tensors are hashed from batches flattened per dtype; the same values
    through the per-tensor path (a non-contiguous view, a tensor subclass) digest alike, in
    any mix of dtypes and across batch boundaries (> 4 MiB)."""
    from lightning_elastic.core.save import digest

    torch.manual_seed(0)
    plain = [
        torch.randn(3, 5),
        torch.tensor([True, False, True]),
        torch.randn(7, dtype=torch.float64),
        torch.randn(4).to(torch.bfloat16),
        torch.arange(6, dtype=torch.int32),
        *[torch.randn(FULL_ELEMENTS) for _ in range(20)],  # 5 MiB of float32: two batches
        torch.randn(2, 3),
    ]
    assert all(digest.plain_small(t) for t in plain)

    class Sub(torch.Tensor):
        pass

    other = [t.t().contiguous().t() if t.dim() == 2 else t.as_subclass(Sub) for t in plain]
    assert not any(digest.plain_small(t) for t in other)
    batched = tensor_digests(plain)
    assert batched == tensor_digests(other)
    assert batched == [tensor_digests([t])[0] for t in plain]
    assert len(set(batched)) == len(batched)


def test_quantized_tensors_differing_only_in_scale_never_look_equal() -> None:
    """Their int_repr is equal; hashing it would restore one rank's value on the other
    (found by review): they are treated as different everywhere instead."""
    import warnings

    with warnings.catch_warnings():  # torch 2.13 deprecates quantized dtypes
        warnings.simplefilter("ignore", UserWarning)
        a = torch.quantize_per_tensor(torch.ones(4), 0.1, 0, torch.qint8)
        b = torch.quantize_per_tensor(torch.ones(4) * 2, 0.2, 0, torch.qint8)
    assert torch.equal(a.int_repr(), b.int_repr())
    assert tensor_digests([a]) != tensor_digests([b])
    assert tensor_digests([a]) != tensor_digests([a])  # unique every time: kept per rank


def test_a_value_that_cannot_be_encoded_is_different_every_time() -> None:
    unpicklable = {"f": lambda: None}
    assert value_digest(unpicklable) != value_digest(unpicklable)  # stored per rank: safe


def test_state_nodes_follow_dcp_traversal_and_mark_mapping_items() -> None:
    nodes = state_nodes(
        {"a": {"b": 1, "c": [torch.ones(1), 2]}, "d": [1, 2], "e": [{"f": 3}], "g": {}}
    )
    assert set(nodes) == {
        ("a",),
        ("a", "b"),
        ("a", "c"),
        ("a", "c", 0),
        ("a", "c", 1),
        ("d",),  # a list of plain values is one leaf, as DCP stores it
        ("e",),
        ("e", 0),
        ("e", 0, "f"),
        ("g",),
    }
    assert nodes[("a", "c")][1] and not nodes[("a", "c", 0)][1] and nodes[("e", 0, "f")][1]


def test_the_record_of_per_rank_entries_round_trips_and_is_validated() -> None:
    paths = (("callbacks", "Tally", "id_sum"), ("loops", "fit_loop", "combined_loader", 0))
    assert decode_paths(encode_paths(paths)) == paths
    assert show_path(paths[1]) == "['loops']['fit_loop']['combined_loader'][0]"
    with pytest.raises(UnsupportedFormatError, match="newer"):
        decode_paths(json.dumps({"version": 99, "paths": []}))
    for bad in ("{", json.dumps({"version": 1}), json.dumps({"version": 1, "paths": [[]]})):
        with pytest.raises(ManifestError):
            decode_paths(bad)
    with pytest.raises(ManifestError, match="malformed path"):
        decode_paths(json.dumps({"version": 1, "paths": [["a", 1.5]]}))


def state_at_two() -> dict:
    """What rank 0 loaded of a checkpoint saved by 2 ranks: its own values everywhere."""
    return {
        "state_dict": {"bn.running_mean": torch.zeros(2)},
        "callbacks": {"Tally": {"id_sum": 5, "rank": 0}, "Timer": {"elapsed": 1.0}},
        "loops": {"fit_loop": {"state_dict": {"combined_loader": [{"n": 3}]}}},
    }


PATHS = (
    ("callbacks", "Tally", "id_sum"),
    ("callbacks", "Tally", "rank"),
    ("callbacks", "Timer", "elapsed"),
    ("loops", "fit_loop", "state_dict", "combined_loader"),
    ("state_dict", "bn.running_mean"),
)
RULES = (
    PerRankRule(("state_dict",), "rank0"),
    PerRankRule(("callbacks", "Timer"), "rank0"),
    PerRankRule(("loops", "fit_loop", "state_dict", "combined_loader"), "fresh", "why"),
)


def test_another_world_size_refuses_per_rank_entries_no_rule_covers() -> None:
    state = state_at_two()
    with pytest.raises(PerRankStateError) as raised:
        restore_per_rank(
            state,
            PATHS,
            None,
            Coordinator.single_process(),
            saved_world_size=2,
            rules=RULES,
            location="ROOT/step_000000010",
        )
    error = raised.value
    assert isinstance(error, WorldSizeError)
    assert error.paths == ("['callbacks']['Tally']['id_sum']", "['callbacks']['Tally']['rank']")
    message = str(error)
    assert "ROOT/step_000000010" in message and "world of 1" in message
    assert "Resume with 2 processes" in message and "PerRankRule" in message
    assert "combined_loader" in state["loops"]["fit_loop"]["state_dict"]
    again = pickle.loads(pickle.dumps(error))
    assert str(again) == message and again.paths == error.paths


def test_rules_give_rank_0s_value_or_drop_the_owners_entry(caplog) -> None:
    state = state_at_two()
    covered = PATHS[2:]
    with caplog.at_level("WARNING", logger="lightning_elastic"):
        restore_per_rank(
            state,
            covered,
            None,
            Coordinator.single_process(),
            saved_world_size=3,
            rules=(*RULES, PerRankRule(("loops",), "rank0")),  # the longer prefix wins
            location="ckpt",
        )
    assert "combined_loader" not in state["loops"]["fit_loop"]["state_dict"]
    assert state["callbacks"]["Timer"] == {"elapsed": 1.0}
    assert state["state_dict"]["bn.running_mean"].tolist() == [0.0, 0.0]
    assert any("dropped" in r.getMessage() and "why" in r.getMessage() for r in caplog.records)


def test_rules_are_validated() -> None:
    with pytest.raises(ConfigError, match="action"):
        PerRankRule(("a",), "average")
    with pytest.raises(ConfigError, match="prefix"):
        PerRankRule((), "rank0")
    assert PerRankRule(("callbacks", 0), "rank0").covers(("callbacks", "0", "x"))
    assert not PerRankRule(("callbacks", "A"), "rank0").covers(("callbacks",))


def test_lightning_rules_cover_its_own_callbacks_and_declared_ones() -> None:
    from lightning.pytorch.callbacks import Callback, Timer

    from lightning_elastic.lightning.per_rank import LOADER_PREFIX, per_rank_rules

    class Declared(Callback):
        per_rank_state_on_resize = "fresh"

    class Silent(Callback):
        pass

    class Wrong(Callback):
        per_rank_state_on_resize = "average"

    timer, declared, silent = Timer(), Declared(), Silent()
    trainer = SimpleNamespace(callbacks=[timer, declared, silent])
    rules = {r.prefix: r.action for r in per_rank_rules(trainer)}  # type: ignore[arg-type]
    assert rules[("callbacks", timer.state_key)] == "rank0"
    assert rules[("callbacks", declared.state_key)] == "fresh"
    assert ("callbacks", silent.state_key) not in rules
    assert rules[LOADER_PREFIX] == "fresh" and rules[("state_dict",)] == "rank0"
    with pytest.raises(ConfigError, match=r"Wrong\.per_rank_state_on_resize"):
        per_rank_rules(SimpleNamespace(callbacks=[Wrong()]))  # type: ignore[arg-type]


def loop_trainer(states: list, ahead: int, epoch: int = 0) -> SimpleNamespace:
    combined = SimpleNamespace(_state_dicts=lambda: states)
    fetcher = SimpleNamespace(batches=[object()] * ahead)
    return SimpleNamespace(
        fit_loop=SimpleNamespace(_combined_loader=combined, _data_fetcher=fetcher),
        current_epoch=epoch,
    )


def checkpoint_with(states: list) -> dict:
    return {"loops": {"fit_loop": {"state_dict": {"combined_loader": states}, "x": 1}}}


def test_a_save_holds_the_loader_states_of_the_last_batch_trained() -> None:
    from lightning_elastic.lightning.loader_states import LoaderStates

    sized = LoaderStates()
    for n in (1, 2, 3):  # at each batch start, a sized loader has yielded that batch
        sized.record(loop_trainer([{"yielded": n}], ahead=0))
    live = checkpoint_with([{"yielded": 4}])  # the next batch was fetched before the save
    saved = sized.apply(live)
    assert saved["loops"]["fit_loop"]["state_dict"]["combined_loader"] == [{"yielded": 3}]
    assert saved["loops"]["fit_loop"]["x"] == 1
    assert live["loops"]["fit_loop"]["state_dict"]["combined_loader"] == [{"yielded": 4}]

    unsized = LoaderStates()  # Lightning's fetcher holds one batch ahead of the loop
    unsized.record(loop_trainer([{"yielded": 2}], ahead=1))
    assert unsized.after_last_batch() is None  # unknown: the live state is kept
    unsized.record(loop_trainer([{"yielded": 3}], ahead=1))
    assert unsized.after_last_batch() == [{"yielded": 2}]
    unsized.record(loop_trainer([{"yielded": 2}], ahead=1, epoch=1))
    assert unsized.after_last_batch() is None  # not across an epoch's start

    stateless = LoaderStates()
    stateless.record(loop_trainer([{}], ahead=0))  # our elastic loaders report {}
    assert stateless.apply(live) is live
