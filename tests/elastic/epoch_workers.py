"""Rank function and module for the epochs-after-a-world-size-change tests.

Every rank journals what it trained (sample ids per step), every epoch end (the LR of an
epoch-interval scheduler, the loop's epoch length, the batches it ran) and every validation,
so that a test can rebuild the run that counts across killed and resumed worker groups.
"""

from __future__ import annotations

import os
import signal
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, DistributedSampler

from lightning_elastic import DistributedCheckpoint, ElasticStrategy
from tests.elastic.journal import Journal
from tests.lightning.models import IdDataset


class EpochModule(pl.LightningModule):
    """A linear model, SGD with an epoch-interval StepLR (halving every epoch), validation,
    and a DistributedSampler with ``drop_last``; SIGKILLs itself at ``kill_at``."""

    def __init__(
        self, *, n: int, batch_size: int, drop_last: bool, kill_at: int, validate: bool
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Linear(8, 1)
        self.batches_this_epoch = 0

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.global_step == self.hparams.kill_at:
            checkpoint = next(
                c for c in self.trainer.callbacks if type(c).__name__ == "DistributedCheckpoint"
            )
            checkpoint.engine.wait()  # the checkpoint of this step is committed: now die
            os.kill(os.getpid(), signal.SIGKILL)
        self.batches_this_epoch += 1
        _, x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        _, x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.net(x), y), sync_dist=True)

    def configure_optimizers(self) -> Any:
        opt = torch.optim.SGD(self.parameters(), lr=1.0)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "epoch"}}

    def train_dataloader(self) -> DataLoader:
        data = IdDataset(self.hparams.n)
        sampler = DistributedSampler(
            data,
            num_replicas=self.trainer.world_size,
            rank=self.trainer.global_rank,
            shuffle=True,
            seed=11,
            drop_last=self.hparams.drop_last,
        )
        return DataLoader(data, batch_size=self.hparams.batch_size, sampler=sampler)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(IdDataset(8), batch_size=4)


class EpochJournal(Journal):
    """The step journal plus a record per training-epoch end and per validation run."""

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        pl_module.batches_this_epoch = 0  # type: ignore[assignment]

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.write(
            kind="epoch_end",
            epoch=trainer.current_epoch,
            step=trainer.global_step,
            world=trainer.world_size,
            num_training_batches=trainer.num_training_batches,
            batches=pl_module.batches_this_epoch,
            lr=trainer.optimizers[0].param_groups[0]["lr"],
        )

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not trainer.sanity_checking:
            self.write(
                kind="val",
                epoch=trainer.current_epoch,
                step=trainer.global_step,
                batch_idx=trainer.fit_loop.epoch_loop.batch_idx,
            )


def epoch_fit(
    root: str,
    *,
    max_epochs: int,
    kill_at: int = -1,
    every: int = 1,
    n: int = 42,
    batch_size: int = 4,
    drop_last: bool = False,
    global_batch_size: int | None = None,
    validate: bool = False,
    trainer_kwargs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Fit ``max_epochs`` (resuming from ``root`` when it holds a checkpoint); checkpoint every
    ``every`` steps; every rank dies at step ``kill_at``."""
    pl.seed_everything(7, verbose=False)
    model = EpochModule(
        n=n, batch_size=batch_size, drop_last=drop_last, kill_at=kill_at, validate=validate
    )
    checkpoint = DistributedCheckpoint(
        f"{root}/ckpts", every_n_train_steps=every, save_on_train_end=False
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=torch.distributed.get_world_size(),
        strategy=ElasticStrategy(global_batch_size=global_batch_size),
        max_epochs=max_epochs,
        default_root_dir=root,
        callbacks=[EpochJournal(f"{root}/journal"), checkpoint],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=1.0 if validate else 0,
        **(trainer_kwargs or {}),
    )
    trainer.fit(model)
    return {
        "global_step": trainer.global_step,
        "current_epoch": trainer.current_epoch,
        "resumed_from": trainer.ckpt_path,
        "num_training_batches": trainer.num_training_batches,
    }
