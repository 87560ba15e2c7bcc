"""The elastic sampler and its injection into training dataloaders.

``ElasticSampler`` yields exactly what ``DistributedSampler`` yields for a fresh epoch and can
resume an epoch at a recorded
:class:`~lightning_elastic.core.elastic.data_position.DataPosition`, at the same or another
world size (see :mod:`lightning_elastic.core.elastic.data_position` for the rules).

``ElasticStrategy`` swaps it in for the sampler Lightning injects into *map-style* training
dataloaders (``DistributedSampler``, ``RandomSampler`` or ``SequentialSampler``). Iterable
datasets and custom samplers are left alone: give them ``state_dict``/``load_state_dict``
(Lightning's stateful-dataloader protocol) to make their position resumable.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator, Sized
from typing import Any

from torch.utils.data import (
    BatchSampler,
    DataLoader,
    DistributedSampler,
    RandomSampler,
    Sampler,
    SequentialSampler,
)

from lightning_elastic.core.elastic.data_position import DataPosition, epoch_order, rank_indices
from lightning_elastic.errors import ConfigError, WorldSizeError
from lightning_elastic.lightning._compat import reinstantiate_dataloader

__all__ = ["ElasticSampler", "make_elastic"]

log = logging.getLogger(__name__)


class ElasticSampler(Sampler[int]):
    """A ``DistributedSampler`` whose position in the epoch can be saved and resumed at any
    world size.

    Args:
        dataset: a sized dataset (only its length is used).
        num_replicas: the world size.
        rank: this rank.
        shuffle: permute the samples with ``seed + epoch`` (as ``DistributedSampler``).
        seed: the shuffling seed; the same on every rank.
        drop_last: drop the tail instead of padding it (as ``DistributedSampler``).
        batch_size: per-rank batch size of the dataloader (to keep step counts equal).
    """

    def __init__(
        self,
        dataset: Sized,
        *,
        num_replicas: int = 1,
        rank: int = 0,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        batch_size: int = 1,
    ) -> None:
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank {rank} is outside [0, {num_replicas})")
        self.dataset = dataset
        self.num_replicas = num_replicas
        self.rank = rank
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.batch_size = max(1, batch_size)
        self.epoch = 0
        self._start = DataPosition(epoch=0, consumed=0, world_size=num_replicas)
        self._cache: tuple[tuple[int, DataPosition], list[int]] | None = None

    def __len__(self) -> int:
        """Samples of the whole epoch for this rank: those before the resume point (counted
        as whole batches, as the loop counts them) plus those still to come."""
        return self._start.batches * self.batch_size + len(self._indices())

    def __iter__(self) -> Iterator[int]:
        return iter(self._indices())

    def set_epoch(self, epoch: int) -> None:
        """Called by Lightning at every epoch start; a new epoch starts from its beginning."""
        if epoch != self.epoch:
            self.epoch = epoch
            self._start = DataPosition(epoch=epoch, consumed=0, world_size=self.num_replicas)

    def resume(self, position: DataPosition) -> None:
        """Continue ``position.epoch`` after ``position.consumed`` samples."""
        self.epoch = position.epoch
        self._start = position

    def position(self, batches_done: int) -> DataPosition:
        """The position after ``batches_done`` per-rank batches of the current epoch (each
        step consumes ``batch_size * num_replicas`` leading positions of the sequence)."""
        start = self._start
        since_resume = max(0, batches_done - start.batches)
        padded = start.continues_padded(self.num_replicas)
        consumed = max(start.consumed, 0) + since_resume * self.batch_size * self.num_replicas
        return DataPosition(
            epoch=self.epoch,
            consumed=min(consumed, self._sequence_length(padded)),
            world_size=self.num_replicas,
            batches=batches_done,
            padded=padded,
        )

    def _sequence_length(self, padded: bool) -> int:
        n, w = len(self.dataset), self.num_replicas
        if not padded:
            return n
        return n - n % w if self.drop_last else n + (-n) % w

    def _indices(self) -> list[int]:
        key = (self.epoch, self._start)
        if self._cache is None or self._cache[0] != key:  # len() is asked often: compute once
            order = epoch_order(
                len(self.dataset), seed=self.seed, epoch=self.epoch, shuffle=self.shuffle
            )
            indices = rank_indices(
                order,
                self._start,
                world=self.num_replicas,
                rank=self.rank,
                batch_size=self.batch_size,
                drop_last=self.drop_last,
            )
            self._cache = (key, indices)
        return self._cache[1]


def make_elastic(
    dataloader: Any, *, num_replicas: int, rank: int, global_batch_size: int | None = None
) -> tuple[Any, ElasticSampler | None]:
    """``dataloader`` rebuilt around an :class:`ElasticSampler`, or unchanged (with ``None``)
    when its sampler cannot be replaced faithfully. With ``global_batch_size`` the per-rank
    batch becomes ``global_batch_size / num_replicas``."""
    if not isinstance(dataloader, DataLoader):
        return dataloader, None
    sampler = dataloader.sampler
    if isinstance(sampler, ElasticSampler) and global_batch_size is None:
        return dataloader, sampler
    if global_batch_size is not None:
        if global_batch_size % num_replicas:
            raise WorldSizeError(
                f"global_batch_size={global_batch_size} is not divisible by the world size "
                f"{num_replicas}; choose a multiple of every world size you may run with "
                "(e.g. a multiple of 6 for 1, 2 or 3 processes)"
            )
        if type(dataloader.batch_sampler) is not BatchSampler:
            raise ConfigError("global_batch_size needs a DataLoader built with batch_size=...")
    batch_size = dataloader.batch_size
    if batch_size is None or type(dataloader.batch_sampler) is not BatchSampler:
        log.warning("custom batch sampler: the position within an epoch is not resumable")
        return dataloader, None
    if type(sampler) is DistributedSampler:
        shuffle, seed, drop_last = sampler.shuffle, sampler.seed, sampler.drop_last
    elif type(sampler) is RandomSampler and sampler.generator is None and not sampler.replacement:
        shuffle, seed, drop_last = True, int(os.environ.get("PL_GLOBAL_SEED", 0)), False
    elif type(sampler) is SequentialSampler:
        shuffle, seed, drop_last = False, 0, False
    elif isinstance(sampler, ElasticSampler):  # user-provided: keep its settings
        shuffle, seed, drop_last = sampler.shuffle, sampler.seed, sampler.drop_last
    else:
        log.warning(
            "%s cannot be replaced: the position within an epoch is not resumable",
            type(sampler).__name__,
        )
        return dataloader, None
    per_rank = batch_size if global_batch_size is None else global_batch_size // num_replicas
    elastic = ElasticSampler(
        dataloader.dataset,  # type: ignore[arg-type]
        num_replicas=num_replicas,
        rank=rank,
        shuffle=shuffle,
        seed=seed,
        drop_last=drop_last,
        batch_size=per_rank,
    )
    rebuilt = _rebuild(dataloader, elastic, per_rank if per_rank != batch_size else None)
    # Lightning treats loaders with state_dict/load_state_dict as resumable mid-epoch (and
    # otherwise warns that they are not). Ours is: the position travels per checkpoint with
    # the rest of our state, so Lightning's own copy is left empty.
    rebuilt.state_dict = dict
    rebuilt.load_state_dict = lambda state: None
    return rebuilt, elastic


def _rebuild(dataloader: DataLoader[Any], sampler: ElasticSampler, batch_size: int | None) -> Any:
    """Re-instantiate ``dataloader`` (its own class and arguments) with ``sampler`` and,
    when given, a new per-rank ``batch_size`` (Lightning's sampler-injection machinery)."""
    overrides = {} if batch_size is None else {"batch_size": batch_size}
    try:
        return reinstantiate_dataloader(dataloader, sampler, **overrides)
    except KeyError:
        raise ConfigError("cannot change the batch size of this DataLoader subclass") from None
