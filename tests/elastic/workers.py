"""Rank functions for the elastic (world-size change) tests."""

from __future__ import annotations

import logging
from typing import Any

import lightning.pytorch as pl
import torch
from torch.distributed.optim import ZeroRedundancyOptimizer

from lightning_elastic import DistributedCheckpoint, ElasticStrategy
from tests.elastic.journal import Journal
from tests.lightning.models import TinyModule, make_trainer


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def partition_state(trainer: pl.Trainer, module: pl.LightningModule) -> dict[str, Any]:
    """This rank's optimizer state by parameter name (the ZeRO partition, or everything)."""
    optimizer = trainer.strategy.optimizers[0]
    names = {p: n for n, p in module.named_parameters()}
    local = optimizer.optim if isinstance(optimizer, ZeroRedundancyOptimizer) else optimizer
    return {
        names[p]: {k: v.clone() for k, v in s.items() if isinstance(v, torch.Tensor)}
        for p, s in local.state.items()
    }


def elastic_fit(
    root: str,
    max_steps: int,
    kill_at: int = -1,
    every: int = 4,
    shard: bool = False,
    global_batch_size: int | None = None,
    dropout: float = 0.3,
    n: int = 120,
    batch_size: int = 4,
) -> dict[str, Any]:
    records = _Records()
    logging.getLogger("lightning_elastic").addHandler(records)
    pl.seed_everything(7, verbose=False)
    model = TinyModule(n=n, batch_size=batch_size, kill_at=kill_at, dropout=dropout)
    checkpoint = DistributedCheckpoint(
        f"{root}/ckpts", every_n_train_steps=every, save_on_train_end=False
    )
    journal = Journal(f"{root}/journal")
    strategy = ElasticStrategy(shard_optimizer_state=shard, global_batch_size=global_batch_size)
    devices = torch.distributed.get_world_size()
    trainer = make_trainer(
        root,
        max_steps=max_steps,
        strategy=strategy,
        devices=devices,
        callbacks=[journal, checkpoint],
        gradient_clip_val=1.0 if shard else None,  # clipping goes through the ZeRO optimizer
    )
    trainer.fit(model)
    return {
        "losses": model.losses,
        "global_losses": model.global_losses,
        "seen": model.seen,
        "epoch_metrics": model.epoch_metrics,
        "global_step": trainer.global_step,
        "resumed_from": trainer.ckpt_path,
        "partition": partition_state(trainer, model),
        "lr": trainer.optimizers[0].param_groups[0]["lr"],
        "sharded": isinstance(trainer.strategy.optimizers[0], ZeroRedundancyOptimizer),
        "log": records.messages,
    }
