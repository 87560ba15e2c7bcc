"""What one save writes, from what the caller passed: the request, checked
(:func:`checked_request`), and the state (:func:`state_to_save`): ``Stateful`` values as their
``state_dict()``, the entries that differ between ranks kept per rank
(:mod:`~lightning_elastic.core.save.replicated`), and this rank's rank-local state under
``__rank_local__/<rank>``.

Which rank calls what: every rank, on the training thread, at the start of each save;
:func:`state_to_save` is collective (the replica check's all-reduce).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch.distributed.checkpoint.stateful import Stateful

from lightning_elastic.core.dist.coordinator import Coordinator
from lightning_elastic.core.format.manifest import check_json_safe, is_plain_name
from lightning_elastic.core.load.load import RANK_LOCAL_KEY
from lightning_elastic.core.save.replicated import (
    PER_RANK_KEY,
    PER_RANK_VALUES_KEY,
    ReplicationCheck,
    encode_paths,
)
from lightning_elastic.core.save.request import SaveRequest
from lightning_elastic.core.save.walk import StateWalk
from lightning_elastic.errors import ConfigError

__all__ = ["checked_request", "state_to_save"]


def checked_request(
    step: int,
    epoch: int | None,
    metrics: Mapping[str, float] | None,
    metadata: Mapping[str, Any] | None,
    name: str | None,
    overwrite: bool,
    extra: Mapping[str, Any],
) -> SaveRequest:
    """The request, validated (``ConfigError``): ``metadata`` JSON-safe, plus ``extra`` (what
    the engine adds to every manifest's metadata); ``metrics`` as floats."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ConfigError(f"step must be a non-negative integer, got {step!r}")
    if name is not None and not is_plain_name(name.strip("/")):
        raise ConfigError(f"name must be a plain directory name below the root, got {name!r}")
    try:
        check_json_safe(metadata or {}, "metadata")
        clean_metrics = {str(k): float(v) for k, v in (metrics or {}).items()}
        check_json_safe(clean_metrics, "metrics")
    except (TypeError, ValueError) as exc:
        raise ConfigError(str(exc)) from exc
    return SaveRequest(step, epoch, clean_metrics, {**(metadata or {}), **extra}, name, overwrite)


def state_to_save(
    check: ReplicationCheck,
    coord: Coordinator,
    state: Mapping[str, Any],
    rank_state: Mapping[str, Any] | None,
) -> tuple[dict[str, Any], StateWalk | None]:
    """Every rank, together: the state dict this rank saves, and the replica check's walk of
    ``state`` (for the plan phase to reuse; drop it while the collector is paused, see
    ``CheckpointEngine.save``). A reserved key raises ``ConfigError`` before any collective."""
    state_dict = _to_state_dict(state)
    for reserved in (RANK_LOCAL_KEY, PER_RANK_KEY):
        if reserved in state_dict:
            raise ConfigError(f"the state key {reserved!r} is reserved")
    local = None if rank_state is None else _to_state_dict(rank_state)
    if local is not None and PER_RANK_VALUES_KEY in local:
        raise ConfigError(f"the rank_state key {PER_RANK_VALUES_KEY!r} is reserved")
    split = check.split(coord, state_dict)
    state_dict = split.state
    if split.per_rank:
        state_dict[PER_RANK_KEY] = encode_paths(split.per_rank)
    if split.values:
        local = {**(local or {}), PER_RANK_VALUES_KEY: split.values}
    if local is not None:
        state_dict[RANK_LOCAL_KEY] = {str(coord.rank): local}
    return state_dict, split.walk


def _to_state_dict(state: Mapping[str, Any]) -> dict[str, Any]:
    """A shallow copy with every ``Stateful`` value replaced by its ``state_dict()``."""
    return {k: v.state_dict() if isinstance(v, Stateful) else v for k, v in state.items()}
