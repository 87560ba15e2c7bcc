"""Giving every rank its own value of the entries that were saved per rank.

A save keeps an entry per rank when its value differed between the ranks
(:mod:`lightning_elastic.core.save.replicated`): the replicated state holds rank 0's value,
every other rank's value is in that rank's rank-local state, and the list of such entries is
saved once, replicated.

Which rank calls what: :func:`restore_per_rank` is called by every rank together, from
:func:`~lightning_elastic.core.load.load.load_checkpoint`, after DCP loaded the replicated
state and this rank's rank-local state. The list of entries is replicated, so every rank
takes the same branch:

* **same world size**: rank 0 keeps what it loaded (its own values); every other rank puts
  its own values in place (and removes an entry it did not hold). One ``all_gather`` carries
  a rank's failure (its values are missing) to every rank.
* **another world size**: the entry's owner decides, through the caller's
  :class:`PerRankRule` s (the longest matching prefix wins): ``"rank0"`` gives every rank
  rank 0's value, ``"fresh"`` removes the owner's whole entry (the rule's prefix) so that it
  starts from its initial state. An entry that no rule covers raises
  :class:`~lightning_elastic.errors.PerRankStateError` on every rank, before anything is put
  in place: never rank 0's value in silence. No collective: the decision is the same
  everywhere.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from lightning_elastic.core.dist.coordinator import Coordinator
from lightning_elastic.core.save.replicated import Path, show_path
from lightning_elastic.errors import (
    CheckpointLoadError,
    ConfigError,
    ManifestError,
    PerRankStateError,
    Phase,
)

__all__ = ["RULE_ACTIONS", "PerRankRule", "restore_per_rank"]

log = logging.getLogger(__name__)
RULE_ACTIONS = ("rank0", "fresh")


@dataclass(frozen=True)
class PerRankRule:
    """What every rank gets, at another world size, for the per-rank entries under
    ``prefix`` (mapping keys from the top of the state).

    Args:
        prefix: the owner's entry, e.g. ``("callbacks", "MyCallback")``.
        action: ``"rank0"``: every rank takes rank 0's value; ``"fresh"``: the entry at
            ``prefix`` is removed, so its owner starts from its initial state.
        reason: why that is right, and what it costs (logged when the rule is applied).
    """

    prefix: tuple[str | int, ...]
    action: str
    reason: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.prefix, tuple) or not self.prefix:
            raise ConfigError(f"a PerRankRule needs a non-empty tuple prefix, got {self.prefix!r}")
        if self.action not in RULE_ACTIONS:
            raise ConfigError(
                f"PerRankRule action must be one of {RULE_ACTIONS}, got {self.action!r}"
            )

    def covers(self, path: Path) -> bool:
        """Whether ``path`` is the rule's prefix or lies below it."""
        return len(path) >= len(self.prefix) and all(
            str(a) == str(b) for a, b in zip(self.prefix, path, strict=False)
        )


def restore_per_rank(
    state: dict[str, Any],
    paths: Sequence[Path],
    values: Mapping[str, Any] | None,
    coord: Coordinator,
    *,
    saved_world_size: int,
    rules: Sequence[PerRankRule],
    location: str,
) -> None:
    """Put this rank's values of the per-rank ``paths`` into ``state`` (see the module
    docstring); ``values`` are this rank's saved values by index (``None``: none saved)."""
    if not paths:
        return
    if saved_world_size == coord.world_size:

        def own() -> None:
            if coord.rank == 0:
                return  # rank 0's values are the replicated ones it just loaded
            if values is None:
                raise ManifestError(
                    f"rank {coord.rank} of {location} saved no values of its per-rank entries"
                )
            for index, path in enumerate(paths):
                if str(index) in values:
                    _put(state, path, values[str(index)])
                else:
                    _drop(state, path)

        coord.all_gather(Phase.LOAD, own, what=location, error=CheckpointLoadError)
        return
    _resolve(state, paths, coord, saved_world_size, rules, location)


def _resolve(
    state: dict[str, Any],
    paths: Sequence[Path],
    coord: Coordinator,
    saved_world_size: int,
    rules: Sequence[PerRankRule],
    location: str,
) -> None:
    applied: dict[PerRankRule, list[Path]] = {}
    uncovered: list[Path] = []
    for path in paths:
        covering = [r for r in rules if r.covers(path)]
        if not covering:
            uncovered.append(path)
            continue
        rule = max(covering, key=lambda r: len(r.prefix))
        applied.setdefault(rule, []).append(path)
    if uncovered:
        raise PerRankStateError(
            location, [show_path(p) for p in uncovered], saved_world_size, coord.world_size
        )
    for rule, covered in applied.items():
        if rule.action == "fresh":
            _drop(state, rule.prefix)
        if coord.rank == 0:
            what = "every rank takes rank 0's value" if rule.action == "rank0" else "dropped"
            log.warning(
                "%s was saved per rank by %d ranks and is resumed by %d: %s (%s). %s",
                ", ".join(show_path(p) for p in covered),
                saved_world_size,
                coord.world_size,
                what,
                show_path(rule.prefix),
                rule.reason,
            )


def _parent(state: Any, path: Path) -> tuple[Any, Any] | None:
    """The container holding ``path`` and the key to use in it, or ``None`` if absent."""
    node = state
    for key in path[:-1]:
        found = _key_in(node, key)
        if found is None:
            return None
        node = node[found]
    if isinstance(node, Mapping):
        key = _key_in(node, path[-1])
        return node, path[-1] if key is None else key
    return None


def _key_in(node: Any, key: Any) -> Any:
    """``key`` as ``node`` holds it (DCP may have stringified it), or ``None``."""
    if isinstance(node, list):
        return key if type(key) is int and 0 <= key < len(node) else None
    if not isinstance(node, Mapping):
        return None
    if key in node:
        return key
    return next((k for k in node if str(k) == str(key)), None)


def _put(state: dict[str, Any], path: Path, value: Any) -> None:
    found = _parent(state, path)
    if found is None:
        raise ManifestError(f"the per-rank entry {show_path(path)} has no place in the state")
    parent, key = found
    current = parent.get(key)
    if (
        isinstance(current, torch.Tensor)
        and isinstance(value, torch.Tensor)
        and current.shape == value.shape
        and current.dtype == value.dtype
    ):
        current.copy_(value)  # in place, as DCP loads tensors into a caller's state
    else:
        parent[key] = value


def _drop(state: dict[str, Any], path: Path) -> None:
    found = _parent(state, path)
    if found is not None and found[1] in found[0]:
        del found[0][found[1]]
