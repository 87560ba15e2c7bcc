"""Local-disk storage: unbuffered writes that release the GIL, O_DIRECT for page-aligned
buffers, ``fsync`` of each file and of its directory, and an atomic exclusive publish (write a
temporary file, then ``os.link`` it to the final name, which fails if the name exists).

Every path is resolved below the root without following symbolic links out of it: a path
whose real location leaves the root is refused, listings report links as links, and deleting
a link removes the link.
"""

from __future__ import annotations

import contextlib
import copy
import ctypes
import errno
import os
import stat
import threading
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from lightning_elastic.core.storage.base import Buffer, Entry, Storage, Written
from lightning_elastic.core.storage.checksum import Hasher, new_hasher
from lightning_elastic.core.storage.retry import RetryPolicy
from lightning_elastic.errors import CheckpointExistsError, StorageError

__all__ = ["SPARE_MIN_BYTES", "LocalStorage", "SparePool", "drain"]

_READ_CHUNK = 8 << 20
_BLOCK = 4096
#: files at least this large are kept as spares when deleted, and writes at least this large
#: reuse them (see :class:`SparePool`)
SPARE_MIN_BYTES = 1 << 20
_SPARE_SUFFIX = ".spare"


class SparePool:
    """Large files a local root retires (:meth:`LocalStorage.retire`: the files of a deleted
    checkpoint's manifest, which no process writes any more; never a plain delete's, whose
    file a stale writer may still hold open), kept in a hidden folder of the root for later
    writes to overwrite, up to ``limit`` bytes (0 until the owner sets it: nothing is kept).

    Why: a node-local tier in ``/dev/shm`` writes one or two checkpoints' bytes every save and
    deletes as many; a new tmpfs file has every page allocated and zeroed by the kernel, a
    spare already holds its pages. Measured on this project's 2-core machine, 550 MB: 0.28-0.34
    s into a new file (with the delete of the old one), 0.09-0.15 s over a spare.

    A spare is never a file with another hard link (its bytes would change under that name),
    and never shorter-lived than a delete: a reader that opened the file before it was
    deleted may see the next save's bytes (checksums catch it; nothing in this library reads a
    checkpoint retention may delete). Moves are renames, so two processes on one node (its
    ranks, or two jobs sharing a root) never take the same spare; the limit is kept per
    process, so together they may keep a little more. Crash-safe: a spare is only ever
    renamed to a temporary name of a write, and a write that fails removes it as it would a
    new file.
    """

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.limit = 0
        self._lock = threading.Lock()

    def keep(self, path: str) -> bool:
        """Move the file at ``path`` into the pool instead of deleting it, if it is a regular
        file of at least :data:`SPARE_MIN_BYTES` with no other link and fits under the
        limit. ``False``: it was not moved (the caller deletes it)."""
        with self._lock:
            try:
                st = os.lstat(path)
                if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
                    return False
                if st.st_size < SPARE_MIN_BYTES or self.held() + st.st_size > self.limit:
                    return False
                os.makedirs(self.directory, exist_ok=True)
                if not self._own_folder():
                    return False
                os.rename(path, os.path.join(self.directory, uuid.uuid4().hex + _SPARE_SUFFIX))
                return True
            except OSError:
                return False

    def take(self, size: int, path: str) -> bool:
        """Rename a spare to ``path`` (replacing what is there) for a write of ``size``
        bytes: the smallest one at least that large, else the largest. ``False``: none."""
        spares = sorted(self._spares())
        ordered = [p for n, p in spares if n >= size] + [p for n, p in reversed(spares) if n < size]
        for candidate in ordered:
            try:
                os.rename(candidate, path)
                return True
            except FileNotFoundError:  # another process took it
                continue
            except OSError:
                return False
        return False

    def held(self) -> int:
        """The bytes the spares take."""
        return sum(n for n, _ in self._spares())

    def clear(self) -> None:
        """Delete every spare, empty ones too (the pool's folder stays; a spare that cannot
        be deleted stays, as in :meth:`trim`)."""
        for _, path in self._spares():
            with contextlib.suppress(OSError):
                os.unlink(path)

    def trim(self, limit: int | None = None) -> None:
        """Delete spares, the largest first, until they take at most ``limit`` bytes (the
        pool's own limit by default): those a killed run left, or more than a smaller save
        now writes, would otherwise hold their memory until :meth:`clear`."""
        limit = self.limit if limit is None else limit
        spares = sorted(self._spares())
        held = sum(n for n, _ in spares)
        while spares and held > limit:
            size, path = spares.pop()
            try:
                os.unlink(path)
            except FileNotFoundError:  # taken by a write meanwhile
                pass
            except OSError:  # not deletable (now a folder, EPERM): it stays, and counts
                continue
            held -= size

    def _own_folder(self) -> bool:
        """Whether the pool's folder is a folder of the root, not a link: one planted there
        would move the root's files out through it, and make writes take and overwrite (and
        :meth:`clear` delete) the files where it leads."""
        try:
            return stat.S_ISDIR(os.lstat(self.directory).st_mode)
        except OSError:
            return False

    def _spares(self) -> list[tuple[int, str]]:
        out = []
        if not self._own_folder():
            return []
        try:
            entries = list(os.scandir(self.directory))
        except OSError:
            return []
        for entry in entries:
            if entry.name.endswith(_SPARE_SUFFIX):
                with contextlib.suppress(OSError):
                    st = entry.stat(follow_symlinks=False)
                    if stat.S_ISREG(st.st_mode):
                        out.append((st.st_size, entry.path))
        return out


class LocalStorage(Storage):
    """:class:`Storage` on a local (or locally mounted) filesystem."""

    def __init__(
        self,
        url: str | os.PathLike[str],
        *,
        storage_options: Mapping[str, Any] | None = None,
        fs: Any = None,
        retry: RetryPolicy | None = None,
        durable: bool = True,
    ) -> None:
        super().__init__(url, storage_options=storage_options, fs=fs, retry=retry, durable=durable)
        path = self.url.split("://", 1)[1] if "://" in self.url else self.url
        self.root = os.path.abspath(path).rstrip("/") or "/"
        self._fs = fs
        self._real: str | None = None  # the root with links resolved, once
        self.spares: SparePool | None = None  # see keep_spares (shared by child storages)

    def keep_spares(self, folder: str = ".spares") -> SparePool:
        """Keep large retired files (:meth:`retire`) in ``folder`` (hidden: no listing of
        checkpoints reads it) for writes that state their ``size`` to overwrite
        (:class:`SparePool`; nothing is kept until its ``limit`` is set)."""
        if self.spares is None:
            self.spares = SparePool(self.full(folder))
        return self.spares

    @property
    def is_local(self) -> bool:
        return True

    @property
    def fs(self) -> Any:
        """An fsspec view of the same files (for callers that want one)."""
        if self._fs is None:
            from fsspec.implementations.local import LocalFileSystem

            self._fs = LocalFileSystem()
        return self._fs

    def _copy(self) -> Storage:
        sub = copy.copy(self)
        sub._real = None
        return sub

    # ------------------------------------------------------------------ confinement

    def full(self, rel: str = "") -> str:
        path = super().full(rel)
        parent = os.path.dirname(path)
        if path != self.root and parent != self.root:  # nested: no link may lead outside
            self._confine(parent, rel)
        return path

    def child(self, rel: str) -> Storage:
        sub = super().child(rel)
        self._confine(sub.root, rel)
        return sub

    def _confine(self, path: str, rel: str) -> None:
        """Refuse ``path`` when its real location (links resolved) is outside the root."""
        real_root = self._real_root()
        real = os.path.realpath(path)
        if real != real_root and not real.startswith(real_root + os.sep):
            raise StorageError(
                "resolve",
                self.display(rel),
                f"the path leads out of the storage root through a symbolic link (to {real})",
            )

    def _real_root(self) -> str:
        if self._real is None:
            self._real = os.path.realpath(self.root)
        return self._real

    def _is_link(self, rel: str) -> bool:
        return os.path.islink(self.full(rel))

    # ------------------------------------------------------------------ writes

    def write_stream(
        self,
        rel: str,
        chunks: Callable[[], Iterable[Buffer]],
        *,
        checksum: str | None = None,
        exclusive: bool = False,
        durable: bool | None = None,
        direct: bool = False,
        size: int | None = None,
    ) -> Written:
        sync = self.durable if durable is None else durable
        path = self.full(rel)
        spare = self.spares if size is not None and size >= SPARE_MIN_BYTES else None

        def write() -> Written:
            if exclusive:
                return _write_exclusive(path, chunks(), checksum, sync, (spare, size or 0))
            return _write(path, chunks(), checksum, sync, direct, (spare, size or 0))

        written: Written = self._call("write", rel, write)
        return written

    def _replace(self, path: str, data: Buffer) -> Written:
        """A temporary name beside ``path``, written and fsynced, renamed over it (``rename``
        replaces atomically), then the directory fsynced."""
        tmp = f"{path}.tmp-{uuid.uuid4().hex[:12]}"
        written = _write(tmp, (data,), None, True, published=False)
        try:
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        _fsync_dir(os.path.dirname(path))
        return written

    # ------------------------------------------------------------------ reads

    def read_bytes(self, rel: str, start: int = 0, length: int | None = None) -> bytes:
        path = self.full(rel)

        def read() -> bytes:
            with open(path, "rb", opener=_no_follow) as f:
                f.seek(start)
                return f.read() if length is None else f.read(length)

        data: bytes = self._call("read", rel, read)
        if length is not None and len(data) != length:
            raise StorageError(
                "read",
                self.display(rel),
                f"file ended after {len(data)} of {length} bytes from offset {start}",
            )
        return data

    def read_into(self, rel: str, offset: int, out: memoryview) -> None:
        path = self.full(rel)
        want = out.nbytes

        def read() -> int:
            got = 0
            with open(path, "rb", buffering=0, opener=_no_follow) as f:
                f.seek(offset)
                view = out.cast("B")
                while got < want:
                    n = f.readinto(view[got:])
                    if not n:
                        break
                    got += n
            return got

        got = self._call("read", rel, read)
        if got != want:
            raise StorageError(
                "read",
                self.display(rel),
                f"file ended after {got} of {want} bytes from offset {offset}",
            )

    def read_ranges(self, rel: str, ranges: Sequence[tuple[int, memoryview]]) -> None:
        """One open for all of ``ranges`` (20,000 small tensors: 20,000 opens otherwise)."""
        path = self.full(rel)

        def read() -> tuple[int, int, int] | None:
            fd = _no_follow(path, os.O_RDONLY)
            try:
                for offset, out in ranges:
                    view, want, got = out.cast("B"), out.nbytes, 0
                    while got < want:
                        n = os.preadv(fd, [view[got:]], offset + got)
                        if not n:
                            return offset, got, want
                        got += n
            finally:
                os.close(fd)
            return None

        short = self._call("read", rel, read)
        if short is not None:
            offset, got, want = short
            raise StorageError(
                "read",
                self.display(rel),
                f"file ended after {got} of {want} bytes from offset {offset}",
            )

    def hash_file(self, rel: str, algorithm: str) -> Written:
        path = self.full(rel)

        def digest() -> Written:
            hasher = new_hasher(algorithm)
            size = 0
            with open(path, "rb", opener=_no_follow) as f:
                while chunk := f.read(_READ_CHUNK):
                    hasher.update(chunk)
                    size += len(chunk)
            return Written(size, hasher.hexdigest())

        result: Written = self._call("read", rel, digest)
        return result

    # ------------------------------------------------------------------ namespace

    def exists(self, rel: str) -> bool:
        path = self.full(rel)
        result: bool = self._call("exists", rel, lambda: os.path.lexists(path))
        return result

    def size(self, rel: str) -> int:
        path = self.full(rel)
        result: int = self._call("stat", rel, lambda: os.stat(path).st_size)
        return result

    def listdir(self, rel: str = "") -> list[Entry]:
        path = self.full(rel)

        def ls() -> list[Entry]:
            if not os.path.isdir(path) or (rel.strip("/") and os.path.islink(path)):
                return []
            try:
                items = list(os.scandir(path))
            except (FileNotFoundError, NotADirectoryError):
                return []  # removed since the check (another run's retention): empty
            entries = []
            for item in items:
                try:
                    stat = item.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue  # removed since the listing (a concurrent save's cleanup)
                if item.is_symlink():
                    entries.append(Entry(item.name, False, 0, is_link=True, mtime=stat.st_mtime))
                    continue
                is_dir = item.is_dir(follow_symlinks=False)
                size = 0 if is_dir else stat.st_size
                entries.append(Entry(item.name, is_dir, size, mtime=stat.st_mtime))
            return entries

        result: list[Entry] = self._call("list", rel, ls)
        return sorted(result, key=lambda e: e.name)

    def delete(self, rel: str) -> None:
        self._remove(rel, reuse=False)

    def retire(self, rel: str) -> None:
        self._remove(rel, reuse=True)

    def _remove(self, rel: str, *, reuse: bool) -> None:
        path = self.full(rel)

        def rm() -> None:
            if reuse and self.spares is not None and self.spares.keep(path):
                return
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)

        self._call("delete", rel, rm)

    def _rmdir(self, path: str) -> None:
        try:
            os.rmdir(path)
        except FileNotFoundError:
            pass
        except OSError as exc:
            if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                raise


_NO_SPARE: tuple[SparePool | None, int] = (None, 0)


def _write(
    path: str,
    chunks: Iterable[Buffer],
    checksum: str | None,
    sync: bool,
    direct: bool = False,
    spare: tuple[SparePool | None, int] = _NO_SPARE,
    *,
    published: bool = True,
) -> Written:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    # a spare has its full size from the start: overwritten at the final name, a write killed
    # midway would leave a file of the expected size there, which recovery counts as a copy
    # (by path and size); it is written under a temporary name and renamed once complete
    work = f"{path}.tmp-{uuid.uuid4().hex[:12]}" if published and spare[0] is not None else path
    out = _LocalFile(work, direct=direct, spare=spare)
    try:
        written = drain(chunks, checksum, out.write)
        out.end()
        if sync:
            out.sync()
    except BaseException:
        out.close()
        with contextlib.suppress(OSError):
            os.unlink(work)
        raise
    out.close()
    if work != path:
        try:
            os.replace(work, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(work)
            raise
    if sync:
        _fsync_dir(os.path.dirname(path))
    return written


def _write_exclusive(
    path: str,
    chunks: Iterable[Buffer],
    checksum: str | None,
    sync: bool,
    spare: tuple[SparePool | None, int] = _NO_SPARE,
) -> Written:
    if os.path.lexists(path):
        raise CheckpointExistsError(f"{path} already exists")
    tmp = f"{path}.tmp-{uuid.uuid4().hex[:12]}"
    written = _write(tmp, chunks, checksum, sync, spare=spare, published=False)
    try:
        os.link(tmp, path)  # atomic, and fails if the name exists
    except FileExistsError:
        raise CheckpointExistsError(f"{path} already exists") from None
    finally:
        os.unlink(tmp)
    if sync:
        _fsync_dir(os.path.dirname(path))
    return written


def drain(
    chunks: Iterable[Buffer], checksum: str | None, write: Callable[[memoryview], Any]
) -> Written:
    """Hand every chunk to ``write`` and hash it on the way: a large chunk is hashed on a
    second thread while this one writes it (the write releases the GIL), which takes the
    checksum off the write's critical path; each chunk is hashed before the next is asked
    for, since a chunk source may reuse its buffer."""
    hasher: Hasher | None = new_hasher(checksum) if checksum else None
    size = 0
    for chunk in chunks:
        view = memoryview(chunk).cast("B")
        if hasher is not None and view.nbytes >= _OVERLAP_BYTES:
            hashed = _hash_thread().submit(hasher.update, view)
            try:
                write(view)
            finally:
                hashed.result()
        else:
            if hasher is not None:
                hasher.update(view)
            write(view)
        size += view.nbytes
    return Written(size, hasher.hexdigest() if hasher is not None else None)


# chunks at least this large are hashed while they are written (a write chunk is 16 MiB)
_OVERLAP_BYTES = 1 << 20
_hasher_thread: ThreadPoolExecutor | None = None
_hasher_lock = threading.Lock()


def _hash_thread() -> ThreadPoolExecutor:
    """The one thread that hashes chunks being written (created on first use, kept)."""
    global _hasher_thread
    with _hasher_lock:
        if _hasher_thread is None:
            _hasher_thread = ThreadPoolExecutor(1, thread_name_prefix="lightning-elastic-hash")
        return _hasher_thread


class _LocalFile:
    """A new local file written sequentially; whole, page-aligned blocks go through an
    O_DIRECT descriptor when asked and supported, everything else through the page cache.
    ``spare=(pool, size)``: a spare of ``pool`` is renamed to ``path`` and overwritten (cut to
    what was written by :meth:`end`), when there is one."""

    def __init__(
        self, path: str, *, direct: bool, spare: tuple[SparePool | None, int] = _NO_SPARE
    ) -> None:
        pool, size = spare
        self.reused = pool is not None and pool.take(size, path)
        self.fd = -1
        if self.reused:
            try:
                self.fd = os.open(path, os.O_WRONLY | os.O_NOFOLLOW)
                st = os.fstat(self.fd)
                linked = not stat.S_ISREG(st.st_mode) or st.st_nlink != 1
            except OSError:
                linked = True
            if linked:  # linked since (its bytes are another name's too): never overwritten
                if self.fd >= 0:
                    os.close(self.fd)
                os.unlink(path)  # our name only; then a new file, as without a spare
                self.reused = False
        if not self.reused:
            self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
        self.direct_fd: int | None = None
        if direct and hasattr(os, "O_DIRECT"):
            try:
                self.direct_fd = os.open(path, os.O_WRONLY | os.O_DIRECT | os.O_NOFOLLOW)
            except OSError:  # e.g. tmpfs: no O_DIRECT
                self.direct_fd = None
        self.offset = 0

    def write(self, view: memoryview) -> None:
        n = view.nbytes
        if self.direct_fd is not None and n % _BLOCK == 0 and _aligned(view):
            try:
                _pwrite_all(self.direct_fd, view, self.offset)
                self.offset += n
                return
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                os.close(self.direct_fd)  # refused after all: use the page cache from now on
                self.direct_fd = None
        _pwrite_all(self.fd, view, self.offset)
        self.offset += n

    def end(self) -> None:
        """After the last write: a reused spare loses what lies past the written bytes."""
        if self.reused:
            os.ftruncate(self.fd, self.offset)

    def sync(self) -> None:
        os.fsync(self.fd)  # per inode: flushes the buffered part and the device cache

    def close(self) -> None:
        if self.direct_fd is not None:
            os.close(self.direct_fd)
            self.direct_fd = None
        os.close(self.fd)


def _aligned(view: memoryview) -> bool:
    if view.readonly or view.nbytes == 0:
        return False
    try:
        return ctypes.addressof(ctypes.c_char.from_buffer(view)) % _BLOCK == 0
    except (TypeError, ValueError):
        return False


def _pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    while view.nbytes:
        n = os.pwrite(fd, view, offset)
        view = view[n:]
        offset += n


def _no_follow(path: str, flags: int) -> int:
    """``open``'s opener: a file that is a symbolic link is not read through (``ELOOP``), so a
    link planted in a checkpoint never makes us read outside the root."""
    return os.open(path, flags | os.O_NOFOLLOW)


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems do not support fsync on directories
    finally:
        os.close(fd)
