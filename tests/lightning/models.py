"""A tiny LightningModule and data for the Lightning tests (module level: they pickle)."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import time
from typing import Any

import lightning.pytorch as pl
import psutil
import torch
import torchmetrics
from torch.utils.data import DataLoader, Dataset


def lose_this_rank() -> None:
    """SIGKILL this rank and every process under it, as losing its node would: its DataLoader
    workers started by a forkserver (``worker_context``) are that forkserver's children, and
    they and the forkserver would keep each other alive after the rank is gone."""
    for child in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            child.kill()
    os.kill(os.getpid(), signal.SIGKILL)


def worker_context(*modules: str) -> Any:
    """The ``multiprocessing_context`` for a rank's DataLoader workers: a forkserver that has
    imported torch, Lightning and ``modules`` (the ones that define the dataset) once per rank.
    A worker started by spawn imports them again (about 7 s of CPU each, every epoch unless
    persistent), and one forked from a rank can hang inside ``os.fork()`` on CPython 3.11.7
    (gh-112275, seen in CI; tests/lightning/test_forking_workers.py). A rank that kills itself
    takes them along (``lose_this_rank``); one that ends normally shuts them down."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["torch", "lightning.pytorch", *modules])
    return context


class IdDataset(Dataset):
    """Sample ``i`` is (i, x_i, y_i) with fixed random features."""

    def __init__(self, n: int = 64, dim: int = 8) -> None:
        g = torch.Generator().manual_seed(1234)
        self.x = torch.randn(n, dim, generator=g)
        self.y = self.x.sum(dim=1, keepdim=True) + 0.1 * torch.randn(n, 1, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[int, torch.Tensor, torch.Tensor]:
        return i, self.x[i], self.y[i]


class TinyModule(pl.LightningModule):
    """MLP with dropout, Adam and a step-wise LR scheduler; records every step's loss and the
    sample ids it trained on; can SIGKILL itself at a given global step."""

    def __init__(
        self,
        n: int = 64,
        batch_size: int = 4,
        kill_at: int = -1,
        lr: float = 0.01,
        hidden: int = 32,
        signal_at: int = -1,
        signal_rank: int = 0,
        step_sleep: float = 0.0,
        dropout: float = 0.3,
        freeze_first: bool = False,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(8, hidden),
            torch.nn.ReLU(),
            torch.nn.Dropout(dropout),
            torch.nn.Linear(hidden, 1),
        )
        if freeze_first:  # the fine-tuning shape: a frozen base, a trained head
            self.net[0].requires_grad_(False)
        self.train_mae = torchmetrics.MeanAbsoluteError()
        # accumulators that depend only on which samples were seen (exact across world sizes)
        self.id_sum = torchmetrics.SumMetric()
        self.id_max = torchmetrics.MaxMetric()
        self.id_cat = torchmetrics.CatMetric()
        self.y_mean = torchmetrics.MeanMetric()
        self.losses: list[tuple[int, float]] = []
        self.global_losses: list[tuple[int, float]] = []
        self.seen: list[tuple[int, int, list[int]]] = []
        self.epoch_metrics: list[dict[str, Any]] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.global_step == self.hparams.kill_at:
            checkpoint = next(
                c for c in self.trainer.callbacks if type(c).__name__ == "DistributedCheckpoint"
            )
            checkpoint.engine.wait()  # the last async checkpoint is committed; now we die
            lose_this_rank()
        if (
            self.global_step == self.hparams.signal_at
            and self.global_rank == self.hparams.signal_rank
        ):
            os.kill(os.getpid(), signal.SIGTERM)  # only this rank is told to stop
        if self.hparams.step_sleep:
            time.sleep(self.hparams.step_sleep)
        ids, x, y = batch
        pred = self.net(x)
        loss = torch.nn.functional.mse_loss(pred, y)
        self.train_mae.update(pred.detach(), y)
        self.id_sum.update(ids.double())
        self.id_max.update(ids.double())
        self.id_cat.update(ids.double())
        self.y_mean.update(y.squeeze(1).double())
        self.losses.append((self.global_step, loss.item()))
        if torch.distributed.is_initialized():  # the mean over the global batch
            total = loss.detach().clone()
            torch.distributed.all_reduce(total)
            self.global_losses.append((self.global_step, total.item() / self.trainer.world_size))
        self.seen.append((self.global_step, self.current_epoch, ids.tolist()))
        return loss

    def on_train_epoch_end(self) -> None:
        self.epoch_metrics.append(
            {
                "epoch": self.current_epoch,
                "id_sum": self.id_sum.compute().item(),
                "id_max": self.id_max.compute().item(),
                "id_cat": sorted(self.id_cat.compute().tolist()),
                "y_mean": self.y_mean.compute().item(),
            }
        )
        for metric in (self.id_sum, self.id_max, self.id_cat, self.y_mean):
            metric.reset()

    def configure_optimizers(self) -> Any:
        opt = torch.optim.Adam(self.parameters(), lr=self.hparams.lr)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.7)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def train_dataloader(self) -> DataLoader:
        return DataLoader(
            IdDataset(self.hparams.n), batch_size=self.hparams.batch_size, shuffle=True
        )


def make_trainer(
    root: str,
    *,
    max_steps: int,
    strategy: Any = "elastic",
    devices: Any = 2,
    callbacks: list | None = None,
    **kwargs: Any,
) -> pl.Trainer:
    return pl.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_steps=max_steps,
        default_root_dir=root,
        callbacks=callbacks or [],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        **kwargs,
    )


def fit_outcome(
    trainer: pl.Trainer,
    model: TinyModule,
    checkpoint: Any = None,
    *,
    ckpt_path: str | None = None,
    errors: tuple[type[Exception], ...] = (),
) -> dict[str, Any]:
    """Fit ``model`` and return what the rank functions report of it: how the fit stopped
    early (``exit``: a signal's SystemExit code; ``error``: the message of one of ``errors``),
    the steps trained (``losses``, ``seen``, ``first_step``), ``global_step`` and
    ``resumed_from`` (``trainer.ckpt_path``), and, given the checkpoint callback, its ``last``,
    ``best``, ``preempted_by`` and ``recovery``. The one fit-and-report harness of the rank
    functions (tests/lightning/workers.py, boundary_workers.py, tests/tiers/*_workers.py): each
    adds its own fields to the dict."""
    out: dict[str, Any] = {}
    try:
        trainer.fit(model, ckpt_path=ckpt_path)
    except SystemExit as exc:
        out["exit"] = exc.code
    except errors as exc:
        out["error"] = str(exc)
    out.update(
        losses=model.losses,
        seen=model.seen,
        first_step=model.losses[0][0] if model.losses else None,
        global_step=trainer.global_step,
        resumed_from=trainer.ckpt_path,
    )
    if checkpoint is not None:
        out.update(
            last=checkpoint.last_model_path,
            best=checkpoint.best_model_path,
            preempted_by=checkpoint.preempted_by,
            recovery=checkpoint.recovery,
        )
    return out
