"""Rank functions for the Lightning tests."""

from __future__ import annotations

import lightning.pytorch as pl

from lightning_elastic import DistributedCheckpoint, ElasticStrategy
from tests.lightning.models import TinyModule, make_trainer


def fit(root: str, max_steps: int, kill_at: int = -1, every: int = 5, strategy: str = "elastic", **cb: object) -> dict:
    pl.seed_everything(7, verbose=False)
    model = TinyModule(kill_at=kill_at)
    checkpoint = DistributedCheckpoint(f"{root}/ckpts", every_n_train_steps=every, **cb)
    trainer = make_trainer(
        root,
        max_steps=max_steps,
        strategy=ElasticStrategy() if strategy == "elastic" else strategy,
        callbacks=[checkpoint],
    )
    trainer.fit(model)
    return {
        "losses": model.losses,
        "seen": model.seen,
        "global_step": trainer.global_step,
        "last": checkpoint.last_model_path,
        "resumed_from": trainer.ckpt_path,
    }
