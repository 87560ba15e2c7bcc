"""A DCP ``StorageReader`` over one committed checkpoint directory, reading the shard files
written by :mod:`lightning_elastic.core.save.write` for ``torch.distributed.checkpoint.load``.

Tensor bytes are stored raw; objects are the bytes DCP serialized for them; zstd-compressed items
are decoded through DCP's extension registry (``stream.zstd/1``).
"""

from __future__ import annotations

import io
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from lightning_elastic.core._compat import dcp_extension_registry
from lightning_elastic.core.format.dcp_json import ItemLocation
from lightning_elastic.core.format.integrity import Problem
from lightning_elastic.core.format.manifest import FileRecord
from lightning_elastic.core.save.stage import byte_view
from lightning_elastic.core.storage.base import Storage
from lightning_elastic.core.storage.checksum import Hasher, new_hasher
from lightning_elastic.errors import ManifestError, StorageError, StorageNotFoundError

__all__ = ["BATCH_BYTES", "SCRATCH_BYTES", "ShardReader"]

# The most bytes a load reads into staging buffers before copying them to their
# destinations (regions read in place into the destination do not count)
BATCH_BYTES = 64 << 20
# The buffer a verifying read hashes the bytes this rank does not need through
SCRATCH_BYTES = 16 << 20


@dataclass
class _Check:
    """A file this reader verifies while it loads: hashed in file order up to ``pos``."""

    record: FileRecord
    hasher: Hasher
    pos: int = 0
    failed: bool = False  # a read of it failed: its checksum can no longer be judged


class ShardReader(StorageReader):
    """DCP ``StorageReader`` over one committed checkpoint directory.

    The metadata is handed in already parsed (from ``dcp_metadata.json``) and verified by
    the caller. Reads are grouped per file in offset order; uncompressed chunks that fill
    their destination are read straight into it.

    ``verify`` names files whose checksum this reader computes while it loads (the load's
    verification, fused with its reads so the bytes cross the storage once): every byte of
    such a file is hashed in file order as it lands, the bytes this rank does not need are
    read through a scratch buffer, and :meth:`finish_verification` hashes what is left and
    compares. A file's checksum covers all of it, so exactly one rank verifies each file.

    ``routes``: where the files an incremental checkpoint refers to live (their own
    checkpoints' directories, :func:`~lightning_elastic.core.format.references.routes`).
    """

    def __init__(
        self,
        storage: Storage,
        metadata: Metadata,
        *,
        verify: Sequence[FileRecord] = (),
        algorithm: str = "xxh3_64",
        routes: Mapping[str, Storage] | None = None,
    ) -> None:
        super().__init__()
        self.storage = storage
        # an incremental checkpoint's referenced files, in their own checkpoints' directories
        self.routes = dict(routes or {})
        self.metadata = metadata
        self.bytes_read = 0
        self.algorithm = algorithm
        self._checks = {r.path: _Check(r, new_hasher(algorithm)) for r in verify}
        self._scratch: memoryview | None = None
        #: a read that failed while only hashing (an I/O error, not a mismatch): the load
        #: fails with it rather than call the checkpoint corrupt
        self.verify_error: StorageError | None = None
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
        batch = _Batch(self.read_ranges, planner)
        for location, req in located:
            if req.type == LoadItemType.BYTE_IO:
                if location.file in self._checks:
                    batch.flush()  # the verified file is hashed in order: its earlier ranges first
                planner.load_bytes(req, io.BytesIO(self._read_item(location)))
            else:
                self._read_tensor(location, req, planner, batch)
        batch.flush()
        self.bytes_read += batch.bytes_read
        future: Future[None] = Future()
        future.set_result(None)
        return future

    # verification while reading ----------------------------------------------------------

    def read_ranges(self, file: str, ranges: Sequence[tuple[int, memoryview]]) -> None:
        """Fill ``ranges`` of ``file``; hashing it on the way when this reader verifies it."""
        check = self._checks.get(file)
        if check is None:
            self.at(file).read_ranges(file, ranges)
            return
        queued: list[tuple[int, memoryview, int]] = []  # (offset, out, bytes already hashed)
        for offset, out in sorted(ranges, key=lambda r: r[0]):
            out = out.cast("B") if out.format != "B" or out.ndim != 1 else out
            self._hash_gap(check, offset, queued)
            queued.append((offset, out, min(max(0, check.pos - offset), out.nbytes)))
            check.pos = max(check.pos, offset + out.nbytes)
        self._run(check, queued)

    def _run(self, check: _Check, queued: list[tuple[int, memoryview, int]]) -> None:
        """Read what is queued (one ``read_ranges`` call), then hash it in order."""
        if queued:
            try:
                path = check.record.path
                self.at(path).read_ranges(path, [(o, out) for o, out, _ in queued])
            except BaseException:
                check.failed = True  # the hash misses these bytes: no verdict on this file
                raise
            for _, out, hashed in queued:
                if hashed < out.nbytes:
                    check.hasher.update(out[hashed:])
            queued.clear()

    def _hash_gap(
        self, check: _Check, until: int, queued: list[tuple[int, memoryview, int]]
    ) -> None:
        """Hash ``check``'s file from where it stands to ``until`` through the scratch buffer
        (bytes this rank does not need); what is queued before them is read and hashed first."""
        if check.pos >= until:
            return
        if self._scratch is None:
            self._scratch = memoryview(bytearray(SCRATCH_BYTES))
        while check.pos < until:
            self._run(check, queued)  # the scratch buffer is reused: what precedes it first
            n = min(until - check.pos, len(self._scratch))
            queued.append((check.pos, self._scratch[:n], 0))
            check.pos += n
            self._run(check, queued)
            self.bytes_read += n

    def finish_verification(self) -> list[Problem]:
        """Hash the rest of every file this reader verifies and compare with the manifest:
        the problems found (a missing file, or one whose size changed, is one). A file whose
        read failed otherwise gets no verdict: a transient I/O error must not quarantine a
        good checkpoint. The error is kept in :attr:`verify_error` when it happened here; one
        that happened during the load's own reads is the load's error already."""
        problems = []
        for path, check in self._checks.items():
            record = check.record
            error: StorageError | None = None
            if not check.failed:  # else the load's own read of it failed: that is its error
                try:
                    self._hash_gap(check, record.size, [])
                except StorageError as exc:
                    error = exc
            if check.failed:  # a read failed: only a missing file or a new size is a verdict
                problem = self._size_problem(record)
                if problem is not None:
                    problems.append(problem)
                elif error is not None:
                    self.verify_error = self.verify_error or error
                continue
            checksum = check.hasher.hexdigest()
            if checksum != record.checksum:
                problems.append(
                    Problem(
                        path,
                        f"{self.algorithm} checksum is {checksum}, the manifest says "
                        f"{record.checksum}",
                    )
                )
        self._checks = {}
        self._scratch = None
        return problems

    def _size_problem(self, record: FileRecord) -> Problem | None:
        """The problem with ``record``'s file when it is gone or its size changed since
        selection checked it; ``None`` when its size is right or cannot be told."""
        try:
            size = self.at(record.path).size(record.path)
        except StorageNotFoundError:
            return Problem(record.path, "file is missing")
        except StorageError:
            return None
        if size != record.size:
            return Problem(record.path, f"size is {size} bytes, the manifest says {record.size}")
        return None

    # helpers ---------------------------------------------------------------------------

    def at(self, file: str) -> Storage:
        """The directory that holds ``file``: the checkpoint's, or a referenced one's."""
        return self.routes.get(file, self.storage)

    def _read_item(self, location: ItemLocation) -> bytes:
        if location.file in self._checks:
            out = memoryview(bytearray(location.length))
            self.read_ranges(location.file, [(location.offset, out)])
            raw = bytes(out)
        else:
            raw = self.at(location.file).read_bytes(location.file, location.offset, location.length)
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
    """Byte ranges read together: per file, in offset order, with one ``read_ranges`` call
    (:meth:`ShardReader.read_ranges`); then each destination is committed. Flushed when the
    staging buffers it holds (regions that are not read in place) pass :data:`BATCH_BYTES`,
    so a resharding load never holds more than that in extra memory."""

    def __init__(
        self,
        read_ranges: Callable[[str, Sequence[tuple[int, memoryview]]], None],
        planner: LoadPlanner,
    ) -> None:
        self.read_ranges = read_ranges
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
            self.read_ranges(file, ranges)
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
