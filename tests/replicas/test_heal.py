"""What a healing replica group does when a peer's live state cannot be had or does not fit,
in one process with torchft's Manager stubbed: a state that does not fit this group (another
number of processes, another data configuration, another model) stops the joiner with that
error, not with "found no quorum"; a payload the safe loader refuses stops it too (every
retry would get the same); a peer that went away is retried at the next quorum, the joiner
taking part in the step's collectives without counting so the others commit."""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytest.importorskip("torchft", reason="replica groups need torchft (the ft extra)")

from torchft.manager import ExceptionWithTraceback

from lightning_elastic.core.replicas.group import (
    ReplicaGroup,
    ReplicaOptions,
    StepView,
)
from lightning_elastic.errors import ConfigError, ReplicaGroupError


class _Manager:
    """torchft's Manager as far as ReplicaGroup uses it; ``heal`` runs at start_quorum."""

    def __init__(self, heal: Any = None, error: Exception | None = None) -> None:
        self.heal = heal
        self.error = error
        self.put: Any = None
        self.allreduced = 0

    def start_quorum(self, allow_heal: bool = True) -> None:
        if self.heal is not None:
            self.put(self.heal)

    def errored(self) -> Any:
        return None if self.error is None else ExceptionWithTraceback(self.error)

    def participating_rank(self) -> int:
        return 1

    def num_participants(self) -> int:
        return 2

    def current_step(self) -> int:
        return 4

    def allreduce(self, tensor: torch.Tensor, reduce_op: Any = None) -> Any:
        self.allreduced += 1
        raise AssertionError("an errored Manager skips its collectives")


class _Work:
    def wait(self) -> bool:
        return True


def _group(manager: _Manager, put_state: Any) -> ReplicaGroup:
    group = ReplicaGroup.__new__(ReplicaGroup)
    group.options = ReplicaOptions(lighthouse="http://127.0.0.1:1", name="g")
    group.name, group.group_rank, group.group_size = "g", 0, 1
    group._intra, group._healed, group.events = None, False, []
    group.last_configure_s, group._last_participants = 0.0, -1
    group._put_state, group._get_state = put_state, dict
    group.transport = type("T", (), {"stats": None})()
    group.manager = manager
    manager.put = group._take
    return group


def _refuse(error: Exception) -> Any:
    def put_state(state: Any) -> None:
        raise error

    return put_state


@pytest.mark.parametrize(
    ("error", "raised", "match"),
    [
        (
            ConfigError("replica groups must have the same number of processes"),
            ConfigError,
            "same number",
        ),
        (ConfigError("configured unlike the running groups'"), ConfigError, "unlike"),
        (RuntimeError("size mismatch for net.weight"), ReplicaGroupError, "could not apply it"),
    ],
)
def test_a_state_that_does_not_fit_stops_the_joiner_with_its_own_error(
    error: Exception, raised: type[Exception], match: str
) -> None:
    group = _group(_Manager(heal={"model": {}}), _refuse(error))
    with pytest.raises(raised, match=match) as caught:
        group.start_step()
    assert "found no quorum" not in str(caught.value)


def test_a_payload_the_safe_loader_refuses_stops_the_joiner() -> None:
    refused = ConfigError("the live state from http://peer holds objects the safe loader refuses")
    group = _group(_Manager(error=refused), _refuse(AssertionError("never applied")))
    with pytest.raises(ConfigError, match="safe loader refuses"):
        group.start_step()


def test_a_failed_heal_takes_part_in_the_step_without_counting(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The others' allreduce gets this group's part (zeros: no samples, no slot, no
    gradient, no agreement), straight on the process group, and this attempt fails."""
    from lightning_elastic.core.replicas import _compat

    manager = _Manager(error=ConnectionError("the peer serving the live state went away"))
    group = _group(manager, _refuse(AssertionError("never applied")))
    group._pg = object()
    sent: list[torch.Tensor] = []

    def allreduce_sum(process_group: Any, tensor: torch.Tensor) -> _Work:
        assert process_group is group._pg
        sent.append(tensor.clone())
        return _Work()

    monkeypatch.setattr(_compat, "allreduce_sum", allreduce_sum)
    view = group.start_step()
    assert view == StepView(4, -1, 2, 1, 0, 1, False)
    grads = [torch.ones(3), torch.ones(2, dtype=torch.float64)]
    reduced = group.reduce(grads, samples=4.0, weight=4.0, view=view, agreement=77)
    assert reduced is None and manager.allreduced == 0
    assert len(sent) == 3 and all(not t.any() for t in sent)
