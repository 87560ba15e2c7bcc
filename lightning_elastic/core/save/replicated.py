"""Which entries of the "replicated" state really are the same on every rank; the others are
kept per rank.

DCP writes an entry that several ranks hold under the same path once, as if it were
replicated, and every rank loads that one copy. An entry whose value differs per rank (a
dataloader's position in its own shard, a callback's counter, a generator state, a
BatchNorm statistic under DDP) would come back as another rank's value, silently. So no
entry is assumed to be replicated; each save checks.

Which rank calls what: :meth:`ReplicationCheck.split` is called by every rank of the
checkpoint group together, from the training thread, at the start of every save (before the
plan phase):

1. each rank walks its state once (:mod:`~lightning_elastic.core.save.walk`, the walk the
   plan phase reuses) and digests it (:mod:`~lightning_elastic.core.save.digest`):
   containers by their kind, leaves by value, small host tensors a batch at a time (one
   digest per batch of up to 4 MB of one dtype, in the walk's order) until the ranks are
   seen to hold their entries in different orders, then entry by entry;
2. one all-reduce of a few integers: a failure flag, the largest and the smallest digest of
   the whole state (all-reduced as the max of ``d`` and of ``MASK - d``), and which rank
   still holds each entry already known to be per rank. Entries known to be per rank and
   entries that only this rank holds are left out of the digest. Equal everywhere: done.
3. only when the digests differ: one ``all_gather`` of every rank's per-entry digests
   (computed only now, whatever batch disagreed: the verdict is per entry as before). An
   entry that two or more ranks hold with different digests becomes per rank, and stays so
   for the engine's life (a steady run pays step 2 only); an entry only one rank holds is
   not a conflict (every rank loads the union, which ZeRO-1's sharded optimizer state uses)
   and is left out of step 2 from then on;
4. rank 0 keeps every per-rank entry in its replicated state, so the checkpoint read in one
   process is rank 0's view, as Lightning's own checkpoint file is. Every other rank moves
   its value of each into its rank-local state, under :data:`PER_RANK_VALUES_KEY`, keyed by
   the entry's index in the list of paths saved once, replicated, under :data:`PER_RANK_KEY`.

An entry is a mapping item: a differing element of a list makes the list's own entry per
rank (a list cannot lose an element without renumbering the rest). Loading puts the values
back (:mod:`lightning_elastic.core.load.per_rank`).
"""

from __future__ import annotations

import copy
import json
import logging
from collections.abc import Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.tensor import DTensor

from lightning_elastic.core.save.digest import MASK, tensor_digests, value_digest
from lightning_elastic.core.save.statedigest import StateDigest, container_digest
from lightning_elastic.core.save.walk import StateWalk, walk_state
from lightning_elastic.errors import (
    CheckpointSaveError,
    ConfigError,
    ManifestError,
    Phase,
    UnsupportedFormatError,
)

if TYPE_CHECKING:
    from lightning_elastic.core.dist.coordinator import Coordinator

__all__ = [
    "PER_RANK_KEY",
    "PER_RANK_VALUES_KEY",
    "Path",
    "ReplicationCheck",
    "Split",
    "decode_paths",
    "encode_paths",
    "show_path",
    "state_nodes",
]

log = logging.getLogger(__name__)

PER_RANK_KEY = "__per_rank__"  # replicated: JSON list of the per-rank entries' paths
PER_RANK_VALUES_KEY = "__per_rank_values__"  # in a rank's rank-local state: index -> value
FORMAT_VERSION = 1

Path = tuple[Any, ...]
Node = tuple[int, bool]  # (digest, the entry is an item of a mapping)


def state_nodes(state: Mapping[str, Any]) -> dict[Path, Node]:
    """Every entry of ``state`` by path, following DCP's traversal (mappings, and lists that
    hold tensors or containers): containers with a digest of their kind (and a list's
    length), leaves with a digest of their value. DTensors are left out: they are sharded,
    and DCP never deduplicates them."""
    return {p: (d, m) for p, d, m in _entries(walk_state(state))}


def _entries(walk: StateWalk) -> list[tuple[Path, int, bool]]:
    """:func:`state_nodes` of a walked state, as ``(path, digest, in_mapping)``."""
    out: list[tuple[Path, int, bool]] = []
    tensors: list[tuple[Path, torch.Tensor, bool]] = []
    for branch in walk.branches.values():
        for path, length, in_mapping in branch.containers:
            out.append((path, container_digest(length), in_mapping))
        for path, leaf, in_mapping in zip(
            branch.paths, branch.leaves, branch.in_mapping, strict=True
        ):
            if isinstance(leaf, DTensor):
                continue
            if isinstance(leaf, torch.Tensor):
                tensors.append((path, leaf, in_mapping))
            else:
                out.append((path, value_digest(leaf), in_mapping))
    digests = tensor_digests([t for _, t, _ in tensors])
    out.extend((p, d, m) for (p, _, m), d in zip(tensors, digests, strict=True))
    return out


@dataclass(frozen=True)
class Split:
    """What one rank saves: ``state`` as replicated, and its own values of the per-rank
    entries (``values``, by index into ``per_rank``; empty on rank 0, whose values stay in
    ``state``). ``walk`` is the replica check's walk of the state it was given, for the plan
    phase to reuse (:mod:`~lightning_elastic.core.save.walk`)."""

    state: dict[str, Any]
    per_rank: tuple[Path, ...]
    values: dict[str, Any]
    walk: StateWalk | None = None


class ReplicationCheck:
    """One engine's check of its saves (see the module docstring); it remembers which
    entries are per rank, which ones only this rank holds, and whether the ranks' states
    come in one order (then small tensors are compared a batch at a time: :attr:`digest`)."""

    def __init__(self) -> None:
        self.per_rank: tuple[Path, ...] = ()
        self.digest = StateDigest()
        self._own: set[Path] = set()

    def split(self, coord: Coordinator, state: dict[str, Any]) -> Split:
        """Every rank, together: ``state`` split into what is saved as replicated and this
        rank's values of the entries that differ between ranks. A failure on any rank is
        raised on every rank as :class:`~lightning_elastic.errors.CheckpointSaveError`."""
        if not coord.distributed:
            return Split(state, (), {})
        walk: StateWalk | None = None
        error: Exception | None = None
        try:
            walk = walk_state(state)
            digest = self.digest(walk, frozenset(self.per_rank) | self._own)
        except Exception as exc:  # raised on every rank below
            error, digest = exc, 0
        known = self.per_rank
        held = _held(walk, known)
        failed, high, low, *present = coord.max_ints(
            [int(error is not None), digest, MASK - digest, *held],
            Phase.SAVE_COMPARE,
            error=CheckpointSaveError,
        )
        if failed or high != MASK - low:
            self._compare_all(coord, walk, error)
        else:
            self.per_rank = tuple(p for p, h in zip(known, present, strict=True) if h)
        if coord.rank == 0 or not self.per_rank:
            return Split(state, self.per_rank, {}, walk)
        values: dict[str, Any] = {}
        for index, path in enumerate(self.per_rank):
            found, value, state = _without(state, path)
            if found:
                values[str(index)] = value
        return Split(state, self.per_rank, values, walk)

    def _compare_all(
        self, coord: Coordinator, walk: StateWalk | None, error: Exception | None
    ) -> None:
        def local() -> list[tuple[Path, int, bool]]:
            if error is not None:
                raise error
            assert walk is not None
            return _entries(walk)

        gathered = coord.all_gather(
            Phase.SAVE_COMPARE, local, what="checkpoint (replica check)", error=CheckpointSaveError
        )
        holders: dict[Path, list[Node]] = {}
        for rank_nodes in gathered:
            for path, digest, in_mapping in rank_nodes:
                holders.setdefault(path, []).append((digest, in_mapping))
        differing = [p for p, hs in holders.items() if len(hs) > 1 and len({d for d, _ in hs}) > 1]
        if self.digest.batched and not differing:
            self._unbatch_if_unordered(coord, holders)
        found = [_entry(p, holders) for p in differing]
        per_rank = _outermost([*self.per_rank, *found])
        new = [p for p in per_rank if p not in self.per_rank]
        if new and coord.rank == 0:
            log.info(
                "%d checkpoint entries differ between ranks and are saved per rank: %s",
                len(new),
                ", ".join(show_path(p) for p in new[:10]) + (" ..." if len(new) > 10 else ""),
            )
        self.per_rank = tuple(sorted(per_rank, key=_sort_key))
        mine = gathered[coord.rank]
        self._own = {
            p
            for p, _, _ in mine
            if len(holders[p]) == 1 and (len(p) == 1 or len(holders.get(p[:-1], ())) > 1)
        }

    def _unbatch_if_unordered(self, coord: Coordinator, holders: dict[Path, list[Node]]) -> None:
        """Every rank holds every entry with equal values, yet the digests differed: the ranks
        hold their entries in different orders (or in different layouts), which batches see
        and per-entry sums do not. Count per entry from now on, or every save would pay the
        gather. Decided from the gathered entries alone, so every rank decides alike."""
        if all(len(hs) == coord.world_size for hs in holders.values()):
            self.digest.unbatch()
            if coord.rank == 0:
                log.info("the ranks' states differ in order only: compared entry by entry")


def _held(walk: StateWalk | None, paths: Sequence[Path]) -> list[int]:
    """1 for each of ``paths`` the walked state holds an entry at, else 0."""
    if walk is None:
        return [0] * len(paths)
    present: dict[Any, set[Path]] = {}
    for key in {p[0] for p in paths}:
        branch = walk.branches.get(key)
        if branch is not None:
            present[key] = {*branch.paths, *(c[0] for c in branch.containers)}
    return [1 if p in present.get(p[0], ()) else 0 for p in paths]


def _entry(path: Path, holders: Mapping[Path, list[Node]]) -> Path:
    """The entry to keep per rank for a differing ``path``: the innermost enclosing mapping
    item whose keys on the way are plain (strings or integers, as the JSON list of paths and
    DCP's own addresses hold them)."""
    plain = 0
    while plain < len(path) and _plain(path[plain]):
        plain += 1
    entry = path[:plain]
    while entry and not holders[entry][0][1]:
        entry = entry[:-1]
    if not entry:
        raise ConfigError(
            f"the state entry {show_path(path)} differs between ranks and cannot be saved per "
            "rank (it has no enclosing mapping item with string or integer keys): make it "
            "the same on every rank, or put it in rank_state"
        )
    return entry


def _plain(key: Any) -> bool:
    return type(key) in (str, int)


def _outermost(paths: Sequence[Path]) -> list[Path]:
    """``paths`` without duplicates and without those inside another one."""
    kept: set[Path] = set()
    for path in sorted(set(paths), key=len):
        if not _under(path, kept):
            kept.add(path)
    return list(kept)


def _under(path: Path, prefixes: set[Path]) -> bool:
    return any(path[:i] in prefixes for i in range(1, len(path) + 1))


def _sort_key(path: Path) -> str:
    return json.dumps(list(path))


def _without(node: Any, path: Path) -> tuple[bool, Any, Any]:
    """``(found, value, node without it)``: the containers on the way are copied, never
    changed (the caller's state is left as it was)."""
    key, rest = path[0], path[1:]
    if isinstance(node, Mapping):
        if key not in node:
            return False, None, node
        child = node[key]
        copied: MutableMapping[Any, Any] = (
            copy.copy(node) if isinstance(node, MutableMapping) else dict(node)
        )
        if not rest:
            del copied[key]
            return True, child, copied
        found, value, new_child = _without(child, rest)
        if not found:
            return False, None, node
        copied[key] = new_child
        return True, value, copied
    if isinstance(node, list) and type(key) is int and 0 <= key < len(node) and rest:
        found, value, new_child = _without(node[key], rest)
        if not found:
            return False, None, node
        items = list(node)
        items[key] = new_child
        return True, value, items
    return False, None, node


# ----------------------------------------------------------------------------- format


def encode_paths(paths: Sequence[Path]) -> str:
    """The replicated record of the per-rank entries (versioned JSON)."""
    return json.dumps({"version": FORMAT_VERSION, "paths": [list(p) for p in paths]})


def decode_paths(text: Any) -> tuple[Path, ...]:
    """The paths :func:`encode_paths` wrote; a malformed record raises
    :class:`~lightning_elastic.errors.ManifestError`, a newer one
    :class:`~lightning_elastic.errors.UnsupportedFormatError`."""
    try:
        body = json.loads(text)
        version, raw = body["version"], body["paths"]
    except (TypeError, ValueError, KeyError) as exc:
        raise ManifestError(f"the record of per-rank entries is malformed: {exc}") from exc
    if not isinstance(version, int) or version < 1:
        raise ManifestError(f"the record of per-rank entries has version {version!r}")
    if version > FORMAT_VERSION:
        raise UnsupportedFormatError(
            f"the record of per-rank entries has version {version}, newer than this "
            f"lightning_elastic reads ({FORMAT_VERSION}): upgrade lightning_elastic"
        )
    if not isinstance(raw, list) or not all(
        isinstance(p, list) and p and all(_plain(k) for k in p) for p in raw
    ):
        raise ManifestError("the record of per-rank entries holds a malformed path")
    return tuple(tuple(p) for p in raw)


def show_path(path: Path) -> str:
    """``path`` as the subscripts a user would write: ``['callbacks']['Counter']``."""
    return "".join(f"[{k!r}]" for k in path)
