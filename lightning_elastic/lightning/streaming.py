"""``ElasticShardedIterable``: an iterable dataset over shards (files or objects, read through
fsspec) whose position is resumable mid-epoch at any world size.

The plan (:class:`~lightning_elastic.core.elastic.shards.ShardReading`, no Lightning): an
epoch reads the shards in a seeded order; the part of the epoch left at a (re)start is dealt
over the data-parallel ranks in contiguous, near-equal runs, and a rank's batches over its
DataLoader workers in contiguous runs, so every worker reads whole ranges of shards
sequentially. The position is the loop's
batch counter (DataLoader yields its workers' batches round-robin, in order), so it is the same
on every rank and travels with the checkpoint like the map-style sampler's; a resume at another
world size deals the samples no rank has trained yet over the new ranks. Every sample is
trained exactly once per epoch; ranks get the same number of batches, padded by repeating the
epoch's first samples only when the samples do not divide evenly (or cut, with
``drop_last=True``).

Use it as the dataset of a plain ``DataLoader(dataset, batch_size=..., num_workers=...)``;
our strategies (and ``DistributedCheckpoint`` under ``ddp``) configure it for this rank.
"""

from __future__ import annotations

import itertools
import json
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import IO, Any, Protocol

from torch.utils.data import IterableDataset, Sampler, get_worker_info

from lightning_elastic.core.elastic.data_position import DataPosition
from lightning_elastic.core.elastic.shards import Segment, ShardReading
from lightning_elastic.core.options import check_count, check_seed
from lightning_elastic.errors import ConfigError
from lightning_elastic.lightning.data import FollowsTheLoop

__all__ = ["ElasticShardedIterable", "read_jsonl"]

Reader = Callable[[IO[bytes], int, int], Iterable[Any]]


def read_jsonl(file: IO[bytes], start: int, stop: int) -> Iterator[Any]:
    """A shard reader for JSON Lines: the parsed lines ``start`` to ``stop`` of ``file``."""
    for line in itertools.islice(file, start, stop):
        yield json.loads(line)


class ElasticShardedIterable(FollowsTheLoop, IterableDataset[Any]):
    """Samples read shard by shard, resumable mid-epoch at any world size.

    Args:
        shards: shard locations (local paths or fsspec URLs).
        samples_per_shard: how many samples each shard holds (a shard of 0 is skipped).
        reader: ``reader(file, start, stop)`` yields samples ``start`` to ``stop`` (exclusive)
            of the open binary ``file``; e.g. :func:`read_jsonl`. It must yield exactly
            ``stop - start`` samples.
        shuffle: read the shards in a new seeded order every epoch (the samples within a
            shard keep their order); otherwise as listed.
        seed: the shuffling seed, the same on every rank (default: ``PL_GLOBAL_SEED``, set by
            ``seed_everything``, or 0).
        drop_last: cut the epoch's samples to a multiple of the world size instead of padding.
        storage_options: fsspec options for opening the shards.
    """

    def __init__(
        self,
        shards: Sequence[str],
        samples_per_shard: Sequence[int],
        reader: Reader,
        *,
        shuffle: bool = True,
        seed: int | None = None,
        drop_last: bool = False,
        storage_options: dict[str, Any] | None = None,
    ) -> None:
        if isinstance(shards, str) or len(shards) != len(samples_per_shard):
            raise ConfigError(
                f"shards and samples_per_shard must be sequences of the same length, got "
                f"{len(shards)} shard(s) and {len(samples_per_shard)} count(s)"
            )
        counts = []
        for shard, count in zip(shards, samples_per_shard, strict=True):
            counts.append(check_count(count, f"samples_per_shard of {shard}", minimum=0))
        if not callable(reader):
            raise ConfigError(f"reader must be callable (file, start, stop), got {reader!r}")
        self.shards = [str(s) for s in shards]
        self.counts = counts
        self.reader = reader
        self.shuffle = shuffle
        self.seed = None if seed is None else check_seed(seed)
        self.drop_last = drop_last
        self.storage_options = dict(storage_options or {})
        self.rank = 0
        self.num_replicas = 1
        self.batch_size = 1
        self.workers = 0
        self.drop_last_batch = False
        self.epoch = 0
        self._start = DataPosition(epoch=0, consumed=0, world_size=1)
        self._resumed: DataPosition | None = None
        self._trainer: Callable[[], Any] | None = None
        self._iterated: int | None = None  # the epoch this copy last iterated (a worker's)

    # ------------------------------------------------------------------ set up by us

    def configure(
        self, *, rank: int, num_replicas: int, batch_size: int, workers: int, drop_last_batch: bool
    ) -> None:
        """Read as ``rank`` of ``num_replicas`` data-parallel ranks, by a DataLoader with
        ``batch_size``, ``workers`` worker processes and ``drop_last`` = ``drop_last_batch``."""
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank {rank} is outside [0, {num_replicas})")
        self.rank, self.num_replicas = rank, num_replicas
        self.batch_size, self.workers = max(1, batch_size), max(0, workers)
        self.drop_last_batch = drop_last_batch
        if self.seed is None:
            self.seed = int(os.environ.get("PL_GLOBAL_SEED", 0))
        if self._start.shards is None and self._start.consumed == 0:
            self._start = DataPosition(
                epoch=self.epoch, consumed=0, world_size=num_replicas, batches=self._start.batches
            )

    def epoch_signal(self) -> Sampler[None]:
        """A stand-in for the DataLoader's (ignored) index sampler that passes Lightning's
        ``set_epoch`` on to this dataset (Lightning calls it on samplers, not datasets)."""
        return EpochSignal(self)

    # ------------------------------------------------------------------ the plan

    def _reading(self) -> ShardReading:
        """How this world reads the shards now (see :class:`ShardReading`)."""
        return ShardReading(
            tuple(self.counts),
            self.seed or 0,
            self.shuffle,
            self.drop_last,
            self.num_replicas,
            self.workers,
            self.batch_size,
            self.drop_last_batch,
        )

    def _segment(self, epoch: int | None = None) -> Segment:
        """What this world reads of ``epoch`` (default: the current one, from its start)."""
        resumed = epoch is None or epoch == self.epoch
        chosen = self.epoch if epoch is None else epoch
        return self._reading().segment(chosen, self._start if resumed else None)

    def __len__(self) -> int:
        """Samples of this rank's epoch as the loop counts them (whole batches): those before
        the (re)start plus those still to come."""
        return (self._start.batches + self._segment().batches()) * self.batch_size

    def full_epoch_batches(self) -> int:
        return self._segment(self.epoch + 1).batches()  # a fresh epoch's (any epoch's) count

    def position(self, batches_done: int) -> DataPosition:
        return self._reading().position(self._start, self.epoch, batches_done)

    def _settle(self, position: DataPosition) -> DataPosition:
        """A mid-epoch position: the samples no rank had trained, as a new segment for this
        world (the loop keeps counting from the checkpoint's counter)."""
        if position.shards is None:
            return super()._settle(position)
        return self._reading().resume(position)

    # ------------------------------------------------------------------ reading

    def __getstate__(self) -> dict[str, Any]:
        """Pickled for DataLoader workers: without the followed trainer (a weak reference,
        used in the main process only)."""
        return {**self.__dict__, "_trainer": None}

    def __iter__(self) -> Iterator[Any]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        if workers != max(self.workers, 1):
            raise ConfigError(
                f"ElasticShardedIterable was set up for {max(self.workers, 1)} DataLoader "
                f"worker(s) and is read by {workers}: give the training DataLoader to the "
                "Trainer as it is, so the strategy can set it up"
            )
        epoch = self.epoch
        if self._iterated is not None and self._iterated >= epoch:
            # a persistent worker's copy: set_epoch happened in the main process only
            epoch = self._iterated + 1
        self._iterated = epoch
        for shard, start, end in self._segment(epoch).worker_pieces(self.rank, worker):
            yield from self._read(shard, start, end)

    def _read(self, shard: int, start: int, stop: int) -> Iterator[Any]:
        import fsspec

        url = self.shards[shard]
        count = 0
        with fsspec.open(url, "rb", **self.storage_options) as file:
            for sample in itertools.islice(self.reader(file, start, stop), stop - start + 1):
                count += 1
                if count > stop - start:
                    break
                yield sample
        if count != stop - start:
            raise ValueError(
                f"the reader yielded {'more than ' if count > stop - start else ''}"
                f"{min(count, stop - start)} sample(s) of {url} [{start}:{stop}], expected "
                f"{stop - start}: check samples_per_shard and that the reader honours "
                "start and stop"
            )


class _FollowsEpochs(Protocol):
    def set_epoch(self, epoch: int) -> None: ...


class EpochSignal(Sampler[None]):
    """Yields nothing but ``None`` forever (what a DataLoader's index sampler yields for an
    iterable dataset) and forwards ``set_epoch`` to ``target`` (Lightning calls it on a
    loader's samplers at every epoch start, never on its dataset)."""

    def __init__(self, target: _FollowsEpochs) -> None:
        self.target = target

    def __iter__(self) -> Iterator[None]:
        return itertools.repeat(None)

    def set_epoch(self, epoch: int) -> None:
        """Lightning's epoch start: tell the target."""
        self.target.set_epoch(epoch)
