"""Rank functions for tests/lightning/test_native_loading.py (module level: they pickle)."""

from __future__ import annotations

import lightning.pytorch as pl
import torch

from lightning_elastic import DistributedCheckpoint, ElasticStrategy
from tests.lightning.models import TinyModule, make_trainer


def fit_and_return_weights(root: str, max_steps: int) -> dict[str, torch.Tensor]:
    """Train on every rank with ElasticStrategy, checkpoints every 3 steps and at the end;
    return the final weights (what the train-end checkpoint holds)."""
    pl.seed_everything(7, verbose=False)
    model = TinyModule(hidden=16)
    checkpoint = DistributedCheckpoint(f"{root}/ckpts", every_n_train_steps=3)
    trainer = make_trainer(
        root, max_steps=max_steps, strategy=ElasticStrategy(), callbacks=[checkpoint]
    )
    trainer.fit(model)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}
