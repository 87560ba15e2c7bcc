"""The one load walk (core/load/walk.py) driven by a scripted placement, in one process: its
retry rule, what it hands the placement, and the one place that decides "partly loaded"."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from lightning_elastic.core.dist.coordinator import Coordinator
from lightning_elastic.core.format.catalog import VALID, CheckpointInfo
from lightning_elastic.core.format.integrity import Problem
from lightning_elastic.core.load import walk as walk_module
from lightning_elastic.core.load.load import CorruptWhileLoading
from lightning_elastic.core.load.walk import (
    RETRIES,
    Filters,
    LoadRequest,
    Retry,
    Selected,
    load_walk,
)
from lightning_elastic.core.storage.base import Storage
from lightning_elastic.errors import CheckpointLoadError, CheckpointNotFoundError, IntegrityError


def info(name: str) -> CheckpointInfo:
    return CheckpointInfo(name, f"/ckpts/{name}", VALID)


@dataclass
class Scripted:
    """A placement whose selections are scripted: each ``select`` pops the next answer (a
    checkpoint name means "this one, selected"); it records what the walk hands it."""

    answers: list[Any]
    storage: Storage
    excluded_seen: list[frozenset[str]] = field(default_factory=list)
    dropped: list[tuple[str, str]] = field(default_factory=list)
    loaded_names: list[str] = field(default_factory=list)

    def select(self, request: LoadRequest, excluded: Collection[str]) -> Selected | Retry | None:
        self.excluded_seen.append(frozenset(excluded))
        answer = self.answers.pop(0)
        if isinstance(answer, str):
            return Selected(info(answer), self.storage, fused=True)
        return answer

    def drop(self, info: CheckpointInfo, file: str, reason: str) -> None:
        self.dropped.append((info.name, file))

    def not_found(self, filters: Filters) -> CheckpointNotFoundError:
        return CheckpointNotFoundError("scripted: nothing left")

    def loaded(self, selected: Selected, seconds: float) -> None:
        self.loaded_names.append(selected.info.name)


@pytest.fixture
def loads(monkeypatch) -> dict[str, Any]:
    """Every checkpoint loads (returning its name) unless named here: then the load hands the
    targets the named paths and raises the given error."""
    script: dict[str, Any] = {}

    def load_checkpoint(storage, coord, chosen, state, *, targets=None, **kwargs):
        failure = script.get(chosen.name)
        if failure is None:
            if targets is not None:
                for path in script.get("writes", ()):
                    targets(path, torch.Size([1]), torch.float32)
            return chosen.name
        paths, error = failure
        for path in paths if targets is not None else ():
            targets(path, torch.Size([1]), torch.float32)
        raise error

    monkeypatch.setattr(walk_module, "load_checkpoint", load_checkpoint)
    return script


def corrupt(name: str) -> CorruptWhileLoading:
    return CorruptWhileLoading(name, [Problem("0-rank00000.distcp", "checksum mismatch")])


def walk(placement: Scripted, **request: Any) -> tuple[CheckpointInfo, Any]:
    return load_walk(
        placement, Coordinator.single_process(), LoadRequest(request.pop("state", None), **request)
    )


def test_a_checkpoint_corrupt_while_loading_is_dropped_and_the_next_older_is_loaded(
    tmp_path, loads
) -> None:
    loads["new"] = ((), corrupt("new"))
    placement = Scripted(["new", "old"], Storage(tmp_path))
    loaded, result = walk(placement)
    assert loaded.name == result == "old"
    assert placement.dropped == [("new", "0-rank00000.distcp")]
    assert placement.excluded_seen == [frozenset(), {"new"}]  # never selected again
    assert placement.loaded_names == ["old"]


def test_a_named_corrupt_checkpoint_is_not_walked_past(tmp_path, loads) -> None:
    loads["named"] = ((), corrupt("named"))
    placement = Scripted(["named", "older"], Storage(tmp_path))
    with pytest.raises(CorruptWhileLoading):
        walk(placement, filters=Filters(checkpoint="named"))
    assert placement.dropped == [] and placement.loaded_names == []


def test_retries_of_one_checkpoint_are_bounded_and_the_error_names_it(tmp_path, loads) -> None:
    placement = Scripted([Retry("step_7")] * (RETRIES + 1) + ["never"], Storage(tmp_path))
    with pytest.raises(CheckpointLoadError, match=r"step_7.*gave up after 6 passes") as info:
        walk(placement)
    assert info.value.failed_ranks == [0] and len(placement.excluded_seen) == RETRIES + 1


def test_a_pass_that_excludes_a_checkpoint_starts_the_retry_count_again(tmp_path, loads) -> None:
    answers: list[Any] = [Retry("a")] * RETRIES + [Retry("a", frozenset({"a"}))]
    answers += [Retry("b")] * RETRIES + ["b"]
    placement = Scripted(answers, Storage(tmp_path))
    loaded, _ = walk(placement)
    assert loaded.name == "b"
    assert placement.excluded_seen[-1] == {"a"}  # excluded from every later selection


def test_nothing_left_is_the_placements_not_found_error(tmp_path, loads) -> None:
    with pytest.raises(CheckpointNotFoundError, match="scripted: nothing left"):
        walk(Scripted([Retry("x", frozenset({"x"})), None], Storage(tmp_path)))


def test_partly_loaded_when_no_older_checkpoint_is_left_after_an_in_place_load(
    tmp_path, loads
) -> None:
    loads["new"] = (("w",), corrupt("new"))
    placement = Scripted(["new", None], Storage(tmp_path))
    with pytest.raises(IntegrityError, match=r"no older valid checkpoint is left.*partly"):
        walk(placement, state={"w": torch.zeros(1)})


def test_partly_loaded_when_the_older_checkpoint_lacks_a_target_the_corrupt_one_wrote(
    tmp_path, loads
) -> None:
    loads["new"] = ((("w",), ("extra",)), corrupt("new"))
    loads["writes"] = (("w",),)
    placement = Scripted(["new", "old"], Storage(tmp_path))
    with pytest.raises(IntegrityError, match="old, loaded instead, does not hold extra"):
        walk(placement, targets=lambda path, shape, dtype: torch.zeros(1))
    assert placement.loaded_names == []  # nothing recorded for a load that was refused


def test_partly_loaded_when_the_older_checkpoint_fails_to_load(tmp_path, loads) -> None:
    loads["new"] = ((), corrupt("new"))
    loads["old"] = ((), OSError("disk gone"))
    placement = Scripted(["new", "old"], Storage(tmp_path))
    with pytest.raises(IntegrityError, match=r"instead failed \(OSError: disk gone\).*partly"):
        walk(placement, state={"w": torch.zeros(1)})


def test_a_fresh_state_walks_past_a_corrupt_checkpoint_without_partly_errors(
    tmp_path, loads
) -> None:
    loads["new"] = ((), corrupt("new"))
    placement = Scripted(["new", None], Storage(tmp_path))
    with pytest.raises(CheckpointNotFoundError):  # nothing was loaded in place
        walk(placement)


def test_fusable_only_with_full_verification_untrusted_and_a_strict_or_new_state() -> None:
    state = {"w": torch.zeros(1)}
    assert LoadRequest(None).fusable and LoadRequest(state).fusable
    assert not LoadRequest(None, verify="size").fusable
    assert not LoadRequest(None, trusted=True).fusable
    assert not LoadRequest(state, strict=False).fusable
    assert LoadRequest(None, targets=lambda *a: None).in_place
    assert not LoadRequest(None).in_place


def test_a_load_names_one_checkpoint_or_filters_by_the_named_run_or_skips_named_runs() -> None:
    assert Filters.of("step_3", "run-a", skip_named=True) == Filters("step_3")
    assert Filters.of(None, "run-a", skip_named=True) == Filters(None, "run-a", False)
    assert Filters.of(None, None, skip_named=True) == Filters(None, None, True)
    assert Filters.of(None, None, skip_named=False) == Filters()
