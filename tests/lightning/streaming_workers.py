"""Rank functions for the streaming tests: ``TinyModule`` trained from JSON Lines shards of
unequal length through ``ElasticShardedIterable``."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader

from lightning_elastic import DistributedCheckpoint, ElasticShardedIterable, ElasticStrategy
from tests.elastic.journal import Journal
from tests.elastic.workers import _Records
from tests.lightning.models import IdDataset, TinyModule, make_trainer, worker_context

COUNTS = [7, 0, 13, 5, 9, 1, 11, 4, 8, 6]  # 10 shards (one empty), 64 samples


def write_shards(directory: str | Path, counts: list[int] = COUNTS) -> list[str]:
    """JSON Lines shards holding ``IdDataset``'s samples in order, ``counts[i]`` in shard i."""
    data = IdDataset(sum(counts))
    paths, first = [], 0
    Path(directory).mkdir(parents=True, exist_ok=True)
    for i, count in enumerate(counts):
        path = Path(directory) / f"shard-{i:02d}.jsonl"
        lines = [
            json.dumps({"id": j, "x": data.x[j].tolist(), "y": data.y[j].tolist()})
            for j in range(first, first + count)
        ]
        path.write_text("".join(line + "\n" for line in lines))
        paths.append(str(path))
        first += count
    return paths


def read_samples(file: IO[bytes], start: int, stop: int) -> Iterator[Any]:
    """The ``(id, x, y)`` samples ``start`` to ``stop`` of a shard."""
    for i, line in enumerate(file):
        if i >= stop:
            return
        if i >= start:
            record = json.loads(line)
            yield record["id"], torch.tensor(record["x"]), torch.tensor(record["y"])


class StreamingModule(TinyModule):
    """``TinyModule`` reading its training data from shards."""

    def __init__(
        self, shards: list[str], workers: int = 0, persistent: bool = False, **kwargs: Any
    ) -> None:
        super().__init__(**kwargs)
        self.shards = shards
        self.workers = workers
        self.persistent = persistent

    def train_dataloader(self) -> DataLoader:
        dataset = ElasticShardedIterable(self.shards, COUNTS, read_samples, shuffle=True)
        return DataLoader(
            dataset,
            batch_size=self.hparams.batch_size,
            num_workers=self.workers,
            persistent_workers=self.persistent,
            multiprocessing_context=worker_context(__name__) if self.workers else None,
        )


class PlainStream(torch.utils.data.IterableDataset):
    """An iterable dataset that keeps no position (neither stateful nor sharded)."""

    def __iter__(self) -> Iterator[Any]:
        data = IdDataset(sum(COUNTS))
        return (data[i] for i in range(len(data)))


class PlainStreamingModule(TinyModule):
    def train_dataloader(self) -> DataLoader:
        return DataLoader(PlainStream(), batch_size=self.hparams.batch_size)


def fit_plain(root: str, max_steps: int) -> dict[str, Any]:
    """Fit from an iterable dataset that cannot resume mid-epoch (twice in this process)."""
    records = _Records()
    logging.getLogger("lightning_elastic").addHandler(records)
    for _ in range(2):
        pl.seed_everything(7, verbose=False)
        trainer = make_trainer(
            root,
            max_steps=max_steps,
            strategy=ElasticStrategy(),
            devices=torch.distributed.get_world_size(),
            callbacks=[DistributedCheckpoint(f"{root}/ckpts", every_n_train_steps=2)],
        )
        trainer.fit(PlainStreamingModule())
        max_steps += 2
    return {"log": records.messages, "global_step": trainer.global_step}


def fit(
    root: str,
    max_steps: int,
    *,
    kill_at: int = -1,
    every: int = 3,
    workers: int = 0,
    global_batch_size: int | None = None,
    persistent: bool = False,
) -> dict[str, Any]:
    """Fit at the process group's world size from the shards in ``root/shards``, with a
    journal of every trained sample in ``root/journal``; SIGKILL at ``kill_at``."""
    records = _Records()
    logging.getLogger("lightning_elastic").addHandler(records)
    pl.seed_everything(7, verbose=False)
    shards = sorted(str(p) for p in Path(root, "shards").glob("*.jsonl"))
    model = StreamingModule(shards, workers, persistent, kill_at=kill_at)
    trainer = make_trainer(
        root,
        max_steps=max_steps,
        strategy=ElasticStrategy(global_batch_size=global_batch_size),
        devices=torch.distributed.get_world_size(),
        callbacks=[
            Journal(f"{root}/journal"),
            DistributedCheckpoint(f"{root}/ckpts", every_n_train_steps=every),
        ],
    )
    trainer.fit(model)
    return {
        "losses": model.losses,
        "seen": model.seen,
        "global_step": trainer.global_step,
        "epoch": trainer.current_epoch,
        "resumed_from": trainer.ckpt_path,
        "num_training_batches": trainer.num_training_batches,
        "log": records.messages,
    }
