"""Rank functions for the tier transfer tests (module level, so they pickle). Each rank has
its own directory ``<root>/node<rank>``, standing for its node-local storage."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from lightning_elastic import Storage
from lightning_elastic.core.tiers import transfer
from lightning_elastic.core.tiers.transfer import Transfer, TransferError, execute_transfers


def node_storage(root: str, rank: int) -> Storage:
    """The storage standing for ``rank``'s node-local directory."""
    return Storage(os.path.join(root, f"node{rank}"))


def transfer_worker(
    root: str,
    files: dict[int, dict[str, bytes]],
    transfers: list[Transfer],
    *,
    chunk_bytes: int = 1024,
    timeout_s: float = 20.0,
    flip_on_rank: int | None = None,
    exit_on_rank: int | None = None,
    stall: tuple[int, float] | None = None,
    in_thread: bool = False,
    memory: dict[int, dict[str, list[bytes | bytearray]]] | None = None,
    fail_after_chunks: tuple[int, str, int] | None = None,
    write_after_sent: tuple[int, str, str] | None = None,
) -> dict[str, Any]:
    """Write this rank's ``files``, run the transfers on a dedicated gloo group and return
    the stats (or the error), the seconds taken and the messages counted by kind.
    ``flip_on_rank`` damages the payloads that rank receives; ``exit_on_rank`` exits
    after the group is set up, before any transfer (a dead peer); ``stall=(rank, s)``
    makes that rank sleep ``s`` seconds first (a live but late peer). ``in_thread`` runs
    the transfers on a thread while the main thread all-reduces on the default group.
    ``memory`` gives a rank's ``sources``: path -> the pieces sent from memory (``bytes`` are
    read-only buffers, ``bytearray`` writable ones). ``fail_after_chunks=(rank, path, n)``
    makes that rank's reads (as sender) or writes (as receiver) of ``path`` fail after ``n``
    chunks (a disk error in mid-stream). ``write_after_sent=(rank, received, sent)`` holds
    that rank's write of ``received`` (its first chunk) until its send of ``sent`` has
    finished, for at most 20 s (then the write fails)."""
    rank = dist.get_rank()
    storage = node_storage(root, rank)
    for path, data in files.get(rank, {}).items():
        storage.write_bytes(path, data)
    if fail_after_chunks is not None and rank == fail_after_chunks[0]:
        _fail_mid_stream(storage, *fail_after_chunks[1:])
    if write_after_sent is not None and rank == write_after_sent[0]:
        _write_after_sent(storage, *write_after_sent[1:])
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
    # every rank's connections of the group are made: a rank that exits before another has
    # connected to it fails that one's new_group (gloo connectFullMesh), not its transfers
    dist.barrier()
    if rank == exit_on_rank:
        os._exit(0)  # a rank that dies after setup: its peers must not hang
    if stall is not None and rank == stall[0]:
        time.sleep(stall[1])  # alive but late: its peers give up after ``timeout_s``
    messages = {"send": 0, "recv": 0}
    _count(messages, rank == flip_on_rank)
    start = time.monotonic()
    outcome: dict[str, Any] = {}

    def work() -> None:
        try:
            outcome["stats"] = execute_transfers(
                transfers,
                rank=rank,
                group=group,
                storage=storage,
                chunk_bytes=chunk_bytes,
                timeout=timedelta(seconds=timeout_s),
                sources={
                    path: (lambda pieces=pieces: [memoryview(p) for p in pieces])
                    for path, pieces in (memory or {}).get(rank, {}).items()
                },
            )
            outcome["error"] = None
        except TransferError as exc:
            outcome["stats"], outcome["error"] = exc.stats, exc

    if in_thread:  # as a save would run it: beside training's collectives on the default group
        thread = threading.Thread(target=work)
        thread.start()
        total = torch.zeros(1)
        for _ in range(20):
            one = torch.ones(1)
            dist.all_reduce(one)
            total += one
        thread.join()
        outcome["training"] = float(total)
    else:
        work()
    return {**outcome, "seconds": time.monotonic() - start, "messages": messages}


def _write_after_sent(storage: Storage, received: str, sent: str) -> None:
    done = threading.Event()
    send = transfer._send

    def sending(t: Transfer, *args: Any, **kwargs: Any) -> Any:
        try:
            return send(t, *args, **kwargs)
        finally:
            if t.path == sent:
                done.set()

    transfer._send = sending
    write_stream = storage.write_stream

    def held(rel: str, chunks: Any, **kwargs: Any) -> Any:
        def after_the_send() -> Any:
            if rel == received and not done.wait(20):
                raise OSError(f"{sent} was not sent while {received} was received")
            yield from chunks()

        return write_stream(rel, after_the_send, **kwargs)

    storage.write_stream = held  # type: ignore[method-assign]


def _fail_mid_stream(storage: Storage, path: str, n: int) -> None:
    fail_reads_after(storage, path, n, lambda: OSError(f"I/O error after {n} chunks"))
    fail_writes_after(
        storage, path, n, lambda: OSError(f"No space left on device after {n} chunks")
    )


def fail_reads_after(
    storage: Storage, path: str, n: int, error: Callable[[], BaseException]
) -> None:
    """``storage``'s reads of ``path`` raise ``error()`` from the ``n + 1``-th on (one read
    is one chunk the sender sends)."""
    read_into = storage.read_into
    reads = [0]

    def failing(rel: str, offset: int, out: memoryview) -> None:
        if rel == path:
            reads[0] += 1
            if reads[0] > n:
                raise error()
        read_into(rel, offset, out)

    storage.read_into = failing  # type: ignore[method-assign]


def fail_writes_after(
    storage: Storage, path: str, n: int, error: Callable[[], BaseException]
) -> None:
    """``storage``'s writes of ``path`` raise ``error()`` after taking ``n`` chunks."""
    write_stream = storage.write_stream

    def failing(rel: str, chunks: Any, **kwargs: Any) -> Any:
        def cut() -> Any:
            for i, chunk in enumerate(chunks()):
                if i == n:
                    raise error()
                yield chunk

        return write_stream(rel, cut if rel == path else chunks, **kwargs)

    storage.write_stream = failing  # type: ignore[method-assign]


def _count(messages: dict[str, int], flip: bool) -> None:
    """Count this rank's sends and receives; with ``flip``, corrupt the first byte of every
    received payload of more than 16 bytes (bytes damaged in flight)."""
    isend, recv = transfer._Link.isend, transfer._Link.recv

    def counted_isend(self: Any, tensor: torch.Tensor) -> Any:  # every send starts here
        messages["send"] += 1
        return isend(self, tensor)

    def counted_recv(self: Any, tensor: torch.Tensor) -> None:
        messages["recv"] += 1
        recv(self, tensor)
        if flip and tensor.dtype == torch.uint8 and tensor.numel() > 16:
            tensor[0] ^= 0xFF

    transfer._Link.isend = counted_isend  # type: ignore[method-assign]
    transfer._Link.recv = counted_recv  # type: ignore[method-assign]
