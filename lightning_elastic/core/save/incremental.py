"""Incremental saves: a tensor equal to the one the previous committed save of this engine
wrote (or referred to) is not written again; the new manifest refers to the file and byte
range that holds it (:class:`~lightning_elastic.core.format.manifest.ReferenceRecord`).

Which rank calls what (each rank alone, no collective):

* :meth:`Increments.preselect` - the training thread, at the save point, after planning: the
  evidence that each tensor item may be unchanged since the last save (its storage pointer,
  version counter, dtype, shape and strides; a few microseconds a tensor, no data read);
  a host tensor whose evidence is unchanged is hashed there (xxh3-128, 16 GB/s here: far
  less than the staging copy it saves) and, when its digest is the one of the bytes the last
  save holds, referred to and not staged at all;
* :meth:`Increments.select` - the writer (or inline for a blocking save), before the shard is
  written: the same decision for what was staged (device tensors: hashed from the staged
  bytes), and the digests of a full save's tensors. An item is referred to only when its
  evidence is the same as at the last save *and* its digest equals the digest of the bytes
  the referenced range holds. The evidence only picks the tensors worth hashing (a training
  step bumps the version of every parameter and moment it touches, so a full-training save
  hashes nothing); the digest is the proof, so a change that bypasses version counters
  (``p.data.copy_``, a new tensor at a freed address) is written, not lost;
* :meth:`Increments.committed` / :meth:`Increments.reset` - the writer, once the commit is
  known on this rank: the committed save becomes the base of the next one; a failed save
  forgets everything (the next save is full).

Chains are bounded: every ``full_every_n_saves``-th save is full (it refers to nothing), so a
load reads from at most that many checkpoints. A full save of a chain hashes every tensor it
writes (16 GB/s here, in the writer thread), so its unchanged tensors can be referred to by the
next save. After a load or a restart the first save is full: the evidence lives in memory only.

References point only at files of the last committed save's manifest (its own files or the
ones it refers to): retention never deletes the newest checkpoint of the run nor anything a
kept checkpoint refers to (:mod:`~lightning_elastic.core.policy.retention`), so a reference
chosen here is still there when its save commits; the coordinator checks that every referenced
file is present with its recorded size before it writes the manifest.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import xxhash
from torch.distributed.checkpoint.planner import WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

from lightning_elastic.core.format.dcp_json import ItemLocation
from lightning_elastic.core.save.stage import (
    ALIGNMENT,
    Payload,
    PayloadItem,
    _resolve_tensor,
    _tensor_bytes,
)

__all__ = ["Increments", "Preselected", "Selection", "item_key"]

Key = tuple[str, tuple[int, ...]]
Evidence = tuple[Any, ...]


def item_key(item: WriteItem) -> Key:
    """What identifies a write item from one save to the next: its FQN and chunk offset."""
    return item.index.fqn, tuple(item.index.offset or ())


@dataclass(frozen=True)
class _Held:
    """Where the bytes of one item are committed, with their digest (``None``: not hashed)
    and the evidence seen at the last save."""

    checkpoint: str
    location: ItemLocation
    digest: int | None
    evidence: Evidence | None


@dataclass(frozen=True)
class _File:
    """A committed shard file, as its manifest records it."""

    checkpoint: str
    size: int
    checksum: str
    rank: int | None


@dataclass
class Selection:
    """What one save writes and what it refers to (see :meth:`Increments.select`)."""

    payload: Payload  # the items to write (a subset of the staged ones, re-laid out)
    referenced: list[tuple[WriteItem, _Held]] = field(default_factory=list)
    digests: dict[Key, int] = field(default_factory=dict)  # of the written items hashed
    full: bool = True
    hash_s: float = 0.0

    def results(self) -> list[WriteResult]:
        """DCP's write result of each referenced item: the held location."""
        return [
            WriteResult(
                index=item.index, size_in_bytes=held.location.length, storage_data=held.location
            )
            for item, held in self.referenced
        ]


@dataclass
class Preselected:
    """What the save point decided (:meth:`Increments.preselect`): the evidence of each
    tensor item, whether the save is full, the items referred to already (host tensors
    whose digest was taken then: not staged at all) and the digests taken of the others."""

    evidence: dict[Key, Evidence]
    full: bool
    referenced: list[tuple[WriteItem, _Held]] = field(default_factory=list)
    digests: dict[Key, int] = field(default_factory=dict)


class Increments:
    """One rank's memory of its last committed save, for incremental saves (see the module
    docstring). ``full_every_n_saves``: the longest chain (1: every save is full)."""

    def __init__(self, full_every_n_saves: int) -> None:
        self.full_every_n_saves = full_every_n_saves
        self._held: dict[Key, _Held] = {}
        self._files: dict[str, _File] = {}
        self._since_full = 0  # incremental saves committed since the last full one
        # the items staged last time: (the plan's items, those left out, the rest)
        self._staged: tuple[Sequence[WriteItem], frozenset[Key], list[WriteItem]] | None = None
        self.bytes_referenced = 0  # by the last selection, for reports

    # training thread ------------------------------------------------------------------

    def preselect(
        self, items: Sequence[WriteItem], planner: Any
    ) -> tuple[Preselected, list[WriteItem]]:
        """At the save point: the evidence of every tensor item (no data read), and, unless
        the save is full, the host tensors whose evidence and digest (taken now, 16 GB/s) say
        they are the bytes the last save holds: referred to, and left out of the items to
        stage, which are returned (the same list object while the same items are left out,
        so the staging layout is reused). Device tensors are staged and hashed in the writer
        (:meth:`select`)."""
        full = not self._held or self._since_full + 1 >= self.full_every_n_saves
        pre = Preselected({}, full)
        for item in items:
            if item.type == WriteItemType.BYTE_IO:
                continue
            try:
                tensor = _resolve_tensor(planner, item)
            except Exception:  # cannot be told: written
                continue
            key = item_key(item)
            seen = pre.evidence[key] = _evidence(tensor)
            held = self._held.get(key)
            if full or held is None or held.evidence != seen or tensor.device.type != "cpu":
                continue
            digest = xxhash.xxh3_128_intdigest(_tensor_bytes(tensor))
            if held.digest == digest and held.location.file in self._files:
                pre.referenced.append((item, held))
            else:
                pre.digests[key] = digest
        if not pre.referenced:
            return pre, list(items)
        left_out = frozenset(item_key(i) for i, _ in pre.referenced)
        cached = self._staged
        if cached is None or cached[0] is not items or cached[1] != left_out:
            staged = [i for i in items if item_key(i) not in left_out]
            cached = self._staged = (items, left_out, staged)
        return pre, cached[2]

    # writer thread --------------------------------------------------------------------

    def select(self, payload: Payload, pre: Preselected | None, name: str) -> Selection:
        """The items of ``payload`` to write and those to refer to (with the ones
        :meth:`preselect` referred to). A full save (the first, one after a failure, every
        ``full_every_n_saves``-th) refers to nothing and hashes every tensor it writes, so
        the next save can refer to them."""
        start = time.perf_counter()
        if pre is None or "/" in name:
            return Selection(payload, full=True)
        full = pre.full
        selection = Selection(payload, list(pre.referenced), dict(pre.digests), full=full)
        written: list[PayloadItem] = []
        for placed in payload.items:
            item = placed.write_item
            key = item_key(item)
            seen = pre.evidence.get(key)
            if key in pre.digests:
                # hashed at the save point, but staged since: with a lazy snapshot the copy
                # ran later, and a change behind the counter in between (``.data``) is in
                # the written bytes; the next save compares with the digest of what is
                # written (rare: the evidence matched and the bytes did not)
                selection.digests[key] = xxhash.xxh3_128_intdigest(placed.data)
                written.append(placed)
                continue
            if item.type == WriteItemType.BYTE_IO or seen is None:
                written.append(placed)
                continue
            held = self._held.get(key)
            candidate = held is not None and held.evidence == seen
            if not full and not candidate:  # changed since the last save: write, no hash
                written.append(placed)
                continue
            digest = xxhash.xxh3_128_intdigest(placed.data)
            if (
                not full
                and held is not None
                and held.digest == digest
                and held.location.file in self._files
            ):
                selection.referenced.append((item, held))
                continue
            selection.digests[key] = digest
            written.append(placed)
        if len(written) < len(payload.items):
            selection.payload = _relaid(written)
        self.bytes_referenced = sum(h.location.length for _, h in selection.referenced)
        selection.hash_s = time.perf_counter() - start
        return selection

    def references(self, selection: Selection) -> list[list[Any]]:
        """The files ``selection`` refers to, as JSON for the rank's report:
        ``[path, checkpoint, size, checksum, rank]``."""
        paths = sorted({held.location.file for _, held in selection.referenced})
        out = []
        for p in paths:
            f = self._files[p]
            out.append([p, f.checkpoint, f.size, f.checksum, f.rank])
        return out

    def committed(
        self,
        selection: Selection,
        evidence: dict[Key, Evidence],
        name: str,
        results: Sequence[WriteResult],
        file: tuple[str, int, str, int] | None,
    ) -> None:
        """The save of ``selection`` committed as ``name``: it is the base of the next one.
        ``results``: DCP's results of the written items; ``file``: the shard written
        (path, size, checksum, rank) or ``None``."""
        held: dict[Key, _Held] = {}
        for item, old in selection.referenced:
            key = item_key(item)
            held[key] = _Held(old.checkpoint, old.location, old.digest, evidence.get(key))
        for result in results:
            location = result.storage_data
            if not isinstance(location, ItemLocation):
                continue
            key = result.index.fqn, tuple(result.index.offset or ())
            held[key] = _Held(name, location, selection.digests.get(key), evidence.get(key))
        files: dict[str, _File] = {}
        if file is not None:
            path, size, checksum, rank = file
            files[path] = _File(name, size, checksum, rank)
        for h in held.values():
            if h.location.file not in files and h.location.file in self._files:
                files[h.location.file] = self._files[h.location.file]
        self._held = {k: h for k, h in held.items() if h.location.file in files}
        self._files = files
        self._since_full = 0 if selection.full else self._since_full + 1

    def reset(self) -> None:
        """Forget the base: the next save is full (after a failed save, a load, a new lease)."""
        self._held.clear()
        self._files.clear()
        self._since_full = 0


def _evidence(tensor: torch.Tensor) -> Evidence:
    t = tensor.detach() if isinstance(tensor, torch.Tensor) else tensor
    return (
        t.data_ptr(),
        t._version,
        t.dtype,
        tuple(t.shape),
        tuple(t.stride()),
        str(t.device),
    )


def _relaid(items: Sequence[PayloadItem]) -> Payload:
    """``items`` laid out anew, back to back at aligned offsets (their bytes unchanged)."""
    placed, position = [], 0
    for item in items:
        position = (position + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT
        placed.append(PayloadItem(item.write_item, position, item.length, item.data))
        position += item.length
    return Payload(tuple(placed), position)
