"""``LightningModule.load_from_checkpoint(<our checkpoint directory>)`` and plain trainers.

Lightning reads checkpoint files with one function, ``pl_load(path, map_location,
weights_only)`` (``cloud_io._load``), imported under that name by ``core/saving.py``
(``load_from_checkpoint``) and by ``TorchCheckpointIO`` (what ``fit/validate/test/predict
(ckpt_path=...)`` use under a strategy that is not ours). We wrap that name in both modules
(once per process, when ``lightning_elastic.lightning`` is imported, through
:mod:`lightning_elastic.lightning._compat`):

* a path holding ``manifest.json`` (one of our checkpoint directories) is consolidated in
  memory, in this process (:func:`lightning_elastic.consolidate`: verified, objects loaded
  safely unless ``weights_only=False`` was passed, tensors on the CPU unless ``map_location``
  names a device);
* a local directory of our checkpoints (a ``dirpath``) raises
  :class:`~lightning_elastic.errors.CheckpointNotFoundError` naming its newest checkpoint;
* anything else goes to Lightning's loader unchanged.

``torch.load`` itself is left alone: a process that never imported ``lightning_elastic.lightning``
gets Lightning's ``IsADirectoryError`` (the docs say to import it or to call
``lightning_elastic.consolidate``).

Under ``DistributedCheckpoint`` or ``ElasticStrategy`` a trainer loads our directories through
the engine instead (the resume hook, ``ElasticStrategy.load_checkpoint``): resharded over the
ranks and with every rank's RNG, metric and data position state.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

from lightning_elastic.core.format.catalog import Catalog
from lightning_elastic.core.load.consolidate import consolidate
from lightning_elastic.core.storage.base import Storage, local_path
from lightning_elastic.errors import CheckpointNotFoundError
from lightning_elastic.lightning._compat import wrap_checkpoint_loaders
from lightning_elastic.lightning.resume import is_elastic_checkpoint

__all__ = ["install_checkpoint_loader", "load_elastic_checkpoint"]

log = logging.getLogger(__name__)


def install_checkpoint_loader() -> None:
    """Make Lightning's checkpoint file loader read our checkpoint directories (process-wide,
    idempotent; called when ``lightning_elastic.lightning`` is imported)."""
    wrap_checkpoint_loaders(_wrap)


def load_elastic_checkpoint(
    path: str | os.PathLike[str],
    map_location: Any = None,
    weights_only: bool | None = None,
    *,
    verify: str = "full",
    storage_options: dict[str, Any] | None = None,
    trusted: bool = False,
) -> dict[str, Any]:
    """Our checkpoint directory ``path`` as Lightning's checkpoint dict, consolidated in this
    process: what ``pl_load`` returns for it. ``weights_only=False`` (an explicit request to
    unpickle anything) loads it ``trusted``; a ``map_location`` that names a device (a string,
    a ``torch.device``, or a dict mapping ``"cpu"``) moves the tensors there. A save of
    ``path`` that an ``ElasticCheckpointIO`` of this process has in flight is waited for."""
    from lightning_elastic.lightning.checkpoint_io import finish_saves_of

    finish_saves_of(path)
    local = local_path(os.fspath(path))
    if local is not None and os.path.islink(local):  # save_last="link": the path is a link
        path = os.path.realpath(local)
    log.info("consolidating %s in this process", path)
    checkpoint = consolidate(
        path,
        verify=verify,
        storage_options=storage_options,
        trusted=trusted or weights_only is False,
    )
    device = _target_device(map_location)
    if device is None:
        return checkpoint
    moved: dict[str, Any] = _to(checkpoint, device)
    return moved


def _wrap(original: Any) -> Any:
    def pl_load(path_or_url: Any, map_location: Any = None, weights_only: Any = None) -> Any:
        if _is_path(path_or_url):
            from lightning_elastic.lightning.checkpoint_io import finish_saves_of

            finish_saves_of(path_or_url)  # trainer.save_checkpoint(p) then load_from_checkpoint(p)
            if is_elastic_checkpoint(path_or_url):
                return load_elastic_checkpoint(path_or_url, map_location, weights_only)
            _refuse_root(os.fspath(path_or_url))
        return original(path_or_url, map_location=map_location, weights_only=weights_only)

    return pl_load


def _is_path(value: Any) -> bool:
    # http(s) URLs are Lightning's own download path; IO objects are not directories
    return isinstance(value, (str, os.PathLike)) and not str(value).startswith("http")


def _refuse_root(path: str) -> None:
    """A local directory holding our checkpoints, named where one checkpoint is expected."""
    if "://" in path or not os.path.isdir(path):
        return
    try:
        valid = Catalog(Storage(path)).valid()
    except Exception:  # not ours to judge: Lightning's own error follows
        return
    if valid:
        raise CheckpointNotFoundError(
            f"{path} is a directory of {len(valid)} checkpoint(s), not one checkpoint: name one, "
            f"e.g. {valid[0].location} (the newest), or load the newest with "
            "lightning_elastic.load_weights / lightning_elastic.consolidate"
        )


def _target_device(map_location: Any) -> torch.device | None:
    if isinstance(map_location, dict):
        map_location = map_location.get("cpu")
    if isinstance(map_location, (str, torch.device)):
        return torch.device(map_location)
    return None  # None or a function of (storage, location): the tensors stay on the CPU


def _to(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, dict):
        return {k: _to(v, device) for k, v in value.items()}
    if isinstance(value, list):
        return [_to(v, device) for v in value]
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        return tuple(_to(v, device) for v in value)
    return value
