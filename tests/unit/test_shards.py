"""The shard plan of ElasticShardedIterable: dealing, workers, what is left, N -> M."""

from __future__ import annotations

import collections
import itertools
import random

import pytest

from lightning_elastic.core.elastic.shards import (
    Segment,
    consumed_batches,
    deal,
    epoch_pieces,
    remaining,
    take,
    total,
    worker_batches,
)

COUNTS = [7, 0, 13, 5, 9, 1, 11, 4, 8, 6]  # 10 shards of unequal length, one empty: 64 samples


def samples(pieces) -> list[tuple[int, int]]:
    return [(shard, i) for shard, start, stop in pieces for i in range(start, stop)]


def read_by_worker(segment: Segment, rank: int) -> list[list[tuple[int, int]]]:
    """Each worker's samples, batched, in the order a DataLoader yields them."""
    mine = segment.rank_pieces(rank)
    bs, batches = segment.batch_size, segment.batches()
    readable = min(total(mine), batches * bs)
    out = []
    for first, stop in worker_batches(batches, segment.workers):
        flat = samples(take(mine, first * bs, min(stop * bs, readable)))
        out.append([flat[i : i + bs] for i in range(0, len(flat), bs)])
    return out


def round_robin(per_worker: list[list[list]]) -> list[list]:
    """DataLoader's in-order round-robin over workers, skipping exhausted ones."""
    out = []
    for batch_round in itertools.zip_longest(*per_worker):
        out += [b for b in batch_round if b is not None]
    return out


def test_epoch_pieces_are_seeded_and_skip_empty_shards() -> None:
    a = epoch_pieces(COUNTS, seed=3, epoch=1, shuffle=True)
    assert a == epoch_pieces(COUNTS, seed=3, epoch=1, shuffle=True)
    assert a != epoch_pieces(COUNTS, seed=3, epoch=2, shuffle=True)
    assert sorted(a) == [(s, 0, c) for s, c in enumerate(COUNTS) if c]
    assert epoch_pieces(COUNTS, seed=0, epoch=0, shuffle=False)[0] == (0, 0, 7)


@pytest.mark.parametrize("world", [1, 2, 3, 4, 7])
@pytest.mark.parametrize("batch_size", [1, 3, 4])
@pytest.mark.parametrize("drop_last_batch", [False, True])
def test_deal_gives_every_rank_the_same_batches_and_every_sample(
    world, batch_size, drop_last_batch
) -> None:
    pieces = epoch_pieces(COUNTS, seed=0, epoch=0, shuffle=True)
    parts = deal(pieces, world, batch_size, drop_last_batch)
    steps = {
        (total(p) // batch_size if drop_last_batch else -(-total(p) // batch_size)) for p in parts
    }
    assert len(steps) == 1  # no rank runs out of batches while the others wait
    seen = collections.Counter(s for p in parts for s in samples(p))
    assert set(seen) == set(samples(pieces))  # nothing lost
    assert sum(seen.values()) - len(seen) < world  # padding: fewer than one sample per rank


def test_deal_with_drop_last_cuts_instead_of_padding() -> None:
    parts = deal(epoch_pieces(COUNTS, seed=0, epoch=0, shuffle=False), 3, 4, False, drop_last=True)
    assert [total(p) for p in parts] == [21, 21, 21]


def test_round_robin_consumption_is_what_a_dataloader_yields() -> None:
    for batches, workers in itertools.product(range(0, 12), range(1, 5)):
        runs = worker_batches(batches, workers)
        order = round_robin([[(w, i) for i in range(a, b)] for w, (a, b) in enumerate(runs)])
        for done in range(batches + 1):
            counts = collections.Counter(w for w, _ in order[:done])
            assert consumed_batches(runs, done) == [counts[w] for w in range(len(runs))]


@pytest.mark.parametrize("seed", range(40))
def test_changes_mid_epoch_see_every_sample_once(seed) -> None:
    """A chain of random (re)starts through one epoch: worlds, workers and batch sizes
    change; what was trained plus what is left is always the epoch, each sample once
    (padding aside)."""
    rng = random.Random(seed)
    epoch = epoch_pieces(COUNTS, seed=seed, epoch=0, shuffle=True)
    pieces, trained = list(epoch), collections.Counter()
    pads = 0
    while True:
        segment = Segment(
            tuple(pieces),
            world=rng.choice([1, 2, 3, 4]),
            workers=rng.choice([0, 1, 2, 3]),
            batch_size=rng.choice([1, 2, 4]),
        )
        pads += sum(map(total, (segment.rank_pieces(r) for r in range(segment.world)))) - total(
            pieces
        )
        per_rank = [round_robin(read_by_worker(segment, r)) for r in range(segment.world)]
        assert len({len(b) for b in per_rank}) == 1 and len(per_rank[0]) == segment.batches()
        done = rng.randint(0, segment.batches())
        last = done == segment.batches() or rng.random() < 0.2
        if last:
            done = segment.batches()
        for batches in per_rank:
            trained.update(s for batch in batches[:done] for s in batch)
        pieces = remaining(segment, done)
        if last:
            break
    assert not pieces
    assert set(trained) == set(samples(epoch))
    assert sum(trained.values()) - len(trained) == pads  # only padding was seen twice
