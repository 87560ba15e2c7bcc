"""Every sample once per epoch while replica groups come and go: the epoch as a queue.

An epoch visits the dataset in one seeded order (:func:`~lightning_elastic.core.elastic.
data_position.epoch_order`, the order ``DistributedSampler`` uses). The state shared by every
group (:class:`EpochQueue`) says how far the epoch has gone: ``taken`` leading samples of the
order were handed to steps, and ``orphans`` are samples a step handed out but did not commit
(their group left before the step committed); they are served first.

A step takes the next samples of the queue (:func:`step_samples`): ``global_batch`` of them, or
fewer at the end of the epoch. They are split over the slots of the step (``participants``
groups times ``group_size`` ranks) in contiguous, near-equal runs (:func:`slot_samples`); slot
``p * group_size + r`` is rank ``r`` of the ``p``-th participating group. When the step
commits, every slot that contributed is committed (:func:`commit`); the samples of a slot that
did not contribute go back to the front of the queue, so a later step trains them. A step that
does not commit at all is simply not recorded: its samples are still the queue's head.

The epoch ends when the queue is empty (or, with ``drop_last``, when less than a global batch
is left); :func:`steps_left` says how many steps that takes if every step commits in full.

Pure functions over frozen values: every group computes the same plan from the same state, and
the state travels as JSON (:meth:`EpochQueue.to_json`) to a joining group and into checkpoints.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence
from typing import Any

from lightning_elastic.core.elastic.data_position import epoch_order
from lightning_elastic.errors import ConfigError

__all__ = [
    "EpochQueue",
    "QueuePlan",
    "commit",
    "commit_rounds",
    "slot_samples",
    "step_samples",
    "steps_left",
]


@dataclasses.dataclass(frozen=True)
class QueuePlan:
    """What every group must agree on to compute the same epochs: the dataset's length, the
    order's seed and shuffling, and whether a short tail is dropped."""

    length: int
    seed: int = 0
    shuffle: bool = True
    drop_last: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.length, bool) or not isinstance(self.length, int) or self.length < 1:
            raise ConfigError(f"the dataset must hold at least one sample, got {self.length!r}")

    def order(self, epoch: int) -> Sequence[int]:
        """The epoch's order of sample indices (cached: every step of an epoch reads it)."""
        return _order(self.length, self.seed, epoch, self.shuffle)


@functools.lru_cache(maxsize=4)
def _order(length: int, seed: int, epoch: int, shuffle: bool) -> tuple[int, ...]:
    return tuple(epoch_order(length, seed=seed, epoch=epoch, shuffle=shuffle))


@dataclasses.dataclass(frozen=True)
class EpochQueue:
    """Where the epoch stands, the same in every group: ``epoch``; ``taken`` leading samples of
    its order handed to steps; ``orphans``, samples handed out but not committed (served
    first); ``steps`` committed and ``samples`` trained so far in the epoch."""

    epoch: int = 0
    taken: int = 0
    orphans: tuple[int, ...] = ()
    steps: int = 0
    samples: int = 0

    def remaining(self, plan: QueuePlan) -> int:
        """Samples of the epoch not trained yet."""
        return len(self.orphans) + max(0, plan.length - self.taken)

    def done(self, plan: QueuePlan, global_batch: int) -> bool:
        """Whether the epoch has nothing left to train (with ``drop_last``: less than a global
        batch left)."""
        left = self.remaining(plan)
        return left == 0 or (plan.drop_last and left < global_batch)

    def next_epoch(self) -> EpochQueue:
        """The start of the following epoch."""
        return EpochQueue(epoch=self.epoch + 1)

    def to_json(self) -> dict[str, Any]:
        """A JSON-safe form (for a joining group and for checkpoints)."""
        return {
            "epoch": self.epoch,
            "taken": self.taken,
            "orphans": list(self.orphans),
            "steps": self.steps,
            "samples": self.samples,
        }

    @classmethod
    def from_json(cls, data: Any) -> EpochQueue:
        """The queue :meth:`to_json` wrote; anything else is refused with a ``ValueError``."""
        if not isinstance(data, dict):
            raise ValueError(f"an epoch queue is a dict, got {type(data).__name__}")
        try:
            fields = {key: int(data[key]) for key in ("epoch", "taken", "steps", "samples")}
            orphans = tuple(int(i) for i in data["orphans"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"not an epoch queue: {data!r}") from exc
        if min(fields.values(), default=0) < 0 or min(orphans, default=0) < 0:
            raise ValueError(f"an epoch queue holds no negative numbers: {data!r}")
        return cls(orphans=orphans, **fields)


def step_samples(plan: QueuePlan, queue: EpochQueue, global_batch: int) -> tuple[int, ...]:
    """The samples of the next step: the queue's head, ``global_batch`` long or shorter at the
    end of the epoch; empty when the epoch is done."""
    _check_positive(global_batch, "global_batch")
    if queue.done(plan, global_batch):
        return ()
    head = queue.orphans[:global_batch]
    fresh = global_batch - len(head)
    order = plan.order(queue.epoch)
    return head + tuple(order[queue.taken : queue.taken + fresh])


def slot_samples(samples: Sequence[int], slots: int, slot: int) -> tuple[int, ...]:
    """Slot ``slot``'s contiguous run of ``samples`` split over ``slots`` (run lengths differ by
    at most one; a slot gets nothing when there are fewer samples than slots)."""
    _check_positive(slots, "slots")
    if not 0 <= slot < slots:
        raise ValueError(f"slot {slot} is not one of {slots}")
    n = len(samples)
    return tuple(samples[slot * n // slots : (slot + 1) * n // slots])


def commit(
    plan: QueuePlan,
    queue: EpochQueue,
    samples: Sequence[int],
    slots: int,
    contributed: Sequence[bool],
) -> EpochQueue:
    """The queue after a step over ``samples`` (split over ``slots``) committed with the slots
    ``contributed`` says; the samples of the others go back to the front of the queue. Past the
    end of the epoch (nothing left) the queue stays at its end: :meth:`EpochQueue.next_epoch`
    starts the next one."""
    if len(contributed) != slots:
        raise ValueError(f"{len(contributed)} contribution flags for {slots} slots")
    from_orphans = min(len(queue.orphans), len(samples))
    fresh = len(samples) - from_orphans
    left_over: list[int] = []
    trained = 0
    for slot in range(slots):
        mine = slot_samples(samples, slots, slot)
        if contributed[slot]:
            trained += len(mine)
        else:
            left_over.extend(mine)
    return EpochQueue(
        epoch=queue.epoch,
        taken=min(plan.length, queue.taken + fresh),
        orphans=tuple(left_over) + queue.orphans[from_orphans:],
        steps=queue.steps + 1,
        samples=queue.samples + trained,
    )


def commit_rounds(
    plan: QueuePlan,
    queue: EpochQueue,
    rounds: Sequence[Sequence[int]],
    slots: int,
    contributed: Sequence[bool],
) -> EpochQueue:
    """The queue after an optimizer step of several ``rounds`` (gradient accumulation)
    committed with the slots ``contributed`` says. The rounds were planned one after the
    other as if each committed in full, so they are consumed that way; the samples of the
    slots that did not contribute, from every round, then go to the front of the queue."""
    if len(contributed) != slots:
        raise ValueError(f"{len(contributed)} contribution flags for {slots} slots")
    left_over: list[int] = []
    for samples in rounds:
        if not samples:
            continue
        queue = commit(plan, queue, samples, slots, [True] * slots)
        for slot in range(slots):
            if not contributed[slot]:
                left_over.extend(slot_samples(samples, slots, slot))
    if not left_over:
        return queue
    return dataclasses.replace(
        queue, orphans=tuple(left_over) + queue.orphans, samples=queue.samples - len(left_over)
    )


def steps_left(plan: QueuePlan, queue: EpochQueue, global_batch: int) -> int:
    """The steps the epoch still takes if every one commits in full."""
    _check_positive(global_batch, "global_batch")
    left = queue.remaining(plan)
    if plan.drop_last:
        return left // global_batch
    return math.ceil(left / global_batch)


def _check_positive(value: int, name: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
