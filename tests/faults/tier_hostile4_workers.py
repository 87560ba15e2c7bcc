"""Rank functions for tests/faults/test_tier_hostile4.py (the fourth hostile review of
multi-tier checkpoints, through Lightning). Module level, so they pickle.

Each rank is its own "node" (``names[rank]``) with its own local root ``<root>/local/<node>``
unless ``local_dirpath`` is given."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from lightning_elastic import DistributedCheckpoint, ElasticStrategy, TierOptions
from tests.lightning.models import IdDataset, TinyModule, make_trainer


class Scored(TinyModule):
    """TinyModule with a ``score`` logged every step (``|step - best_at|``: the checkpoint of
    step ``best_at`` is the best, mode "min") and a validation/test loop that records the
    weights' checksum it ran with."""

    def __init__(self, best_at: int = 10, **kw: Any) -> None:
        super().__init__(**kw)
        self.best_at = best_at
        self.eval_weights: list[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        loss = super().training_step(batch, batch_idx)
        score = float(abs(self.global_step + 1 - self.best_at))
        self.log("score", score, on_step=True, on_epoch=False, sync_dist=False)
        return loss

    def _eval(self, batch: Any) -> torch.Tensor:
        _, x, y = batch
        self.eval_weights.append(weights_sum(self))
        return torch.nn.functional.mse_loss(self.net(x), y)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", self._eval(batch), sync_dist=True)

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self.log("test_loss", self._eval(batch), sync_dist=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(IdDataset(8), batch_size=4)

    def test_dataloader(self) -> DataLoader:
        return DataLoader(IdDataset(8), batch_size=4)


def weights_sum(module: torch.nn.Module) -> float:
    return float(sum(p.detach().double().sum() for p in module.net.parameters()))


TIER_OPTIONS = ("persist_every_n_saves", "replicas", "local_keep")


def _tiers(root: str, names: str, cb: dict[str, Any], local: str | None = None) -> dict[str, Any]:
    """The callback's keywords: ``cb`` with its tier options in ``tiers=TierOptions``, this
    rank's node ``names[rank]`` and local root (``local``, else ``root/local/<node>``)."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    node = names[rank]
    rest = dict(cb)
    tier = {k: rest.pop(k) for k in TIER_OPTIONS if k in rest}
    local_dirpath = local or f"{root}/local/{node}"
    return {"tiers": TierOptions(local_dirpath, node=node, **tier), **rest}


def fit(
    root: str,
    max_steps: int,
    kill_at: int = -1,
    *,
    names: str = "ab",
    every: int | None = 5,
    dirpath: str | None = None,
    model_kwargs: dict | None = None,
    monitor: str | None = None,
    **cb: Any,
) -> dict[str, Any]:
    """Fit ``Scored`` at the process group's world size, every rank its own node."""
    pl.seed_everything(7, verbose=False)
    world = dist.get_world_size()
    model = Scored(kill_at=kill_at, **(model_kwargs or {}))
    checkpoint = DistributedCheckpoint(
        dirpath or f"{root}/ckpts",
        every_n_train_steps=every,
        monitor=monitor,
        **_tiers(root, names, cb),
    )
    trainer = make_trainer(
        root,
        max_steps=max_steps,
        strategy=ElasticStrategy(),
        devices=world,
        callbacks=[checkpoint],
        limit_val_batches=0,
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
        first_step=model.losses[0][0] if model.losses else None,
        last=checkpoint.last_model_path,
        best=checkpoint.best_model_path,
        best_score=checkpoint.best_model_score,
        recovery=checkpoint.recovery,
        weights=weights_sum(model),
    )
    return out


def evaluate(
    root: str,
    fn: str,
    ckpt_path: str,
    *,
    names: str = "ab",
    monitor: str | None = None,
    **cb: Any,
) -> dict[str, Any]:
    """A fresh process: ``trainer.validate/test(model, ckpt_path=...)`` with a tiered
    ``DistributedCheckpoint`` (as after a restart); what was loaded."""
    pl.seed_everything(123, verbose=False)  # other initial weights than any fit
    model = Scored()
    checkpoint = DistributedCheckpoint(
        f"{root}/ckpts", monitor=monitor, mode="min", **_tiers(root, names, cb)
    )
    trainer = make_trainer(
        root,
        max_steps=1,
        strategy=ElasticStrategy(),
        devices=dist.get_world_size(),
        callbacks=[checkpoint],
    )
    out: dict[str, Any] = {}
    try:
        getattr(trainer, fn)(model, ckpt_path=ckpt_path, verbose=False)
    except Exception as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
    out.update(
        ckpt_path=str(trainer.ckpt_path) if trainer.ckpt_path is not None else None,
        eval_weights=model.eval_weights,
        weights=weights_sum(model),
    )
    return out


def fit_then_test_best_path(root: str, max_steps: int, **cb: Any) -> dict[str, Any]:
    """Fit with a monitor, then ``trainer.test(ckpt_path=checkpoint.best_model_path)`` in the
    same process, as Lightning users do after ``ModelCheckpoint``."""
    pl.seed_everything(7, verbose=False)
    model = Scored()
    checkpoint = DistributedCheckpoint(
        f"{root}/ckpts", every_n_train_steps=5, monitor="score", **_tiers(root, "ab", cb)
    )
    trainer = make_trainer(
        root,
        max_steps=max_steps,
        strategy=ElasticStrategy(),
        devices=dist.get_world_size(),
        callbacks=[checkpoint],
        limit_val_batches=0,
    )
    trainer.fit(model)
    out: dict[str, Any] = {"best": checkpoint.best_model_path, "last": checkpoint.last_model_path}
    try:
        trainer.test(model, ckpt_path=checkpoint.best_model_path, verbose=False)
        out["tested"] = str(trainer.ckpt_path)
    except Exception as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
    return out


def fit_config(root: str, max_steps: int, local_of: dict[str, str], **cb: Any) -> dict[str, Any]:
    """A fit whose rank r is node ``names[r]`` with local root ``local_of[node]``: the error
    (type and message) or the outcome."""
    pl.seed_everything(7, verbose=False)
    rank = dist.get_rank()
    names = cb.pop("names", "ab")
    node = names[rank]
    out: dict[str, Any] = {}
    try:
        checkpoint = DistributedCheckpoint(
            f"{root}/ckpts", every_n_train_steps=3, **_tiers(root, names, cb, local_of[node])
        )
        trainer = make_trainer(
            root,
            max_steps=max_steps,
            strategy=ElasticStrategy(),
            devices=dist.get_world_size(),
            callbacks=[checkpoint],
        )
        trainer.fit(TinyModule())
        out["global_step"] = trainer.global_step
    except Exception as exc:
        out["error"] = type(exc).__name__
        out["message"] = str(exc)
    return out
