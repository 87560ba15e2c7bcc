"""Rank functions for the LitData tests: ``TinyModule`` trained from a LitData
``StreamingDataset`` (written by ``litdata.optimize``) through its ``StreamingDataLoader``, with
a journal of every trained sample and every epoch end.

An interruption is a crash inside the fit (every rank raises at the same step, once the
checkpoint before it is committed), so that one launch can run several fits."""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
from pathlib import Path
from typing import Any
from unittest import mock

import lightning.pytorch as pl
import torch

from lightning_elastic import DistributedCheckpoint, ElasticStrategy
from tests.elastic.journal import Journal
from tests.elastic.workers import _Records
from tests.lightning.models import TinyModule, make_trainer

N = 96  # samples, in 8 chunks of 12: 12 batches of 4 per epoch at 2 ranks, 8 at 3, 24 at 1
CHUNK = 12


def sample(i: int) -> tuple[int, torch.Tensor, torch.Tensor]:
    """Sample ``i`` (what ``litdata.optimize`` writes): its id, 8 features and a target."""
    g = torch.Generator().manual_seed(1234 + i)
    x = torch.randn(8, generator=g)
    return i, x, x.sum(0, keepdim=True)


def write(directory: str | Path, n: int = N) -> str:
    """The dataset, written by ``litdata.optimize`` in chunks of ``CHUNK`` samples."""
    import litdata

    # optimize() sets the process's start method for good, and leaves a SIGINT handler that
    # ends the process with os._exit(0) (LitData 0.2.76, DataProcessor._signal_handler): put
    # both back (a later Ctrl-C test ended the whole pytest run with exit code 0). Its one
    # worker is forked (spawning one imports torch again: 20 s on a loaded CI machine)
    method = multiprocessing.get_start_method(allow_none=True)
    sigint = signal.getsignal(signal.SIGINT)
    try:
        litdata.optimize(
            fn=sample,
            inputs=list(range(n)),
            output_dir=str(directory),
            chunk_size=CHUNK,
            num_workers=1,
            start_method="fork",
            verbose=False,
        )
    finally:
        multiprocessing.set_start_method(method, force=True)
        signal.signal(signal.SIGINT, sigint)
    return str(directory)


def streaming_dataset(data: str, *, drop_last: bool | None, before_group: bool = False) -> Any:
    """``StreamingDataset(data, shuffle=True, seed=42)``; ``before_group``: built as at module
    level under torchrun, before the process group exists (``RANK`` and ``WORLD_SIZE`` are
    set, ``GLOBAL_RANK`` is not)."""
    from litdata import StreamingDataset

    if before_group:  # (Lightning's own environment deletes WORLD_SIZE when a fit ends)
        torchrun = {"WORLD_SIZE": str(torch.distributed.get_world_size())}
        with (
            mock.patch("torch.distributed.is_initialized", return_value=False),
            mock.patch.dict(os.environ, torchrun),
        ):
            os.environ.pop("GLOBAL_RANK", None)
            return StreamingDataset(data, shuffle=True, seed=42, drop_last=drop_last)
    return StreamingDataset(data, shuffle=True, seed=42, drop_last=drop_last)


class Crash(Exception):
    """Raised by every rank at ``crash_at`` (the checkpoint before it committed)."""


class LitDataModule(TinyModule):
    """``TinyModule`` reading from a ``StreamingDataLoader`` built in ``train_dataloader()``
    (over ``dataset`` when given: one built before the process group)."""

    def __init__(
        self,
        data: str,
        workers: int,
        drop_last: bool | None,
        dataset: Any = None,
        crash_at: int = -1,
        combined_with: str | None = None,
        **kw: Any,
    ) -> None:
        super().__init__(**kw)
        self.data, self.workers, self.drop_last = data, workers, drop_last
        self.dataset = dataset
        self.combined_with = combined_with
        self.crash_at = crash_at
        self.batches_this_epoch = 0

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.global_step == self.crash_at:
            checkpoint = next(
                c for c in self.trainer.callbacks if isinstance(c, DistributedCheckpoint)
            )
            checkpoint.engine.wait()
            raise Crash(f"crash at step {self.global_step}")
        self.batches_this_epoch += 1
        return super().training_step(batch, batch_idx)

    def on_train_epoch_start(self) -> None:
        self.batches_this_epoch = 0

    def train_dataloader(self) -> Any:
        from litdata import StreamingDataLoader

        dataset = self.dataset or streaming_dataset(self.data, drop_last=self.drop_last)
        if self.combined_with:
            from litdata import CombinedStreamingDataset

            other = streaming_dataset(self.combined_with, drop_last=self.drop_last)
            dataset = CombinedStreamingDataset([dataset, other], seed=42, iterate_over_all=True)
        context = None
        if self.workers:
            # forkserver, with torch and LitData loaded once per rank: a worker started by
            # spawn imports them again (seconds each, every epoch), and one forked from a rank
            # can hang in os.fork() (see tests/lightning/streaming_workers.py)
            context = multiprocessing.get_context("forkserver")
            context.set_forkserver_preload(["torch", "litdata", __name__])
        return StreamingDataLoader(
            dataset,
            batch_size=self.hparams.batch_size,
            num_workers=self.workers,
            multiprocessing_context=context,
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
    max_steps: int = -1,
    crash_at: int = -1,
    every: int = 3,
    workers: int = 0,
    drop_last: bool | None = True,
    before_group: bool = False,
    combined_with: str | None = None,
    batch_size: int = 4,
    **trainer_kw: Any,
) -> dict[str, Any]:
    """Fit ``max_epochs`` (or ``max_steps``) at the process group's world size, or in this
    process alone without one (resuming from ``root/ckpts`` when it holds a checkpoint),
    checkpoints every ``every`` steps, crash at ``crash_at``; ``combined_with``: a second
    dataset, read through a ``CombinedStreamingDataset``."""
    records = _Records()
    logger = logging.getLogger("lightning_elastic")
    logger.addHandler(records)
    pl.seed_everything(7, verbose=False)
    dataset = (
        streaming_dataset(data, drop_last=drop_last, before_group=True) if before_group else None
    )
    model = LitDataModule(
        data,
        workers,
        drop_last,
        dataset=dataset,
        crash_at=crash_at,
        combined_with=combined_with,
        n=N,
        dropout=0.3,
        batch_size=batch_size,
    )
    grouped = torch.distributed.is_initialized()
    trainer = make_trainer(
        root,
        max_steps=max_steps,
        max_epochs=max_epochs,
        strategy=ElasticStrategy() if grouped else "auto",
        devices=torch.distributed.get_world_size() if grouped else 1,
        **trainer_kw,
        callbacks=[
            EpochJournal(f"{root}/journal"),
            DistributedCheckpoint(f"{root}/ckpts", every_n_train_steps=every),
        ],
    )
    crashed = False
    try:
        trainer.fit(model)
    except Crash:
        crashed = True
    finally:
        logger.removeHandler(records)
    return {
        "crashed": crashed,
        "losses": model.losses,
        "seen": model.seen,
        "epoch_metrics": model.epoch_metrics,
        "global_step": trainer.global_step,
        "current_epoch": trainer.current_epoch,
        "resumed_from": trainer.ckpt_path,
        "log": records.messages,
    }


def same_world(root: str, data: str, *, max_epochs: int, chain_crash_at: int) -> dict[str, Any]:
    """At this world: for 0 workers with ``drop_last`` and 2 workers without, an uninterrupted
    fit, one that crashes mid-epoch 1 and its resumption (over a dataset built before the
    process group, with 0 workers); one that crashes after the save at the end of epoch 0 and
    its resumption; then the start of a run that another world resumes (``root/chain``,
    crashing at ``chain_crash_at``)."""
    results: dict[str, Any] = {}
    for name, workers, drop_last in (("w0", 0, True), ("w2", 2, False)):
        kw = {"max_epochs": max_epochs, "workers": workers, "drop_last": drop_last}
        results[name] = {
            "reference": fit(f"{root}/{name}/ref", data, **kw),
            "crashed": fit(f"{root}/{name}/run", data, crash_at=17, **kw),
            "resumed": fit(f"{root}/{name}/run", data, before_group=workers == 0, **kw),
        }
    # a fit that stops (and saves) at the end of epoch 0, and one that goes on from there
    kw = {"max_epochs": max_epochs, "workers": 0, "drop_last": True}
    results["boundary"] = {
        "stopped": fit(f"{root}/boundary", data, max_steps=12, **kw),
        "resumed": fit(f"{root}/boundary", data, **kw),
    }
    results["chain"] = fit(f"{root}/chain", data, max_epochs=max_epochs, crash_at=chain_crash_at)
    return results
