"""lightning_elastic: distributed checkpoint sync for elastic PyTorch Lightning training.

The public names below are imported lazily (PEP 562): ``import lightning_elastic`` (and the
core, the errors, the CLI) never imports Lightning, and torch only when a name that needs it
is used.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# public name -> module that defines it
_EXPORTS = {
    "CheckpointEngine": "lightning_elastic.core.engine",
    "SaveHandle": "lightning_elastic.core.engine",
    "CheckpointInfo": "lightning_elastic.core.format.catalog",
    "Manifest": "lightning_elastic.core.format.manifest",
    "LoadResult": "lightning_elastic.core.load.load",
    "consolidate": "lightning_elastic.core.load.consolidate",
    "ImportResult": "lightning_elastic.core.load.import_ckpt",
    "import_checkpoint": "lightning_elastic.core.load.import_ckpt",
    "PerRankRule": "lightning_elastic.core.load.per_rank",
    "LoadedWeights": "lightning_elastic.core.load.weights",
    "load_weights": "lightning_elastic.core.load.weights",
    "KeepAll": "lightning_elastic.core.policy.retention",
    "KeepBestK": "lightning_elastic.core.policy.retention",
    "KeepEveryNSteps": "lightning_elastic.core.policy.retention",
    "KeepLastN": "lightning_elastic.core.policy.retention",
    "SaveResult": "lightning_elastic.core.save.request",
    "RetryPolicy": "lightning_elastic.core.storage.retry",
    "Storage": "lightning_elastic.core.storage.base",
    "DistributedCheckpoint": "lightning_elastic.lightning.callback",
    "ElasticCheckpointIO": "lightning_elastic.lightning.checkpoint_io",
    "ElasticSampler": "lightning_elastic.lightning.data",
    "ElasticFSDPStrategy": "lightning_elastic.lightning.fsdp",
    "ElasticFTStrategy": "lightning_elastic.lightning.replicas",
    "ElasticShardedIterable": "lightning_elastic.lightning.streaming",
    "read_jsonl": "lightning_elastic.lightning.streaming",
    "ElasticStrategy": "lightning_elastic.lightning.strategy",
    "ForkingWorkersWarning": "lightning_elastic.lightning.fork_safety",
    **{
        name: "lightning_elastic.errors"
        for name in (
            "CheckpointExistsError",
            "CheckpointLoadError",
            "CheckpointMismatchError",
            "CheckpointNotFoundError",
            "CheckpointSaveError",
            "CheckpointTimeoutError",
            "ConfigError",
            "CorruptCheckpointWarning",
            "DataShardingError",
            "ElasticCheckpointError",
            "IntegrityError",
            "LoadTimeoutError",
            "ManifestError",
            "PerRankStateError",
            "ReplicaGroupError",
            "SaveTimeoutError",
            "StaleWriterError",
            "StorageError",
            "StorageFullError",
            "StorageNotFoundError",
            "StoragePermissionError",
            "StragglerWarning",
            "TransientStorageError",
            "UnsafeCheckpointError",
            "UnsupportedFormatError",
            "WeightsMismatchError",
            "WorldSizeError",
        )
    },
}

__all__ = sorted([*_EXPORTS, "__version__"])

if TYPE_CHECKING:  # for type checkers and IDEs; at run time __getattr__ imports on demand
    from lightning_elastic.core.engine import CheckpointEngine, SaveHandle
    from lightning_elastic.core.format.catalog import CheckpointInfo
    from lightning_elastic.core.format.manifest import Manifest
    from lightning_elastic.core.load.consolidate import consolidate
    from lightning_elastic.core.load.import_ckpt import ImportResult, import_checkpoint
    from lightning_elastic.core.load.load import LoadResult
    from lightning_elastic.core.load.per_rank import PerRankRule
    from lightning_elastic.core.load.weights import LoadedWeights, load_weights
    from lightning_elastic.core.policy.retention import (
        KeepAll,
        KeepBestK,
        KeepEveryNSteps,
        KeepLastN,
    )
    from lightning_elastic.core.save.request import SaveResult
    from lightning_elastic.core.storage.base import Storage
    from lightning_elastic.core.storage.retry import RetryPolicy
    from lightning_elastic.errors import (
        CheckpointExistsError,
        CheckpointLoadError,
        CheckpointMismatchError,
        CheckpointNotFoundError,
        CheckpointSaveError,
        CheckpointTimeoutError,
        ConfigError,
        CorruptCheckpointWarning,
        DataShardingError,
        ElasticCheckpointError,
        IntegrityError,
        LoadTimeoutError,
        ManifestError,
        PerRankStateError,
        ReplicaGroupError,
        SaveTimeoutError,
        StaleWriterError,
        StorageError,
        StorageFullError,
        StorageNotFoundError,
        StoragePermissionError,
        StragglerWarning,
        TransientStorageError,
        UnsafeCheckpointError,
        UnsupportedFormatError,
        WeightsMismatchError,
        WorldSizeError,
    )
    from lightning_elastic.lightning.callback import DistributedCheckpoint
    from lightning_elastic.lightning.checkpoint_io import ElasticCheckpointIO
    from lightning_elastic.lightning.data import ElasticSampler
    from lightning_elastic.lightning.fork_safety import ForkingWorkersWarning
    from lightning_elastic.lightning.fsdp import ElasticFSDPStrategy
    from lightning_elastic.lightning.replicas import ElasticFTStrategy
    from lightning_elastic.lightning.strategy import ElasticStrategy
    from lightning_elastic.lightning.streaming import ElasticShardedIterable, read_jsonl


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'lightning_elastic' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # cache: later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return __all__
