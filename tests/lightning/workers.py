"""Rank functions for the Lightning tests."""

from __future__ import annotations

import dataclasses
from typing import Any

import lightning.pytorch as pl

from lightning_elastic import DistributedCheckpoint, ElasticStrategy
from tests.lightning.models import TinyModule, make_trainer


def _strategy(name: str) -> Any:
    return ElasticStrategy() if name == "elastic" else name


def fit(
    root: str,
    max_steps: int,
    kill_at: int = -1,
    every: int | None = 5,
    strategy: str = "elastic",
    devices: int = 2,
    model_kwargs: dict | None = None,
    **cb: Any,
) -> dict:
    pl.seed_everything(7, verbose=False)
    model = TinyModule(kill_at=kill_at, **(model_kwargs or {}))
    checkpoint = DistributedCheckpoint(f"{root}/ckpts", every_n_train_steps=every, **cb)
    trainer = make_trainer(
        root,
        max_steps=max_steps,
        strategy=_strategy(strategy),
        devices=devices,
        callbacks=[checkpoint],
    )
    out: dict[str, Any] = {}
    try:
        trainer.fit(model)
    except SystemExit as exc:
        out["exit"] = exc.code
    out.update(
        losses=model.losses,
        seen=model.seen,
        global_step=trainer.global_step,
        last=checkpoint.last_model_path,
        best=checkpoint.best_model_path,
        resumed_from=trainer.ckpt_path,
        resume_cost=dataclasses.asdict(checkpoint.resume_cost) if checkpoint.resume_cost else None,
        preempted_by=checkpoint.preempted_by,
        recovery=checkpoint.recovery,
    )
    return out


def save_then_fit_ckpt_path(root: str) -> dict:
    """trainer.save_checkpoint(path) with ElasticStrategy, then fit(ckpt_path=path)."""
    pl.seed_everything(7, verbose=False)
    first = make_trainer(root, max_steps=6, strategy=ElasticStrategy())
    first.fit(TinyModule())
    path = f"{root}/manual.ckpt"
    first.save_checkpoint(path)
    model = TinyModule()
    second = make_trainer(root, max_steps=9, strategy=ElasticStrategy())
    second.fit(model, ckpt_path=path)
    return {"steps": [s for s, _ in model.losses], "ckpt_path": second.ckpt_path}


def fit_with_request(root: str) -> dict:
    """Rank 1 alone asks for a checkpoint at step 3 (no signals, no interval configured)."""
    import lightning.pytorch as pl

    pl.seed_everything(7, verbose=False)
    checkpoint = DistributedCheckpoint(f"{root}/ckpts", signals=(), save_on_train_end=False)

    class Asking(TinyModule):
        def training_step(self, batch, batch_idx):
            if self.global_step == 2 and self.global_rank == 1:  # step 3 once this one ends
                checkpoint.request_checkpoint()
            return super().training_step(batch, batch_idx)

    trainer = make_trainer(root, max_steps=6, strategy=ElasticStrategy(), callbacks=[checkpoint])
    trainer.fit(Asking())
    return {"last": checkpoint.last_model_path}


def fit_with_failing_storage(root: str, faults: list) -> dict:
    """Saves go through faulty://, where rank 1's second shard write is refused."""
    import lightning.pytorch as pl

    import lightning_elastic.testing.faults  # noqa: F401  (registers faulty://)
    from lightning_elastic.errors import CheckpointSaveError

    pl.seed_everything(7, verbose=False)
    checkpoint = DistributedCheckpoint(f"faulty://{root}/ckpts", every_n_train_steps=2)
    model = TinyModule()
    strategy = ElasticStrategy(storage_options={"faults": faults})
    trainer = make_trainer(root, max_steps=12, strategy=strategy, callbacks=[checkpoint])
    error = None
    try:
        trainer.fit(model)
    except CheckpointSaveError as exc:
        error = exc
    assert checkpoint.health is not None
    metrics = checkpoint.health.health.snapshot()
    return {"error": error, "step": trainer.global_step, "metrics": metrics}
