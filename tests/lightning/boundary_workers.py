"""Rank functions for the step-boundary tests: validation, ReduceLROnPlateau, EarlyStopping and
gradient accumulation beside DistributedCheckpoint (module level: they pickle)."""

from __future__ import annotations

import os
import signal
import warnings
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import EarlyStopping
from torch.utils.data import DataLoader

from lightning_elastic import DistributedCheckpoint, ElasticStrategy
from tests.lightning.models import IdDataset, TinyModule, fit_outcome, make_trainer


class ValModule(TinyModule):
    """TinyModule with a validation loop, a ReduceLROnPlateau on ``val_loss`` stepped right
    after each validation, and a record, per training batch, of what a resume must reproduce:
    loss, learning rates, EarlyStopping's counters and the loggers' step."""

    def __init__(
        self,
        *,
        plateau_interval: str = "step",
        plateau_frequency: int = 1,
        request_at: tuple[int, int] | None = None,
        sigterm_at: tuple[int, int] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.plateau_interval = plateau_interval
        self.plateau_frequency = plateau_frequency
        self.request_at = request_at  # (rank, batch index within the run): request_checkpoint
        self.sigterm_at = sigterm_at  # (rank, batch index within the run): SIGTERM to self
        self.records: list[tuple[Any, ...]] = []
        self.val_losses: list[tuple[int, float]] = []
        self._val_sum = 0.0
        self._val_n = 0

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        total = self.trainer.fit_loop.epoch_loop.total_batch_idx
        if self.request_at == (self.global_rank, total):
            checkpoint = next(
                c for c in self.trainer.callbacks if isinstance(c, DistributedCheckpoint)
            )
            checkpoint.request_checkpoint()
        if self.sigterm_at == (self.global_rank, total):
            os.kill(os.getpid(), signal.SIGTERM)
        loss = super().training_step(batch, batch_idx)
        early = next(c for c in self.trainer.callbacks if isinstance(c, EarlyStopping))
        self.records.append(
            (
                self.global_step,
                total,
                loss.item(),
                tuple(group["lr"] for group in self.trainer.optimizers[0].param_groups),
                early.wait_count,
                float(early.best_score),
                self.trainer.fit_loop.epoch_loop._batches_that_stepped,
            )
        )
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        _, x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("val_loss", loss, sync_dist=True)

    def on_validation_epoch_end(self) -> None:
        value = self.trainer.callback_metrics.get("val_loss")
        if value is not None:
            self.val_losses.append((self.global_step, float(value)))

    def configure_optimizers(self) -> Any:
        config = super().configure_optimizers()
        plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(
            config["optimizer"], mode="min", factor=0.5, patience=0
        )
        return [config["optimizer"]], [
            config["lr_scheduler"],
            {
                "scheduler": plateau,
                "monitor": "val_loss",
                "interval": self.plateau_interval,
                "frequency": self.plateau_frequency,
            },
        ]

    def val_dataloader(self) -> DataLoader:
        return DataLoader(IdDataset(16), batch_size=4)


def fit(
    root: str,
    max_steps: int,
    kill_at: int = -1,
    every: int | None = 4,
    trainer_kwargs: dict | None = None,
    model_kwargs: dict | None = None,
    **cb: Any,
) -> dict:
    """One fit with validation; SIGKILLs itself at ``kill_at`` (after the last checkpoint is
    committed) or exits on a signal; returns what the tests compare."""
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    pl.seed_everything(7, verbose=False)
    model = ValModule(kill_at=kill_at, **(model_kwargs or {}))
    checkpoint = DistributedCheckpoint(
        f"{root}/ckpts", every_n_train_steps=every, monitor="val_loss", **cb
    )
    early = EarlyStopping(monitor="val_loss", patience=1000, mode="min")
    trainer = make_trainer(
        root,
        max_steps=max_steps,
        strategy=ElasticStrategy(),
        callbacks=[early, checkpoint],
        **(trainer_kwargs or {}),
    )
    out = fit_outcome(trainer, model, checkpoint)
    out.update(
        records=model.records,
        val_losses=model.val_losses,
        wait_count=early.wait_count,
        lrs=[group["lr"] for group in trainer.optimizers[0].param_groups],
    )
    return out
