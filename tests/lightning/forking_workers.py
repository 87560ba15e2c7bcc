"""Rank functions for the DataLoader-workers-and-background-saves tests (module level: they
pickle)."""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from torch.utils.data import DataLoader

from lightning_elastic import DistributedCheckpoint, ElasticStrategy
from tests.lightning.models import IdDataset, TinyModule, make_trainer


def mark_worker(directory: str, worker_id: int) -> None:
    """A worker's ``worker_init_fn``: one file per forked worker process."""
    Path(directory, f"{os.getpid()}-{worker_id}").touch()


class ForkingWorkers(TinyModule):
    """TinyModule whose training DataLoader forks 2 new workers at every epoch. The fork
    context is explicit: a rank started by ``run_distributed`` (a forkserver child) would
    otherwise default to forkserver workers, where a rank that torchrun starts forks them."""

    def __init__(self, workers_dir: str, context: str = "fork", **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.workers_dir = workers_dir
        self.context = context

    def train_dataloader(self) -> DataLoader:
        return DataLoader(
            IdDataset(self.hparams.n),
            batch_size=self.hparams.batch_size,
            shuffle=True,
            num_workers=2,
            persistent_workers=False,
            multiprocessing_context=self.context,
            worker_init_fn=functools.partial(mark_worker, self.workers_dir),
        )


def fit_forking_workers(
    root: str, epochs: int, every: int | None, context: str = "fork"
) -> dict[str, Any]:
    """``epochs`` epochs of 2 batches per rank, an asynchronous save every ``every`` steps
    (``None``: no checkpoint callback at all), workers started by ``context``."""
    pl.seed_everything(7, verbose=False)
    workers_dir = f"{root}/workers"
    os.makedirs(workers_dir, exist_ok=True)
    model = ForkingWorkers(workers_dir, context, n=16, batch_size=4)
    callbacks = []
    if every is not None:
        callbacks.append(
            DistributedCheckpoint(
                f"{root}/ckpts", every_n_train_steps=every, keep_last_n=2, save_on_train_end=False
            )
        )
    trainer = make_trainer(
        root,
        max_steps=-1,
        max_epochs=epochs,
        strategy=ElasticStrategy(),
        callbacks=callbacks,
    )
    trainer.fit(model)
    loader = trainer.train_dataloader
    return {
        "global_step": trainer.global_step,
        "epochs": trainer.current_epoch,
        "seen": model.seen,
        "loader": (loader.num_workers, loader.persistent_workers),
    }
