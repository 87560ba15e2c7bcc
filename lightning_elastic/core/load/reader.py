"""A DCP ``StorageReader`` over one committed checkpoint directory, reading the shard files
written by :mod:`lightning_elastic.core.save.write` for ``torch.distributed.checkpoint.load``.

Tensor bytes are stored raw; objects are the bytes DCP serialized for them; zstd-compressed items
are decoded through DCP's extension registry (``stream.zstd/1``).
"""

from __future__ import annotations

import io
import os
from collections.abc import Sequence
from typing import Any, cast

import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from lightning_elastic.core._compat import dcp_extension_registry
from lightning_elastic.core.format.dcp_json import ItemLocation
from lightning_elastic.core.save.stage import byte_view
from lightning_elastic.core.storage.base import Storage
from lightning_elastic.errors import ManifestError

__all__ = ["BATCH_BYTES", "ShardReader"]

# The most bytes a load reads into staging buffers before copying them to their
# destinations (regions read in place into the destination do not count)
BATCH_BYTES = 64 << 20


class ShardReader(StorageReader):
    """DCP ``StorageReader`` over one committed checkpoint directory.

    The metadata is handed in already parsed (from ``dcp_metadata.json``) and verified by
    the caller; this reader only moves bytes. Reads are grouped per file in offset order;
    uncompressed chunks that fill their destination are read straight into it.
    """

    def __init__(self, storage: Storage, metadata: Metadata) -> None:
        super().__init__()
        self.storage = storage
        self.metadata = metadata
        self.bytes_read = 0
        self._chunks: dict[tuple[str, tuple[int, ...]], tuple[torch.dtype, torch.Size]] = {}
        for fqn, md in metadata.state_dict_metadata.items():
            if isinstance(md, TensorStorageMetadata):
                for chunk in md.chunks:
                    key = (fqn, tuple(chunk.offsets))
                    self._chunks[key] = (md.properties.dtype, chunk.sizes)
        self._registry = dcp_extension_registry()

    # DCP protocol --------------------------------------------------------------------

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        self.bytes_read = 0

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        return self.metadata

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        self.metadata = metadata

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return False  # never auto-selected by DCP; always passed explicitly

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        storage_data = cast(dict[MetadataIndex, ItemLocation], self.metadata.storage_data)
        located = []
        for req in plan.items:
            try:
                located.append((storage_data[req.storage_index], req))
            except KeyError:
                raise ManifestError(
                    f"{self.storage.display()}: no stored bytes for {req.storage_index.fqn}"
                ) from None
        located.sort(key=lambda pair: (pair[0].file, pair[0].offset))
        batch = _Batch(self.storage, planner)
        for location, req in located:
            if req.type == LoadItemType.BYTE_IO:
                planner.load_bytes(req, io.BytesIO(self._read_item(location)))
            else:
                self._read_tensor(location, req, planner, batch)
        batch.flush()
        self.bytes_read += batch.bytes_read
        future: Future[None] = Future()
        future.set_result(None)
        return future

    # helpers ---------------------------------------------------------------------------

    def _read_item(self, location: ItemLocation) -> bytes:
        raw = self.storage.read_bytes(location.file, location.offset, location.length)
        self.bytes_read += len(raw)
        if not location.transforms:
            return raw
        stream: Any = io.BytesIO(raw)
        for ext in self._registry.from_descriptor_list(list(location.transforms)):
            stream = ext.transform_from(stream)
        return cast(bytes, stream.read())

    def _read_tensor(
        self, location: ItemLocation, req: ReadItem, planner: LoadPlanner, batch: _Batch
    ) -> None:
        key = (req.storage_index.fqn, tuple(req.storage_index.offset or ()))
        try:
            dtype, sizes = self._chunks[key]
        except KeyError:
            raise ManifestError(
                f"{self.storage.display()}: no chunk metadata for {req.storage_index.fqn}"
            ) from None
        target = planner.resolve_tensor(req).detach()
        rows = (
            None
            if location.transforms
            else _row_range(sizes, req.storage_offsets, req.lengths, dtype.itemsize)
        )
        if rows is not None:
            # The wanted region is one byte range of the stored chunk (the whole chunk, or
            # whole rows of it when resharding along dim 0): read just that range, together
            # with the other ranges of the file (one open per file and batch).
            start, length = rows
            direct = (
                target.device.type == "cpu"
                and target.is_contiguous()
                and target.dtype == dtype
                and target.numel() * target.element_size() == length
            )
            buffer = target if direct else torch.empty(tuple(req.lengths), dtype=dtype)
            batch.add(location.file, location.offset + start, req, target, buffer, direct)
        else:
            data = bytearray(self._read_item(location))
            if not data:
                chunk = torch.empty(sizes, dtype=dtype)
            else:
                chunk = torch.frombuffer(data, dtype=dtype).view(sizes)
            _copy_checked(req, target, _narrow(chunk, req.storage_offsets, req.lengths))
            planner.commit_tensor(req, target)


class _Batch:
    """Byte ranges read together: per file, in offset order, with one
    :meth:`Storage.read_ranges` call; then each destination is committed. Flushed when the
    staging buffers it holds (regions that are not read in place) pass :data:`BATCH_BYTES`,
    so a resharding load never holds more than that in extra memory."""

    def __init__(self, storage: Storage, planner: LoadPlanner) -> None:
        self.storage = storage
        self.planner = planner
        self.bytes_read = 0
        self._ranges: dict[str, list[tuple[int, memoryview]]] = {}
        self._pending: list[tuple[ReadItem, torch.Tensor, torch.Tensor, bool]] = []
        self._buffered = 0

    def add(
        self,
        file: str,
        offset: int,
        req: ReadItem,
        target: torch.Tensor,
        buffer: torch.Tensor,
        direct: bool,
    ) -> None:
        length = buffer.numel() * buffer.element_size()
        if length:
            view = byte_view(buffer.reshape(-1).view(torch.uint8))
            self._ranges.setdefault(file, []).append((offset, view))
        self.bytes_read += length
        self._pending.append((req, target, buffer, direct))
        if not direct:
            self._buffered += length
            if self._buffered >= BATCH_BYTES:
                self.flush()

    def flush(self) -> None:
        for file, ranges in self._ranges.items():
            self.storage.read_ranges(file, ranges)
        self._ranges.clear()
        pending, self._pending, self._buffered = self._pending, [], 0
        for req, target, buffer, direct in pending:
            if not direct:
                _copy_checked(req, target, buffer)
            self.planner.commit_tensor(req, target)


def _row_range(
    sizes: torch.Size, offsets: Sequence[int], lengths: Sequence[int], itemsize: int
) -> tuple[int, int] | None:
    """(start, length) in bytes of the region ``offsets``/``lengths`` of a contiguous chunk of
    shape ``sizes`` when it is contiguous too (only dim 0 narrowed), else ``None``."""
    if len(sizes) == 0:
        return (0, itemsize)
    if tuple(offsets[1:]) != (0,) * (len(sizes) - 1) or tuple(lengths[1:]) != tuple(sizes[1:]):
        return None
    row = itemsize
    for size in sizes[1:]:
        row *= size
    return (offsets[0] * row, lengths[0] * row)


def _copy_checked(req: ReadItem, target: torch.Tensor, source: torch.Tensor) -> None:
    if target.size() != source.size():
        raise ManifestError(
            f"{req.storage_index.fqn}: stored chunk has shape {tuple(source.size())}, "
            f"the destination {tuple(target.size())}"
        )
    target.copy_(source)


def _narrow(tensor: torch.Tensor, offsets: Sequence[int], lengths: Sequence[int]) -> torch.Tensor:
    """The region ``offsets``/``lengths`` of ``tensor`` (a view)."""
    for dim, (start, length) in enumerate(zip(offsets, lengths, strict=True)):
        if start != 0 or length != tensor.size(dim):
            tensor = tensor.narrow(dim, start, length)
    return tensor
