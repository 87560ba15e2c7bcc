"""The elastic sampler and its injection into training dataloaders.

``ElasticSampler`` yields exactly what ``DistributedSampler`` yields for a fresh epoch and can
resume an epoch at a recorded
:class:`~lightning_elastic.core.elastic.data_position.DataPosition`, at the same or another
world size (see :mod:`lightning_elastic.core.elastic.data_position` for the rules).

The epoch length the loop counts. Lightning reads ``len(dataloader)`` once, when it sets the
training data up, and derives the epoch's batch count (``num_training_batches``), the
``limit_train_batches`` cut-off and the fractional ``val_check_interval`` from it. A resumed
epoch is counted from the loop's own batch counter (batches already done, at the old world
size, plus the batches still to come at the new one), so its length differs from a full epoch
at the new world size. A sampler that follows the trainer (:meth:`~ElasticSampler.follow`)
recounts the loop when the next epoch starts (``set_epoch``): without that, every later epoch
ran the resumed epoch's length (2 -> 1 ranks, 42 samples, batch 4: 8 of 11 batches, 32 of 42
samples, in every later epoch).

``ElasticStrategy`` swaps it in for the sampler Lightning injects into *map-style* training
dataloaders (``DistributedSampler``, ``RandomSampler`` or ``SequentialSampler``). Iterable
datasets and custom samplers are left alone: give them ``state_dict``/``load_state_dict``
(Lightning's stateful-dataloader protocol) to make their position resumable.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import weakref
from collections.abc import Callable, Iterator, Sized
from typing import Any

from torch.utils.data import (
    BatchSampler,
    DataLoader,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    Sampler,
    SequentialSampler,
)

from lightning_elastic.core.elastic.data_position import DataPosition, epoch_order, rank_indices
from lightning_elastic.core.options import check_count, check_seed
from lightning_elastic.errors import ConfigError, WorldSizeError
from lightning_elastic.lightning._compat import (
    limit_train_batches,
    reinstantiate_dataloader,
    train_combined_loader,
    train_loader_mode,
    validates_by_time,
)

__all__ = ["ElasticSampler", "make_elastic", "sync_training_loop"]

log = logging.getLogger(__name__)


class FollowsTheLoop:
    """What an elastic data source (``ElasticSampler``, ``ElasticShardedIterable``) shares: it
    knows the epoch, where the epoch (re)started (``_start``, a
    :class:`~lightning_elastic.core.elastic.data_position.DataPosition`), and keeps the
    trainer's loop counting its epochs. Subclasses set ``num_replicas``, ``batch_size``,
    ``epoch``, ``_start``, ``_resumed`` and ``_trainer`` and define
    :meth:`full_epoch_batches` and :meth:`position`."""

    num_replicas: int
    batch_size: int
    epoch: int
    _start: DataPosition
    _resumed: DataPosition | None
    _trainer: Callable[[], Any] | None

    def full_epoch_batches(self) -> int:
        """The batches of a fresh epoch at this world size (what the loop counts)."""
        raise NotImplementedError

    def position(self, batches_done: int) -> DataPosition:
        """The position after ``batches_done`` per-rank batches of the current epoch."""
        raise NotImplementedError

    def __len__(self) -> int:
        """This rank's samples of the epoch, as the loop counts them."""
        raise NotImplementedError

    def set_epoch(self, epoch: int) -> None:
        """Called by Lightning at every epoch start; a new epoch starts from its beginning,
        and a followed trainer's loop is recounted for it (see :meth:`follow`)."""
        if epoch != self.epoch:
            self.epoch = epoch
            self._start = DataPosition(epoch=epoch, consumed=0, world_size=self.num_replicas)
            self._resumed = None
            trainer = self._followed()
            if trainer is not None:
                sync_training_loop(trainer)

    def resume(self, position: DataPosition) -> None:
        """Continue ``position.epoch`` from ``position``.

        ``position.batches`` is the loop's batch counter in the checkpoint. At an epoch start
        (``consumed == 0``) the loop either starts that epoch at batch 0 (its counter reached
        the epoch length it computes) or keeps counting from ``batches``; the source follows
        the loop, so that both agree on where the epoch ends (:meth:`_settle`).
        """
        self.epoch = position.epoch
        self._resumed = position
        self._start = self._settle(position)

    def follow(self, trainer: Any) -> None:
        """Keep ``trainer``'s training loop counting this source's epochs: at every new
        epoch, Lightning's ``num_training_batches``, the ``limit_train_batches`` cut-off and
        the fractional ``val_check_interval`` are recomputed from the full epoch length.

        Raises:
            ConfigError: a whole number ``val_check_interval`` longer than an epoch at this
                world size (Lightning refuses it for a fresh run; after a resume it would
                silently never validate).
        """
        self._trainer = weakref.ref(trainer)
        if self._resumed is not None:
            self._start = self._settle(self._resumed)
        interval = getattr(trainer, "val_check_interval", 1.0)
        full = limit_train_batches(self.full_epoch_batches(), trainer.limit_train_batches)
        if (
            isinstance(interval, int)
            and getattr(trainer, "check_val_every_n_epoch", None) is not None
            and getattr(trainer, "limit_val_batches", 0) != 0
            and interval > full
        ):
            raise ConfigError(
                f"val_check_interval={interval} is more than the {full} training batches of an "
                f"epoch at world size {self.num_replicas}: validation would never run; use a "
                "smaller interval, a float, or check_val_every_n_epoch=None"
            )

    def _followed(self) -> Any:
        return None if self._trainer is None else self._trainer()

    def _settle(self, position: DataPosition) -> DataPosition:
        """``position`` with ``batches`` as the loop will count them.

        Mid-epoch, the loop continues from the checkpoint's counter. At an epoch start
        reached by a checkpoint on the previous epoch's last batch, Lightning restarts its
        counter only when it reached the epoch length computed from ``len(dataloader)``; a
        smaller world size has longer epochs, and the loop then keeps counting from
        ``batches`` instead, over a full epoch: the source reports that length too.
        """
        if position.consumed > 0 or position.batches <= 0:
            return position
        trainer = self._followed()
        limit = 1.0 if trainer is None else trainer.limit_train_batches
        if position.batches >= limit_train_batches(self.full_epoch_batches(), limit):
            return dataclasses.replace(position, batches=0)
        return position


class ElasticSampler(FollowsTheLoop, Sampler[int]):
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
        drop_last_batch: the dataloader drops an incomplete last batch (``DataLoader``'s
            ``drop_last``), so an epoch has ``len // batch_size`` batches.
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
        drop_last_batch: bool = False,
    ) -> None:
        num_replicas = check_count(num_replicas, "num_replicas")
        rank = check_count(rank, "rank", minimum=0, maximum=num_replicas - 1)
        self.dataset = dataset
        self.num_replicas = num_replicas
        self.rank = rank
        self.shuffle = shuffle
        self.seed = check_seed(seed)
        self.drop_last = drop_last
        self.batch_size = check_count(batch_size, "batch_size")
        self.drop_last_batch = drop_last_batch
        self.epoch = 0
        self._start = DataPosition(epoch=0, consumed=0, world_size=num_replicas)
        self._resumed: DataPosition | None = None  # as given to resume(), before settling
        self._cache: tuple[tuple[int, DataPosition], list[int]] | None = None
        self._trainer: Callable[[], Any] | None = None

    def __len__(self) -> int:
        """Samples of the whole epoch for this rank: those before the resume point (counted
        as whole batches, as the loop counts them) plus those still to come."""
        return self._start.batches * self.batch_size + len(self._indices())

    def __iter__(self) -> Iterator[int]:
        return iter(self._indices())

    def full_epoch_batches(self) -> int:
        """The batches of a fresh epoch at this world size (what the loop counts)."""
        n, w = len(self.dataset), self.num_replicas
        per_rank = n // w if self.drop_last else -(-n // w)
        return (
            per_rank // self.batch_size if self.drop_last_batch else -(-per_rank // self.batch_size)
        )

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
    from lightning_elastic.lightning.streaming import ElasticShardedIterable

    if isinstance(dataloader.dataset, ElasticShardedIterable):
        return _sharded_iterable(
            dataloader, dataloader.dataset, num_replicas, rank, global_batch_size
        )
    sampler = dataloader.sampler
    if isinstance(sampler, ElasticSampler) and global_batch_size is None:
        return dataloader, sampler
    if global_batch_size is not None:
        _check_divisible(global_batch_size, num_replicas)
        if type(dataloader.batch_sampler) is not BatchSampler:
            raise ConfigError("global_batch_size needs a DataLoader built with batch_size=...")
    batch_size = dataloader.batch_size
    if isinstance(dataloader.dataset, IterableDataset):
        _keeps_own_position(dataloader, f"an IterableDataset, {type(dataloader.dataset).__name__}")
        return dataloader, None
    if batch_size is None or type(dataloader.batch_sampler) is not BatchSampler:
        _keeps_own_position(dataloader, "a custom batch sampler")
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
        _keeps_own_position(dataloader, f"its sampler, {type(sampler).__name__}, is not ours")
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
        drop_last_batch=bool(dataloader.drop_last),
    )
    rebuilt = _rebuild(dataloader, elastic, per_rank if per_rank != batch_size else None)
    # Lightning treats loaders with state_dict/load_state_dict as resumable mid-epoch (and
    # otherwise warns that they are not). Ours is: the position travels per checkpoint with
    # the rest of our state, so Lightning's own copy is left empty.
    rebuilt.state_dict = dict
    rebuilt.load_state_dict = lambda state: None
    return rebuilt, elastic


def _sharded_iterable(
    dataloader: DataLoader[Any],
    dataset: Any,
    num_replicas: int,
    rank: int,
    global_batch_size: int | None,
) -> tuple[Any, Any]:
    """A DataLoader over an ``ElasticShardedIterable``: the dataset set up for this rank and
    the loader's batch size and workers, Lightning's ``set_epoch`` routed to it."""
    if dataloader.batch_size is None:
        raise ConfigError("an ElasticShardedIterable needs a DataLoader built with batch_size=...")
    if not getattr(dataloader, "in_order", True):
        raise ConfigError(
            "an ElasticShardedIterable needs DataLoader(in_order=True): its position is the "
            "number of batches trained, taken from the workers in order"
        )
    batch_size = dataloader.batch_size
    if global_batch_size is not None:
        _check_divisible(global_batch_size, num_replicas)
        if global_batch_size // num_replicas != batch_size:
            batch_size = global_batch_size // num_replicas
            dataloader = _rebuild(dataloader, None, batch_size)
    dataset.configure(
        rank=rank,
        num_replicas=num_replicas,
        batch_size=batch_size,
        workers=dataloader.num_workers,
        drop_last_batch=bool(dataloader.drop_last),
    )
    dataloader.batch_sampler.sampler = dataset.epoch_signal()  # type: ignore[union-attr]
    dataloader.state_dict = dict  # the position is ours
    dataloader.load_state_dict = lambda state: None
    return dataloader, dataset


def _check_divisible(global_batch_size: int, num_replicas: int) -> None:
    if global_batch_size % num_replicas:
        raise WorldSizeError(
            f"global_batch_size={global_batch_size} is not divisible by the world size "
            f"{num_replicas}; choose a multiple of every world size you may run with "
            "(e.g. a multiple of 6 for 1, 2 or 3 processes)"
        )


_WARNED: set[str] = set()  # the not-resumable warning, once per process and kind


def _keeps_own_position(dataloader: DataLoader[Any], why: str) -> None:
    """Say whether a dataloader left alone can resume within an epoch: with Lightning's
    stateful-dataloader protocol (``state_dict``/``load_state_dict``, e.g. torchdata's
    ``StatefulDataLoader``) it keeps its own position, per rank; without, it cannot: one
    warning at setup, saying what to implement."""
    if callable(getattr(dataloader, "state_dict", None)) and callable(
        getattr(dataloader, "load_state_dict", None)
    ):
        log.info("%s: %s keeps its own position (state_dict)", why, type(dataloader).__name__)
        return
    if why in _WARNED:
        return
    _WARNED.add(why)
    log.warning(
        "the training dataloader cannot resume within an epoch (%s): after a resume its epoch "
        "starts over from the first batch, so samples are trained twice or, at another world "
        "size, skipped. Give the DataLoader state_dict()/load_state_dict() (e.g. torchdata's "
        "StatefulDataLoader: exact at the same world size), or, for data in shards, use "
        "lightning_elastic.ElasticShardedIterable (exact at any world size). See "
        "docs/streaming.md.",
        why,
    )


def _rebuild(
    dataloader: DataLoader[Any], sampler: ElasticSampler | None, batch_size: int | None
) -> Any:
    """Re-instantiate ``dataloader`` (its own class and arguments) with ``sampler`` (``None``:
    none, for an iterable dataset) and, when given, a new per-rank ``batch_size`` (Lightning's
    sampler-injection machinery)."""
    overrides: dict[str, Any] = {} if batch_size is None else {"batch_size": batch_size}
    try:
        return reinstantiate_dataloader(dataloader, sampler, **overrides)
    except KeyError:
        raise ConfigError("cannot change the batch size of this DataLoader subclass") from None


def sync_training_loop(trainer: Any) -> None:
    """Recount ``trainer``'s training epoch from its dataloaders' lengths now, as Lightning's
    ``FitLoop.setup_data`` counts it when it sets the data up: the per-loader
    ``limit_train_batches`` cut-offs, ``num_training_batches`` and, for a fractional
    ``val_check_interval``, the batch to validate at. The data fetcher reads the cut-offs
    when the epoch's iterator is created, right after ``set_epoch``.

    Lightning has no public way to do this short of reloading the dataloaders (which calls
    the user's ``train_dataloader()`` again); the private parts it reads are in
    :mod:`lightning_elastic.lightning._compat`; it sets ``FitLoop.max_batches``,
    ``CombinedLoader.limits`` and ``Trainer.val_check_batch``.
    """
    from lightning.fabric.utilities.data import sized_len

    loop = trainer.fit_loop
    combined = train_combined_loader(trainer)
    if combined is None:
        return
    lengths: list[int | float] = []
    for loader in combined.flattened:
        length = sized_len(loader)
        lengths.append(math.inf if length is None else length)
    limits = [limit_train_batches(length, trainer.limit_train_batches) for length in lengths]
    combined.limits = limits  # read when the epoch's iterator is created
    # not len(combined): that asks the previous epoch's iterator, with the old limits
    counts = [min(length, limit) for length, limit in zip(lengths, limits, strict=True)]
    mode = train_loader_mode(combined)
    loop.max_batches = (min(counts) if mode == "min_size" else max(counts)) if counts else 0
    if validates_by_time(trainer):
        return  # time-based validation does not count batches
    interval = trainer.val_check_interval
    if not isinstance(interval, int) and loop.max_batches != math.inf:
        trainer.val_check_batch = max(1, int(loop.max_batches * interval))
