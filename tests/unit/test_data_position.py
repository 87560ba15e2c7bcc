"""Data position: fresh epochs equal DistributedSampler, resumes are exact or exactly-once."""

import collections
import math

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler

from lightning_elastic.core.elastic.data_position import DataPosition
from lightning_elastic.lightning.data import ElasticSampler


def batches(sampler: ElasticSampler, batch_size: int) -> list[list[int]]:
    idx = list(sampler)
    return [idx[i : i + batch_size] for i in range(0, len(idx), batch_size)]


def samplers(n, world, batch_size, **kw) -> list[ElasticSampler]:
    return [
        ElasticSampler(range(n), num_replicas=world, rank=r, batch_size=batch_size, **kw)
        for r in range(world)
    ]


@pytest.mark.parametrize("n", [10, 11, 64, 97])
@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("drop_last", [True, False])
def test_fresh_epoch_equals_distributed_sampler(n, world, shuffle, drop_last) -> None:
    for rank in range(world):
        ours = ElasticSampler(
            range(n),
            num_replicas=world,
            rank=rank,
            shuffle=shuffle,
            seed=7,
            drop_last=drop_last,
            batch_size=4,
        )
        theirs = DistributedSampler(
            range(n), num_replicas=world, rank=rank, shuffle=shuffle, seed=7, drop_last=drop_last
        )
        for epoch in (0, 3):
            ours.set_epoch(epoch)
            theirs.set_epoch(epoch)
            assert list(ours) == list(theirs)
            assert len(ours) == len(theirs)


@pytest.mark.parametrize(
    ("n", "world", "bs", "done"), [(64, 2, 4, 3), (97, 3, 5, 2), (10, 2, 2, 1)]
)
def test_same_world_resume_continues_exactly(n, world, bs, done) -> None:
    fresh = samplers(n, world, bs, seed=3)
    for s in fresh:
        s.set_epoch(2)
    full = [batches(s, bs) for s in fresh]
    position = fresh[0].position(done)
    resumed = samplers(n, world, bs, seed=3)
    for r, s in enumerate(resumed):
        s.resume(position)
        s.set_epoch(2)  # Lightning calls this again at the epoch start: must keep the position
        assert batches(s, bs) == full[r][done:]
        assert math.ceil(len(s) / bs) == len(full[r])  # the loop's epoch length is unchanged


def seen_across(n, bs, worlds_and_steps, seed=0) -> tuple[collections.Counter, list[list[int]]]:
    """Train ``steps`` batches at each world size in turn; return what every rank saw."""
    seen: collections.Counter = collections.Counter()
    position = DataPosition(epoch=0, consumed=0, world_size=worlds_and_steps[0][0])
    batch_counts = []
    done = 0
    for world, steps in worlds_and_steps:
        group = samplers(n, world, bs, seed=seed)
        for s in group:
            s.resume(position)
        per_rank = [batches(s, bs) for s in group]  # from the resume point on
        counts = {len(b) for b in per_rank}
        assert len(counts) == 1, f"unequal step counts at world {world}: {counts}"
        # the loop's epoch length: batches before the resume + batches still to come
        assert {math.ceil(len(s) / bs) for s in group} == {done + len(per_rank[0])}
        take = len(per_rank[0]) if steps is None else min(steps, len(per_rank[0]))
        for b in per_rank:
            for batch in b[:take]:
                seen.update(batch)
        batch_counts.append(counts.pop())
        done += take  # Lightning's per-epoch batch counter keeps counting
        position = group[0].position(done)
    return seen, batch_counts


@pytest.mark.parametrize(
    "plan",
    [
        [(2, 5), (3, None)],  # 2 -> 3
        [(3, 4), (2, None)],  # 3 -> 2
        [(2, 6), (1, None)],  # 2 -> 1
        [(2, 3), (3, 2), (2, None)],  # 2 -> 3 -> 2
        [(1, 7), (3, None)],
    ],
)
def test_world_change_sees_every_sample_exactly_once(plan) -> None:
    seen, _ = seen_across(120, 4, plan)
    assert seen == collections.Counter(range(120))


def test_world_change_pads_only_when_steps_would_differ() -> None:
    # 2 -> 3 after 5 steps of 2x4: 80 remain; 27/27/26 samples are 7 batches each: no padding
    seen, _ = seen_across(120, 4, [(2, 5), (3, None)])
    assert sum(seen.values()) == 120
    # 100 samples, 3 ranks, batch 1 -> 34/33/33 would be 34 vs 33 steps: pad 2 duplicates
    seen, _ = seen_across(100, 1, [(2, 0), (3, None)], seed=1)
    assert set(seen) == set(range(100)) and sum(seen.values()) == 102


def test_sampler_drives_a_dataloader_length() -> None:
    data = list(range(50))
    s = ElasticSampler(data, num_replicas=2, rank=1, batch_size=5)
    loader = DataLoader(data, batch_size=5, sampler=s)
    assert len(loader) == 5
    s.resume(DataPosition(epoch=0, consumed=20, world_size=2, batches=2))
    assert len(loader) == 5 and len(list(loader)) == 3
    assert torch.is_tensor(next(iter(loader)))


def test_rank_outside_world_is_rejected() -> None:
    with pytest.raises(ValueError):
        ElasticSampler(range(4), num_replicas=2, rank=2)


def test_global_batch_size_must_divide_by_the_world_size() -> None:
    from lightning_elastic.errors import WorldSizeError
    from lightning_elastic.lightning.data import make_elastic

    loader = DataLoader(list(range(60)), batch_size=4, shuffle=True)
    with pytest.raises(
        WorldSizeError, match="global_batch_size=10 is not divisible by the world size 3"
    ):
        make_elastic(loader, num_replicas=3, rank=0, global_batch_size=10)
    rebuilt, sampler = make_elastic(loader, num_replicas=3, rank=1, global_batch_size=12)
    assert rebuilt.batch_size == 4 and sampler is not None and sampler.batch_size == 4
    assert len(next(iter(rebuilt))) == 4


def test_metric_folding_and_the_unmergeable_warning() -> None:
    import torchmetrics

    from lightning_elastic.lightning.torchmetrics_state import fold_metric_states, metric_states

    class Holder(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.total = torchmetrics.SumMetric()
            self.seen = torchmetrics.CatMetric()
            self.top = torchmetrics.MaxMetric()

    per_rank = []
    for values in ([1.0, 2.0], [5.0]):
        holder = Holder()
        for v in values:
            for metric in (holder.total, holder.seen, holder.top):
                metric.update(torch.tensor(v))
        per_rank.append(metric_states(holder))
    folded = fold_metric_states(Holder(), per_rank)
    assert folded["total"]["state"]["sum_value"].item() == 8.0
    assert folded["top"]["state"]["max_value"].item() == 5.0
    assert sorted(
        torch.cat([torch.atleast_1d(t) for t in folded["seen"]["state"]["value"]]).tolist()
    ) == [1.0, 2.0, 5.0]
    assert folded["total"]["update_count"] == 3

    class Last(torchmetrics.Metric):  # keeps only the last value: no meaningful merge
        def __init__(self) -> None:
            super().__init__()
            self.add_state("last", torch.tensor(0.0), dist_reduce_fx=None)

        def update(self, value: torch.Tensor) -> None:
            self.last = value

        def compute(self) -> torch.Tensor:
            return self.last

    class WithLast(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.m = Last()

    states = []
    for v in (1.0, 3.0):
        holder = WithLast()
        holder.m.update(torch.tensor(v))
        states.append(metric_states(holder))
    with pytest.warns(UserWarning, match="cannot be merged across a world-size change"):
        assert fold_metric_states(WithLast(), states) == {}
