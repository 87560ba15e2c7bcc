"""Lightning's semantics under strategy="elastic_ft", in this process (one replica group, a
Lighthouse of its own): a step attempt that does not commit is redone with everything it
changed rolled back, so a run with failed attempts is bitwise the run without them; gradient
accumulation, clipping, LR schedulers, BatchNorm, dropout, torchmetrics and epoch-level
self.log values included."""

from __future__ import annotations

import hashlib
import os
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torchmetrics
from torch.utils.data import DataLoader, Dataset

from tests.replicas.harness import Lighthouse

pytestmark = pytest.mark.timeout(300)


class Numbered(Dataset):  # type: ignore[type-arg]
    def __len__(self) -> int:
        return 40

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        generator = torch.Generator().manual_seed(index)
        return torch.tensor(index), torch.randn(6, generator=generator)


class Model(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(6, 16),
            torch.nn.BatchNorm1d(16),
            torch.nn.ReLU(),
            torch.nn.Dropout(0.3),
            torch.nn.Linear(16, 1),
        )
        self.mean_id = torchmetrics.MeanMetric()
        self.steps: list[dict[str, Any]] = []
        self.recorded = 0

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        ids, x = batch
        loss = self.net(x).square().mean()
        self.mean_id(ids.float())
        self.log("loss", loss, on_step=True, on_epoch=True, sync_dist=True)
        self.log("mean_id", self.mean_id, on_step=False, on_epoch=True)
        return loss

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.trainer.global_step == self.recorded:
            return  # inside an accumulation window: no optimizer step yet
        self.recorded = self.trainer.global_step
        digest = hashlib.sha1()
        for tensor in [*self.parameters(), *self.buffers()]:
            digest.update(tensor.detach().numpy().tobytes())
        self.steps.append(
            {
                "step": self.trainer.global_step,
                "in_epoch": self.trainer.current_epoch,
                "state": digest.hexdigest(),
                "lr": self.trainer.optimizers[0].param_groups[0]["lr"],
                "samples": list(self.trainer.strategy.committed_samples),
            }
        )

    def on_train_epoch_end(self) -> None:
        metrics = self.trainer.callback_metrics
        self.steps.append({"epoch": {k: float(v) for k, v in sorted(metrics.items())}})

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(self.parameters(), lr=0.02)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.7)
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": scheduler, "interval": "step"},
        }

    def train_dataloader(self) -> DataLoader:  # type: ignore[type-arg]
        return DataLoader(Numbered(), batch_size=4, shuffle=True)


def _fit(monkeypatch: pytest.MonkeyPatch, fail_calls: set[int], **trainer: Any) -> Model:
    from lightning_elastic import ElasticFTStrategy
    from lightning_elastic.core.replicas.group import ReplicaGroup

    real = ReplicaGroup.reduce
    calls = {"n": 0}

    def reduce(self: ReplicaGroup, *args: Any, **kwargs: Any) -> Any:
        calls["n"] += 1
        if calls["n"] in fail_calls:  # a peer died during this step's allreduce
            self.manager.report_error(RuntimeError("injected"))
            return None
        return real(self, *args, **kwargs)

    monkeypatch.setattr(ReplicaGroup, "reduce", reduce)
    lighthouse = Lighthouse()
    monkeypatch.setenv("LIGHTNING_ELASTIC_LIGHTHOUSE", lighthouse.address)
    monkeypatch.setenv("LIGHTNING_ELASTIC_REPLICA_GROUP", "solo")
    monkeypatch.setenv("RUST_LOG", "warn")
    try:
        pl.seed_everything(7)
        model = Model()
        pl.Trainer(
            strategy=ElasticFTStrategy(step_timeout=5, quorum_timeout=30),
            accelerator="cpu",
            devices=1,
            max_epochs=2,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            **trainer,
        ).fit(model)
    finally:
        lighthouse.close()
        if torch.distributed.is_initialized():  # later tests expect a process without one
            torch.distributed.destroy_process_group()
    assert calls["n"] >= max(fail_calls, default=0)
    return model


@pytest.mark.parametrize(
    "trainer",
    [{}, {"accumulate_grad_batches": 3, "gradient_clip_val": 0.05}],
    ids=["plain", "accumulate-clip"],
)
def test_a_redone_step_is_bitwise_the_step_without_a_failure(
    monkeypatch: pytest.MonkeyPatch, trainer: dict[str, Any]
) -> None:
    """Failed attempts (an allreduce error, as a lost peer makes) at the first step, in the
    middle of the first epoch and at the last step of an epoch: every committed step's
    parameters and buffers, the LR schedule, the samples and the epoch-level self.log and
    torchmetrics values equal the run without failures; each step is seen once by Lightning."""
    os.environ.pop("PL_GLOBAL_SEED", None)
    clean = _fit(monkeypatch, set(), **trainer)
    first_epoch = [s for s in clean.steps if s.get("in_epoch") == 0]
    assert len(first_epoch) > 3
    faulty = _fit(monkeypatch, {1, 4, 5, len(first_epoch)}, **trainer)
    assert faulty.steps == clean.steps
    trained = sorted(i for s in first_epoch for i in s["samples"])
    assert trained == list(range(40))  # the first epoch: every sample once


class WithUnused(pl.LightningModule):
    """A head the loss never reaches (a second task's, a frozen-by-routing branch)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Linear(6, 1)
        self.unused = torch.nn.Linear(6, 2)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        _, x = batch
        return self.net(x).square().mean()

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        assert self.unused.weight.grad is None  # clipping, optimizers and hooks see it unused

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=0.05, weight_decay=0.5)

    def train_dataloader(self) -> DataLoader:  # type: ignore[type-arg]
        return DataLoader(Numbered(), batch_size=8, shuffle=True)


def test_a_parameter_no_backward_reached_stays_untouched(monkeypatch: pytest.MonkeyPatch) -> None:
    """As on one device and under DDP, a parameter without a gradient anywhere keeps
    ``grad=None``, so AdamW's weight decay and moments leave it alone (a zero gradient
    decayed it by lr * weight_decay each step)."""
    from lightning_elastic import ElasticFTStrategy
    from tests.replicas.harness import solo_group

    model = WithUnused()
    before = model.unused.weight.detach().clone()
    with solo_group(monkeypatch):
        pl.Trainer(
            strategy=ElasticFTStrategy(step_timeout=5, quorum_timeout=30),
            accelerator="cpu",
            devices=1,
            max_epochs=1,
            gradient_clip_val=1.0,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        ).fit(model)
    assert torch.equal(model.unused.weight, before)
    assert model.unused.weight not in model.trainer.optimizers[0].state


class Validated(pl.LightningModule):
    """Validation with a torchmetrics metric, ReduceLROnPlateau and EarlyStopping on it."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1)
        )
        self.val_mse = torchmetrics.MeanSquaredError()
        self.validated_at: list[int] = []
        self.autocast: set[bool] = set()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        ids, x = batch
        self.autocast.add(torch.is_autocast_enabled("cpu"))
        loss = (self.net(x).float().squeeze(1) - ids.float() / 40).square().mean()
        self.log("train_loss", loss, on_epoch=True, sync_dist=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        ids, x = batch
        self.val_mse(self.net(x).float().squeeze(1), ids.float() / 40)
        self.log("val_mse", self.val_mse, on_epoch=True)

    def on_validation_end(self) -> None:
        self.validated_at.append(self.trainer.global_step)

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(self.parameters(), lr=0.05)
        plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(
            optimizer, patience=0, factor=0.5, threshold=1.0, threshold_mode="abs"
        )
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": plateau, "monitor": "val_mse"},
        }

    def train_dataloader(self) -> DataLoader:  # type: ignore[type-arg]
        return DataLoader(Numbered(), batch_size=3, shuffle=True)

    def val_dataloader(self) -> DataLoader:  # type: ignore[type-arg]
        return DataLoader(Numbered(), batch_size=8)


def test_validation_every_n_steps_early_stopping_and_plateau_in_bf16_as_lightning_runs_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """bf16-mixed, validation every 5 steps and at epoch ends: validation runs at the steps
    plain Lightning runs it, ReduceLROnPlateau lowers the LR on the validation metric and
    EarlyStopping ends the fit at an epoch end, before max_epochs."""
    from lightning.pytorch.callbacks import EarlyStopping

    from lightning_elastic import ElasticFTStrategy
    from tests.replicas.harness import solo_group

    def fit(strategy: Any) -> tuple[Validated, pl.Trainer]:
        pl.seed_everything(1)
        model = Validated()
        trainer = pl.Trainer(
            strategy=strategy,
            accelerator="cpu",
            devices=1,
            precision="bf16-mixed",
            max_epochs=40,
            val_check_interval=5,
            num_sanity_val_steps=0,
            callbacks=[
                EarlyStopping("val_mse", patience=1, min_delta=1.0, check_on_train_epoch_end=True)
            ],
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        trainer.fit(model)
        return model, trainer

    plain, lightning = fit("auto")
    with solo_group(monkeypatch):
        model, trainer = fit(ElasticFTStrategy(step_timeout=5, quorum_timeout=30))
    assert model.autocast == {True}
    assert model.validated_at == plain.validated_at
    assert trainer.global_step == lightning.global_step == 28  # two epochs of 14 steps
    assert trainer.current_epoch == lightning.current_epoch
    lrs = [t.optimizers[0].param_groups[0]["lr"] for t in (trainer, lightning)]
    assert lrs == [0.025, 0.025]
