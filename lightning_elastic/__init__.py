"""lightning_elastic: distributed checkpoint sync for elastic PyTorch Lightning training.

The public API is the names below (``__all__``), listed once: ``_EXPORTS`` names where each is
defined, and every error and warning of :mod:`lightning_elastic.errors` (its ``__all__``) is
re-exported whole. docs/api.md lists the same names (a test keeps the two equal). Every other
module of the package is internal (docs/architecture.md, "The public boundary").

The names are imported lazily (PEP 562): ``import lightning_elastic`` (and the core, the errors,
the CLI) never imports Lightning, and torch only when a name that needs it is used. The import
does make ``Trainer(strategy="elastic")``, ``"elastic_fsdp"`` and ``"elastic_ft"`` work, whether
Lightning is imported before or after it (:mod:`lightning_elastic._strategy_names`).
"""

from __future__ import annotations

import importlib
import warnings
from typing import TYPE_CHECKING, Any

from lightning_elastic import _strategy_names, errors

__version__ = "0.1.0"

# public name -> module that defines it (the errors: below)
_EXPORTS = {
    "CheckpointEngine": "lightning_elastic.core.engine",
    "CheckpointInfo": "lightning_elastic.core.format.catalog",
    "Manifest": "lightning_elastic.core.format.manifest",
    "LoadResult": "lightning_elastic.core.load.load",
    "consolidate": "lightning_elastic.core.load.consolidate",
    "ImportResult": "lightning_elastic.core.load.import_ckpt",
    "import_checkpoint": "lightning_elastic.core.load.import_ckpt",
    "PerRankRule": "lightning_elastic.core.load.per_rank",
    "LoadedWeights": "lightning_elastic.core.load.weights",
    "load_weights": "lightning_elastic.core.load.weights",
    "RunHistory": "lightning_elastic.core.observe.history",
    "read_history": "lightning_elastic.core.observe.history",
    "HealthMonitor": "lightning_elastic.core.observe.monitor",
    "KeepAll": "lightning_elastic.core.policy.retention",
    "KeepBestK": "lightning_elastic.core.policy.retention",
    "KeepEveryNSteps": "lightning_elastic.core.policy.retention",
    "KeepLastN": "lightning_elastic.core.policy.retention",
    "CadenceOptions": "lightning_elastic.core.policy.cadence",
    "MonitoringOptions": "lightning_elastic.core.options",
    "TierOptions": "lightning_elastic.core.options",
    "SaveHandle": "lightning_elastic.core.save.inflight",
    "SaveResult": "lightning_elastic.core.save.request",
    "guard_optimizers": "lightning_elastic.core.save.snapshot",
    "guarded_tensors": "lightning_elastic.core.save.snapshot",
    "RetryPolicy": "lightning_elastic.core.storage.retry",
    "Storage": "lightning_elastic.core.storage.base",
    "DistributedCheckpoint": "lightning_elastic.lightning.callback",
    "ElasticCheckpointIO": "lightning_elastic.lightning.checkpoint_io",
    "ElasticSampler": "lightning_elastic.lightning.data",
    "ElasticFSDPStrategy": "lightning_elastic.lightning.fsdp",
    "ElasticFTStrategy": "lightning_elastic.lightning.replicas",
    "ElasticShardedIterable": "lightning_elastic.lightning.streaming",
    "ElasticStrategy": "lightning_elastic.lightning.strategy",
    "Lighthouse": "lightning_elastic.lighthouse",
    **dict.fromkeys(errors.__all__, "lightning_elastic.errors"),
}

# names that were public once: still importable, with a DeprecationWarning saying what to do
_DEPRECATED = {
    "read_jsonl": (
        "lightning_elastic.lightning.streaming",
        "lightning_elastic.read_jsonl is deprecated and will be removed: a reader is three "
        "lines of your own code (docs/streaming.md shows one)",
    ),
}

__all__ = sorted([*_EXPORTS, "__version__"])

if TYPE_CHECKING:  # for type checkers and IDEs; at run time __getattr__ imports on demand
    from lightning_elastic.core.engine import CheckpointEngine
    from lightning_elastic.core.format.catalog import CheckpointInfo
    from lightning_elastic.core.format.manifest import Manifest
    from lightning_elastic.core.load.consolidate import consolidate
    from lightning_elastic.core.load.import_ckpt import ImportResult, import_checkpoint
    from lightning_elastic.core.load.load import LoadResult
    from lightning_elastic.core.load.per_rank import PerRankRule
    from lightning_elastic.core.load.weights import LoadedWeights, load_weights
    from lightning_elastic.core.observe.history import RunHistory, read_history
    from lightning_elastic.core.observe.monitor import HealthMonitor
    from lightning_elastic.core.options import MonitoringOptions, TierOptions
    from lightning_elastic.core.policy.cadence import CadenceOptions
    from lightning_elastic.core.policy.retention import (
        KeepAll,
        KeepBestK,
        KeepEveryNSteps,
        KeepLastN,
    )
    from lightning_elastic.core.save.inflight import SaveHandle
    from lightning_elastic.core.save.request import SaveResult
    from lightning_elastic.core.save.snapshot import guard_optimizers, guarded_tensors
    from lightning_elastic.core.storage.base import Storage
    from lightning_elastic.core.storage.retry import RetryPolicy
    from lightning_elastic.errors import *  # noqa: F403  (exactly errors.__all__)
    from lightning_elastic.lighthouse import Lighthouse
    from lightning_elastic.lightning.callback import DistributedCheckpoint
    from lightning_elastic.lightning.checkpoint_io import ElasticCheckpointIO
    from lightning_elastic.lightning.data import ElasticSampler
    from lightning_elastic.lightning.fsdp import ElasticFSDPStrategy
    from lightning_elastic.lightning.replicas import ElasticFTStrategy
    from lightning_elastic.lightning.strategy import ElasticStrategy
    from lightning_elastic.lightning.streaming import ElasticShardedIterable

_strategy_names.install()


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None and name in _DEPRECATED:
        module, message = _DEPRECATED[name]
        warnings.warn(message, DeprecationWarning, stacklevel=2)
        return getattr(importlib.import_module(module), name)  # not cached: warns every time
    if module is None:
        raise AttributeError(f"module 'lightning_elastic' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # cache: later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return __all__
