"""Writing a rank's shard file: the bytes of its :class:`~lightning_elastic.core.save.stage.Payload`
(read back by :mod:`lightning_elastic.core.load.reader`).

Tensor bytes are written raw (no pickling on the hot path); objects are the bytes DCP's
planner serialized for them. With ``compression="zstd"`` each item becomes one zstd frame,
recorded with DCP's ``stream.zstd/1`` descriptor and decoded through DCP's extension registry.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from torch.distributed.checkpoint.storage import WriteResult

from lightning_elastic.core._compat import dcp_zstd_available
from lightning_elastic.core.format.dcp_json import ItemLocation
from lightning_elastic.core.gcpause import paused_gc
from lightning_elastic.core.save.stage import Payload
from lightning_elastic.core.storage.base import Storage, Written
from lightning_elastic.errors import ConfigError

__all__ = ["COMPRESSIONS", "ShardWrite", "check_compression", "write_shard"]

COMPRESSIONS = (None, "zstd")
_ZSTD_DESCRIPTOR = "stream.zstd/1"


@dataclass(frozen=True)
class ShardWrite:
    """A written shard file: its size and checksum, and DCP's result for each item."""

    written: Written
    results: tuple[WriteResult, ...]


def check_compression(compression: str | None) -> None:
    """Raise :class:`ConfigError` unless ``compression`` is supported and, for ``"zstd"``,
    the zstandard package is installed."""
    if compression not in COMPRESSIONS:
        raise ConfigError(f"compression must be one of {COMPRESSIONS}, got {compression!r}")
    if compression == "zstd" and not dcp_zstd_available():
        raise ConfigError(
            "compression='zstd' needs the zstandard package: pip install 'lightning_elastic[zstd]'"
        )


def write_shard(
    storage: Storage,
    rel_path: str,
    payload: Payload,
    *,
    checksum: str,
    compression: str | None = None,
    zstd_level: int = 3,
) -> ShardWrite:
    """Write ``payload`` to ``rel_path``; return its digest and one DCP WriteResult per item."""
    file_name = rel_path.rsplit("/", 1)[-1]
    if compression is None:
        written = storage.write_stream(
            rel_path,
            payload.chunks,
            checksum=checksum,
            direct=payload.image is not None,
            size=payload.size,
        )
        with paused_gc():  # CPU only, one result per item: see core/gcpause.py
            results = tuple(
                WriteResult(
                    index=item.write_item.index,
                    size_in_bytes=item.length,
                    storage_data=ItemLocation(file_name, item.offset, item.length),
                )
                for item in payload.items
            )
        return ShardWrite(written, results)

    import zstandard

    locations: list[tuple[int, int]] = []

    def compressed_chunks() -> Iterator[bytes]:
        locations.clear()  # a retry restarts the file from the beginning
        compressor = zstandard.ZstdCompressor(level=zstd_level)
        position = 0
        for item in payload.items:
            frame = compressor.compress(item.data)
            locations.append((position, len(frame)))
            position += len(frame)
            yield frame

    written = storage.write_stream(rel_path, compressed_chunks, checksum=checksum)
    results = tuple(
        WriteResult(
            index=item.write_item.index,
            size_in_bytes=length,
            storage_data=ItemLocation(file_name, offset, length, (_ZSTD_DESCRIPTOR,)),
        )
        for item, (offset, length) in zip(payload.items, locations, strict=True)
    )
    return ShardWrite(written, results)
