"""Only the model weights of a checkpoint, into a ``torch.nn.Module`` (fine-tuning, evaluation).

Like Composer's ``load_weights_only`` / ``load_ignore_keys`` / ``load_strict_model_weights``:
the module's ``state_dict`` is compared with the checkpoint's by key and shape before a byte
of data is read (DCP metadata only), then only the entries that will be loaded are read:
optimizer states, loops and callbacks are neither deserialized nor held in memory.

Which process calls what: one process, no collective (a checkpoint of any world size). Called
on every rank of a job, every rank reads the weights itself.
"""

from __future__ import annotations

import fnmatch
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from lightning_elastic.core.format.dcp_json import read_checkpoint_metadata
from lightning_elastic.core.format.skeleton import keys
from lightning_elastic.core.load.consolidate import locate_checkpoint
from lightning_elastic.core.load.load import RANK_LOCAL_KEY, read_into, read_template
from lightning_elastic.core.storage.base import Storage
from lightning_elastic.errors import ConfigError, WeightsMismatchError

__all__ = ["WEIGHT_KEYS", "LoadedWeights", "load_weights"]

# where the weights are, tried in order: Lightning's checkpoint dict, then the usual name of
# a CheckpointEngine.save({"model": model, ...})
WEIGHT_KEYS = ("state_dict", "model")


@dataclass(frozen=True)
class LoadedWeights:
    """What :func:`load_weights` did (like the ``missing_keys``/``unexpected_keys`` of torch's
    ``load_state_dict``), in the module's and the checkpoint's key order."""

    checkpoint: str  # the checkpoint directory the weights came from
    step: int | None
    loaded_keys: tuple[str, ...]
    missing_keys: tuple[str, ...]  # in the module, not in the checkpoint: left as they were
    unexpected_keys: tuple[str, ...]  # in the checkpoint, not in the module: not read
    ignored_keys: tuple[str, ...]  # matched ``ignore_keys`` (either side): not compared, not read


def load_weights(
    module: torch.nn.Module,
    path: str | os.PathLike[str],
    *,
    strict: bool = True,
    ignore_keys: str | Iterable[str] = (),
    key: str | None = None,
    storage_options: Mapping[str, Any] | None = None,
    trusted: bool = False,
    verify: str = "full",
) -> LoadedWeights:
    """Load a checkpoint's model weights into ``module`` (a ``LightningModule`` or any
    ``torch.nn.Module``), whatever world size wrote it.

    Args:
        module: receives the weights through its ``load_state_dict`` (on its own device and
            dtype).
        path: a checkpoint directory, or a root holding several (its newest valid one).
        strict: every key of the module and of the checkpoint (outside ``ignore_keys``) must
            match; else :class:`~lightning_elastic.errors.WeightsMismatchError` names the first
            that does not, and nothing is loaded. ``strict=False`` loads the keys both have and
            reports the rest in the result.
        ignore_keys: glob patterns (``fnmatch``, e.g. ``"head.*"``) of keys to leave alone on
            both sides: not read from the checkpoint, not compared, the module's own values
            kept (a new head for fine-tuning).
        key: the checkpoint entry holding the weights: by default ``"state_dict"`` (a
            checkpoint of ``DistributedCheckpoint``/``ElasticStrategy``), else ``"model"`` (a
            ``CheckpointEngine.save({"model": ...})``); it must be a flat ``state_dict``.
        storage_options: fsspec options for ``path``.
        trusted: unpickle non-tensor entries (``_extra_state``) without the allowlist.
        verify: ``"full"`` (checksums of every file), ``"size"`` or ``"none"``.

    Shapes must agree for every key loaded (as in torch, also with ``strict=False``): a
    mismatch raises ``WeightsMismatchError`` naming the key and both shapes; ignore the key to
    keep the module's value. The weights are read as whole tensors on the CPU, for a module
    whose ``state_dict`` holds plain tensors (not FSDP2 ``DTensor`` shards: load those through
    the engine, which reshards).
    """
    patterns = (ignore_keys,) if isinstance(ignore_keys, str) else tuple(ignore_keys)
    ckpt, info = locate_checkpoint(path, storage_options=storage_options, verify=verify)
    entry = _weights_key(ckpt, key, info.location)
    tree = read_template(ckpt, (entry,))
    saved = _flat(tree[entry] if tree is not None else {}, entry, info.location)

    def ignored(name: str) -> bool:
        return any(fnmatch.fnmatchcase(name, p) for p in patterns)

    current = module.state_dict()
    loaded = [k for k in current if k in saved and not ignored(k)]
    missing = [k for k in current if k not in saved and not ignored(k)]
    unexpected = [k for k in saved if k not in current and not ignored(k)]
    for name in loaded:
        ours, theirs = _shape(current[name]), _shape(saved[name])
        if ours is not None and theirs is not None and ours != theirs:
            hint = f"Pass ignore_keys=[{name!r}] (or a pattern) to keep the model's own."
            raise WeightsMismatchError(info.location, name, theirs, ours, hint)
    if strict and (missing or unexpected):
        hint = "Pass strict=False to load the keys both have, or ignore_keys=[patterns]."
        if missing:
            name = missing[0]
            raise WeightsMismatchError(info.location, name, None, _shape(current[name]), hint)
        name = unexpected[0]
        raise WeightsMismatchError(info.location, name, _shape(saved[name]), None, hint)
    selected = {name: saved[name] for name in loaded}
    read_into(ckpt, {entry: selected}, trusted=trusted)
    module.load_state_dict(selected, strict=False)
    return LoadedWeights(
        checkpoint=info.location,
        step=info.step,
        loaded_keys=tuple(loaded),
        missing_keys=tuple(missing),
        unexpected_keys=tuple(unexpected),
        ignored_keys=tuple(k for k in dict.fromkeys([*current, *saved]) if ignored(k)),
    )


def _weights_key(ckpt: Storage, key: str | None, location: str) -> str:
    _, skeleton = read_checkpoint_metadata(ckpt)
    top = [str(k) for k in keys(skeleton)]  # the skeleton alone: nothing is allocated
    saved = [k for k in top if k != RANK_LOCAL_KEY]
    if key is not None:
        if key in top:
            return key
        raise ConfigError(f"{location} has no entry {key!r}; its entries are {sorted(saved)}")
    for candidate in WEIGHT_KEYS:
        if candidate in top:
            return candidate
    raise ConfigError(
        f"{location} has neither of {list(WEIGHT_KEYS)}; its entries are {sorted(saved)}: "
        "pass key=<the entry that holds the state_dict>"
    )


def _flat(node: Any, entry: str, location: str) -> dict[str, Any]:
    if not isinstance(node, dict) or any(isinstance(v, (dict, list)) for v in node.values()):
        raise ConfigError(
            f"entry {entry!r} of {location} is not a flat state_dict (name -> tensor): load "
            "the checkpoint with lightning_elastic.consolidate() and pick the part you need"
        )
    return {str(k): v for k, v in node.items()}


def _shape(value: Any) -> tuple[int, ...] | None:
    return tuple(value.shape) if isinstance(value, torch.Tensor) else None
