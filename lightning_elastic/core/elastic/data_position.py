"""Plans for resuming at a different world size: the data position.

An epoch visits the samples in one global order (a permutation seeded by ``seed + epoch``,
or ``range`` without shuffling). The position is how many *leading* samples of that order
all ranks together have trained on (``consumed``), and the world size that trained them.

Which samples a rank gets next (:func:`rank_indices`):

* fresh epoch (``consumed == 0``): exactly ``torch.utils.data.DistributedSampler`` (pad the
  order to a multiple of the world size by repeating its head, or truncate with
  ``drop_last``; deal ``order[rank::world]``), so nothing changes for runs that never resume;
* resumed at the same world size: the continuation of that same sequence, sample for sample;
* resumed at another world size: the remaining samples ``order[consumed:]`` dealt round-robin,
  padded only when the ranks would otherwise run a different number of steps (DDP needs
  equal steps), so every sample of the epoch is seen exactly once whenever that is possible.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["DataPosition", "epoch_order", "rank_indices"]


@dataclass(frozen=True)
class DataPosition:
    """Where an epoch stands.

    ``consumed`` leading positions of the epoch's sequence were trained by ``world_size``
    ranks; ``batches`` is the per-rank batch counter at that point (Lightning's loop
    progress). With ``padded`` the sequence is ``DistributedSampler``'s padded order for
    ``world_size`` (no resume at another world size happened this epoch); otherwise it is the
    raw order, whose remaining part is dealt with minimal padding.

    For a sharded iterable dataset (:mod:`~lightning_elastic.core.elastic.shards`),
    ``shards`` describes the segment being read instead: ``pieces`` (the pieces left when it
    started, ``None`` for the whole epoch), ``workers``, ``batch_size``, ``drop_last_batch``
    and ``start_batches`` (the loop's counter when it started); ``consumed`` is then the
    samples each rank has read of it.
    """

    epoch: int
    consumed: int
    world_size: int
    batches: int = 0
    padded: bool = True
    shards: dict[str, Any] | None = None

    def continues_padded(self, world: int) -> bool:
        """Whether a segment starting here at ``world`` ranks follows the padded order."""
        return self.consumed <= 0 or (self.padded and self.world_size == world)


def epoch_order(length: int, *, seed: int, epoch: int, shuffle: bool) -> list[int]:
    """The epoch's global order, identical to ``DistributedSampler``'s."""
    if not shuffle:
        return list(range(length))
    generator = torch.Generator()
    generator.manual_seed(seed + epoch)
    order: list[int] = torch.randperm(length, generator=generator).tolist()
    return order


def rank_indices(
    order: list[int],
    start: DataPosition,
    *,
    world: int,
    rank: int,
    batch_size: int,
    drop_last: bool,
) -> list[int]:
    """The indices ``rank`` of ``world`` trains on from ``start`` to the end of the epoch."""
    if start.continues_padded(world):
        tail = _distributed_sampler_order(order, world, drop_last)[max(start.consumed, 0) :]
        return tail[rank::world]
    remaining = order[start.consumed :]
    if drop_last:
        remaining = remaining[: len(remaining) - len(remaining) % world]
    elif _uneven_steps(len(remaining), world, batch_size):
        pad = (-len(remaining)) % world
        remaining = remaining + _repeat(order, pad)
    return remaining[rank::world]


def _distributed_sampler_order(order: list[int], world: int, drop_last: bool) -> list[int]:
    if drop_last:
        return order[: len(order) - len(order) % world]
    return order + _repeat(order, (-len(order)) % world)


def _repeat(order: list[int], count: int) -> list[int]:
    if not order:
        return []
    out: list[int] = []
    while len(out) < count:
        out += order[: count - len(out)]
    return out


def _uneven_steps(remaining: int, world: int, batch_size: int) -> bool:
    """Would dealing ``remaining`` round-robin give ranks different numbers of batches?"""
    if remaining % world == 0:
        return False
    low, high = remaining // world, remaining // world + 1
    return -(-low // batch_size) != -(-high // batch_size)
