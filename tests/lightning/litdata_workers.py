"""Rank functions for the LitData tests: ``TinyModule`` trained from a LitData
``StreamingDataset`` (written by ``litdata.optimize``) through its ``StreamingDataLoader``, with
a journal of every trained sample and every epoch end."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any
from unittest import mock

import lightning.pytorch as pl
import torch

from lightning_elastic import DistributedCheckpoint, ElasticStrategy
from tests.elastic.journal import Journal
from tests.elastic.workers import _Records
from tests.lightning.models import TinyModule, make_trainer

N = 200  # samples, in 10 chunks of 20
CHUNK = 20


def sample(i: int) -> tuple[int, torch.Tensor, torch.Tensor]:
    """Sample ``i`` (what ``litdata.optimize`` writes): its id, 8 features and a target."""
    g = torch.Generator().manual_seed(1234 + i)
    x = torch.randn(8, generator=g)
    return i, x, x.sum(0, keepdim=True)


def write(directory: str | Path, n: int = N) -> str:
    """The dataset, written by ``litdata.optimize`` in chunks of ``CHUNK`` samples."""
    import litdata

    litdata.optimize(
        fn=sample, inputs=list(range(n)), output_dir=str(directory), chunk_size=CHUNK, num_workers=1
    )
    return str(directory)


def streaming_dataset(data: str, *, drop_last: bool | None, before_group: bool = False) -> Any:
    """``StreamingDataset(data, shuffle=True, seed=42)``; ``before_group``: built as at module
    level under torchrun, before the process group exists (``RANK`` and ``WORLD_SIZE`` are
    set, ``GLOBAL_RANK`` is not)."""
    from litdata import StreamingDataset

    if before_group:
        with mock.patch("torch.distributed.is_initialized", return_value=False):
            return StreamingDataset(data, shuffle=True, seed=42, drop_last=drop_last)
    return StreamingDataset(data, shuffle=True, seed=42, drop_last=drop_last)


class LitDataModule(TinyModule):
    """``TinyModule`` reading from a ``StreamingDataLoader`` built in ``train_dataloader()``
    (or over a dataset built before the process group, ``dataset``)."""

    def __init__(
        self, data: str, workers: int, drop_last: bool | None, dataset: Any = None, **kw: Any
    ) -> None:
        super().__init__(**kw)
        self.data = data
        self.workers = workers
        self.drop_last = drop_last
        self.dataset = dataset
        self.batches_this_epoch = 0

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.batches_this_epoch += 1
        return super().training_step(batch, batch_idx)

    def on_train_epoch_start(self) -> None:
        self.batches_this_epoch = 0

    def train_dataloader(self) -> Any:
        from litdata import StreamingDataLoader

        dataset = self.dataset or streaming_dataset(self.data, drop_last=self.drop_last)
        # spawn: see tests/lightning/streaming_workers.py
        return StreamingDataLoader(
            dataset,
            batch_size=self.hparams.batch_size,
            num_workers=self.workers,
            multiprocessing_context="spawn" if self.workers else None,
        )


class EpochJournal(Journal):
    """The step journal plus a record per training-epoch end."""

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.write(
            kind="epoch_end",
            epoch=trainer.current_epoch,
            step=trainer.global_step,
            world=trainer.world_size,
            num_training_batches=trainer.num_training_batches,
            batches=pl_module.batches_this_epoch,
        )


def fit(
    root: str,
    data: str,
    *,
    max_epochs: int,
    kill_at: int = -1,
    every: int = 3,
    workers: int = 0,
    drop_last: bool | None = True,
    before_group: bool = False,
) -> dict[str, Any]:
    """Fit ``max_epochs`` at the process group's world size (resuming from ``root/ckpts``
    when it holds a checkpoint), checkpoints every ``every`` steps, SIGKILL at ``kill_at``."""
    records = _Records()
    logging.getLogger("lightning_elastic").addHandler(records)
    pl.seed_everything(7, verbose=False)
    dataset = (
        streaming_dataset(data, drop_last=drop_last, before_group=True) if before_group else None
    )
    model = LitDataModule(data, workers, drop_last, dataset=dataset, n=N, kill_at=kill_at)
    trainer = make_trainer(
        root,
        max_steps=-1,
        max_epochs=max_epochs,
        strategy=ElasticStrategy(),
        devices=torch.distributed.get_world_size(),
        callbacks=[
            EpochJournal(f"{root}/journal"),
            DistributedCheckpoint(f"{root}/ckpts", every_n_train_steps=every),
        ],
    )
    trainer.fit(model)
    return {
        "losses": model.losses,
        "seen": model.seen,
        "global_step": trainer.global_step,
        "current_epoch": trainer.current_epoch,
        "resumed_from": trainer.ckpt_path,
        "num_training_batches": trainer.num_training_batches,
        "log": records.messages,
    }
