"""lightning_elastic: distributed checkpoint sync for elastic PyTorch Lightning training."""

from lightning_elastic.core.catalog import CheckpointInfo
from lightning_elastic.core.engine import CheckpointEngine, SaveHandle
from lightning_elastic.core.loader import LoadResult
from lightning_elastic.core.manifest import Manifest
from lightning_elastic.core.retention import KeepAll, KeepBestK, KeepEveryNSteps, KeepLastN
from lightning_elastic.core.retry import RetryPolicy
from lightning_elastic.core.saver import SaveResult
from lightning_elastic.core.storage import Storage
from lightning_elastic.errors import (
    CheckpointExistsError,
    CheckpointLoadError,
    CheckpointNotFoundError,
    CheckpointSaveError,
    CheckpointTimeoutError,
    ConfigError,
    CorruptCheckpointWarning,
    ElasticCheckpointError,
    IntegrityError,
    ManifestError,
    StorageError,
    StorageFullError,
    StorageNotFoundError,
    StoragePermissionError,
    TransientStorageError,
    UnsupportedFormatError,
)
from lightning_elastic.lightning import DistributedCheckpoint, ElasticSampler, ElasticStrategy

__version__ = "0.1.0"

__all__ = [
    "CheckpointEngine",
    "CheckpointExistsError",
    "CheckpointInfo",
    "CheckpointLoadError",
    "CheckpointNotFoundError",
    "CheckpointSaveError",
    "CheckpointTimeoutError",
    "ConfigError",
    "CorruptCheckpointWarning",
    "DistributedCheckpoint",
    "ElasticCheckpointError",
    "ElasticSampler",
    "ElasticStrategy",
    "IntegrityError",
    "KeepAll",
    "KeepBestK",
    "KeepEveryNSteps",
    "KeepLastN",
    "LoadResult",
    "Manifest",
    "ManifestError",
    "RetryPolicy",
    "SaveHandle",
    "SaveResult",
    "Storage",
    "StorageError",
    "StorageFullError",
    "StorageNotFoundError",
    "StoragePermissionError",
    "TransientStorageError",
    "UnsupportedFormatError",
    "__version__",
]
