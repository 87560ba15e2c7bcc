"""Rank functions for the FSDP2 (``elastic_fsdp``) tests: the tiny model sharded with
``fully_shard``, and full snapshots of its parameters and optimizer states."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
)
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor

from lightning_elastic import (
    DistributedCheckpoint,
    ElasticFSDPStrategy,
    ElasticStrategy,
    TierOptions,
)
from tests.lightning.models import TinyModule, make_trainer

_FULL = StateDictOptions(full_state_dict=True)  # on every rank


class ShardedModule(TinyModule):
    """``TinyModule`` with its layers sharded by FSDP2 in ``configure_model``; optionally
    bf16 compute (fp32 reduction), a frozen first layer, or unsharded (plain DDP use)."""

    def __init__(
        self, *args: Any, mixed: bool = False, frozen: bool = False, unused: bool = False, **kw: Any
    ) -> None:
        super().__init__(*args, **kw)
        self.save_hyperparameters()
        if frozen:
            self.net[0].requires_grad_(False)
        if unused:  # a layer the optimizer holds that never gets a gradient (a later head)
            self.aux = torch.nn.Linear(4, 4)

    def configure_model(self) -> None:
        if getattr(self, "_device_mesh", None) is None:
            return  # not under a model-parallel strategy: a plain module
        if self.device_mesh["tensor_parallel"].size() > 1:  # 2-D: TP inside, FSDP across
            from torch.distributed.tensor.parallel import (
                ColwiseParallel,
                RowwiseParallel,
                parallelize_module,
            )

            plan = {"0": ColwiseParallel(), "3": RowwiseParallel()}
            parallelize_module(self.net, self.device_mesh["tensor_parallel"], plan)
        mesh = self.device_mesh["data_parallel"]
        policy = (
            MixedPrecisionPolicy(
                param_dtype=torch.bfloat16, reduce_dtype=torch.float32, output_dtype=torch.float32
            )
            if self.hparams.mixed
            else MixedPrecisionPolicy()
        )
        for layer in (self.net[0], self.net[3]):
            fully_shard(layer, mesh=mesh, mp_policy=policy)
        if self.hparams.unused:
            fully_shard(self.aux, mesh=mesh, mp_policy=policy)
        fully_shard(self.net, mesh=mesh, mp_policy=policy)

    def configure_optimizers(self) -> Any:
        trainable = [p for p in self.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(trainable, lr=self.hparams.lr, weight_decay=0.1)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.7)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class _SaveAtStart(pl.Callback):
    def __init__(self, path: str) -> None:
        self.path = path

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        trainer.save_checkpoint(self.path)


def _full(value: Any) -> Any:
    if isinstance(value, DTensor):
        return value.full_tensor().detach().clone()
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: _full(v) for k, v in value.items()}
    return value


def snapshot(trainer: pl.Trainer, module: pl.LightningModule) -> dict[str, Any]:
    """Every parameter and optimizer state as full tensors, keyed by name (collective under
    FSDP), and what each rank holds of them."""
    optimizer = trainer.optimizers[0]
    sharded = isinstance(next(module.parameters()), DTensor)
    if sharded:
        model = get_model_state_dict(module, options=_FULL)
        # (asked first: torch would create the states of an optimizer that never stepped)
        optim = {}
        if optimizer.state:
            optim = get_optimizer_state_dict(module, optimizer, options=_FULL)["state"]
        local = sum(p.to_local().numel() for p in module.parameters())
    else:
        names = {p: n for n, p in module.named_parameters()}
        model = {k: v.detach().clone() for k, v in module.state_dict().items()}
        local_optim = (
            optimizer.optim if isinstance(optimizer, ZeroRedundancyOptimizer) else optimizer
        )
        # ZeRO: this rank's partition only (the union over the ranks is the whole state)
        optim = {names[p]: _full(s) for p, s in local_optim.state.items()}
        local = sum(p.numel() for p in module.parameters())
    params = {k: v for k, v in model.items() if k.startswith("net.")}
    return {
        "params": params,
        "optim": {k: {n: _full(t) for n, t in s.items()} for k, s in optim.items()},
        "local_numel": local,
        "partitioned": isinstance(optimizer, ZeroRedundancyOptimizer),
        "lr": optimizer.param_groups[0]["lr"],
    }


def fsdp_fit(
    root: str,
    max_steps: int,
    *,
    kill_at: int = -1,
    every: int = 4,
    strategy: str = "elastic_fsdp",
    global_batch_size: int | None = None,
    mixed: bool = False,
    frozen: bool = False,
    shard: bool = False,
    n: int = 96,
    batch_size: int = 4,
    dropout: float = 0.3,
    async_save: bool = True,
    ckpt_path: str | None = None,
    tensor_parallel: int = 1,
    signal_at: int = -1,
    unused: bool = False,
    save_at_start: bool = False,
    nodes: bool = False,
) -> dict[str, Any]:
    """Fit ``ShardedModule`` under ``strategy`` (``"elastic_fsdp"``, ``"elastic"``, or
    ``"single"``: one device) with a ``DistributedCheckpoint`` every ``every`` steps, resuming
    from the newest checkpoint of ``root``. ``nodes``: multi-tier, each rank its own "node"
    (``"ab"[rank]``, local root ``<root>/local/<node>``), every 3rd save persisted, one
    replica."""
    pl.seed_everything(7, verbose=False)
    model = ShardedModule(
        n=n,
        batch_size=batch_size,
        kill_at=kill_at,
        dropout=dropout,
        hidden=30,
        mixed=mixed,
        frozen=frozen,
        signal_at=signal_at,
        signal_rank=1,
        unused=unused,
    )
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    chosen: Any
    if strategy == "elastic_fsdp":
        chosen = ElasticFSDPStrategy(
            tensor_parallel_size=tensor_parallel, global_batch_size=global_batch_size
        )
    elif strategy == "elastic":
        chosen = ElasticStrategy(shard_optimizer_state=shard, global_batch_size=global_batch_size)
    else:
        chosen = "auto"
    tiers: dict[str, Any] = {}
    if nodes:
        node = "ab"[torch.distributed.get_rank()]
        tiers = {"tiers": TierOptions(f"{root}/local/{node}", node=node, persist_every_n_saves=3)}
    checkpoint = DistributedCheckpoint(
        f"{root}/ckpts",
        every_n_train_steps=every,
        save_on_train_end=False,
        async_save=async_save,
        **tiers,
    )
    callbacks: list[Any] = [checkpoint]
    if save_at_start:  # a checkpoint before the first optimizer step
        callbacks.append(_SaveAtStart(f"{root}/at_start"))
    trainer = make_trainer(
        root,
        max_steps=max_steps,
        strategy=chosen,
        devices=world if strategy != "single" else 1,
        callbacks=callbacks,
    )
    try:
        trainer.fit(model, ckpt_path=ckpt_path)
    except SystemExit as exc:  # a signal: the agreed checkpoint was taken, every rank exits
        return {"exit": exc.code, "global_step": trainer.global_step}
    return {
        "losses": model.losses,
        "global_losses": model.global_losses,
        "seen": model.seen,
        "global_step": trainer.global_step,
        "resumed_from": trainer.ckpt_path,
        "recovery": checkpoint.recovery,
        **snapshot(trainer, model),
    }


class EvaluatedModule(ShardedModule):
    """``ShardedModule`` with a validation loop (the mean squared error over 32 samples)."""

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        _, x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.net(x), y), sync_dist=True)

    def val_dataloader(self) -> Any:
        from torch.utils.data import DataLoader

        from tests.lightning.models import IdDataset

        return DataLoader(IdDataset(32), batch_size=8)


def fsdp_save_then_validate(root: str, saved: bool) -> dict[str, Any]:
    """``saved=False``: fit 4 steps under ``elastic_fsdp`` and ``trainer.save_checkpoint`` to
    ``root/manual``; ``saved=True``: validate that checkpoint (``ckpt_path``) under
    ``elastic_fsdp`` at this world size, or on one device when the world is 1."""
    pl.seed_everything(7, verbose=False)
    model = EvaluatedModule(dropout=0.0, hidden=30)
    world = torch.distributed.get_world_size()
    strategy: Any = ElasticFSDPStrategy() if world > 1 or not saved else "auto"
    trainer = make_trainer(root, max_steps=4, strategy=strategy, devices=world)
    if not saved:
        trainer.fit(model)
        trainer.save_checkpoint(f"{root}/manual")
        return {"params": snapshot(trainer, model)["params"]}
    metrics = trainer.validate(model, ckpt_path=f"{root}/manual", verbose=False)
    return {"val_loss": metrics[0]["val_loss"], "strategy": type(trainer.strategy).__name__}
