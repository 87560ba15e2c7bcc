"""Rank functions for pipelined checkpoint file transfers under hostile storage and messages
(core/tiers/transfer.py: the sender reads the next chunk while the last is in flight, the
receiver receives the next chunk on a thread while it writes the last). Module level, so
they pickle. Each rank has its own directory ``<root>/node<rank>`` (its node-local storage).

``hooks`` is a list of ``(rank, name, kwargs)``: the hook ``name`` of this module (below)
is applied on that rank before the transfers, to make its storage or its messages hostile.
"""

from __future__ import annotations

import errno
import gc
import os
import threading
import time
import weakref
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from lightning_elastic import Storage
from lightning_elastic.core.storage import local as local_storage
from lightning_elastic.core.tiers import transfer
from lightning_elastic.core.tiers.transfer import Transfer, TransferError, execute_transfers
from tests.distributed import tier_workers
from tests.distributed.tier_workers import node_storage


class Abort(BaseException):
    """Not an ``Exception``: stands for KeyboardInterrupt or a SystemExit in mid-write."""


def hostile_worker(
    root: str,
    files: dict[int, dict[str, bytes]],
    transfers: list[Transfer],
    *,
    chunk_bytes: int | dict[int, int] = 1024,
    timeout_s: float = 10.0,
    hooks: list[tuple[int, str, dict[str, Any]]] = (),  # type: ignore[assignment]
    memory: dict[int, dict[str, list[bytes | bytearray] | str]] | None = None,
    settle_s: float = 0.0,
) -> dict[str, Any]:
    """Write this rank's ``files``, apply its hooks, run the transfers on a dedicated gloo
    group; return the stats, the error (or the type name of a non-TransferError), the
    seconds taken, the transfer threads still alive ``settle_s`` after the call, how many
    chunk buffer sets are still alive, and what the hooks observed (``seen``)."""
    rank, storage, seen = prepared(root, files, hooks)
    buffer_sets = _track_buffers()
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
    chunk = chunk_bytes[rank] if isinstance(chunk_bytes, dict) else chunk_bytes
    sources = {}
    for path, pieces in (memory or {}).get(rank, {}).items():
        if pieces == "raise":
            sources[path] = _raising_source
        else:
            sources[path] = lambda pieces=pieces: [memoryview(p) for p in pieces]
    out: dict[str, Any] = {"error": None, "stats": None, "other": None, "notes": []}
    start = time.monotonic()
    try:
        out["stats"] = execute_transfers(
            transfers,
            rank=rank,
            group=group,
            storage=storage,
            chunk_bytes=chunk,
            timeout=timedelta(seconds=timeout_s),
            sources=sources,
        )
    except TransferError as exc:  # without its traceback, which holds the call's frame
        out["stats"], out["error"] = exc.stats, exc.with_traceback(None)
    except BaseException as exc:
        out["other"] = f"{type(exc).__name__}: {exc}"
        out["notes"] = list(getattr(exc, "__notes__", []))
    out["seconds"] = time.monotonic() - start
    time.sleep(settle_s)
    gc.collect()
    out["threads"] = sorted(t.name for t in threading.enumerate() if "transfer" in t.name)
    out["buffer_sets"] = sum(1 for ref in buffer_sets if ref() is not None)
    out["seen"] = seen
    return out


def prepared(
    root: str, files: dict[int, dict[str, bytes]], hooks: list[tuple[int, str, dict[str, Any]]]
) -> tuple[int, Storage, dict[str, Any]]:
    """This rank, its node storage holding its ``files``, and what its ``hooks`` (functions of
    this module, by name) observe."""
    rank = dist.get_rank()
    storage = node_storage(root, rank)
    for path, data in files.get(rank, {}).items():
        storage.write_bytes(path, data)
    seen: dict[str, Any] = {}
    for hook_rank, name, kwargs in hooks:
        if hook_rank == rank:
            globals()[name](storage, seen, **kwargs)
    return rank, storage, seen


def _raising_source() -> Any:
    raise RuntimeError("the staged payload was released")


def _track_buffers() -> list[weakref.ref]:
    """Weak references to every ``_Buffers`` made from now on (memory held after a call)."""
    refs: list[weakref.ref] = []
    init = transfer._Buffers.__init__

    def tracked(self: Any, size: int) -> None:
        init(self, size)
        refs.append(weakref.ref(self))

    transfer._Buffers.__init__ = tracked  # type: ignore[method-assign]
    return refs


# ----------------------------------------------------------------------------- hooks


def slow_checked_writer(storage: Storage, seen: dict[str, Any], delay: float) -> None:
    """The writer holds each chunk ``delay`` seconds and checks that its bytes did not
    change meanwhile (the receiving thread must not refill a buffer the writer holds)."""
    write_stream = storage.write_stream
    seen["changed_while_held"] = 0
    seen["chunks_written"] = 0

    def checked(rel: str, chunks: Any, **kwargs: Any) -> Any:
        def slow() -> Any:
            for chunk in chunks():
                view = memoryview(chunk).cast("B")
                before = bytes(view)
                time.sleep(delay)
                if bytes(view) != before:
                    seen["changed_while_held"] += 1
                seen["chunks_written"] += 1
                yield chunk

        return write_stream(rel, slow, **kwargs)

    storage.write_stream = checked  # type: ignore[method-assign]


def checked_isends(storage: Storage, seen: dict[str, Any]) -> None:
    """Every tensor handed to ``isend`` is compared, when its send is waited for, with its
    bytes when the send started (a buffer refilled while in flight would differ)."""
    isend, wait = transfer._Link.isend, transfer._Link.wait
    started: dict[int, tuple[Any, torch.Tensor, bytes]] = {}
    seen["changed_in_flight"] = 0
    seen["isends_checked"] = 0

    def snap_isend(self: Any, tensor: torch.Tensor) -> Any:
        work = isend(self, tensor)
        started[id(work)] = (work, tensor, tensor.numpy().tobytes())
        return work

    def checked_wait(self: Any, work: Any) -> None:
        wait(self, work)
        entry = started.pop(id(work), None)
        if entry is not None:
            seen["isends_checked"] += 1
            if entry[1].numpy().tobytes() != entry[2]:
                seen["changed_in_flight"] += 1

    transfer._Link.isend = snap_isend  # type: ignore[method-assign]
    transfer._Link.wait = checked_wait  # type: ignore[method-assign]


def eio_on_write(storage: Storage, seen: dict[str, Any], call: int) -> None:
    """The ``call``-th chunk write of a local file fails with EIO (transient: the storage
    layer retries the whole write, asking the chunk source to start again)."""
    write = local_storage._LocalFile.write
    calls = [0]

    def failing(self: Any, view: memoryview) -> None:
        calls[0] += 1
        if calls[0] == call:
            raise OSError(errno.EIO, "Input/output error (injected)")
        write(self, view)

    local_storage._LocalFile.write = failing  # type: ignore[method-assign]


def eio_on_first_open(storage: Storage, seen: dict[str, Any]) -> None:
    """The first local file opened for writing fails with EIO before any chunk is taken."""
    init = local_storage._LocalFile.__init__
    calls = [0]

    def failing(self: Any, path: str, **kwargs: Any) -> None:
        calls[0] += 1
        if calls[0] == 1:
            raise OSError(errno.EIO, "Input/output error (injected at open)")
        init(self, path, **kwargs)

    local_storage._LocalFile.__init__ = failing  # type: ignore[method-assign]


def exists_lies(storage: Storage, seen: dict[str, Any], path: str) -> None:
    """``exists(path)`` says no although the file is there: the receiver's exclusive write
    then meets the file (CheckpointExistsError from write_stream, before any chunk)."""
    exists = storage.exists
    storage.exists = lambda rel: False if rel == path else exists(rel)  # type: ignore[method-assign]


def abort_writer(storage: Storage, seen: dict[str, Any], path: str, after: int) -> None:
    """The write of ``path`` is interrupted by a BaseException after ``after`` chunks."""
    tier_workers.fail_writes_after(
        storage, path, after, lambda: Abort(f"interrupted after {after} chunks")
    )


def change_source_mid_stream(
    storage: Storage, seen: dict[str, Any], path: str, after: int, mode: str
) -> None:
    """After ``after`` chunk reads of ``path`` the file changes under the sender:
    ``truncate`` cuts it to half, ``replace`` swaps in other bytes of the same size."""
    read_into = storage.read_into
    reads = [0]

    def changing(rel: str, offset: int, out: memoryview) -> None:
        if rel == path:
            reads[0] += 1
            if reads[0] == after + 1:
                target = storage.full(rel)  # type: ignore[attr-defined]
                size = os.path.getsize(target)
                if mode == "truncate":
                    os.truncate(target, size // 2)
                else:
                    tmp = target + ".swap"
                    with open(tmp, "wb") as f:
                        f.write(bytes(size))
                    os.replace(tmp, target)
        read_into(rel, offset, out)

    storage.read_into = changing  # type: ignore[method-assign]


def fail_reads_after(storage: Storage, seen: dict[str, Any], path: str, n: int) -> None:
    tier_workers.fail_reads_after(
        storage, path, n, lambda: OSError(errno.EBADF, "read error (injected)")
    )


def fail_writes_after(storage: Storage, seen: dict[str, Any], path: str, n: int) -> None:
    tier_workers.fail_writes_after(
        storage,
        path,
        n,
        lambda: OSError(errno.ENOSPC, f"No space left on device after {n} chunks"),
    )


def slow_reads(storage: Storage, seen: dict[str, Any], path: str, delay: float) -> None:
    """Each chunk read of ``path`` takes ``delay`` seconds more (a slow sender)."""
    read_into = storage.read_into

    def slow(rel: str, offset: int, out: memoryview) -> None:
        if rel == path:
            time.sleep(delay)
        read_into(rel, offset, out)

    storage.read_into = slow  # type: ignore[method-assign]


def stall_chunk_send(storage: Storage, seen: dict[str, Any], nth: int, seconds: float) -> None:
    """The sender stalls ``seconds`` between the header of its ``nth`` chunk (counted over
    the call, from 1) and the chunk's bytes: the receiver's receive of that chunk (into one
    of its two buffers) times out and is still posted when the bytes come."""
    isend = transfer._Link.isend
    chunks = [0]

    def stalling(self: Any, tensor: torch.Tensor) -> Any:
        if tensor.dtype == torch.uint8 and tensor.numel() > 64:
            chunks[0] += 1
            if chunks[0] == nth:
                time.sleep(seconds)
        return isend(self, tensor)

    transfer._Link.isend = stalling  # type: ignore[method-assign]
