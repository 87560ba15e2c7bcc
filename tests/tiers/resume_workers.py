"""Lightning rank functions for test_lightning_resume.py and test_ckpt_path.py: a fit with tiers
that may raise at a given step, reporting where it resumed from and how it ended."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl

from lightning_elastic import DistributedCheckpoint, ElasticStrategy
from tests.lightning.models import TinyModule, fit_outcome, make_trainer


class Raising(TinyModule):
    def __init__(self, raise_at: int = -1, **kw: Any) -> None:
        super().__init__(**kw)
        self.raise_at = raise_at

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        if self.global_step == self.raise_at:
            raise RuntimeError("boom")
        return super().training_step(batch, batch_idx)


def fit(
    root: str,
    max_steps: int,
    *,
    ckpt_path: str | None = None,
    raise_at: int = -1,
    every: int | None = 5,
    model_kwargs: dict | None = None,
    **cb: Any,
) -> dict:
    pl.seed_everything(7, verbose=False)
    model = Raising(raise_at=raise_at, **(model_kwargs or {}))
    checkpoint = DistributedCheckpoint(f"{root}/ckpts", every_n_train_steps=every, **cb)
    trainer = make_trainer(
        root, max_steps=max_steps, strategy=ElasticStrategy(), callbacks=[checkpoint]
    )
    return fit_outcome(trainer, model, checkpoint, ckpt_path=ckpt_path, errors=(RuntimeError,))
