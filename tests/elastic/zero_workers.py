"""Optimizers, a module and rank functions for the ZeRO-1-with-every-optimizer tests.

One distributed run trains one small model per optimizer kind, one after the other, so that
the whole matrix costs a handful of process starts instead of one per (optimizer, world).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import lightning.pytorch as pl
import torch
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.optim import Optimizer
from torch.utils.data import DataLoader

from lightning_elastic import DistributedCheckpoint, ElasticStrategy
from lightning_elastic.errors import ConfigError
from lightning_elastic.lightning import zero
from tests.lightning.models import IdDataset, make_trainer

SAVE_AT = 3  # the checkpoint step; training then goes on to END (an epoch is 4 steps)
END = 5
GLOBAL_BATCH = 12  # 6 per rank at 2 ranks, 12 at 1, 4 at 3: the same samples per step
N = 48
LR = (0.01, 0.02)  # weights, biases: per-group hyperparameters that must survive
GAMMA = 0.5  # StepLR(step_size=2)


class SignMomentum(Optimizer):
    """A user's optimizer: an explicit extra hyperparameter (``beta``), others through
    ``**kwargs`` into its defaults (``scale``), and tensor state of two dtypes."""

    def __init__(self, params: Any, lr: float = 1e-3, beta: float = 0.9, **kwargs: Any) -> None:
        super().__init__(params, {"lr": lr, "beta": beta, "scale": 1.0, **kwargs})

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["avg"] = torch.zeros_like(p)
                    state["count"] = torch.zeros((), dtype=torch.int64)
                state["avg"].mul_(group["beta"]).add_(p.grad, alpha=1 - group["beta"])
                state["count"] += 1
                p.add_(state["avg"].sign(), alpha=-group["lr"] * group["scale"])
        return loss


class ForwardingAdamW(torch.optim.AdamW):
    """A user's subclass that forwards ``**kwargs``: its defaults hold AdamW's
    ``decoupled_weight_decay``, which neither it nor AdamW accepts."""

    def __init__(self, params: Any, **kwargs: Any) -> None:
        super().__init__(params, **kwargs)


def _groups(model: torch.nn.Module, **extra: Any) -> list[dict[str, Any]]:
    weights = [p for n, p in model.named_parameters() if n.endswith("weight")]
    biases = [p for n, p in model.named_parameters() if n.endswith("bias")]
    return [
        {"params": weights, "lr": LR[0], **extra},
        {"params": biases, "lr": LR[1], **({"weight_decay": 0.0} if extra else {})},
    ]


OPTIMIZERS: dict[str, Callable[[torch.nn.Module], Optimizer]] = {
    "sgd": lambda m: torch.optim.SGD(_groups(m), momentum=0.9, nesterov=True),
    "adam": lambda m: torch.optim.Adam(_groups(m), betas=(0.8, 0.99), amsgrad=True),
    "adamw": lambda m: torch.optim.AdamW(_groups(m, weight_decay=0.05)),
    "adagrad": lambda m: torch.optim.Adagrad(_groups(m), lr_decay=0.01),
    "rmsprop": lambda m: torch.optim.RMSprop(_groups(m), momentum=0.5, centered=True),
    "custom": lambda m: SignMomentum(_groups(m), beta=0.7, scale=0.5),
    "forwarding_adamw": lambda m: ForwardingAdamW(_groups(m, weight_decay=0.05)),
}


class ZeroModule(pl.LightningModule):
    """A two-layer MLP (no dropout: runs are deterministic), two parameter groups and a
    step-interval StepLR."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.net = torch.nn.Sequential(
            torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1)
        )

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        _, x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> Any:
        opt = OPTIMIZERS[self.kind](self)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=GAMMA)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def train_dataloader(self) -> DataLoader[Any]:
        return DataLoader(IdDataset(N), batch_size=4, shuffle=True)


def snapshot(trainer: pl.Trainer, module: pl.LightningModule) -> dict[str, Any]:
    """This rank's optimizer partition by parameter name, the global and local parameter
    groups' hyperparameters, and the scheduler's state."""
    optimizer = trainer.strategy.optimizers[0]
    assert isinstance(optimizer, ZeroRedundancyOptimizer), type(optimizer)
    names: dict[torch.Tensor, str] = {p: n for n, p in module.named_parameters()}
    return {
        "state": {
            names[p]: {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in s.items()}
            for p, s in optimizer.optim.state.items()
        },
        "groups": _hyperparameters(optimizer.param_groups, names),
        "local_groups": _hyperparameters(optimizer.optim.param_groups, names),
        "local_class": type(optimizer.optim).__name__,
        "scheduler": dict(trainer.lr_scheduler_configs[0].scheduler.state_dict()),
    }


def _hyperparameters(
    groups: Iterable[dict[str, Any]], names: dict[torch.Tensor, str]
) -> list[dict[str, Any]]:
    return [
        {**{k: v for k, v in g.items() if k != "params"}, "params": [names[p] for p in g["params"]]}
        for g in groups
    ]


class _Probe(pl.Callback):
    """Snapshots the optimizer when training (re)starts and after step ``at``."""

    def __init__(self, at: int) -> None:
        self.at = at
        self.taken: dict[str, Any] = {}

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.taken["start"] = snapshot(trainer, pl_module)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, *args: Any) -> None:
        if trainer.global_step == self.at:
            self.taken["at"] = snapshot(trainer, pl_module)


def fit_all(root: str, kinds: list[str]) -> dict[str, Any]:
    """Per kind: train to END (resuming from ``root/kind`` when it holds a checkpoint),
    checkpointing at SAVE_AT; the snapshots, final parameters and LR."""
    results: dict[str, Any] = {}
    for kind in kinds:
        pl.seed_everything(3, verbose=False)
        module = ZeroModule(kind)
        probe = _Probe(SAVE_AT)
        checkpoint = DistributedCheckpoint(
            f"{root}/{kind}", every_n_train_steps=SAVE_AT, save_on_train_end=False
        )
        strategy = ElasticStrategy(shard_optimizer_state=True, global_batch_size=GLOBAL_BATCH)
        trainer = make_trainer(
            f"{root}/{kind}-run",
            max_steps=END,
            strategy=strategy,
            devices=torch.distributed.get_world_size(),
            callbacks=[probe, checkpoint],
        )
        trainer.fit(module)
        results[kind] = {
            **probe.taken,
            "final": {n: p.detach().clone() for n, p in module.named_parameters()},
            "lr": [g["lr"] for g in trainer.optimizers[0].param_groups],
            "global_step": trainer.global_step,
            "resumed_from": trainer.ckpt_path,
        }
    return results


# ------------------------------------------------------------------ construction (1 rank)


class RejectsExtras(Optimizer):
    """Takes ``**kwargs`` but refuses every one of them: cannot be rebuilt from defaults."""

    def __init__(self, params: Any, lr: float = 0.1, **kwargs: Any) -> None:
        if kwargs:
            raise TypeError(
                f"RejectsExtras got an unexpected keyword argument {next(iter(kwargs))!r}"
            )
        super().__init__(params, {"lr": lr, "decay": 0.5})


def shard_kinds() -> dict[str, Any]:
    """Shard each optimizer kind (and one that cannot be rebuilt) on a ZeroModule."""
    out: dict[str, Any] = {}
    for kind, build in OPTIMIZERS.items():
        module = ZeroModule(kind)
        original = build(module)
        sharded = zero.shard(original)
        names: dict[torch.Tensor, str] = {p: n for n, p in module.named_parameters()}
        out[kind] = {
            "original": _hyperparameters(original.param_groups, names),
            "groups": _hyperparameters(sharded.param_groups, names),
            "local_groups": _hyperparameters(sharded.optim.param_groups, names),
            "local_class": type(sharded.optim).__name__,
        }
    try:
        zero.shard(RejectsExtras(ZeroModule("sgd").parameters()))
    except ConfigError as e:
        out["error"] = str(e)
    return out
