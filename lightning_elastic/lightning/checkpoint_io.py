"""``ElasticCheckpointIO``: our committed checkpoints under ``ModelCheckpoint`` and ``fabric.save``.

Lightning hands every checkpoint file it writes or reads to the strategy's ``CheckpointIO``
plugin: ``ModelCheckpoint`` and ``trainer.save_checkpoint`` call ``save_checkpoint`` (the
``.ckpt`` path, the checkpoint dict), top-k rotation calls ``remove_checkpoint``, ``fit/
validate/test(ckpt_path=...)`` call ``load_checkpoint``; Fabric's ``save``/``load`` do the
same. This plugin turns each path into one of our checkpoint directories (``dirpath/
epoch=3-step=400.ckpt/``: manifest, checksums, two-phase commit) through a
:class:`~lightning_elastic.core.engine.CheckpointEngine` per directory, and keeps every option
of ``ModelCheckpoint`` as it is.

Which rank calls what: Lightning's strategies call ``save_checkpoint`` and
``remove_checkpoint`` on global rank 0 only (the state is replicated), so the engine has a
single-process coordinator: no collective, rank 0 writes the whole state. ``load_checkpoint``
runs on every rank, each reading (and verifying) the whole checkpoint, as Lightning's
``torch.load`` does. ``teardown`` (the end of every ``fit/validate/test``) and :meth:`wait`
wait for the save in flight.

A save blocks training while the state is copied into the engine's host buffer (one staging
copy, reused across saves), then writes, checksums and commits in a background thread; the
next save, a load of that directory, a removal or ``teardown`` waits for it. With
``snapshot="lazy"`` (the default) the save returns before the optimizer state (two thirds of
an Adam checkpoint) is copied: the writer thread copies it while the next step's forward and
backward run, and every optimizer step of the process waits for that copy before it changes
it (:class:`~lightning_elastic.core.save.snapshot.EveryOptimizerGuard`: torch's global step
pre-hook, after the closure; the optimizers seen stepping name what is guarded, so a fit's
first save copies everything at once). The parameters are copied before the save returns:
callbacks change them in place outside the optimizer step (``StochasticWeightAveraging`` at
the end of the fit, EMA weight swaps), and the plugin sees no callback. Something else
changing an optimizer's state in place before the copy fails that save (it is not committed,
never mixed; ``SnapshotFallbackWarning``) and the directory's saves copy everything at once
from then on. Guarantees:

* a crash leaves the previous checkpoint of a path or the new one (``last.ckpt`` is replaced
  under its name: its manifest is swapped only when the new one is durable);
* top-k rotation never deletes a checkpoint before the save that replaces it is committed
  (the removal waits for the commit; if that save fails, the old one is kept);
* a load verifies checksums first: a corrupt checkpoint raises
  :class:`~lightning_elastic.errors.IntegrityError` naming the file; ``ckpt_path="last"``
  takes the newest checkpoint of the ``ModelCheckpoint`` directories that verifies, and says
  which (see :mod:`.checkpoint_io_rules`);
* paths that are not ours (a ``.ckpt`` file of an earlier run) load as Lightning loads them.

Strategies: those whose saves and loads go through the plugin (``SingleDeviceStrategy``,
``DDPStrategy`` in every start method, Fabric's ``DDPStrategy``/``DataParallelStrategy``) and
ours (whose own saves are sharded already); the others are refused when the Trainer or Fabric
is built (:func:`~.checkpoint_io_rules.check_strategy`).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

from lightning_elastic.core.dist.coordinator import Coordinator
from lightning_elastic.core.engine import CheckpointEngine, SaveHandle
from lightning_elastic.core.format.catalog import Catalog, holds_checkpoint_files, split_location
from lightning_elastic.core.format.integrity import VERIFY_MODES
from lightning_elastic.core.format.manifest import MANIFEST_FILE
from lightning_elastic.core.options import check_bool, check_choice, check_seconds
from lightning_elastic.core.policy.housekeeping import delete_checkpoint
from lightning_elastic.core.save.request import SaveResult
from lightning_elastic.core.save.snapshot import SNAPSHOT_MODES, EveryOptimizerGuard
from lightning_elastic.core.storage.base import Storage, local_path
from lightning_elastic.core.storage.checksum import DEFAULT_ALGORITHM
from lightning_elastic.errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    ConfigError,
    SnapshotChangedError,
)
from lightning_elastic.lightning.loading import load_elastic_checkpoint
from lightning_elastic.lightning.resume import is_elastic_checkpoint

__all__ = ["ElasticCheckpointIO", "finish_saves_of"]

log = logging.getLogger(__name__)
_LIVE: weakref.WeakSet[ElasticCheckpointIO] = weakref.WeakSet()  # for finish_saves_of


@dataclass
class _Directory:
    """One directory this plugin saves into: its engine, the save in flight, and the
    checkpoints to delete once that save is committed."""

    engine: CheckpointEngine
    handle: SaveHandle | None = None
    doomed: list[str] = field(default_factory=list)
    handling: int | None = None  # id() of the exception being handled when the save began


class ElasticCheckpointIO(CheckpointIO):
    """Lightning's ``CheckpointIO`` plugin writing committed, verified checkpoint directories.

    ``Trainer(plugins=[ElasticCheckpointIO()], callbacks=[ModelCheckpoint(...)])`` or
    ``Fabric(plugins=[ElasticCheckpointIO()])``; ``ModelCheckpoint``, ``trainer.save_checkpoint``
    and ``fabric.save/load`` are used as before (see the module docstring).

    Args:
        async_save: write in a background thread after one copy of the state into a reused
            host buffer (``True``), or write and commit before returning.
        snapshot: with ``async_save``, when the optimizer state is copied: ``"lazy"`` while
            the next forward and backward run (every optimizer step waits for the copy),
            ``"blocking"`` before the save returns (module docstring).
        verify: what a load checks first: ``"full"`` (checksums), ``"size"`` or ``"none"``.
        checksum: the manifest's checksum algorithm (``"xxh3_64"``, ``"crc32"``, ...).
        compression: ``None`` or ``"zstd"``.
        checkpoint_timeout: how long a save may take before it fails (seconds or a
            ``timedelta``; the strategies' option of that name).
        storage_options: fsspec options (credentials, ``endpoint_url``, ...) for every path.
        trusted: unpickle checkpoint objects without the safe-loading allowlist (may run code
            from the checkpoint): only for checkpoints whose origin you trust.
    """

    def __init__(
        self,
        *,
        async_save: bool = True,
        snapshot: str = "lazy",
        verify: str = "full",
        checksum: str = DEFAULT_ALGORITHM,
        compression: str | None = None,
        checkpoint_timeout: timedelta | float = timedelta(minutes=10),
        storage_options: dict[str, Any] | None = None,
        trusted: bool = False,
    ) -> None:
        check_bool(async_save, "async_save")
        check_choice(snapshot, "snapshot", SNAPSHOT_MODES)
        check_choice(verify, "verify", VERIFY_MODES)
        check_bool(trusted, "trusted")
        if storage_options is not None and not isinstance(storage_options, dict):
            raise ConfigError(f"storage_options must be a dict, got {storage_options!r}")
        self.async_save = async_save
        self.snapshot = snapshot if async_save else "blocking"
        self.verify = verify
        self.checksum = checksum
        self.compression = compression
        self.timeout = timedelta(seconds=check_seconds(checkpoint_timeout, "checkpoint_timeout"))
        self.storage_options = dict(storage_options or {})
        self.trusted = trusted
        self.last_result: SaveResult | None = None  # the newest committed save
        self._directories: dict[str, _Directory] = {}
        self._lock = threading.RLock()
        self._guard: EveryOptimizerGuard | None = None  # at the first lazy save
        # validated now (ConfigError), not at the first save in the middle of a fit
        from lightning_elastic.core.save.request import SaveConfig

        SaveConfig(checksum, compression, self.timeout.total_seconds())
        _LIVE.add(self)

    # ------------------------------------------------------------------ CheckpointIO

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None
    ) -> None:
        """Save ``checkpoint`` as the checkpoint directory ``path`` (replacing the one there);
        returns once the state is copied (``async_save``) or committed."""
        location = os.fspath(path)
        root, name = split_location(location)
        _unlink_link(location)  # save_last="link" left `last.ckpt` there: never write through it
        _refuse_file(location)
        with self._lock:
            for key, other in self._directories.items():
                if key != _key(root):  # one staging buffer held at a time: the idle one goes
                    self._finish(other)
                    other.engine.arena.release()
            directory = self._directory(root, storage_options)
            self._finish(directory)
            guarded = None
            if self.snapshot == "lazy":
                if self._guard is None:
                    self._guard = EveryOptimizerGuard(_waiter(self))
                    weakref.finalize(self, self._guard.remove)  # a plugin never torn down
                guarded = self._guard.tensors(parameters=False)  # (module docstring)
            handle = directory.engine.save(
                checkpoint,
                step=_int(checkpoint, "global_step", "step"),
                epoch=_int(checkpoint, "epoch", default=None),
                metrics=_monitored(checkpoint),
                metadata={"saved_by": type(self).__name__, "path": location},
                name=name,
                overwrite=True,
                blocking=not self.async_save,
                guarded=guarded,
            )
            directory.handle = handle
            directory.handling = _handled()
            if not self.async_save:
                self._finish(directory)

    def load_checkpoint(
        self, path: Any, map_location: Any | None = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """The checkpoint at ``path``, verified: one of our directories, or (a path that is
        not) a file as Lightning loads it. ``ckpt_path="last"`` comes here as a
        :class:`~.checkpoint_io_rules.LastCheckpoint`: the newest one that verifies."""
        from lightning_elastic.lightning.checkpoint_io_rules import LastCheckpoint, load_last

        if isinstance(path, LastCheckpoint):
            return load_last(self, path, map_location, weights_only)
        location = os.fspath(path)
        finish_saves_of(location)
        if is_elastic_checkpoint(location, self.storage_options):
            return self.load_directory(location, map_location, weights_only)
        _refuse_incomplete(location, self.storage_options)
        loaded: dict[str, Any] = TorchCheckpointIO().load_checkpoint(
            location, map_location=map_location, weights_only=weights_only
        )
        return loaded

    def load_directory(
        self, location: str, map_location: Any = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """Our checkpoint directory ``location``, verified with :attr:`verify` and read in this
        process (see :func:`~lightning_elastic.lightning.loading.load_elastic_checkpoint`)."""
        return load_elastic_checkpoint(
            location,
            map_location,
            weights_only,
            verify=self.verify,
            storage_options=self.storage_options,
            trusted=self.trusted,
        )

    def remove_checkpoint(self, path: Any) -> None:
        """Delete the checkpoint at ``path``: manifest first, then the data, and only once the
        save in flight in its directory is committed (a crash in between leaves both)."""
        location = os.fspath(path)
        local = local_path(location)
        if local is not None and os.path.islink(local):
            os.unlink(local)  # a link save_last="link" made: the link, never its target
            return
        root, name = split_location(location)
        with self._lock:
            directory = self._directories.get(_key(root))
            if directory is not None:
                if directory.handle is not None and directory.handle.done():
                    self._finish(directory)
                if directory.handle is not None:
                    if directory.handle.name != name:
                        directory.doomed.append(name)  # after the commit (see _finish)
                        return
                    self._finish(directory)  # removing the save in flight itself: after it
            self._delete(root, name, location)

    def teardown(self) -> None:
        """Wait for every save in flight (raising the first failure after all are closed, or
        logging it while another exception is being handled) and release the engines; a later
        save starts new ones."""
        with self._lock:
            directories, self._directories = self._directories, {}
            guard, self._guard = self._guard, None
            if guard is not None:
                guard.remove()
            errors = []
            handled = _handled()  # here, not in the `except` below (that one would be ours)
            during = False  # a save failed that began while `handled` was being handled
            for directory in directories.values():
                try:
                    self._finish(directory)
                except Exception as exc:  # finish and close every engine, then report
                    errors.append(exc)
                    during = during or directory.handling == handled
                try:
                    directory.engine.close()
                except Exception as exc:
                    errors.append(exc)
        if errors and handled is not None and not during:
            # Lightning tears down inside the `except` block of a crashed fit (and before its
            # KeyboardInterrupt exit): raising here would replace the user's exception with
            # ours, so the save failure is logged and the crash propagates. A save that began
            # while that exception was already handled (a whole fit in a script's `except`
            # block; also OnExceptionCheckpoint's save of the crash itself) raises its failure
            for error in errors:
                log.error("while handling another exception: %s", error)
            return
        if errors:
            raise errors[0]

    # ------------------------------------------------------------------ public helpers

    def wait(self) -> SaveResult | None:
        """Wait for the saves in flight and the removals waiting for them; raise a save's
        error (also :class:`~lightning_elastic.errors.SnapshotChangedError` for one its lazy
        snapshot gave up: the path still holds what it held). Returns the newest committed
        save (also :attr:`last_result`). For a Fabric script that reads its checkpoint
        elsewhere before ``teardown``."""
        with self._lock:
            for directory in self._directories.values():
                self._finish(directory, given_up=True)
        return self.last_result

    def pending(self, location: str) -> bool:
        """Whether a save of ``location`` is in flight in this plugin."""
        root, name = split_location(os.fspath(location))
        directory = self._directories.get(_key(root))
        return (
            directory is not None
            and directory.handle is not None
            and (directory.handle.name == name)
        )

    def __getstate__(self) -> dict[str, Any]:  # ddp_spawn pickles the plugin to each process
        state = self.__dict__.copy()
        state["_directories"] = {}
        state["_lock"] = None
        state["_guard"] = None  # a hook of this process
        state["last_result"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.RLock()
        _LIVE.add(self)

    # ------------------------------------------------------------------ internals

    def _directory(self, root: str, storage_options: Any) -> _Directory:
        key = _key(root)
        directory = self._directories.get(key)
        if directory is None:
            if storage_options is not None and not isinstance(storage_options, Mapping):
                raise ConfigError(
                    f"storage_options must be a dict of fsspec options, got {storage_options!r}"
                )
            options = {**self.storage_options, **(storage_options or {})}
            engine = CheckpointEngine(
                root,
                storage_options=options,
                coordinator=Coordinator.single_process(self.timeout),
                async_save=self.async_save,
                snapshot=self.snapshot,
                checksum=self.checksum,
                compression=self.compression,
                timeout=self.timeout,
            )
            directory = self._directories[key] = _Directory(engine)
        return directory

    def _finish(self, directory: _Directory, *, given_up: bool = False) -> None:
        """Wait for ``directory``'s save in flight; once it is committed, delete what was
        waiting for it. A failed save keeps them (the newest valid checkpoint stays) and
        raises its error; one given up by its lazy snapshot warns (the save of a fit goes on)
        and raises only with ``given_up``."""
        handle, directory.handle = directory.handle, None
        doomed, directory.doomed = directory.doomed, []
        if handle is not None:
            try:
                result = handle.result()
            except SnapshotChangedError as exc:
                # not committed (it would have mixed two states); what it made way for stays
                log.warning(
                    "%s not committed: %s%s",
                    handle.name,
                    exc,
                    f"; kept {', '.join(doomed)}" if doomed else "",
                )
                directory.engine.wait()  # it warns now (once) and copies at once from now on
                if given_up:
                    raise
                return
            except Exception:
                if doomed:
                    log.warning(
                        "kept %s: the save they made way for (%s) failed",
                        ", ".join(doomed),
                        handle.name,
                    )
                raise
            self.last_result = result
            self._committed(result)
        storage = directory.engine.storage
        for name in doomed:
            self._delete(storage.url, name, storage.display(name), directory.engine)

    def _committed(self, result: SaveResult) -> None:
        """Called once per committed save (in the thread that noticed it): a hook for
        subclasses that report saves."""
        log.debug("committed %s in %.2f s", result.location, result.total_s)

    def _delete(
        self, root: str, name: str, location: str, engine: CheckpointEngine | None = None
    ) -> None:
        storage = (
            engine.storage
            if engine is not None
            else Storage(root, storage_options=self.storage_options)
        )
        if holds_checkpoint_files(e.name for e in storage.listdir(name) if not e.is_dir):
            catalog = engine.catalog if engine is not None else Catalog(storage)
            info = catalog.info(name)
            listed = [f.path for f in info.manifest.files] if info.manifest is not None else []
            delete_checkpoint(storage, catalog, name, listed=listed)
            log.debug("removed checkpoint %s", location)
        else:  # not ours: a file of an earlier run, removed as Lightning would
            TorchCheckpointIO().remove_checkpoint(location)


def _waiter(plugin: ElasticCheckpointIO) -> Any:
    """What the optimizer-step guard calls: wait for the lazy copies in flight of ``plugin``'s
    directories (held weakly: the global hook does not keep a dropped plugin alive)."""
    ref = weakref.ref(plugin)

    def wait() -> None:
        live = ref()
        if live is not None:
            for directory in list(live._directories.values()):
                directory.engine.wait_snapshot()

    return wait


def finish_saves_of(path: Any) -> None:
    """Wait for the save of ``path`` that a live ``ElasticCheckpointIO`` of this process has
    in flight, if any (a load right after ``trainer.save_checkpoint(path)``)."""
    try:
        location = os.fspath(path)
    except TypeError:
        return
    local = local_path(location)
    names = {location} if local is None else {location, os.path.realpath(local)}  # a link too
    for plugin in list(_LIVE):
        if any(plugin.pending(name) for name in names):
            plugin.wait()


def _handled() -> int | None:
    """``id()`` of the exception being handled here, if any (see :meth:`teardown`)."""
    exc = sys.exc_info()[1]
    return None if exc is None else id(exc)


def _key(root: str) -> str:
    """One spelling of a directory (``ckpts``, ``./ckpts/`` and its absolute path are one)."""
    local = local_path(root)
    return root.rstrip("/") if local is None else os.path.realpath(local)


def _unlink_link(location: str) -> None:
    local = local_path(location)
    if local is not None and os.path.islink(local):
        os.unlink(local)


def _refuse_file(location: str) -> None:
    local = local_path(location)
    if local is not None and os.path.isfile(local):
        raise CheckpointExistsError(
            f"{location} is a file (a torch.save checkpoint?): ElasticCheckpointIO writes a "
            "checkpoint directory under that name; move the file away or choose another "
            "dirpath or filename"
        )


def _refuse_incomplete(location: str, storage_options: dict[str, Any]) -> None:
    """A directory of ours without a manifest (a save that never committed), or any other
    directory: not a file for ``torch.load``, whose ``IsADirectoryError`` would not say so."""
    try:
        storage = Storage(location, storage_options=storage_options)
        names = [e.name for e in storage.listdir() if not e.is_dir]
    except Exception:
        return
    if names and holds_checkpoint_files(names):
        raise CheckpointNotFoundError(
            f"{location} is incomplete: a save that did not commit (it crashed, or another "
            "process is still writing it); load the checkpoint before it"
        )
    local = local_path(location)
    if local is not None and os.path.isdir(local):  # torch.load would say IsADirectoryError
        raise CheckpointNotFoundError(
            f"{location} is a directory but not a checkpoint: neither one of ours (no "
            f"{MANIFEST_FILE}) nor a torch.save file"
        )


def _int(checkpoint: Mapping[str, Any], *keys: str, default: int | None = 0) -> Any:
    """The first of ``keys`` holding a non-negative int (Lightning's ``global_step`` and
    ``epoch``; a Fabric state's ``step``), else ``default``."""
    for key in keys:
        value = checkpoint.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            return value
    return default


def _monitored(checkpoint: Mapping[str, Any]) -> dict[str, float]:
    """``ModelCheckpoint``'s monitored value of this save (``current_score`` in its state),
    for the manifest (``lightning-elastic ls``/``inspect``)."""
    out: dict[str, float] = {}
    callbacks = checkpoint.get("callbacks")
    if not isinstance(callbacks, Mapping):
        return out
    for state in callbacks.values():
        if not isinstance(state, Mapping):
            continue
        monitor, score = state.get("monitor"), state.get("current_score")
        if isinstance(monitor, str) and score is not None:
            try:
                value = float(score)
            except (TypeError, ValueError):
                continue
            if value == value and abs(value) != float("inf"):
                out[monitor] = value
    return out
