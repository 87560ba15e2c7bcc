"""DCP ``Metadata`` as JSON, and where each item lives in the shard files.

``torch.distributed.checkpoint`` pickles its metadata; we store the same information as JSON
so a checkpoint can be listed, inspected and verified without unpickling anything, and so it
stays readable across torch versions. Planning and resharding still run through DCP: the
loader rebuilds the ``Metadata`` object from this file.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from lightning_elastic.core.format.skeleton import Skeleton
from lightning_elastic.core.storage.base import Storage

if TYPE_CHECKING:
    from lightning_elastic.core.format.manifest import Manifest
from lightning_elastic.errors import ManifestError

__all__ = [
    "ItemLocation",
    "dtype_from_name",
    "dtype_name",
    "metadata_from_json",
    "metadata_to_json",
    "read_checkpoint_metadata",
    "read_metadata",
]

_LAYOUT_VERSION = 1


@dataclass(frozen=True)
class ItemLocation:
    """Byte range of one item (tensor chunk or serialized object) inside a shard file.

    ``transforms`` lists DCP stream-extension descriptors applied to the bytes
    (e.g. ``"stream.zstd/1"``), outermost last, as DCP records them.
    """

    file: str
    offset: int
    length: int
    transforms: tuple[str, ...] = ()


def dtype_name(dtype: torch.dtype) -> str:
    """The dtype's name without the ``torch.`` prefix (``float32``), as the metadata stores it."""
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    """The ``torch.dtype`` called ``name``; raises :class:`ManifestError` for an unknown name."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ManifestError(f"unknown tensor dtype {name!r} in checkpoint metadata")
    return dtype


def metadata_to_json(metadata: Metadata, skeleton: Skeleton = None) -> str:
    """DCP ``metadata`` (and the state's ``skeleton``) as the compact JSON that
    :func:`read_metadata` parses back."""
    tensors: dict[str, Any] = {}
    objects: list[str] = []
    for fqn, md in metadata.state_dict_metadata.items():
        if isinstance(md, BytesStorageMetadata):
            objects.append(fqn)
            continue
        tensors[fqn] = {
            "dtype": dtype_name(md.properties.dtype),
            "requires_grad": bool(md.properties.requires_grad),
            "size": list(md.size),
            "chunks": [[list(c.offsets), list(c.sizes)] for c in md.chunks],
        }
    storage = []
    for index, loc in (metadata.storage_data or {}).items():
        if not isinstance(loc, ItemLocation):
            raise TypeError(f"unexpected storage data {loc!r} for {index.fqn}")
        offset = None if index.offset is None else list(index.offset)
        storage.append(
            [index.fqn, offset, index.index, loc.file, loc.offset, loc.length, list(loc.transforms)]
        )
    planner_data = metadata.planner_data
    body = {
        "layout_version": _LAYOUT_VERSION,
        "dcp_version": metadata.version,
        "tensors": tensors,
        "objects": objects,
        "planner_data": (
            None
            if planner_data is None
            else {fqn: list(path) for fqn, path in dict(planner_data).items()}
        ),
        "storage": storage,
        "skeleton": skeleton,
    }
    return json.dumps(body, separators=(",", ":"))


def metadata_from_json(text: str | bytes, where: str) -> Metadata:
    """The DCP ``Metadata`` alone (see :func:`read_metadata`)."""
    return read_metadata(text, where)[0]


def read_checkpoint_metadata(
    ckpt: Storage, manifest: Manifest | None = None
) -> tuple[Metadata, Skeleton]:
    """The DCP metadata of the checkpoint directory ``ckpt`` (the file its ``manifest``
    names; the manifest is read when not given), parsed."""
    from lightning_elastic.core.format.manifest import MANIFEST_FILE, Manifest

    if manifest is None:
        manifest = Manifest.from_json(ckpt.read_bytes(MANIFEST_FILE), ckpt.display(MANIFEST_FILE))
    name = manifest.dcp_metadata
    return read_metadata(ckpt.read_bytes(name), ckpt.display(name))


def read_metadata(text: str | bytes, where: str) -> tuple[Metadata, Skeleton]:
    """The DCP ``Metadata`` and the state's skeleton (``None`` if it was not recorded)."""
    try:
        body = json.loads(text)
        if body.get("layout_version") != _LAYOUT_VERSION:
            raise ManifestError(
                f"{where} has layout version {body.get('layout_version')!r}; "
                f"this lightning_elastic reads version {_LAYOUT_VERSION}"
            )
        sd_md: dict[str, TensorStorageMetadata | BytesStorageMetadata] = {}
        for fqn, t in body["tensors"].items():
            sd_md[fqn] = TensorStorageMetadata(
                properties=TensorProperties(
                    dtype=dtype_from_name(t["dtype"]), requires_grad=bool(t["requires_grad"])
                ),
                size=torch.Size(t["size"]),
                chunks=[
                    ChunkStorageMetadata(offsets=torch.Size(o), sizes=torch.Size(s))
                    for o, s in t["chunks"]
                ],
            )
        for fqn in body["objects"]:
            sd_md[fqn] = BytesStorageMetadata()
        storage: dict[MetadataIndex, ItemLocation] = {}
        for fqn, offset, hint, file, pos, length, transforms in body["storage"]:
            index = MetadataIndex(fqn, offset, hint)
            storage[index] = ItemLocation(str(file), int(pos), int(length), tuple(transforms))
        planner_data = body["planner_data"]
        if planner_data is not None:
            planner_data = {fqn: tuple(path) for fqn, path in _mapping(planner_data).items()}
        metadata = Metadata(
            state_dict_metadata=sd_md,
            planner_data=planner_data,
            storage_data=storage,
            version=body.get("dcp_version"),
        )
        return metadata, body.get("skeleton")
    except ManifestError:
        raise
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ManifestError(f"{where} is malformed: {type(exc).__name__}: {exc}") from exc


def _mapping(value: Any) -> Mapping[str, Any]:
    if not isinstance(value, dict):
        raise TypeError("planner_data is not an object")
    return value
