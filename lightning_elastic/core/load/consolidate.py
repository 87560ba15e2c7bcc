"""One checkpoint, whatever world size wrote it, as one nested dict or one ``torch.save`` file.

Which process calls what: everything here runs in one process, without collectives and
without ``torch.distributed`` (a notebook, a CPU box, an export job). :func:`locate_checkpoint`
finds and verifies the checkpoint a path names; :func:`consolidate` reads all of it (DCP
reshards N -> 1) and optionally writes it; ``lightning-elastic consolidate`` and the Lightning
``load_from_checkpoint`` hook both call :func:`consolidate`.

Objects are unpickled safely (``weights_only=True`` and the allowlist of
:mod:`~lightning_elastic.core.load.safe`) unless ``trusted=True``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import torch

from lightning_elastic.core.dist.coordinator import Coordinator
from lightning_elastic.core.format.catalog import (
    VALID,
    Catalog,
    CheckpointInfo,
    holds_checkpoint_files,
    split_location,
)
from lightning_elastic.core.format.integrity import check_verify_mode, raise_first, verify_files
from lightning_elastic.core.format.optimizer_state import is_named, named_to_positional
from lightning_elastic.core.format.references import reference_records, routes
from lightning_elastic.core.load.load import read_full_state
from lightning_elastic.core.load.select import select_checkpoint
from lightning_elastic.core.storage.base import Storage, local_path
from lightning_elastic.errors import (
    CheckpointNotFoundError,
    ConfigError,
    UnsupportedFormatError,
)

__all__ = ["Progress", "ProgressFactory", "consolidate", "locate_checkpoint"]


class Progress(Protocol):
    """A progress bar (tqdm's interface): ``update(n)`` after ``n`` more bytes, ``close()``."""

    def update(self, n: int = 1) -> Any:
        """Advance by ``n`` bytes."""
        ...

    def close(self) -> Any:
        """Done (also after a failure)."""
        ...


# (description, total bytes or None) -> a bar; descriptions: verifying, reading, writing
ProgressFactory = Callable[[str, int | None], Progress]


def consolidate(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str] | None = None,
    *,
    storage_options: Mapping[str, Any] | None = None,
    trusted: bool = False,
    verify: str = "full",
    include_rank_state: bool = False,
    progress: ProgressFactory | None = None,
) -> dict[str, Any]:
    """Read a whole checkpoint, written by any number of processes, in this process.

    For a checkpoint written by ``DistributedCheckpoint`` or ``ElasticStrategy`` the result
    is Lightning's own checkpoint dict (``state_dict``, ``optimizer_states``,
    ``lr_schedulers``, ``loops``, ``callbacks``, ``hyper_parameters``, ...) plus our
    ``"lightning_elastic"`` entry (the data position); for one of ``CheckpointEngine.save``
    the state that was saved, with its containers and key types. Tensors are on the CPU.
    Sharded optimizer states (ZeRO-1, FSDP2: keyed by parameter name) become plain
    ``Optimizer.state_dict()`` ones, as in a checkpoint of Lightning's.

    Args:
        src: a checkpoint directory (holds ``manifest.json``; local path or fsspec URL), or a
            root holding several: then its newest valid one, walking back past corrupt ones
            (which are quarantined, as a resume does).
        dst: also write the dict there as one ``torch.save`` file (local path; written beside
            it and renamed, so an interrupted run leaves no partial file), loadable by
            ``torch.load`` and ``LightningModule.load_from_checkpoint``.
        storage_options: fsspec options for ``src`` (credentials, ``endpoint_url``, ...).
        trusted: unpickle objects without the safe-loading allowlist (may run code from the
            checkpoint): only for checkpoints you trust. By default a type outside the allowlist
            raises :class:`~lightning_elastic.errors.UnsafeCheckpointError`.
        verify: ``"full"`` (checksums), ``"size"`` or ``"none"``, before anything is read.
        include_rank_state: also return every rank's own state (RNG, metric states) under
            ``"__rank_local__"``.
        progress: a factory of progress bars (``tqdm``'s interface), one per phase.

    Raises:
        CheckpointNotFoundError: ``src`` holds no checkpoint (or an incomplete one).
        IntegrityError: a file does not match the manifest.
        UnsafeCheckpointError: an object would need ``trusted=True``.
        ConfigError: ``dst`` is a directory or its directory does not exist.
    """
    output = None if dst is None else _output_path(dst)
    ckpt, info = locate_checkpoint(
        src, storage_options=storage_options, verify=verify, progress=progress
    )
    bar = _bar(progress, "reading", _total_bytes(info))
    try:
        _count_reads(ckpt, bar.update)
        state = read_full_state(ckpt, include_rank_state=include_rank_state, trusted=trusted)
    finally:
        bar.close()
    if isinstance(state.get("optimizer_states"), list):  # a Lightning checkpoint: plain ones
        state["optimizer_states"] = [
            named_to_positional(s) if is_named(s) else s for s in state["optimizer_states"]
        ]
    if output is not None:
        _write(state, output, _bar(progress, "writing", None))
    return state


def locate_checkpoint(
    src: str | os.PathLike[str],
    *,
    storage_options: Mapping[str, Any] | None = None,
    verify: str = "full",
    progress: ProgressFactory | None = None,
) -> tuple[Storage, CheckpointInfo]:
    """The checkpoint ``src`` names, verified: a checkpoint directory, or a root's newest
    valid checkpoint. Returns the checkpoint's storage and its catalog entry; raises as
    :func:`consolidate` does."""
    check_verify_mode(verify)
    path = os.fspath(src)
    if "://" not in path and os.path.islink(path):
        # a link the user names (save_last="link"'s last.ckpt): its target, since listings
        # below a root never follow links
        path = os.path.realpath(path)
    if "://" not in path and os.path.isfile(path):
        raise CheckpointNotFoundError(
            f"{path} is a file, not a checkpoint directory (a regular file loads with torch.load)"
        )
    storage = Storage(path, storage_options=storage_options)
    entries = storage.listdir()
    if holds_checkpoint_files(e.name for e in entries if not e.is_dir):
        root_url, name = split_location(path)
        root = Storage(root_url, storage_options=storage_options)
        return root.child(name), _verified(root, Catalog(root).info(name), verify, progress)
    if not entries:
        raise CheckpointNotFoundError(f"no checkpoint at {path}: it is missing or empty")
    info = select_checkpoint(storage, Catalog(storage), Coordinator.single_process(), None, verify)
    if info is None:
        raise CheckpointNotFoundError(
            f"{path} is neither a checkpoint (no manifest.json) nor a directory holding a valid "
            "one: name a checkpoint directory such as <dirpath>/step_000000100"
        )
    return storage.child(info.name), info


def _verified(
    root: Storage, info: CheckpointInfo, verify: str, progress: ProgressFactory | None
) -> CheckpointInfo:
    if info.unsupported:
        raise UnsupportedFormatError(info.problem or info.location)
    if info.status != VALID or info.manifest is None:
        raise CheckpointNotFoundError(f"{info.location} is {info.status}: {info.problem}")
    manifest, ckpt = info.manifest, root.child(info.name)
    paths = routes(ckpt, manifest)  # an incremental checkpoint's referenced files
    if verify != "full":
        raise_first(info.location, verify_files(ckpt, manifest, verify, routes=paths))
        return info
    bar = _bar(progress, "verifying", _total_bytes(info) + manifest.referenced_bytes)
    try:
        problems = []
        for record in (*manifest.files, *reference_records(manifest)):  # one at a time
            problems += verify_files(ckpt, manifest, "full", files=[record], routes=paths)
            bar.update(record.size)
    finally:
        bar.close()
    raise_first(info.location, problems)
    return info


def _output_path(dst: str | os.PathLike[str]) -> str:
    given = os.fspath(dst)
    text = local_path(given)
    if text is None:
        raise ConfigError(f"dst must be a local file path, got {given!r}")
    output = os.path.abspath(text)
    if os.path.isdir(output):
        raise ConfigError(f"{text} is a directory: name the file to write")
    if not os.path.isdir(os.path.dirname(output)):
        raise ConfigError(f"cannot write {text}: its directory does not exist")
    return output


def _write(state: dict[str, Any], output: str, bar: Progress) -> None:
    """``torch.save`` beside ``output``, then rename: never a half-written file under its name."""
    tmp = f"{output}.tmp-{os.getpid()}"
    try:
        with open(tmp, "wb") as raw:
            torch.save(state, _CountingFile(raw, bar.update))  # type: ignore[arg-type]
        os.replace(tmp, output)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    finally:
        bar.close()


def _total_bytes(info: CheckpointInfo) -> int:
    size = info.manifest.total_bytes if info.manifest is not None else 0
    return size if isinstance(size, int) and not isinstance(size, bool) else 0


class _NoBar:
    def update(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        pass


def _bar(progress: ProgressFactory | None, desc: str, total: int | None) -> Progress:
    return _NoBar() if progress is None else progress(desc, total)


def _count_reads(storage: Storage, update: Callable[[int], Any]) -> None:
    """Report the bytes ``storage`` reads (this instance only) to a progress bar."""
    read_bytes, read_into, read_ranges = storage.read_bytes, storage.read_into, storage.read_ranges

    def counted_bytes(rel: str, start: int = 0, length: int | None = None) -> bytes:
        data = read_bytes(rel, start, length)
        update(len(data))
        return data

    def counted_into(rel: str, offset: int, out: memoryview) -> None:
        read_into(rel, offset, out)
        update(out.nbytes)

    def counted_ranges(rel: str, ranges: Sequence[tuple[int, memoryview]]) -> None:
        read_ranges(rel, ranges)
        update(sum(out.nbytes for _, out in ranges))

    storage.read_bytes = counted_bytes  # type: ignore[method-assign]
    storage.read_into = counted_into  # type: ignore[method-assign]
    if type(storage).read_ranges is not Storage.read_ranges:  # the base one calls read_into
        storage.read_ranges = counted_ranges  # type: ignore[method-assign]


class _CountingFile:
    """A writable file that reports the bytes written (``torch.save`` needs write/flush)."""

    def __init__(self, raw: Any, update: Callable[[int], Any]) -> None:
        self._raw = raw
        self._update = update

    def write(self, data: Any) -> int:
        n: int = self._raw.write(data)
        self._update(n)
        return n

    def flush(self) -> None:
        self._raw.flush()
