"""The epoch length the loop counts: a resumed epoch's, every later epoch's, and the recount of
Lightning's training loop when the next epoch starts (one process, no Trainer run)."""

from __future__ import annotations

import gc
import math
from types import SimpleNamespace
from typing import Any

import pytest
from lightning.pytorch.utilities.combined_loader import CombinedLoader
from torch.utils.data import DataLoader

from lightning_elastic.core.elastic.data_position import DataPosition
from lightning_elastic.errors import ConfigError
from lightning_elastic.lightning.data import ElasticSampler, sync_training_loop


def sampler(n: int, world: int, rank: int = 0, bs: int = 4, **kw: Any) -> ElasticSampler:
    return ElasticSampler(range(n), num_replicas=world, rank=rank, batch_size=bs, **kw)


def loader_batches(s: ElasticSampler, drop_last_batch: bool = False) -> int:
    return len(
        DataLoader(
            range(len(s.dataset)), batch_size=s.batch_size, sampler=s, drop_last=drop_last_batch
        )
    )  # type: ignore[arg-type]


class Namespace(SimpleNamespace):
    """A SimpleNamespace a weakref can point at (the sampler holds its trainer weakly)."""

    __slots__ = ("__weakref__",)


def fake_trainer(loader: DataLoader, **settings: Any) -> Any:
    """What sync_training_loop reads and writes, set up as Lightning's setup_data leaves it."""
    combined = CombinedLoader(loader, "max_size_cycle")
    combined.limits = [len(loader)]
    iter(combined)  # the epoch's iterator, holding its own copy of the limits
    trainer = Namespace(
        fit_loop=SimpleNamespace(_combined_loader=combined, max_batches=len(loader)),
        limit_train_batches=settings.get("limit_train_batches", 1.0),
        val_check_interval=settings.get("val_check_interval", 1.0),
        check_val_every_n_epoch=settings.get("check_val_every_n_epoch", 1),
        limit_val_batches=1.0,
        val_check_batch=len(loader),
    )
    return trainer


@pytest.mark.parametrize(
    ("world", "new_world", "done"), [(2, 1, 4), (3, 2, 2), (3, 1, 1), (1, 2, 5), (2, 3, 3)]
)
@pytest.mark.parametrize("drop_last", [False, True])
def test_resumed_epoch_is_counted_from_the_loop_then_every_later_epoch_is_full(
    world, new_world, done, drop_last
) -> None:
    n = 66
    before = sampler(n, world, drop_last=drop_last)
    position = before.position(done)
    for rank in range(new_world):
        s = sampler(n, new_world, rank, drop_last=drop_last)
        s.resume(position)
        remaining = math.ceil(len(list(s)) / 4)
        assert loader_batches(s) == done + remaining  # the loop counts on from `done`
        s.set_epoch(1)
        fresh = sampler(n, new_world, rank, drop_last=drop_last)
        fresh.set_epoch(1)
        assert list(s) == list(fresh)
        assert loader_batches(s) == loader_batches(fresh) == s.full_epoch_batches()


@pytest.mark.parametrize("n", [41, 42, 44])
@pytest.mark.parametrize("drop_last_batch", [False, True])
@pytest.mark.parametrize("drop_last", [False, True])
def test_full_epoch_batches_is_the_dataloaders_length(n, drop_last_batch, drop_last) -> None:
    for world in (1, 2, 3):
        s = sampler(n, world, bs=4, drop_last=drop_last, drop_last_batch=drop_last_batch)
        assert s.full_epoch_batches() == loader_batches(s, drop_last_batch)


def test_an_epoch_start_keeps_the_loop_counter_only_when_the_loop_keeps_it() -> None:
    # a checkpoint on the last batch of epoch 0 at 2 ranks (6 batches) resumes in epoch 1
    s = sampler(42, 1)  # 11 batches: the loop does not reach its epoch length, keeps counting
    s.resume(DataPosition(epoch=1, consumed=0, world_size=2, batches=6))
    assert loader_batches(s) == 6 + 11 and s.position(6).consumed == 0
    assert s.position(8).consumed == 8
    s = sampler(42, 3)  # 4 batches: the loop restarts its counter at 0
    s.resume(DataPosition(epoch=1, consumed=0, world_size=2, batches=6))
    assert loader_batches(s) == 4 and s.position(1).consumed == 12
    # with limit_train_batches=3 the loop restarts even for a longer epoch
    s = sampler(42, 1)
    trainer = fake_trainer(DataLoader(range(42), batch_size=4), limit_train_batches=3)
    s.follow(trainer)  # the session follows before it resumes
    s.resume(DataPosition(epoch=1, consumed=0, world_size=2, batches=3))
    assert loader_batches(s) == 11


def test_next_epoch_recounts_a_followed_loop() -> None:
    s = sampler(42, 1)
    s.resume(DataPosition(epoch=0, consumed=16, world_size=2, batches=2))  # 2 + 7 batches
    loader = DataLoader(range(42), batch_size=4, sampler=s)
    trainer = fake_trainer(loader, val_check_interval=0.5, limit_train_batches=0.9)
    s.follow(trainer)
    s.set_epoch(0)  # Lightning's call at the resumed epoch's start: nothing changes
    assert trainer.fit_loop.max_batches == 9
    s.set_epoch(1)
    assert trainer.fit_loop._combined_loader.limits == [int(11 * 0.9)]
    assert trainer.fit_loop.max_batches == 9  # int(11 * 0.9), not the resumed epoch's 9 * 0.9
    assert trainer.val_check_batch == 4
    trainer.limit_train_batches = 1.0
    sync_training_loop(trainer)
    assert trainer.fit_loop.max_batches == 11 and trainer.val_check_batch == 5


def test_a_whole_number_val_interval_is_checked_against_the_new_epoch() -> None:
    s = sampler(42, 2)  # 6 batches an epoch
    loader = DataLoader(range(42), batch_size=4, sampler=s)
    with pytest.raises(ConfigError, match=r"val_check_interval=8 .* 6 training batches"):
        s.follow(fake_trainer(loader, val_check_interval=8))
    s.follow(fake_trainer(loader, val_check_interval=8, check_val_every_n_epoch=None))
    s.follow(fake_trainer(loader, val_check_interval=6))


def test_a_sampler_does_not_keep_its_trainer_alive() -> None:
    s = sampler(42, 1)
    s.follow(fake_trainer(DataLoader(range(42), batch_size=4, sampler=s)))
    gc.collect()
    s.set_epoch(3)  # the trainer is gone: nothing to recount
    assert len(s) == 42
