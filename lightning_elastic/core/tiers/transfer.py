"""Moving checkpoint files between ranks over a process group (gloo): what peer replication
(a shard copied to a rank on another node) and recovery from a peer are built on.

Which rank calls what, in what order:
    Every rank named in ``transfers`` calls :func:`execute_transfers` with the same list, in
    the same order (a rank named in none returns at once, or need not call it); no rank
    sends a file it receives earlier in the list (a relay takes two calls). Each rank
    takes part only in the transfers where it is ``src`` or ``dst``, in two directions at
    once (the receiving one on a thread): the transfers it sends, one at a time in list order,
    and those it receives, one at a time in list order, with point-to-point send/recv on
    ``group`` (no other collective, so it may run in a background thread on a dedicated
    group). A node thus sends its replicas while it receives the other nodes' (measured, 550
    MB each way between 2 processes on 2 cores: 0.52-0.84 s where one direction after the
    other took 0.62-1.6 s).

    Why this cannot deadlock: take the earliest transfer in the list that is not finished,
    ``A -> B``. A's sending direction has finished every earlier transfer A sends, and B's
    receiving direction every earlier transfer B receives, so both are at this one, and its
    exchange is one fixed sequence in which each step has one of them sending and the other
    receiving (its own tag: no message of another transfer matches): it finishes, and by
    induction so do all. A cycle (A->B, B->C, C->A) runs at once.

One transfer's exchange (tag = its index in the list, so no message matches another one):
    1. dst -> src  int64 [want]: 0 when dst already holds a file of this size and checksum
       (an idempotent retry after a crash: both count it as present, nothing is sent).
    2. src -> dst  per chunk, int64 [0, n] and n bytes (uint8, no pickle); then [0, 0]. A
       failure at src (missing file, wrong size, read error, its copy not matching the
       checksum) takes the place of the next header: [code, m] and an m-byte UTF-8 message,
       so dst stops waiting at once.
    3. dst -> src  int64 [code, m] (+ message) after a complete stream: whether dst's copy is
       written and matches. Both ranks thus agree on the outcome of every transfer.
    Each side works one chunk ahead: src reads (and hashes) the next chunk while the last one
    is sent (``isend``), dst receives the next chunk on a thread while it writes the last one,
    so the file I/O overlaps the network (two buffers per direction, used in turn).
    A failing rank keeps to the exchange (dst takes the rest of a file it could not write), so
    failures are in-band and the later transfers go on; at the end each rank raises one
    :class:`TransferError` listing its failed transfers. Only a broken connection leaves the
    exchange. A dead peer: that rank skips its remaining transfers with that peer, in both
    directions, and the peer fails by its own timeout. A ``timeout`` that expires: gloo
    closes every connection of the group on that rank, so it skips all its remaining
    transfers (its peers see the connection close); the caller rebuilds the group before
    using it again. An interrupt (any other exception) in either direction, or while the
    caller waits for the receiving one, is raised after both directions ended: neither
    starts another transfer, the ones in progress end (or fail by ``timeout``).
"""

from __future__ import annotations

import contextlib
import functools
import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, fields
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from lightning_elastic.core.forksafe import fork_safe_logger
from lightning_elastic.core.save.stage import byte_view
from lightning_elastic.core.storage.base import Storage, Written, check_rel_path
from lightning_elastic.core.storage.checksum import DEFAULT_ALGORITHM, new_hasher
from lightning_elastic.core.storage.retry import RetryPolicy
from lightning_elastic.errors import (
    ConfigError,
    ElasticCheckpointError,
    StorageError,
    StorageNotFoundError,
    TransferError,  # re-exported: it lived here
    TransferIntegrityError,  # re-exported: it lived here
    TransientStorageError,
)

__all__ = [
    "Transfer",
    "TransferError",
    "TransferFailure",
    "TransferIntegrityError",
    "TransferStats",
    "execute_transfers",
]

log = fork_safe_logger(__name__)  # may run on a background thread

_OK, _MISSING, _SIZE, _READ, _SOURCE_CORRUPT, _RECEIVED_CORRUPT, _WRITE = range(7)
_KIND = {_MISSING: "source", _SIZE: "source", _READ: "source", _WRITE: "write"}
_KIND |= {_SOURCE_CORRUPT: "integrity", _RECEIVED_CORRUPT: "integrity"}
_MAX_MESSAGE = 4096
_ONE_ATTEMPT = RetryPolicy(max_attempts=1)


@dataclass(frozen=True)
class Transfer:
    """Copy one checkpoint file from ``src`` rank's storage to ``dst`` rank's storage.

    ``path`` is relative to the storage root (``"step_000000010/ab12-rank00001.distcp"``);
    ``size`` and ``checksum`` are the manifest's (:class:`FileRecord`), ``algorithm`` the
    manifest's ``checksum_algorithm``. Ranks are global ranks (what ``dist.send`` takes).
    """

    src: int
    dst: int
    path: str
    size: int
    checksum: str
    algorithm: str = DEFAULT_ALGORITHM


@dataclass(frozen=True)
class TransferFailure:
    """One failed transfer. ``kind``: ``"source"`` (src could not read it), ``"integrity"``
    (src's copy or the received bytes did not match; no such copy is kept), ``"write"`` (dst
    could not store it), ``"communication"`` (the connection to the peer broke)."""

    transfer: Transfer
    kind: str
    reason: str


@dataclass(frozen=True)
class TransferStats:
    """What this rank did: files and bytes it delivered (acknowledged) and received, files
    found already present at the receiver (counted on both sides), and the seconds taken."""

    files_sent: int = 0
    bytes_sent: int = 0
    files_received: int = 0
    bytes_received: int = 0
    files_present: int = 0
    seconds: float = 0.0


class _PeerLost(ElasticCheckpointError):
    """send/recv with the peer failed (dead peer, timeout, protocol violation);
    ``timed_out``: a wait expired, which closed every connection of the group here."""

    def __init__(self, message: str, *, timed_out: bool = False) -> None:
        super().__init__(message)
        self.timed_out = timed_out


class _SourceFailed(ElasticCheckpointError):
    """The sender reported a failure in place of a chunk header (typed so retries pass it)."""

    def __init__(self, code: int, message: str) -> None:
        self.code, self.message = code, message
        super().__init__(message)


class _Link:
    """Point-to-point messages with one peer for one transfer (its tag)."""

    def __init__(self, group: Any, peer: int, tag: int, timeout: timedelta | None) -> None:
        self.group, self.peer, self.tag, self.timeout = group, peer, tag, timeout

    def _start(self, op: Any, tensor: torch.Tensor) -> Any:
        try:
            return op(tensor, self.peer, group=self.group, tag=self.tag)
        except Exception as exc:
            raise _PeerLost(f"send/recv with rank {self.peer} failed: {exc}") from exc

    def wait(self, work: Any) -> None:
        """Wait for a started send or receive (``None``: nothing to wait for)."""
        if work is None:
            return
        try:
            work.wait() if self.timeout is None else work.wait(self.timeout)
        except Exception as exc:
            message = f"send/recv with rank {self.peer} failed: {exc}"
            raise _PeerLost(message, timed_out=_timed_out(str(exc))) from exc

    def isend(self, tensor: torch.Tensor) -> Any:
        """Start sending ``tensor``; it must stay unchanged until :meth:`wait` returns."""
        return self._start(dist.isend, tensor)

    def send(self, tensor: torch.Tensor) -> None:
        self.wait(self.isend(tensor))

    def recv(self, tensor: torch.Tensor) -> None:
        self.wait(self._start(dist.irecv, tensor))

    def send_ints(self, *values: int) -> None:
        self.send(torch.tensor(values, dtype=torch.int64))

    def recv_ints(self, count: int) -> list[int]:
        out = torch.empty(count, dtype=torch.int64)
        self.recv(out)
        return [int(v) for v in out.tolist()]

    def send_status(self, code: int, message: str = "") -> None:
        data = message.encode()[:_MAX_MESSAGE]
        self.send_ints(code, len(data))
        if data:
            self.send(torch.frombuffer(bytearray(data), dtype=torch.uint8))

    def recv_message(self, length: int) -> str:
        if not 0 <= length <= _MAX_MESSAGE:
            raise _PeerLost(f"rank {self.peer} broke the protocol: a {length}-byte message")
        out = torch.empty(length, dtype=torch.uint8)
        if length:
            self.recv(out)
        return bytes(out.numpy()).decode(errors="replace")


def _timed_out(message: str) -> bool:
    """Whether gloo's error says a wait expired: this one ("Timed out waiting ...") or, seen
    by the other direction's wait, the closing of the connection that followed it."""
    return "Timed out" in message or "timeout caused pair closure" in message


class _Buffers:
    """A rank's two chunk buffers, used in turn (each allocated when first needed, grown when
    a peer sends more): a chunk is filled while the one before it is still being sent or
    written, so a buffer is filled again only two chunks later."""

    def __init__(self, size: int) -> None:
        self.size = max(size, 1)
        self.tensors: list[torch.Tensor | None] = [None, None]
        self.turn = 0

    def take(self, size: int) -> torch.Tensor:
        turn, self.turn = self.turn, 1 - self.turn
        tensor = self.tensors[turn]
        if tensor is None or tensor.numel() < size:
            tensor = self.tensors[turn] = torch.empty(max(size, self.size), dtype=torch.uint8)
        return tensor[:size]


def execute_transfers(
    transfers: Sequence[Transfer],
    *,
    rank: int,
    group: dist.ProcessGroup | None,
    storage: Storage,
    chunk_bytes: int = 32 * 2**20,
    timeout: timedelta | None = None,
    sources: Mapping[str, Callable[[], Iterable[memoryview]]] | None = None,
) -> TransferStats:
    """Take part in the transfers of ``transfers`` where ``rank`` is the sender or receiver.

    Args:
        transfers: the same list, in the same order, on every rank (see the module header).
        rank: this process's global rank.
        group: the process group to send on (``None``: the default group); a dedicated gloo
            group, never the one training runs on.
        storage: this rank's storage (sender: read from; receiver: written with exclusive
            create, hashed on the way).
        chunk_bytes: bytes per message; also the size of each of the two buffers of each
            direction (sending, receiving) of this rank.
        timeout: the longest one send or receive may wait (``None``: the group's timeout).
        sources: the bytes of files this rank sends from memory instead of reading them from
            ``storage`` (by path): a save's staged payload, just written to the file. They are
            sent as they are, neither read back nor hashed here; the receiver checks them
            against the checksum as it does every copy.

    Returns:
        What this rank sent, received and found present.

    Raises:
        TransferError: some transfer of this rank failed (all of them were still attempted);
            :class:`TransferIntegrityError` when each failure was a checksum or size mismatch.
        ConfigError: the list or ``chunk_bytes`` is invalid (on every rank alike).
    """
    _validate(transfers, chunk_bytes)
    start = time.monotonic()
    peers = _Peers()
    lanes = [
        _Lane(
            [(i, t) for i, t in enumerate(transfers) if (t.src if sending else t.dst) == rank],
            sending=sending,
            peers=peers,
        )
        for sending in (True, False)
    ]
    run = functools.partial(
        _Lane.run,
        group=group,
        storage=storage,
        chunk_bytes=chunk_bytes,
        timeout=timeout,
        sources=sources or {},
    )
    sends, receives = lanes
    if sends.transfers and receives.transfers:  # both directions at once
        done = threading.Event()

        def receive() -> None:
            try:
                run(receives)
            finally:
                done.set()

        thread = threading.Thread(target=receive, name="le-transfer-in", daemon=True)
        thread.start()
        try:
            run(sends)
        finally:
            _join(thread, done, peers, receives)
    else:
        for lane in lanes:
            run(lane)
    _raise_crash(lanes)
    counts = {f.name: 0 for f in fields(TransferStats) if f.name != "seconds"}
    for lane in lanes:
        for key, value in lane.counts.items():
            counts[key] += value
    stats = TransferStats(**counts, seconds=time.monotonic() - start)
    failures = [f for _, f in sorted(sends.failures + receives.failures, key=lambda x: x[0])]
    if failures:
        integrity = all(f.kind == "integrity" for f in failures)
        raise (TransferIntegrityError if integrity else TransferError)(failures, stats)
    return stats


def _raise_crash(lanes: list[_Lane]) -> None:
    """Raise what stopped a direction (the sending one's first, if both): the other's crash
    is logged with its traceback and named in a note of what is raised, not lost."""
    first = next((lane.crashed for lane in lanes if lane.crashed is not None), None)
    if first is None:
        return
    for lane in lanes:
        _name_crash(first, lane)  # skips the lane that raised it, and one that did not crash
    raise first


def _name_crash(raised: BaseException, lane: _Lane) -> None:
    """Log ``lane``'s crash, if any and not ``raised`` itself, with its traceback, and name it
    in a note of ``raised`` (best effort: a note that fails must not replace ``raised``)."""
    if lane.crashed is None or lane.crashed is raised:
        return
    side = "sending" if lane.sending else "receiving"
    log.error("the %s direction of the transfers crashed too", side, exc_info=lane.crashed)
    with contextlib.suppress(Exception):
        raised.add_note(f"the {side} direction crashed too: {lane.crashed!r}")


def _join(thread: threading.Thread, done: threading.Event, peers: _Peers, lane: _Lane) -> None:
    """Wait for the receiving direction (``done``, ``lane``). Interrupted meanwhile (Ctrl-C
    on the caller's thread): it starts no more transfers, and the wait goes on for the one it
    is in (bounded by ``timeout``), so no thread of this call goes on writing files and taking
    this group's messages after the call raised; the interrupt is raised, naming the
    direction's crash if it had one. (An interrupted ``Thread.join`` cannot be waited again:
    Python 3.11 then takes the thread for ended.)"""
    try:
        done.wait()
    except BaseException as interrupt:
        peers.stopped = True
        done.wait()
        _name_crash(interrupt, lane)
        raise
    thread.join()


class _Peers:
    """What both directions of a rank know about its connections: the peers whose connection
    broke, and whether a wait timed out (gloo then closed every connection of the group on
    this rank); ``stopped``: a direction crashed or the caller was interrupted (what is
    raised), so neither direction starts another transfer."""

    def __init__(self) -> None:
        self.lost: set[int] = set()
        self.timed_out = False
        self.stopped = False

    def skip_reason(self, peer: int) -> str | None:
        if self.stopped:
            return "not attempted: this rank was interrupted"
        if self.timed_out:
            return (
                "not attempted: a send/receive of this rank timed out earlier, which closes "
                "all its connections on the group"
            )
        if peer in self.lost:
            return f"not attempted: the connection to rank {peer} broke earlier"
        return None


class _Lane:
    """One direction of a rank's transfers (those it sends, or those it receives), taken one
    at a time in list order; the two directions run at once (module header)."""

    def __init__(self, transfers: list[tuple[int, Transfer]], *, sending: bool, peers: _Peers):
        self.transfers, self.sending, self.peers = transfers, sending, peers
        self.counts = {f.name: 0 for f in fields(TransferStats) if f.name != "seconds"}
        self.failures: list[tuple[int, TransferFailure]] = []
        self.crashed: BaseException | None = None  # not a transfer's failure: a bug, an interrupt

    def run(
        self,
        *,
        group: dist.ProcessGroup | None,
        storage: Storage,
        chunk_bytes: int,
        timeout: timedelta | None,
        sources: Mapping[str, Callable[[], Iterable[memoryview]]],
    ) -> None:
        try:
            size = min(chunk_bytes, max((t.size for _, t in self.transfers), default=0))
            buffers = _Buffers(size)
            for index, t in self.transfers:
                peer = t.dst if self.sending else t.src
                reason = self.peers.skip_reason(peer)
                if reason is not None:
                    self.failures.append((index, TransferFailure(t, "communication", reason)))
                    continue
                link = _Link(group, peer, index, timeout)
                try:
                    if self.sending:
                        source = sources.get(t.path)
                        failure = _send(t, link, storage, buffers, chunk_bytes, self.counts, source)
                    else:
                        failure = _receive(t, link, storage, buffers, self.counts)
                except _PeerLost as exc:
                    self.peers.lost.add(peer)
                    self.peers.timed_out = self.peers.timed_out or exc.timed_out
                    buffers = _Buffers(size)  # a receive that timed out may still land in the old
                    failure = TransferFailure(t, "communication", str(exc))
                if failure is not None:
                    log.warning(
                        "transfer of %s failed (%s): %s", t.path, failure.kind, failure.reason
                    )
                    self.failures.append((index, failure))
        except BaseException as exc:  # raised by execute_transfers, on the caller's thread
            self.crashed = exc
            self.peers.stopped = True  # the other direction starts no more transfers


def _validate(transfers: Sequence[Transfer], chunk_bytes: int) -> None:
    if chunk_bytes < 1:
        raise ConfigError(f"chunk_bytes must be >= 1, got {chunk_bytes}")
    received: set[tuple[int, str]] = set()
    for t in transfers:
        if t.src == t.dst or min(t.src, t.dst) < 0 or t.size < 0:
            raise ConfigError(f"invalid transfer {t}: needs src != dst, ranks >= 0, size >= 0")
        if (t.src, t.path) in received:  # its two directions run at once: not yet arrived
            raise ConfigError(
                f"invalid transfer {t}: rank {t.src} receives {t.path!r} earlier in the list; "
                "a file cannot be passed on in the call that brings it"
            )
        received.add((t.dst, t.path))
        try:
            check_rel_path(t.path)
            new_hasher(t.algorithm)
        except StorageError as exc:
            raise ConfigError(f"invalid transfer {t}: {exc}") from exc


def _send(
    t: Transfer,
    link: _Link,
    storage: Storage,
    buffers: _Buffers,
    chunk_bytes: int,
    counts: dict[str, int],
    source: Callable[[], Iterable[memoryview]] | None = None,
) -> TransferFailure | None:
    """The sender's side: stream the file (or ``source``) unless the receiver has it, then
    read its verdict."""
    if link.recv_ints(1) == [0]:
        counts["files_present"] += 1
        return None
    if source is None:
        where = f"rank {t.src}: {storage.display(t.path)}"
        chunks = _file_chunks(t, storage, buffers, chunk_bytes, where)
    else:
        where = f"rank {t.src}: {t.path} in memory"
        chunks = _memory_chunks(source, buffers, chunk_bytes)
    code, message = _stream(t, link, chunks, where)
    link.send_status(code, message)  # the end of the stream, or a failure in a header's place
    if code != _OK:
        return TransferFailure(t, _KIND[code], message)
    code, length = link.recv_ints(2)
    reply = link.recv_message(length)
    if code != _OK:
        return TransferFailure(t, _KIND.get(code, "write"), reply)
    counts["files_sent"] += 1
    counts["bytes_sent"] += t.size
    return None


def _stream(
    t: Transfer, link: _Link, chunks: Iterator[torch.Tensor], where: str
) -> tuple[int, str]:
    """Send each chunk after an ``[0, n]`` header; the next chunk is made (read, hashed) while
    the last one is on its way. The failure code and message to send instead of the next
    header (``_OK``: the end): from the chunk source, or a stream of another size than the
    transfer's."""
    sent, pending = 0, None
    try:
        for chunk in chunks:
            if sent + chunk.numel() > t.size:
                raise _SourceFailed(_SIZE, f"{where} is longer than {t.size} bytes")
            link.wait(pending)  # frees the buffer the chunk after this one is made in
            link.send_ints(_OK, chunk.numel())
            pending = link.isend(chunk)
            sent += chunk.numel()
        if sent != t.size:
            raise _SourceFailed(_SIZE, f"{where} has {sent} bytes, the transfer expects {t.size}")
    except _PeerLost:
        raise
    except _SourceFailed as exc:
        code, message = exc.code, exc.message
    except StorageNotFoundError as exc:
        code, message = _MISSING, f"{where} is missing: {exc}"
    except Exception as exc:
        code, message = _READ, f"{where} could not be read at offset {sent}: {exc}"
    else:
        code, message = _OK, ""
    link.wait(pending)
    return code, message


def _file_chunks(
    t: Transfer, storage: Storage, buffers: _Buffers, chunk_bytes: int, where: str
) -> Iterator[torch.Tensor]:
    """The file's chunks, hashed on the way: a wrong size fails before the first, a mismatch
    with the checksum after the last (the copy is not sent on)."""
    size = storage.size(t.path)
    if size != t.size:
        raise _SourceFailed(_SIZE, f"{where} has {size} bytes, the transfer expects {t.size}")
    hasher = new_hasher(t.algorithm)
    for offset in range(0, t.size, chunk_bytes):
        chunk = buffers.take(min(chunk_bytes, t.size - offset))
        view = byte_view(chunk)
        storage.read_into(t.path, offset, view)
        hasher.update(view)
        yield chunk
    if hasher.hexdigest() != t.checksum:
        raise _SourceFailed(
            _SOURCE_CORRUPT,
            f"{where} does not match its checksum ({t.algorithm} {hasher.hexdigest()}, "
            f"expected {t.checksum}); not replicated",
        )


def _memory_chunks(
    source: Callable[[], Iterable[memoryview]], buffers: _Buffers, chunk_bytes: int
) -> Iterator[torch.Tensor]:
    """Bytes held in memory (see ``sources``), neither read nor hashed: writable buffers go
    out as they are, read-only ones (padding) through ``buffers``. ``source`` is called here,
    in the stream, so its failure is reported in-band like a read error."""
    for buffer in source():
        view = buffer.cast("B")
        for start in range(0, view.nbytes, chunk_bytes):
            piece = view[start : start + chunk_bytes]
            if piece.readonly:
                chunk = buffers.take(piece.nbytes)
                byte_view(chunk)[:] = piece
                yield chunk
            else:
                yield torch.frombuffer(piece, dtype=torch.uint8)


def _receive(
    t: Transfer, link: _Link, storage: Storage, buffers: _Buffers, counts: dict[str, int]
) -> TransferFailure | None:
    """The receiver's side: say whether to send, write what arrives, check it, reply."""
    if _present(t, storage):
        link.send_ints(0)
        counts["files_present"] += 1
        return None
    link.send_ints(1)
    incoming = _Incoming(t, link, buffers)
    where = f"rank {t.dst}: {storage.display(t.path)}"
    try:
        try:
            written = _write(t, storage, incoming)
        except (_PeerLost, _SourceFailed):
            raise
        except Exception as exc:
            incoming.drain()  # keep to the exchange: take the rest of the file
            code, reply = _WRITE, f"{where} could not be written: {exc}"
        else:
            code, reply = _check(t, storage, written.size, written.checksum, where)
    except _SourceFailed as exc:
        return TransferFailure(t, _KIND.get(exc.code, "source"), exc.message)
    finally:
        incoming.close()
    link.send_status(code, reply)
    if code != _OK:
        return TransferFailure(t, _KIND[code], reply)
    counts["files_received"] += 1
    counts["bytes_received"] += t.size
    return None


def _write(t: Transfer, storage: Storage, incoming: _Incoming) -> Written:
    """Write the received stream. Retried (the storage's policy) only while no chunk was
    taken: a stream cannot restart, so a later retry could only fail again and hide the
    error that stopped the first attempt."""
    try:
        return storage.with_retry(_ONE_ATTEMPT).write_stream(
            t.path, incoming.chunks, checksum=t.algorithm, exclusive=True, size=t.size
        )
    except TransientStorageError:
        if incoming.started:
            raise
    return storage.write_stream(
        t.path, incoming.chunks, checksum=t.algorithm, exclusive=True, size=t.size
    )


def _check(
    t: Transfer, storage: Storage, size: int, checksum: str | None, where: str
) -> tuple[int, str]:
    """The reply for a received copy: ``_OK``, or a mismatch (the copy is then deleted)."""
    if size == t.size and checksum == t.checksum:
        return _OK, ""
    try:
        storage.delete(t.path)
    except StorageError as exc:
        log.warning("could not delete the mismatching copy %s: %s", where, exc)
    return _RECEIVED_CORRUPT, (
        f"{where} received {size} bytes with {t.algorithm} {checksum}, expected {t.size} "
        f"bytes with {t.checksum}; the received copy was deleted"
    )


def _present(t: Transfer, storage: Storage) -> bool:
    """Whether the receiver already holds this file (size and checksum match). A file that
    differs is deleted so the exclusive write can replace it: names are save-unique, so it
    can only be a damaged copy of the same file. Measured (2 ranks, /dev/shm, 2 cores): a
    present 128 MiB file costs 29 ms (re-hashing it; the "no" message is 0.4 ms) where
    sending it costs 122 ms (1.1 GB/s over loopback gloo, 64 MiB chunks)."""
    try:
        if not storage.exists(t.path):
            return False
        same_size = storage.size(t.path) == t.size
        if same_size and storage.hash_file(t.path, t.algorithm).checksum == t.checksum:
            return True
        log.warning("replacing %s: its size or checksum differs", storage.display(t.path))
        storage.delete(t.path)
    except StorageError as exc:  # the write that follows will fail and say why
        log.warning("could not check %s: %s", storage.display(t.path), exc)
    return False


class _Incoming:
    """The chunks of one file as they arrive: a single-use chunk source for ``write_stream``
    (a retried write cannot restart a stream from its first byte). A thread receives one
    chunk ahead of the writer, into the buffer the writer is not holding; it ends with the
    stream (its last item: ``None``, or the failure it met, raised to the writer)."""

    def __init__(self, t: Transfer, link: _Link, buffers: _Buffers) -> None:
        self.t, self.link, self.buffers = t, link, buffers
        self.items: queue.SimpleQueue[torch.Tensor | BaseException | None] = queue.SimpleQueue()
        self.free = threading.Semaphore(2)  # buffers the writer does not hold
        self.started = self.held = self.closed = False
        self.thread = threading.Thread(target=self._receive, name="le-transfer-recv", daemon=True)
        self.thread.start()

    def chunks(self) -> Iterator[memoryview]:
        """Yield each chunk (its buffer is filled again once the next one is asked for)."""
        if self.started:
            raise ElasticCheckpointError("the write failed, and a received file cannot restart")
        self.started = True
        while (chunk := self._next()) is not None:
            self.held = True
            yield byte_view(chunk)
            self.held = False
            self.free.release()

    def drain(self) -> None:
        """Receive and drop the rest of the stream."""
        if self.held:
            self.held = False
            self.free.release()
        while self._next() is not None:
            self.free.release()

    def close(self) -> None:
        """Let the thread end: it has ended when the stream did; otherwise (the writer
        failed in an unforeseen way) it stops before its next chunk."""
        self.closed = True
        self.free.release(2)

    def _next(self) -> torch.Tensor | None:
        item = self.items.get()
        if isinstance(item, BaseException):
            self.items.put(None)  # a later _next (drain) ends too
            raise item
        if item is None:
            self.items.put(None)
        return item

    def _receive(self) -> None:
        received = 0
        try:
            while True:
                self.free.acquire()
                if self.closed:
                    return
                code, length = self.link.recv_ints(2)
                if code != _OK:
                    raise _SourceFailed(code, self.link.recv_message(length))
                if length == 0:
                    break
                if not 0 < length <= self.t.size - received:
                    raise _PeerLost(f"rank {self.t.src} sent {length} bytes past the file's end")
                chunk = self.buffers.take(length)
                self.link.recv(chunk)
                received += length
                self.items.put(chunk)
        except BaseException as exc:
            self.items.put(exc)
        else:
            self.items.put(None)
