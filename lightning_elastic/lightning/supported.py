"""Which Lightning strategies ``DistributedCheckpoint`` works with."""

from __future__ import annotations

import lightning.pytorch as pl
from lightning.pytorch.strategies import (
    DDPStrategy,
    DeepSpeedStrategy,
    FSDPStrategy,
    ModelParallelStrategy,
    SingleDeviceStrategy,
)

from lightning_elastic.errors import ConfigError
from lightning_elastic.lightning.fsdp import ElasticFSDPStrategy

__all__ = ["check_strategy"]


def check_strategy(trainer: pl.Trainer) -> None:
    """Raise :class:`ConfigError` naming what to use when the trainer's strategy is not one
    ``DistributedCheckpoint`` supports."""
    strategy = trainer.strategy
    supported = (ElasticFSDPStrategy, DDPStrategy, SingleDeviceStrategy)
    if isinstance(strategy, supported) and not isinstance(strategy, DeepSpeedStrategy):
        return
    hint = ""
    if isinstance(strategy, (ModelParallelStrategy, FSDPStrategy)):
        hint = " (for FSDP2, strategy='elastic_fsdp' is ModelParallelStrategy with our checkpoints)"
    raise ConfigError(
        f"DistributedCheckpoint does not support {strategy.__class__.__name__}: use "
        "strategy='elastic' (ElasticStrategy: DDP, optionally ZeRO-1), 'elastic_fsdp' "
        f"(ElasticFSDPStrategy: FSDP2), 'ddp', 'ddp_spawn' or a single device{hint}"
    )
