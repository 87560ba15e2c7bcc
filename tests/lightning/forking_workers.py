"""Rank functions for the DataLoader-workers-and-background-saves tests (module level: they
pickle)."""

from __future__ import annotations

import functools
import multiprocessing
import multiprocessing.context
import os
import signal
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from torch.utils.data import DataLoader

from lightning_elastic import DistributedCheckpoint, ElasticStrategy
from tests.lightning.models import IdDataset, TinyModule, make_trainer


def mark_worker(directory: str, worker_id: int) -> None:
    """A worker's ``worker_init_fn``: one file per forked worker process."""
    Path(directory, f"{os.getpid()}-{worker_id}").touch()


# Raised by a rank whose DataLoader timed out on a worker that never got out of ``os.fork()``
CPYTHON_FORK_HANG = "a DataLoader worker never returned from os.fork() (CPython gh-112275)"
LOADER_TIMEOUT_S = 30


class RecordingFork(multiprocessing.context.ForkContext):
    """The ``fork`` context, remembering the pid of every worker it starts."""

    def __init__(self) -> None:
        super().__init__()
        self.pids: list[int] = []

    def Process(self, *args: Any, **kwargs: Any) -> Any:
        context = self

        class Recorded(multiprocessing.context.ForkProcess):
            def start(self) -> None:
                super().start()
                assert self.pid is not None
                context.pids.append(self.pid)

        return Recorded(*args, **kwargs)


def hung_in_fork(workers_dir: str, pids: list[int]) -> list[int]:
    """Workers that were started but never ran their ``worker_init_fn``: each marks its
    start first thing after the fork, so a missing mark means the child is stuck inside
    ``os.fork()`` itself - CPython gh-112275 (an interpreter lock held by another thread at
    the fork; seen here before any save had started a writer thread). A hang caused by a
    lock of ours would come later: the import, stderr and logging locks are first taken
    after the worker's start."""
    marked = {int(p.name.split("-")[0]) for p in Path(workers_dir).iterdir()}
    return [pid for pid in pids if pid not in marked]


class ForkingWorkers(TinyModule):
    """TinyModule whose training DataLoader forks 2 new workers at every epoch. The fork
    context is explicit: a rank started by ``run_distributed`` (a forkserver child) would
    otherwise default to forkserver workers, where a rank that torchrun starts forks them."""

    def __init__(self, workers_dir: str, context: str = "fork", **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.workers_dir = workers_dir
        self.context: Any = RecordingFork() if context == "fork" else context

    def train_dataloader(self) -> DataLoader:
        return DataLoader(
            IdDataset(self.hparams.n),
            batch_size=self.hparams.batch_size,
            shuffle=True,
            num_workers=2,
            persistent_workers=False,
            multiprocessing_context=self.context,
            worker_init_fn=functools.partial(mark_worker, self.workers_dir),
            timeout=LOADER_TIMEOUT_S,  # a hung worker fails the rank instead of the test
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
    try:
        trainer.fit(model)
    except RuntimeError as exc:
        pids = getattr(model.context, "pids", [])
        hung = hung_in_fork(workers_dir, pids) if "timed out" in str(exc) else []
        for pid in hung:  # stuck in C: SIGTERM would only set Python's flag
            os.kill(pid, signal.SIGKILL)
        if hung:
            raise RuntimeError(f"{CPYTHON_FORK_HANG}: pids {hung}") from exc
        raise
    loader = trainer.train_dataloader
    return {
        "global_step": trainer.global_step,
        "epochs": trainer.current_epoch,
        "seen": model.seen,
        "loader": (loader.num_workers, loader.persistent_workers),
    }
