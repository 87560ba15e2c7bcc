"""Rank functions for tests/lightning/test_checkpoint_io.py (module level: they pickle)."""

from __future__ import annotations

import os
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_elastic import ElasticCheckpointIO
from tests.lightning.models import TinyModule, make_trainer


class Scored(TinyModule):
    """Logs ``score`` every step: the save at step 6 records 0, the best."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.log("score", abs(self.global_step - 5.0))
        return loss

    def test_step(self, batch: Any, batch_idx: int) -> None:
        _, x, y = batch
        self.log("test_loss", torch.nn.functional.mse_loss(self.net(x), y), sync_dist=True)

    def test_dataloader(self) -> Any:
        return self.train_dataloader()


def _trainer(root: str, max_steps: int) -> tuple[pl.Trainer, ModelCheckpoint]:
    callback = ModelCheckpoint(
        dirpath=f"{root}/ckpts",
        monitor="score",
        save_top_k=2,
        every_n_train_steps=2,
        save_last=True,
    )
    trainer = make_trainer(
        root,
        max_steps=max_steps,
        strategy="ddp",
        devices=2,
        callbacks=[callback],
        plugins=[ElasticCheckpointIO()],
    )
    return trainer, callback


def fit_test_resume(root: str) -> dict[str, Any]:
    """Every rank: fit 10 steps under DDP with ModelCheckpoint (top 2 by ``score`` every 2
    steps, and last.ckpt), test(ckpt_path="best"), then a new Trainer fits on to step 14 from
    ckpt_path="last"."""
    pl.seed_everything(3, verbose=False)
    model = Scored(n=32, hidden=16)  # 32 samples, 2 ranks, batches of 4: 4 steps an epoch
    trainer, callback = _trainer(root, 10)
    trainer.fit(model)
    names = sorted(n for n in os.listdir(f"{root}/ckpts") if not n.startswith("."))
    best = callback.best_model_path
    trainer.test(model, ckpt_path="best", verbose=False)
    tested = {k: v.detach().clone() for k, v in model.state_dict().items()}
    from lightning_elastic import consolidate

    best_weights = consolidate(best)["state_dict"]
    again, _ = _trainer(root, 14)
    resumed = Scored(n=32, hidden=16)
    again.fit(resumed, ckpt_path="last")
    return {
        "names": names,
        "best": best,
        "tested": all(torch.equal(tested[k], best_weights[k]) for k in best_weights),
        "resumed": again.ckpt_path,
        "step": again.global_step,
    }
