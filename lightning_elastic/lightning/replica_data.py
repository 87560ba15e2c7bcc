"""The training data of replica groups (``strategy="elastic_ft"``): which samples each process
trains at each step, whoever takes part in it.

The epoch is a queue every group agrees on (:mod:`lightning_elastic.core.replicas.plan`). A
*round* is one micro-batch on every process of every participating group: ``global_batch``
samples from the queue's head, split over the slots (``participants * group_size``). An
optimizer step is one round, or ``accumulate_grad_batches`` rounds (Lightning's window). When
the step commits, the queue moves past the samples of every slot that contributed; a slot
whose group left before the commit gives its samples back to the front of the queue.

The DataLoader keeps its workers and its prefetching: :class:`ReplicaBatchSampler` hands it
the index lists it *predicts* this process will train (the quorum as it was, every step
committing in full) and remembers them. When a batch comes up for training, the strategy asks
:class:`ReplicaData` for the samples this slot really has in that round; a prediction that
turned out wrong (the quorum changed, a step was redone, this group just joined) is replaced
by loading those samples in this process (``dataset[i]`` and the loader's ``collate_fn``).
A slot that has no samples in a round (the last round of an epoch, with more slots than
samples) trains the round's first sample with weight 0: it takes part in the step without
counting, so no sample is trained twice.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import json
import logging
import os
import threading
from collections.abc import Iterator, Sequence, Sized
from typing import Any, cast

from torch.utils.data import (
    DataLoader,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    Sampler,
    SequentialSampler,
)

from lightning_elastic.core.replicas.group import StepView
from lightning_elastic.core.replicas.plan import (
    EpochQueue,
    QueuePlan,
    commit,
    commit_rounds,
    slot_samples,
    step_samples,
    steps_left,
)
from lightning_elastic.errors import ConfigError
from lightning_elastic.lightning._compat import reinstantiate_dataloader

__all__ = ["ReplicaBatchSampler", "ReplicaData", "Window"]

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Window:
    """One optimizer step's rounds as this process sees them: the quorum, the samples of each
    round (the whole round, all slots), this slot's share of each and the weight of each
    micro-batch (its samples over the nominal share; 0 for a padding sample)."""

    view: StepView
    rounds: tuple[tuple[int, ...], ...]
    mine: tuple[tuple[int, ...], ...]
    factors: tuple[float, ...]
    nominal: float

    @property
    def samples(self) -> int:
        """The samples this process trains in the window (padding not counted)."""
        return sum(len(m) for m, f in zip(self.mine, self.factors, strict=True) if f > 0)


class ReplicaData:
    """The epoch queue of one training dataloader and this process's place in it (every
    method is called from the training thread, :meth:`predict` also from DataLoader's)."""

    def __init__(
        self,
        plan: QueuePlan,
        *,
        batch_size: int,
        global_batch_size: int | None,
        group_rank: int,
        group_size: int,
        dataset: Any,
        collate_fn: Any,
        accumulate: int = 1,
    ) -> None:
        self.plan = plan
        self.batch_size = batch_size
        self.global_batch_size = global_batch_size
        self.accumulate = accumulate
        self.group_rank = group_rank
        self.group_size = group_size
        self.dataset = dataset
        self.collate_fn = collate_fn
        self.queue = EpochQueue()
        self.window: Window | None = None
        self._participants = 1
        self._participant = 0
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ sizes

    def global_batch(self, participants: int) -> int:
        """The samples of one round: ``global_batch_size``, or the per-process batch times the
        processes taking part."""
        if self.global_batch_size is not None:
            return self.global_batch_size
        return self.batch_size * participants * self.group_size

    def rounds_left(self) -> int:
        """The rounds the epoch still takes at the current quorum if each commits in full."""
        return steps_left(self.plan, self.queue, self.global_batch(self._participants))

    # ------------------------------------------------------------------ the step

    def start_epoch(self, epoch: int) -> None:
        """The loop is in ``epoch``: a queue of an earlier epoch is finished (or was cut short
        by ``limit_train_batches``), so the new epoch starts from its beginning."""
        if epoch > self.queue.epoch:
            self.queue = EpochQueue(epoch=epoch)

    def begin_window(self, view: StepView, length: int) -> Window:
        """The rounds of an optimizer step of ``length`` micro-batches under ``view``."""
        participants = max(1, view.participants)
        slots = participants * self.group_size
        slot = view.slot if view.slot is not None else None
        size = self.global_batch(participants)
        queue = self.queue
        rounds: list[tuple[int, ...]] = []
        mine: list[tuple[int, ...]] = []
        factors: list[float] = []
        nominal = size / slots
        for _ in range(length):
            samples = step_samples(self.plan, queue, size)
            rounds.append(samples)
            share = () if slot is None or not samples else slot_samples(samples, slots, slot)
            if share:
                mine.append(share)
                factors.append(len(share) / nominal)
            else:  # take part without counting
                mine.append((self._padding(queue, samples),))
                factors.append(0.0)
            if samples:
                queue = commit(self.plan, queue, samples, slots, [True] * slots)
        with self._lock:
            self._participants, self._participant = participants, view.participant or 0
        self.window = Window(view, tuple(rounds), tuple(mine), tuple(factors), nominal)
        return self.window

    def commit(self, contributed: Sequence[bool]) -> None:
        """The window's step committed with the slots ``contributed`` says."""
        window = self.window
        assert window is not None, "commit without a window"
        queue = commit_rounds(self.plan, self.queue, window.rounds, len(contributed), contributed)
        with self._lock:
            self.queue = queue
        self.window = None

    def fetch(self, indices: Sequence[int]) -> Any:
        """Load ``indices`` in this process, as the DataLoader would have."""
        return self.collate_fn([self.dataset[i] for i in indices])

    # ------------------------------------------------------------------ live state

    def state(self) -> dict[str, Any]:
        """What a joining group needs (JSON): the queue, and what every group must agree on
        to compute the same steps from it."""
        return {"queue": self.queue.to_json(), "length": self.plan.length, "agree": self._agree()}

    def load_state(self, state: dict[str, Any], *, peer: bool = False) -> None:
        """Take a peer's :meth:`state` (``peer``: a live group's, whose training configuration
        must be this group's; a checkpoint's may have had another batch size)."""
        if int(state.get("length", -1)) != self.plan.length:
            raise ConfigError(
                f"the replica groups train different datasets: {state.get('length')} samples "
                f"in the peer's, {self.plan.length} in this group's; every group must train "
                "the same dataset"
            )
        theirs = state.get("agree")
        if peer and isinstance(theirs, dict) and theirs != (mine := self._agree()):
            differ = ", ".join(
                f"{key}={theirs.get(key)!r} there, {mine.get(key)!r} here"
                for key in sorted(set(mine) | set(theirs))
                if theirs.get(key) != mine.get(key)
            )
            raise ConfigError(
                "this replica group's training data is configured unlike the running groups' "
                f"({differ}); every group must train with the same DataLoader (batch_size, "
                "shuffle, drop_last, seed), global_batch_size and accumulate_grad_batches"
            )
        with self._lock:
            self.queue = EpochQueue.from_json(state["queue"])
        self.window = None

    def _agree(self) -> dict[str, Any]:
        """The settings every group must share to split the queue the same way."""
        plan = self.plan
        return {
            "shuffle": plan.shuffle,
            "seed": plan.seed if plan.shuffle else 0,
            "drop_last": plan.drop_last,
            "global_batch_size": self.global_batch_size,
            # without global_batch_size the DataLoader's batch_size makes the global batch
            "batch_size": self.batch_size if self.global_batch_size is None else None,
            "accumulate_grad_batches": self.accumulate,
            "processes_per_group": self.group_size,
        }

    def agreement(self) -> int:
        """A digest in ``[1, 2**16)`` of what the current window depends on (the settings and
        the queue at its start): equal on every process of every group taking part."""
        window = self.window
        parts = [self._agree(), self.queue.to_json(), self.plan.length]
        parts.append(None if window is None else len(window.rounds))
        digest = hashlib.blake2b(json.dumps(parts, sort_keys=True).encode(), digest_size=8)
        return int.from_bytes(digest.digest(), "big") % (2**16 - 1) + 1

    # ------------------------------------------------------------------ predictions

    def predict(self, ahead: int) -> list[int]:
        """This slot's samples ``ahead`` rounds after the next one to be trained, if the
        quorum stays and every step commits in full (what the DataLoader prefetches)."""
        with self._lock:
            queue, participants, participant = self.queue, self._participants, self._participant
        size = self.global_batch(participants)
        slots = participants * self.group_size
        pending = 0 if self.window is None else len(self.window.rounds)
        remaining = list(queue.orphans[: size * (pending + ahead + 1)])
        order = self.plan.order(queue.epoch)
        need = size * (pending + ahead + 1) - len(remaining)
        remaining.extend(order[queue.taken : queue.taken + max(0, need)])
        samples = remaining[size * (pending + ahead) : size * (pending + ahead + 1)]
        share = slot_samples(samples, slots, participant * self.group_size + self.group_rank)
        return list(share) if share else [self._padding(queue, samples)]

    def _padding(self, queue: EpochQueue, samples: Sequence[int]) -> int:
        if samples:
            return int(samples[0])
        return int(self.plan.order(queue.epoch)[0])


class ReplicaBatchSampler(Sampler[list[int]]):
    """Hands the DataLoader the batches :meth:`ReplicaData.predict` expects and remembers them
    (:meth:`take`). Its length is an upper bound of an epoch's rounds: the loop's epoch ends
    when the queue is empty (the strategy sets ``num_training_batches`` as it goes)."""

    def __init__(self, data: ReplicaData, bound: int) -> None:
        self.data = data
        self.bound = bound
        self._handed: collections.deque[list[int]] = collections.deque()

    def __len__(self) -> int:
        return self.bound

    def __iter__(self) -> Iterator[list[int]]:
        self._handed.clear()
        for _ in range(self.bound):
            indices = self.data.predict(len(self._handed))
            self._handed.append(indices)
            yield indices

    def take(self) -> list[int] | None:
        """The indices of the batch the loop is about to train (the oldest handed out)."""
        return self._handed.popleft() if self._handed else None


def make_replica_loader(
    dataloader: Any,
    *,
    global_batch_size: int | None,
    group_rank: int,
    group_size: int,
    accumulate: int,
) -> tuple[Any, ReplicaData, ReplicaBatchSampler]:
    """A training DataLoader rebuilt with a :class:`ReplicaBatchSampler`."""
    if not isinstance(dataloader, DataLoader) or isinstance(dataloader.dataset, IterableDataset):
        raise ConfigError(
            "strategy='elastic_ft' needs a map-style training dataset (with __len__ and "
            f"__getitem__) in a DataLoader, got {type(dataloader).__name__} over "
            f"{type(getattr(dataloader, 'dataset', None)).__name__}: the samples of each step "
            "are chosen by index, whichever groups take part"
        )
    sampler = dataloader.sampler
    if isinstance(sampler, DistributedSampler):
        shuffle, seed, drop_last = bool(sampler.shuffle), int(sampler.seed), sampler.drop_last
    elif isinstance(sampler, RandomSampler):
        shuffle, seed, drop_last = True, int(os.environ.get("PL_GLOBAL_SEED", 0)), False
    elif isinstance(sampler, SequentialSampler):
        shuffle, seed, drop_last = False, 0, False
    else:
        raise ConfigError(
            f"strategy='elastic_ft' cannot take the samples of a {type(sampler).__name__}: use "
            "the DataLoader's shuffle=True/False (the strategy chooses the samples of each step)"
        )
    batch_size = dataloader.batch_size
    if batch_size is None:
        raise ConfigError("strategy='elastic_ft' needs a DataLoader built with batch_size=...")
    drop_last = drop_last or bool(dataloader.drop_last)
    plan = QueuePlan(
        len(cast(Sized, dataloader.dataset)), seed=seed, shuffle=shuffle, drop_last=drop_last
    )
    data = ReplicaData(
        plan,
        batch_size=int(batch_size),
        global_batch_size=global_batch_size,
        group_rank=group_rank,
        group_size=group_size,
        dataset=dataloader.dataset,
        collate_fn=dataloader.collate_fn,
        accumulate=max(1, accumulate),
    )
    batch_sampler = ReplicaBatchSampler(data, bound=plan.length * max(1, accumulate))
    rebuilt = reinstantiate_dataloader(
        dataloader,
        None,
        batch_sampler=batch_sampler,
        batch_size=1,
        if_given={"shuffle": None, "drop_last": False},
    )
    return rebuilt, data, batch_sampler
