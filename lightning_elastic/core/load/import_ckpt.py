"""A checkpoint from elsewhere into our format: a Lightning ``.ckpt`` (any ``torch.save`` file)
or a ``torch.distributed.checkpoint`` directory (Lightning's sharded FSDP and ModelParallel
checkpoints included) becomes one committed checkpoint directory, verified.

Which process calls what: one process, no collectives (``lightning-elastic import``). With
:func:`~lightning_elastic.core.load.consolidate.consolidate` (our directory -> one
``torch.save`` file Lightning loads) a run moves to us and away from us without retraining.

Nothing from the source is trusted: a ``torch.save`` file is read with torch's ``weights_only``
unpickler and our allowlist (:func:`~lightning_elastic.core.load.safe.load_file`); DCP's
``.metadata`` is a pickle, read here by an unpickler that builds DCP's metadata classes and
nothing else; DCP's objects go through the allowlist too. ``trusted=True`` lifts both.

Verified: the written checkpoint's checksums are checked, then it is read back whole and
compared with what was read from the source, tensor for tensor.
"""

from __future__ import annotations

import io
import os
import pickle
import time
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.api import CheckpointException

from lightning_elastic.core._compat import read_dcp_directory
from lightning_elastic.core.dist.coordinator import Coordinator
from lightning_elastic.core.engine import CheckpointEngine
from lightning_elastic.core.load.consolidate import locate_checkpoint
from lightning_elastic.core.load.load import read_full_state
from lightning_elastic.core.load.safe import PATH_CLASSES, UnsafeObjectError, load_file, load_object
from lightning_elastic.core.storage.base import local_path
from lightning_elastic.errors import (
    CheckpointNotFoundError,
    ConfigError,
    ElasticCheckpointError,
    IntegrityError,
    Phase,
    RankFailure,
    UnsafeCheckpointError,
)

__all__ = ["ImportResult", "import_checkpoint", "read_foreign"]

TORCH_SAVE = "torch.save file"
DCP = "torch.distributed.checkpoint directory"
_DCP_METADATA = ".metadata"
_LIGHTNING_META = "meta.pt"  # Lightning's sharded checkpoints: everything but model/optimizers


@dataclass(frozen=True)
class ImportResult:
    """What :func:`import_checkpoint` wrote: where, from what, and how long it took."""

    source: str
    kind: str  # TORCH_SAVE or DCP
    location: str
    step: int
    bytes: int
    seconds: float


def import_checkpoint(
    source: str | os.PathLike[str],
    root: str | os.PathLike[str],
    *,
    name: str | None = None,
    storage_options: Mapping[str, Any] | None = None,
    trusted: bool = False,
    overwrite: bool = False,
) -> ImportResult:
    """Write the checkpoint ``source`` (a local ``torch.save`` file or DCP directory) as our
    checkpoint ``root/name`` (default name: the source's own, e.g. ``epoch=3-step=400.ckpt``),
    verified (see the module docstring). ``overwrite`` replaces a checkpoint of that name.

    Raises:
        CheckpointNotFoundError: ``source`` is neither a file nor a DCP directory.
        UnsafeCheckpointError: an object of ``source`` would need ``trusted=True``.
        IntegrityError: ``source`` is truncated or garbled (not a ``torch.save`` file, a DCP
            ``.metadata`` or shard that cannot be read), naming the file.
            Or what was written does not read back as what was read.
    """
    start = time.monotonic()
    src = os.fspath(source)
    state, kind = read_foreign(src, trusted=trusted)
    name = name or os.path.basename(src.rstrip("/"))
    engine = CheckpointEngine(
        root,
        storage_options=storage_options,
        coordinator=Coordinator.single_process(),
        async_save=False,
    )
    try:
        result = engine.save(
            state,
            step=_int(state, "global_step", "step"),
            epoch=_int(state, "epoch", default=None),
            metadata={"imported_from": os.path.abspath(src), "format": kind},
            name=name,
            overwrite=overwrite,
        )
        assert result is not None
        location = result.result().location
    finally:
        engine.close()
    ckpt, info = locate_checkpoint(location, storage_options=storage_options, verify="full")
    _compare(read_full_state(ckpt, trusted=trusted), state, location)
    manifest = info.manifest
    assert manifest is not None
    return ImportResult(
        src, kind, location, manifest.step, manifest.total_bytes, time.monotonic() - start
    )


def read_foreign(source: str, *, trusted: bool = False) -> tuple[dict[str, Any], str]:
    """The whole state of ``source`` (a ``torch.save`` file or a DCP directory), read safely,
    and which kind it was."""
    path = local_path(source)
    if path is None:
        raise ConfigError(f"the source must be a local file or directory, got {source!r}")
    if os.path.isfile(path):
        if not trusted and not zipfile.is_zipfile(path):
            raise IntegrityError(
                source,
                os.path.basename(path),
                "not a torch.save file (truncated, or another format; a legacy-format "
                "torch.save file loads with trusted=True / --trusted)",
            )
        state = _unreadable_to_typed(
            source, path, lambda: _unsafe_to_typed(source, lambda: load_file(path, trusted=trusted))
        )
        if not isinstance(state, dict):
            raise ConfigError(
                f"{source} holds a {type(state).__name__}, not a checkpoint dict: save a dict "
                "(Lightning's .ckpt is one)"
            )
        return state, TORCH_SAVE
    if os.path.isfile(os.path.join(path, _DCP_METADATA)):
        state = _unreadable_to_typed(
            source,
            "a .distcp shard",
            lambda: _unsafe_to_typed(source, lambda: _read_dcp(path, trusted)),
        )
        return state, DCP
    raise CheckpointNotFoundError(
        f"{source} is neither a torch.save file nor a torch.distributed.checkpoint directory "
        f"(no {_DCP_METADATA} in it)"
    )


def _read_dcp(path: str, trusted: bool) -> dict[str, Any]:
    def unpickle() -> Any:
        with open(os.path.join(path, _DCP_METADATA), "rb") as stream:  # before DCP opens it
            return pickle.load(stream) if trusted else _MetadataUnpickler(stream).load()

    metadata = _unreadable_to_typed(path, _DCP_METADATA, unpickle)

    def read_metadata(stream: Any) -> Any:
        return metadata

    def read_object(buffer: io.BytesIO, fqn: str) -> Any:
        return load_object(buffer, fqn, trusted=trusted)

    state: dict[str, Any] = _int_optimizer_keys(
        read_dcp_directory(path, read_metadata, read_object)
    )
    meta = os.path.join(path, _LIGHTNING_META)
    if os.path.isfile(meta):  # Lightning's FSDP/ModelParallel layout: back to its .ckpt dict
        rest = load_file(meta, trusted=trusted)
        if isinstance(rest, dict):
            if "model" in state and "state_dict" not in state:
                state["state_dict"] = state.pop("model")
            optimizers = sorted(
                (k for k in state if k.startswith("optimizer_") and k[10:].isdigit()),
                key=lambda k: int(k[10:]),
            )
            if optimizers:
                state["optimizer_states"] = [state.pop(k) for k in optimizers]
            state = {**rest, **state}
    return state


def _int_optimizer_keys(value: Any) -> Any:
    """DCP keeps mapping keys as strings: an ``Optimizer.state_dict()`` comes back with
    ``state`` keyed ``"0", "1", ...`` while its ``param_groups`` list ``0, 1, ...``, and
    ``load_state_dict`` would then silently find no state for any parameter. Such states get
    their int keys back (ones keyed by parameter name, FSDP's, are left as they are)."""
    if not isinstance(value, dict):
        return value
    value = {k: _int_optimizer_keys(v) for k, v in value.items()}
    state, groups = value.get("state"), value.get("param_groups")
    if (
        isinstance(state, dict)
        and isinstance(groups, list)
        and all(isinstance(k, str) and k.isdigit() for k in state)
        and all(
            isinstance(g, dict) and all(isinstance(p, int) for p in g.get("params", ()))
            for g in groups
        )
    ):
        value["state"] = {int(k): v for k, v in state.items()}
    return value


class _MetadataUnpickler(pickle.Unpickler):
    """DCP's ``.metadata`` pickle, building only DCP's metadata classes and torch's dtypes,
    sizes, layouts and memory formats; any other global is refused (nothing runs)."""

    _CLASSES = {
        "torch.distributed.checkpoint.metadata": {
            "Metadata",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "ChunkStorageMetadata",
            "TensorProperties",
            "MetadataIndex",
            "StorageMeta",
            "_MEM_FORMAT_ENCODING",
        },
        "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
        "torch": {"Size"},
        "torch.serialization": {"_get_layout"},  # a layout by its name (torch.strided)
        "collections": {"OrderedDict"},
        # StorageMeta.checkpoint_id (a path: data only, as in safe.ALLOWED_GLOBALS)
        "pathlib": set(PATH_CLASSES),
        "pathlib._local": set(PATH_CLASSES),
    }

    def find_class(self, module: str, name: str) -> Any:
        if name in self._CLASSES.get(module, ()):
            return super().find_class(module, name)
        if module == "torch":
            value = getattr(torch, name, None)
            if isinstance(value, (torch.dtype, torch.layout, torch.memory_format)):
                return value
        raise UnsafeObjectError(_DCP_METADATA, [f"{module}.{name}"])


def _unsafe_to_typed(source: str, read: Any) -> Any:
    try:
        return read()
    except UnsafeObjectError as exc:
        failure = RankFailure.from_exception(0, Phase.LOAD, exc)
        raise UnsafeCheckpointError(source, [failure], exc.types) from None


def _unreadable_to_typed(source: str, file: str, read: Any) -> Any:
    """What torch or DCP raise for a truncated or garbled source, as an :class:`IntegrityError`
    naming it (our own errors pass through)."""
    try:
        return read()
    except (ElasticCheckpointError, UnsafeObjectError):
        raise
    except (
        pickle.UnpicklingError,
        EOFError,
        RuntimeError,
        ValueError,
        KeyError,
        CheckpointException,  # DCP's, for a shard it cannot read (a BaseException)
    ) as exc:
        reason = f"cannot be read: {type(exc).__name__}: {str(exc)[:300]}"
        raise IntegrityError(source, os.path.basename(file), reason) from exc


def _compare(back: Any, read: Any, location: str, where: str = "") -> None:
    """``back`` (the written checkpoint, read back) is ``read`` (the source), or
    :class:`IntegrityError` names the first difference."""

    def differ(reason: str) -> IntegrityError:
        return IntegrityError(location, where or "/", f"reads back other than the source: {reason}")

    if isinstance(read, torch.Tensor):
        if not isinstance(back, torch.Tensor) or not torch.equal(back, read.cpu()):
            raise differ("another tensor")
    elif isinstance(read, Mapping):
        if not isinstance(back, Mapping) or set(back) != set(read):
            raise differ("other keys")
        for key, value in read.items():
            _compare(back[key], value, location, f"{where}/{key}")
    elif isinstance(read, (list, tuple)):
        if not isinstance(back, (list, tuple)) or len(back) != len(read):
            raise differ("another length")
        for i, (a, b) in enumerate(zip(back, read, strict=True)):
            _compare(a, b, location, f"{where}[{i}]")
    elif not _equal(back, read):
        raise differ(f"{back!r} for {read!r}")


def _equal(a: Any, b: Any) -> bool:
    """``a == b`` for plain values and arrays (elementwise, all); NaN equals NaN here."""
    if isinstance(b, float) and b != b:
        return isinstance(a, float) and a != a
    try:
        same = a == b
        return bool(same) if isinstance(same, bool) else bool(same.all())
    except Exception:
        return False


def _int(state: Mapping[str, Any], *keys: str, default: int | None = 0) -> Any:
    for key in keys:
        value = state.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            return value
    return default
