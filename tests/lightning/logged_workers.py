"""Fits for the tests of what Lightning reads from earlier steps and validations after a
resume: ``trainer.callback_metrics``, the epoch-level ``self.log`` accumulators, and the
``ReduceLROnPlateau`` schedulers that read them between validations (module level: they
pickle)."""

from __future__ import annotations

import warnings
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader

from lightning_elastic import DistributedCheckpoint, ElasticStrategy
from tests.lightning.models import IdDataset, TinyModule, make_trainer

# (interval, frequency, strict): the plateau schedulers of the model, all on its one
# optimizer, with validation every 5 global steps and 8 batches per epoch. Lightning steps an
# interval="step" one at (batch index in the epoch + 1) % frequency == 0: 5 divides the
# validation interval, not the epoch; 8 and 4 the epoch, not the validation interval; 6
# neither; 1 both. strict=True ones first read val_loss after the first validation (a strict
# one stepped before it raises in any run); strict=False ones also step before it (skipped)
PLATEAUS = (
    ("step", 5, True),
    ("step", 6, True),
    ("step", 8, True),
    ("epoch", 1, True),
    ("step", 1, False),
    ("step", 4, False),
    ("step", 5, False),
    ("epoch", 2, False),
)


def plateau_name(interval: str, frequency: int, strict: bool) -> str:
    return f"{interval}/{frequency}/{'strict' if strict else 'lenient'}"


class LoggingModule(TinyModule):
    """TinyModule that logs what users log (a step and epoch loss, epoch sums, maxima, minima
    and means of the sample ids, a torchmetrics metric, a value that differs per rank) and
    steps ``ReduceLROnPlateau`` schedulers on ``val_loss`` (``plateaus``); it records, per
    training batch, the loss, the learning rate and every plateau scheduler's state."""

    def __init__(self, *, plateaus: tuple[tuple[str, int, bool], ...] = (), **kwargs: Any):
        super().__init__(**kwargs)
        self.plateaus = plateaus
        self.records: list[tuple[Any, ...]] = []
        self.epoch_values: list[tuple[int, dict[str, float]]] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        ids = batch[0].double()
        self.log("train_loss", loss, on_step=True, on_epoch=True, sync_dist=True, prog_bar=True)
        # epoch values only: synced at the epoch's end, not at every step
        epoch = {"on_step": False, "on_epoch": True, "sync_dist": True}
        self.log("id_total", ids.sum(), reduce_fx="sum", **epoch)
        self.log("id_top", ids.max(), reduce_fx="max", **epoch)
        self.log("id_low", ids.min(), reduce_fx="min", **epoch)
        self.log("id_mean", ids.mean(), **epoch)
        self.log("rank_ids", ids.mean(), on_step=True, on_epoch=True)  # differs per rank
        self.log("train_mae", self.train_mae, on_step=False, on_epoch=True)
        if self.global_step < 3:  # logged early in the run only: kept, never logged again
            self.log("early", loss, on_step=True, on_epoch=False)
        optimizer = self.trainer.optimizers[0]
        schedulers = [c.scheduler for c in self.trainer.lr_scheduler_configs[1:]]
        self.records.append(
            (
                self.global_step,
                self.trainer.fit_loop.epoch_loop.total_batch_idx,
                loss.item(),
                optimizer.param_groups[0]["lr"],
                [(s.best, s.num_bad_epochs, s.last_epoch) for s in schedulers],
            )
        )
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        _, x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.net(x), y), sync_dist=True)

    def on_train_epoch_end(self) -> None:
        super().on_train_epoch_end()
        metrics = self.trainer.callback_metrics  # the epoch values, computed now
        names = ("train_loss_epoch", "id_total", "id_top", "id_low", "id_mean", "train_mae")
        self.epoch_values.append(
            (self.current_epoch, {k: float(metrics[k]) for k in names if k in metrics})
        )

    def configure_optimizers(self) -> Any:
        config = super().configure_optimizers()
        optimizer = config["optimizer"]
        plateaus = [
            {
                "scheduler": torch.optim.lr_scheduler.ReduceLROnPlateau(
                    optimizer, mode="min", factor=0.8, patience=0
                ),
                "monitor": "val_loss",
                "interval": interval,
                "frequency": frequency,
                "strict": strict,
                "name": plateau_name(interval, frequency, strict),
            }
            for interval, frequency, strict in self.plateaus
        ]
        return [optimizer], [config["lr_scheduler"], *plateaus]

    def val_dataloader(self) -> DataLoader:
        return DataLoader(IdDataset(16), batch_size=4)


def _plain(metrics: dict[str, Any]) -> dict[str, float]:
    return {k: float(v) for k, v in sorted(metrics.items())}


class MetricsReader(pl.Callback):
    """Reads what the trainer shows callbacks at the end of every training batch, and what
    it shows at every batch's and epoch's start (a callback placed before the checkpoint
    callback, which Lightning runs last)."""

    def __init__(self) -> None:
        self.seen: list[tuple[int, dict[str, float], dict[str, float], dict[str, float]]] = []
        self.started: list[tuple[str, int, dict[str, float]]] = []

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        self.started.append(("epoch", trainer.global_step, _plain(trainer.callback_metrics)))

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.started.append(("batch", trainer.global_step, _plain(trainer.callback_metrics)))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.seen.append(
            (
                trainer.global_step,
                _plain(trainer.callback_metrics),
                _plain(trainer.logged_metrics),
                _plain(trainer.progress_bar_metrics),
            )
        )


def fit(
    root: str,
    max_steps: int,
    *,
    plateaus: tuple[tuple[str, int, bool], ...] = PLATEAUS,
    kill_at: int = -1,
    ckpt_path: str | None = None,
    devices: int | None = None,
    n: int | None = None,
) -> dict[str, Any]:
    """One fit with validation every 5 global steps and a checkpoint every 5 steps and at
    every epoch's end; SIGKILLs itself at ``kill_at`` (after the last checkpoint committed);
    resumes from ``ckpt_path``, else from the newest checkpoint of ``root``. ``devices=None``:
    the world of the process group (``ElasticStrategy``), else a single process without one.
    ``n`` samples (default: 8 batches of 4 per rank and epoch)."""
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    warnings.filterwarnings("ignore", ".*ReduceLROnPlateau conditioned on metric.*")
    warnings.filterwarnings("ignore", ".*callbacks used to create the checkpoint.*")
    pl.seed_everything(7, verbose=False)
    distributed = devices is None
    world = torch.distributed.get_world_size() if distributed else devices
    model = LoggingModule(n=n or 32 * world, kill_at=kill_at, plateaus=plateaus)
    reader = MetricsReader()
    checkpoint = DistributedCheckpoint(
        f"{root}/ckpts", every_n_train_steps=5, every_n_epochs=1, save_on_train_end=False
    )
    trainer = make_trainer(
        root,
        max_steps=max_steps,
        strategy=ElasticStrategy() if distributed else "auto",
        devices=world,
        callbacks=[reader, checkpoint],
        val_check_interval=5,
        check_val_every_n_epoch=None,
    )
    trainer.fit(model, ckpt_path=ckpt_path)
    return {
        "records": model.records,
        "epoch_values": model.epoch_values,
        "seen": reader.seen,
        "started": reader.started,
        "resumed_from": trainer.ckpt_path,
        "global_step": trainer.global_step,
    }


def fits(runs: list[tuple[str, int, dict[str, Any]]]) -> list[dict[str, Any]]:
    """``fit(root, max_steps, **kwargs)`` for each run, one after the other, in this process
    (one launch of the ranks for several fits)."""
    return [fit(root, max_steps, **kwargs) for root, max_steps, kwargs in runs]


class EditedModule(LoggingModule):
    """LoggingModule whose ``train_loss`` is logged with other arguments (``edit``), as after
    an edit of the code between a save and its resume."""

    def __init__(self, *, edit: dict[str, Any] | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.edit = edit

    def log(self, name: str, value: Any, *args: Any, **kwargs: Any) -> None:
        if name == "train_loss" and self.edit is not None:
            kwargs.update(self.edit)
        super().log(name, value, *args, **kwargs)


def fit_edited(root: str, max_steps: int, edit: dict[str, Any] | None) -> dict[str, Any]:
    """A fit of :class:`EditedModule` on one device, checkpointed every 5 steps, resuming
    from the newest checkpoint of ``root``."""
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    pl.seed_everything(7, verbose=False)
    model = EditedModule(n=32, edit=edit)
    checkpoint = DistributedCheckpoint(
        f"{root}/ckpts", every_n_train_steps=5, save_on_train_end=False
    )
    trainer = make_trainer(
        root, max_steps=max_steps, strategy="auto", devices=1, callbacks=[checkpoint]
    )
    trainer.fit(model)
    return {"epoch_values": model.epoch_values, "resumed_from": trainer.ckpt_path}


def fit_native(root: str, max_steps: int, *, ckpt_path: str | None = None) -> dict[str, Any]:
    """A fit on one device under ``ElasticStrategy`` whose checkpoints are Lightning's own
    ``ModelCheckpoint(monitor="val_loss")`` saves, taken after each validation (every 5
    global steps, inside 8-batch epochs), written through the strategy."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    warnings.filterwarnings("ignore", ".*ReduceLROnPlateau conditioned on metric.*")
    warnings.filterwarnings("ignore", ".*when logging on epoch level in distributed.*")
    warnings.filterwarnings("ignore", ".*The dirpath has changed from.*")
    pl.seed_everything(7, verbose=False)
    model = LoggingModule(n=32, plateaus=PLATEAUS)
    reader = MetricsReader()
    best = ModelCheckpoint(
        dirpath=f"{root}/mc", monitor="val_loss", save_top_k=-1, filename="{step}"
    )
    trainer = make_trainer(
        root,
        max_steps=max_steps,
        strategy=ElasticStrategy(),
        devices=1,
        callbacks=[reader, best],
        val_check_interval=5,
        check_val_every_n_epoch=None,
    )
    had_group = torch.distributed.is_initialized()
    try:
        trainer.fit(model, ckpt_path=ckpt_path)
    finally:
        if not had_group and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()  # in this test process: leave none
    return {
        "records": model.records,
        "epoch_values": model.epoch_values,
        "seen": reader.seen,
        "started": reader.started,
        "resumed_from": trainer.ckpt_path,
    }
