"""What ``ElasticCheckpointIO`` needs from Lightning beyond the plugin interface: which
strategies it works under, and ``ckpt_path="last"``.

**Strategies.** Lightning has no hook that tells a ``CheckpointIO`` its strategy, and some
strategies never call it (or call it for saves but not for loads). :func:`check_strategy`
runs when a Trainer's or a Fabric's connector hands the strategy its plugins (wrapped once per
process through :mod:`lightning_elastic.lightning._compat`) and refuses, with a
:class:`~lightning_elastic.errors.ConfigError`, a strategy whose ``save_checkpoint``,
``load_checkpoint`` or ``remove_checkpoint`` is Lightning's own override of the base
strategy's (which are what call ``checkpoint_io``). Read from Lightning 2.6's sources:

* served: ``SingleDeviceStrategy``, ``DDPStrategy`` (``ddp``, ``ddp_spawn``, ``ddp_fork``,
  ``ddp_notebook``), Fabric's ``DDPStrategy`` and ``DataParallelStrategy``: rank 0 saves
  and removes through the plugin, every rank loads through it;
* ours (``ElasticStrategy``, ``ElasticFSDPStrategy``, ``ElasticFTStrategy``): accepted; their
  saves are sharded committed checkpoints already, the plugin serves the paths they hand on
  (a plain ``.ckpt`` file of an earlier run);
* refused: ``FSDPStrategy`` and ``ModelParallelStrategy`` (with a full state dict they call the
  plugin to save, but load with ``torch.load`` straight from the path and refuse to save
  over a directory, so neither a resume nor ``save_last`` would work; sharded, they write
  DCP themselves), ``DeepSpeedStrategy`` (DeepSpeed's own files) and the XLA strategies
  (``XLACheckpointIO`` only). Fabric's FSDP and ModelParallel strategies take no plugin at all.

**``ckpt_path="last"``.** Lightning picks the ``last*.ckpt`` path with the newest
modification time. With this plugin, when a ``ModelCheckpoint`` directory holds any checkpoint
directory of ours, the string becomes a :class:`LastCheckpoint` (in :mod:`.aliases`' wrapper
of ``_parse_ckpt_path``) that the plugin resolves when the strategy loads it, on every rank
after the set-up barrier (a rank-0 save of the previous ``fit`` is committed by then): the
newest committed checkpoint, in commit order, of the ``ModelCheckpoint`` directories that
verifies, or a newer plain ``last*.ckpt`` file of Lightning's. Skipped corrupt ones (files or
manifest) are warned about, a manifest of a newer format raises
:class:`~lightning_elastic.errors.UnsupportedFormatError`, the choice is logged, and
``trainer.ckpt_path`` names it; when none verifies,
:class:`~lightning_elastic.errors.CheckpointNotFoundError` says why for each. Directories
without any of ours go through Lightning's own resolution (a first run: "no last checkpoint",
and training starts fresh).
"""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from lightning.pytorch.utilities import rank_zero_info

from lightning_elastic.core.format.catalog import Catalog, split_location
from lightning_elastic.core.storage.base import Storage, local_path
from lightning_elastic.errors import (
    CheckpointNotFoundError,
    ConfigError,
    CorruptCheckpointWarning,
    IntegrityError,
    ManifestError,
    UnsupportedFormatError,
)
from lightning_elastic.lightning._compat import (
    last_checkpoint_files,
    model_checkpoint_dir,
    set_ckpt_path,
    wrap_strategy_connection,
    wrapped_checkpoint_io,
)

if TYPE_CHECKING:
    from lightning_elastic.lightning.checkpoint_io import ElasticCheckpointIO

__all__ = [
    "SUPPORTED",
    "LastCheckpoint",
    "check_strategy",
    "install_strategy_check",
    "last_checkpoint",
    "load_last",
]

log = logging.getLogger(__name__)
SUPPORTED = (
    "SingleDeviceStrategy, DDPStrategy (ddp, ddp_spawn, ddp_fork, ddp_notebook), Fabric's "
    "DDPStrategy and DataParallelStrategy, and ElasticStrategy / ElasticFSDPStrategy / "
    "ElasticFTStrategy (whose own saves are sharded checkpoints)"
)
# why Lightning's own overrides of the base strategy's checkpoint methods do not serve us
_WHY = {
    "lightning.pytorch.strategies.fsdp.FSDPStrategy": "its loads do not go through "
    "checkpoint_io (a full state dict is read with torch.load straight from the path) and it "
    "refuses to save over a directory",
    "lightning.pytorch.strategies.model_parallel.ModelParallelStrategy": "its loads do not go "
    "through checkpoint_io (a full state dict is read with torch.load straight from the path) "
    "and it refuses to save over a directory",
    "lightning.fabric.strategies.fsdp.FSDPStrategy": "it takes no CheckpointIO plugin (it "
    "saves and loads with torch.distributed.checkpoint itself)",
    "lightning.fabric.strategies.model_parallel.ModelParallelStrategy": "it takes no "
    "CheckpointIO plugin (it saves and loads with torch.distributed.checkpoint itself)",
}
_SHARDED = (
    "; for sharded checkpoints that reshard, use ElasticFSDPStrategy with DistributedCheckpoint"
)


def install_strategy_check() -> None:
    """Refuse unsupported strategies when a Trainer or Fabric is built (process-wide,
    idempotent; called when ``lightning_elastic.lightning`` is imported)."""
    wrap_strategy_connection(check_strategy)


def check_strategy(strategy: Any, io: Any) -> None:
    """Raise :class:`ConfigError` when ``io`` is (or wraps) an ``ElasticCheckpointIO`` that
    ``strategy`` would not call for every save, load and removal; see the module docstring."""
    from lightning_elastic.lightning.checkpoint_io import ElasticCheckpointIO
    from lightning_elastic.lightning.strategy import ElasticCheckpointing

    if isinstance(wrapped_checkpoint_io(io), ElasticCheckpointIO):
        raise ConfigError(
            f"{type(io).__name__}(ElasticCheckpointIO()): ElasticCheckpointIO saves "
            "asynchronously itself (one copy of the state, then a background write); pass it "
            "alone in plugins=[...]"
        )
    if not isinstance(io, ElasticCheckpointIO) or isinstance(strategy, ElasticCheckpointing):
        return
    for method in ("save_checkpoint", "load_checkpoint", "remove_checkpoint"):
        owner = _defined_by(type(strategy), method)
        if owner is None or owner.__name__ == "Strategy":
            continue
        qualified = f"{owner.__module__}.{owner.__name__}"
        why = _WHY.get(qualified, f"its {method} does not call the checkpoint_io plugin")
        if qualified in _WHY:
            why += _SHARDED
        elif "DeepSpeed" in owner.__name__:
            why = "DeepSpeed writes and reads its own checkpoint files"
        raise ConfigError(
            f"ElasticCheckpointIO does not work under {type(strategy).__name__}: {why}. "
            f"It works under {SUPPORTED}"
        )


def _defined_by(cls: type, method: str) -> type | None:
    """The Lightning class whose ``method`` ``cls`` uses, or ``None`` when it is a class of
    someone else's (a user's override that may well call the plugin: theirs to judge)."""
    for klass in cls.__mro__:
        if method in vars(klass):
            return klass if klass.__module__.startswith("lightning.") else None
    return None


# ---------------------------------------------------------------------- ckpt_path="last"


class LastCheckpoint(str):
    """``"last"`` (it compares equal to the string) for a trainer with ``ElasticCheckpointIO``:
    resolved by the plugin when loaded (see the module docstring)."""

    directories: tuple[str, ...]
    files: tuple[str, ...]  # Lightning's own candidates that are plain files
    trainer: Any
    fn: str

    def __new__(
        cls, directories: Iterable[str], files: Iterable[str], trainer: Any, fn: str
    ) -> LastCheckpoint:
        obj = super().__new__(cls, "last")
        obj.directories = tuple(dict.fromkeys(directories))
        obj.files = tuple(files)
        obj.trainer = trainer
        obj.fn = fn
        return obj


def last_checkpoint(trainer: Any, fn: str) -> LastCheckpoint | None:
    """``ckpt_path="last"`` of ``trainer`` as a :class:`LastCheckpoint`, or ``None`` when the
    trainer has no ``ElasticCheckpointIO`` or no directory it looks in holds one of our
    checkpoints (Lightning's own resolution then runs, and warns when there is nothing)."""
    from lightning.pytorch.callbacks import ModelCheckpoint, OnExceptionCheckpoint

    from lightning_elastic.lightning.checkpoint_io import ElasticCheckpointIO

    plugin = trainer.strategy.checkpoint_io
    if not isinstance(plugin, ElasticCheckpointIO):
        return None
    directories, files = [], []
    for callback in trainer.callbacks:
        if isinstance(callback, ModelCheckpoint):
            directories.append(model_checkpoint_dir(callback, trainer))
            files += [p for p in last_checkpoint_files(callback, trainer) if _is_file(p)]
        elif isinstance(callback, OnExceptionCheckpoint):
            directories.append(split_location(callback.ckpt_path)[0])
            files += [callback.ckpt_path] if _is_file(callback.ckpt_path) else []
    options = plugin.storage_options
    # Decided on every rank before the set-up barrier, while rank 0 may still be committing
    # the previous fit's last save: any directory of ours counts, committed or not (a save's
    # directory is claimed before trainer.save_checkpoint's barrier), so all ranks agree.
    if not any(_scan(d, options) for d in directories):
        return None
    return LastCheckpoint(directories, files, trainer, fn)


def load_last(
    plugin: ElasticCheckpointIO, last: LastCheckpoint, map_location: Any, weights_only: Any
) -> dict[str, Any]:
    """Load the newest checkpoint that verifies (every rank, each on its own: they read the
    same storage, so they agree); see the module docstring."""
    skipped: list[str] = []
    # A manifest that does not parse (or is of a newer format) never becomes a candidate
    # below, which lists valid ones only: say so as for one whose files fail verification,
    # and refuse a newer format rather than resume silently from an older checkpoint
    for directory in last.directories:
        for info in _scan(directory, plugin.storage_options):
            if str(info.status) != "corrupt":
                continue  # valid, or incomplete (a save in flight or crashed): not corrupt
            if info.unsupported:
                raise UnsupportedFormatError(f'{last.fn}(ckpt_path="last"): {info.problem}')
            skipped.append(f"{info.location}: {info.problem}")
            warnings.warn(
                f'{last.fn}(ckpt_path="last"): skipping {info.location}, which does not '
                f"verify: {info.problem}",
                CorruptCheckpointWarning,
                stacklevel=2,
            )
    for when, location, ours in _newest_first(last, plugin.storage_options):
        del when
        if not ours:  # a plain file of Lightning's, newer than any of ours
            checkpoint = plugin.load_checkpoint(location, map_location, weights_only)
        else:
            try:
                checkpoint = plugin.load_directory(location, map_location, weights_only)
            except (IntegrityError, ManifestError, CheckpointNotFoundError) as exc:
                if isinstance(exc, UnsupportedFormatError):
                    raise
                skipped.append(f"{location}: {exc}")
                warnings.warn(
                    f'{last.fn}(ckpt_path="last"): skipping {location}, which does not '
                    f"verify: {exc}",
                    CorruptCheckpointWarning,
                    stacklevel=2,
                )
                continue
        where = ", ".join(last.directories)
        message = (
            f'{last.fn}(ckpt_path="last"): restoring {location}, the newest checkpoint of '
            f"{where} that verifies" + (f" ({len(skipped)} skipped)" if skipped else "")
        )
        log.info(message)
        rank_zero_info(message)
        set_ckpt_path(last.trainer, location)
        return checkpoint
    for directory in last.directories:  # never committed: a crashed save's leftovers
        skipped += [f"{i.location}: {i.problem}" for i in _scan(directory, plugin.storage_options)]
    raise CheckpointNotFoundError(
        f'{last.fn}(ckpt_path="last"): no checkpoint of {", ".join(last.directories)} '
        "verifies: " + ("; ".join(dict.fromkeys(skipped)) or "none is left")
    )


def _newest_first(last: LastCheckpoint, options: dict[str, Any]) -> list[tuple[float, str, bool]]:
    """(commit or modification time, location, ours) of every candidate, newest first: our
    committed checkpoints by their manifests' commit time (``sequence`` orders one directory,
    the time several), Lightning's plain files by modification time."""
    found: list[tuple[float, int, str, bool]] = []
    for directory in last.directories:
        for info in _valid(directory, options):
            found.append((info.created_unix, info.sequence, info.location, True))
    for path in last.files:
        found.append((os.path.getmtime(path), 0, path, False))
    found.sort(key=lambda c: (c[0], c[1]), reverse=True)
    return [(when, location, ours) for when, _, location, ours in found]


def _valid(directory: str, options: dict[str, Any]) -> list[Any]:
    return [i for i in _scan(directory, options) if str(i.status) == "valid"]


def _scan(directory: str, options: dict[str, Any]) -> list[Any]:
    """Every checkpoint directory of ours in ``directory`` (valid, corrupt, incomplete)."""
    try:
        return Catalog(Storage(directory, storage_options=options)).scan()
    except Exception:  # missing, unreadable: nothing of ours there
        return []


def _is_file(path: str) -> bool:
    local = local_path(path)
    return local is not None and os.path.isfile(local) and not os.path.islink(local)
