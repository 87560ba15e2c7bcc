"""Plans for iterable datasets made of shards: who reads which samples, and what is left.

A dataset is a list of shards (files, objects) with a known number of samples each. An epoch
reads the shards in one global order (seeded by ``seed + epoch``, or as listed), each shard's
samples in their stored order: a sequence of *pieces* ``(shard, start, stop)``.

A *segment* is that sequence from a (re)start to the end of the epoch, dealt over ``world``
ranks in contiguous, near-equal parts (:func:`deal`); within a rank, its batches are split over
its DataLoader workers in contiguous runs (:func:`worker_batches`), so every worker reads its
shards sequentially. A DataLoader takes batches from its workers round-robin, in order, so
after ``k`` batches of a rank every worker has yielded a known prefix of its run
(:func:`consumed_batches`): the position is the loop's batch counter, the same on every rank,
and the state of the whole job can be computed on any rank. :func:`remaining` gives the pieces
no rank has trained yet; a resume deals them over the new world, at any world size.

Every rank gets the same number of batches (collectives stay matched): when the samples do not
divide evenly, the segment is padded by repeating the epoch's first samples, only as many as
needed (as :mod:`~lightning_elastic.core.elastic.data_position` does for map-style data), or,
with ``drop_last``, cut to a multiple of the world size.

:class:`ShardReading` puts these together for one world reading one dataset: the segment of
an epoch, the position after some batches (what a checkpoint stores) and, from a stored
position, the new start of this world. ``ElasticShardedIterable`` (Lightning) is a dataset
around it; nothing here needs Lightning or a DataLoader.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import torch

from lightning_elastic.core.elastic.data_position import DataPosition

__all__ = [
    "Piece",
    "Segment",
    "ShardReading",
    "consumed_batches",
    "deal",
    "epoch_pieces",
    "remaining",
    "take",
    "total",
    "worker_batches",
]

Piece = tuple[int, int, int]  # (shard index, first sample, one past the last sample)


def epoch_pieces(counts: Sequence[int], *, seed: int, epoch: int, shuffle: bool) -> list[Piece]:
    """The epoch's sequence: every shard whole, in a seeded order (or as listed)."""
    order = list(range(len(counts)))
    if shuffle:
        generator = torch.Generator()
        generator.manual_seed(seed + epoch)
        order = torch.randperm(len(counts), generator=generator).tolist()
    return [(s, 0, int(counts[s])) for s in order if counts[s] > 0]


def total(pieces: Sequence[Piece]) -> int:
    """The number of samples in ``pieces``."""
    return sum(stop - start for _, start, stop in pieces)


def take(pieces: Sequence[Piece], start: int, stop: int) -> list[Piece]:
    """Samples ``start`` to ``stop`` of the concatenation of ``pieces``, as pieces."""
    out: list[Piece] = []
    offset = 0
    for shard, first, last in pieces:
        size = last - first
        lo, hi = max(start - offset, 0), min(stop - offset, size)
        if lo < hi:
            out.append((shard, first + lo, first + hi))
        offset += size
        if offset >= stop:
            break
    return out


def _repeat_head(head: Sequence[Piece], count: int) -> list[Piece]:
    """``count`` samples from the start of ``head``, cycling through it when it is short."""
    out: list[Piece] = []
    size = total(head)
    while count > 0 and size > 0:
        part = take(head, 0, min(count, size))
        out += part
        count -= total(part)
    return out


def _batches(samples: int, batch_size: int, drop_last_batch: bool) -> int:
    return samples // batch_size if drop_last_batch else -(-samples // batch_size)


@dataclass(frozen=True)
class Segment:
    """The pieces left of an epoch at a (re)start, and how they are read: by ``world`` ranks,
    ``workers`` DataLoader workers each, ``batch_size`` samples per batch (the last batch of a
    rank may be short unless ``drop_last_batch``); cut to a multiple of ``world`` with
    ``drop_last``, else padded when needed (:func:`deal`)."""

    pieces: tuple[Piece, ...]
    world: int
    workers: int
    batch_size: int
    drop_last_batch: bool = False
    drop_last: bool = False

    def rank_pieces(self, rank: int) -> list[Piece]:
        """The samples ``rank`` reads in this segment, in order."""
        return self._parts[rank]

    def batches(self) -> int:
        """The batches every rank reads in this segment (the same on every rank)."""
        return _batches(total(self._parts[0]), self.batch_size, self.drop_last_batch)

    def worker_pieces(self, rank: int, worker: int, skip: int = 0) -> list[Piece]:
        """The samples ``worker`` of ``rank`` reads (its run of batches, see
        :func:`worker_batches`), after its first ``skip`` batches; without the samples of a
        last short batch the DataLoader drops (``drop_last_batch``)."""
        mine, batches = self._parts[rank], self.batches()
        readable = min(total(mine), batches * self.batch_size)
        first, stop = worker_batches(batches, self.workers)[worker]
        start = min((first + skip) * self.batch_size, readable)
        return take(mine, start, min(stop * self.batch_size, readable))

    @cached_property
    def _parts(self) -> list[list[Piece]]:
        """Every rank's samples (dealt once per segment: asked for every rank and worker)."""
        return deal(
            list(self.pieces),
            self.world,
            self.batch_size,
            self.drop_last_batch,
            drop_last=self.drop_last,
        )


def deal(
    pieces: list[Piece],
    world: int,
    batch_size: int,
    drop_last_batch: bool,
    *,
    head: Sequence[Piece] | None = None,
    drop_last: bool = False,
) -> list[list[Piece]]:
    """``pieces`` split over ``world`` ranks in contiguous parts of ``n // world`` or one more
    samples, so that every rank reads the same number of batches: padded by repeating the
    first samples of ``head`` (default: of ``pieces``) when the parts would give ranks a
    different number of batches, or, with ``drop_last``, cut to a multiple of ``world``."""
    n = total(pieces)
    if drop_last:
        pieces = take(pieces, 0, n - n % world)
        n = total(pieces)
    elif n % world and _batches(n // world, batch_size, drop_last_batch) != _batches(
        n // world + 1, batch_size, drop_last_batch
    ):
        pad = world - n % world
        pieces = pieces + _repeat_head(pieces if head is None else head, pad)
        n += pad
    sizes = [n // world + (1 if r < n % world else 0) for r in range(world)]
    out, start = [], 0
    for size in sizes:
        out.append(take(pieces, start, start + size))
        start += size
    return out


def worker_batches(batches: int, workers: int) -> list[tuple[int, int]]:
    """Each worker's contiguous run of a rank's batches, ``[first, stop)``: the first
    ``batches % workers`` workers one batch more (so a DataLoader's round-robin yields them in
    order: the workers that end first are the last ones)."""
    workers = max(workers, 1)
    out, first = [], 0
    for w in range(workers):
        size = batches // workers + (1 if w < batches % workers else 0)
        out.append((first, first + size))
        first += size
    return out


def consumed_batches(runs: Sequence[tuple[int, int]], done: int) -> list[int]:
    """How many batches of its run each worker had yielded after ``done`` batches of the
    rank, taken round-robin (worker 0, 1, ..., skipping workers whose run has ended)."""
    workers = len(runs)
    return [
        min(stop - first, done // workers + (1 if w < done % workers else 0))
        for w, (first, stop) in enumerate(runs)
    ]


def remaining(segment: Segment, done: int) -> list[Piece]:
    """The pieces of ``segment`` that no rank has read after ``done`` batches of every rank:
    rank by rank, worker by worker, the rest of each worker's run. Samples that a rank
    never reads (a last short batch dropped with ``drop_last_batch``) are not included."""
    runs = worker_batches(segment.batches(), segment.workers)
    used = consumed_batches(runs, done)
    return [
        piece
        for rank in range(segment.world)
        for worker, skip in enumerate(used)
        for piece in segment.worker_pieces(rank, worker, skip)
    ]


@dataclass(frozen=True)
class ShardReading:
    """How one world reads one sharded dataset: the samples of each shard (``counts``), the
    order of the shards (``seed``, ``shuffle``), ``drop_last`` (cut instead of pad), and the
    readers: ``world`` ranks, ``workers`` DataLoader workers each, ``batch_size`` samples per
    batch, ``drop_last_batch`` (the DataLoader's ``drop_last``).

    A position's ``shards`` field holds what a resume needs to find the samples no rank has
    read: the pieces of the segment the epoch (re)started with (``None``: the whole epoch),
    the readers' shape and the loop's counter at that (re)start."""

    counts: tuple[int, ...]
    seed: int
    shuffle: bool
    drop_last: bool
    world: int
    workers: int
    batch_size: int
    drop_last_batch: bool

    def epoch_pieces(self, epoch: int) -> list[Piece]:
        """The whole of ``epoch``, in its order."""
        return epoch_pieces(self.counts, seed=self.seed, epoch=epoch, shuffle=self.shuffle)

    def segment(self, epoch: int, start: DataPosition | None = None) -> Segment:
        """What this world reads of ``epoch``: from ``start`` (the position it (re)started
        at, when it holds pieces), else from the epoch's beginning."""
        shards = None if start is None else start.shards
        if shards is not None and shards.get("pieces") is not None:
            pieces: tuple[Piece, ...] = tuple(tuple(p) for p in shards["pieces"])
        else:
            pieces = tuple(self.epoch_pieces(epoch))
        return Segment(
            pieces, self.world, self.workers, self.batch_size, self.drop_last_batch, self.drop_last
        )

    def position(self, start: DataPosition, epoch: int, batches_done: int) -> DataPosition:
        """The position after ``batches_done`` per-rank batches of ``epoch`` (the loop's
        counter), which (re)started at ``start``."""
        done = max(0, batches_done - start.batches)
        pieces = None if start.shards is None else start.shards.get("pieces")
        return DataPosition(
            epoch=epoch,
            consumed=done * self.batch_size,
            world_size=self.world,
            batches=batches_done,
            padded=False,
            shards={
                "pieces": pieces,
                "workers": self.workers,
                "batch_size": self.batch_size,
                "drop_last_batch": self.drop_last_batch,
                "start_batches": start.batches,
            },
        )

    def resume(self, position: DataPosition) -> DataPosition:
        """A stored mid-epoch ``position`` (with ``shards``, possibly of another world): the
        samples no rank had read, as this world's new start (the loop keeps counting from the
        checkpoint's counter)."""
        shards = position.shards
        assert shards is not None
        pieces = shards.get("pieces")
        saved = Segment(
            tuple(tuple(p) for p in pieces)
            if pieces is not None
            else tuple(self.epoch_pieces(position.epoch)),
            position.world_size,
            int(shards["workers"]),
            int(shards["batch_size"]),
            bool(shards["drop_last_batch"]),
            self.drop_last,
        )
        left = remaining(saved, position.batches - int(shards["start_batches"]))
        return DataPosition(
            epoch=position.epoch,
            consumed=max(1, position.consumed),
            world_size=self.world,
            batches=position.batches,
            padded=False,
            shards={"pieces": [list(p) for p in left]},
        )
