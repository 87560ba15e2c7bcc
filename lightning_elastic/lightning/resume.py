"""Hooking our checkpoints into Lightning's restore path, for any supported strategy.

Lightning restores from its checkpoint connector's ``resume_start(path)``, called on every
rank before the strategy sets up. We wrap that one method for the duration of a run (through
:mod:`lightning_elastic.lightning._compat`):

* ``path`` is one of our checkpoint directories: load it through the engine (verified,
  resharded) instead of ``torch.load``;
* ``path`` is ``None`` during ``fit`` with ``resume="auto"``: load the newest valid checkpoint
  of the callback's directory, chosen once by rank 0 and broadcast, or start fresh;
* ``path`` is ``"last"``/``"best"`` made a :class:`~.aliases.CheckpointAlias`: the newest, or
  the best by the callback's ``monitor``, of the callback's directory.

Lightning then restores model, callbacks, loops, optimizers and schedulers from the loaded
dict as it would from its own file; per-rank state is handed back by the session.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

from lightning.pytorch.utilities import rank_zero_info

from lightning_elastic.core.engine import CheckpointEngine
from lightning_elastic.core.format.catalog import is_checkpoint_name, split_location
from lightning_elastic.core.format.manifest import MANIFEST_FILE
from lightning_elastic.core.storage.base import Storage, local_path
from lightning_elastic.lightning._compat import (
    install_on_connector,
    set_loaded_checkpoint,
    uninstall_from_connector,
)
from lightning_elastic.lightning.aliases import CheckpointAlias, resolve_alias
from lightning_elastic.lightning.session import is_our_strategy

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from lightning_elastic.lightning.session import ElasticSession

__all__ = [
    "install_resume_hook",
    "is_elastic_checkpoint",
    "uninstall_resume_hook",
]

log = logging.getLogger(__name__)
_ORIGINAL_PROCESS = "_lightning_elastic_original_process_dataloader"


def is_elastic_checkpoint(path: Any, storage_options: dict[str, Any] | None = None) -> bool:
    """Whether ``path`` is one of our checkpoint directories (holds a manifest); opened with
    the run's ``storage_options`` (credentials, endpoint), like every other access."""
    if path is None:
        return False
    try:
        return Storage(str(path), storage_options=storage_options).exists(MANIFEST_FILE)
    except Exception:
        return False


def install_resume_hook(
    trainer: pl.Trainer,
    session: ElasticSession,
    engine: CheckpointEngine | None,
    *,
    auto: bool,
    verify: str,
) -> None:
    """Make ``trainer``'s ``resume_start`` load our checkpoint directories through ``session``,
    and with ``auto`` and no path the newest valid one of ``engine``'s root (or start fresh)."""
    uninstall_resume_hook(trainer)
    original: Any = None

    def resume_start(checkpoint_path: Any = None, weights_only: Any = None) -> None:
        if checkpoint_path is None and auto and engine is not None:
            checkpoint = session.load(engine, name=None, verify=verify)
            if checkpoint is None:
                rank_zero_info(f"no valid checkpoint in {engine.storage.display()}: starting fresh")
                return original(checkpoint_path, weights_only=weights_only)  # type: ignore[no-any-return]
        elif isinstance(checkpoint_path, CheckpointAlias):  # "last"/"best", see aliases.py
            checkpoint = resolve_alias(checkpoint_path, session, verify=verify)
            if checkpoint is None:
                return original(None, weights_only=weights_only)  # type: ignore[no-any-return]
        elif (tiered := _tiered_engine(session, checkpoint_path)) is not None:
            # a checkpoint of a multi-tier dirpath (best_model_path, last_model_path) may be
            # on the nodes only: chosen by name across the tiers, as a resume would
            name = split_location(checkpoint_path)[1]
            checkpoint = session.load(tiered, name=name, verify=verify)
        elif is_elastic_checkpoint(checkpoint_path, session.storage_options):
            root, name = split_location(checkpoint_path)
            checkpoint = session.load(session.engine(root), name=name, verify=verify)
        else:
            return original(checkpoint_path, weights_only=weights_only)  # type: ignore[no-any-return]
        assert checkpoint is not None and session.resumed is not None
        location = session.resumed.info.location
        rank_zero_info(f"Restoring states from the checkpoint at {location}")
        set_loaded_checkpoint(trainer, checkpoint, location)
        return None

    original = install_on_connector(trainer, "resume_start", resume_start)


def _tiered_engine(session: ElasticSession, path: Any) -> CheckpointEngine | None:
    """The session's multi-tier engine whose ``dirpath`` holds ``path`` directly, named as a
    save is, or ``None``: its saves are named ``dirpath/<name>`` even while only the
    node-local tier holds them."""
    if path is None:
        return None
    root, name = split_location(path)
    if not is_checkpoint_name(name):  # e.g. a Lightning file the user put there
        return None
    where = _normalized(root)
    for engine in session.engines.values():
        if engine.multi_tier and _normalized(engine.storage.display()) == where:
            return engine
    return None


def _normalized(location: str) -> str:
    """One spelling of a directory: a local path (relative, ``./``, ``//``, ``file://``)
    resolved; a URL without its trailing slashes."""
    local = local_path(location)
    return location.rstrip("/") if local is None else os.path.realpath(local)


def install_dataloader_hook(trainer: pl.Trainer, session: ElasticSession) -> None:
    """For strategies other than ElasticStrategy: route their ``process_dataloader`` through
    the session so training dataloaders get a resumable sampler too."""
    strategy = trainer.strategy
    if _ORIGINAL_PROCESS in strategy.__dict__ or is_our_strategy(strategy):
        return  # already hooked, or an ElasticStrategy (which does it itself)
    original = strategy.process_dataloader

    def process_dataloader(dataloader: object) -> object:
        return session.process_train_dataloader(original(dataloader))

    setattr(strategy, _ORIGINAL_PROCESS, original)
    strategy.process_dataloader = process_dataloader  # type: ignore[method-assign]


def uninstall_dataloader_hook(trainer: pl.Trainer) -> None:
    """Undo :func:`install_dataloader_hook` (nothing if it was not installed)."""
    strategy = trainer.strategy
    if strategy.__dict__.pop(_ORIGINAL_PROCESS, None) is not None:
        strategy.__dict__.pop("process_dataloader", None)


def uninstall_resume_hook(trainer: pl.Trainer) -> None:
    """Undo :func:`install_resume_hook` (nothing if it was not installed)."""
    uninstall_from_connector(trainer, "resume_start")
