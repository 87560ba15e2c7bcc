"""The storage interface the core uses, rooted at one directory, and what both backends share.

A :class:`Storage` is rooted at a directory; every method takes a path relative to it
(``"step_000000100/manifest.json"``). Every operation retries transient errors within a
:class:`~lightning_elastic.core.storage.retry.RetryPolicy` and raises a typed
:class:`~lightning_elastic.errors.StorageError` naming the operation and the path otherwise.

Two backends implement it: :class:`~lightning_elastic.core.storage.local.LocalStorage`
(local disks: unbuffered writes, fsync, ``link()`` for exclusive publishes, O_DIRECT) and
:class:`~lightning_elastic.core.storage.fsspec.FsspecStorage` (any fsspec URL; object stores
get ``mode="xb"``, S3 ``If-None-Match: *``). ``Storage(url)`` picks the right one.

Paths are confined: a relative path with ``..``, ``.`` or empty components is refused, and
listings and deletions never follow symbolic links (a ``latest -> step_N`` link is listed as
a link, and deleting it removes the link, never its target).

To add a backend: subclass :class:`Storage`, implement the abstract methods, and teach
:func:`backend_for` when to pick it.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from lightning_elastic.core.storage.retry import RetryPolicy, retry_call
from lightning_elastic.errors import StorageError

__all__ = ["Buffer", "Entry", "Storage", "Written", "backend_for", "check_rel_path", "local_path"]

Buffer = bytes | bytearray | memoryview


@dataclass(frozen=True)
class Written:
    """Result of writing one file: its size and checksum (``None`` when not requested)."""

    size: int
    checksum: str | None


@dataclass(frozen=True)
class Entry:
    """One directory entry. ``is_link``: a symbolic link (never followed; ``is_dir`` False);
    ``mtime``: last modification (Unix seconds) when the backend reports it."""

    name: str
    is_dir: bool
    size: int
    is_link: bool = False
    mtime: float | None = None


def local_path(location: str) -> str | None:
    """The local path ``location`` names (a bare path, or a ``file://`` URL), or ``None`` for
    a URL of another protocol."""
    if location.startswith("file://"):
        return location[len("file://") :]
    return None if "://" in location else location


def check_rel_path(rel: str) -> str:
    """``rel`` with surrounding slashes removed, or a :class:`StorageError` when it could
    leave the root (``..``), or names an odd component (``.``, empty, a backslash)."""
    clean = rel.strip("/")
    if not clean:
        return ""
    for part in clean.split("/"):
        if part in ("", ".", "..") or "\\" in part or "\x00" in part:
            raise StorageError(
                "resolve", rel, "refusing a path that is not a plain relative path below the root"
            )
    return clean


class Storage:
    """Checkpoint storage rooted at ``url``; ``Storage(url)`` builds the backend the URL needs
    (the methods below raising ``NotImplementedError`` are what a backend implements).

    Args:
        url: local path or fsspec URL of the root directory.
        storage_options: passed to the fsspec filesystem (credentials, endpoint, ...).
        fs: an already built fsspec filesystem to use instead of resolving ``url`` (tests,
            wrappers such as the fault injector).
        retry: how transient errors are retried.
        durable: fsync local files and directories before reporting a write as done.
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> Storage:
        if cls is Storage:  # Storage(url, ...) builds the backend the URL needs
            url = args[0] if args else kwargs["url"]
            cls = backend_for(os.fspath(url), kwargs.get("fs"))
        return super().__new__(cls)

    def __init__(
        self,
        url: str | os.PathLike[str],
        *,
        storage_options: Mapping[str, Any] | None = None,
        fs: Any = None,
        retry: RetryPolicy | None = None,
        durable: bool = True,
    ) -> None:
        self.url = os.fspath(url)
        self.storage_options = dict(storage_options or {})
        self.retry = retry or RetryPolicy()
        self.durable = durable
        self.root = ""

    # ------------------------------------------------------------------ shared

    @property
    def is_local(self) -> bool:
        """Files on a local disk (fsync, links and symlinks exist)."""
        return False

    def child(self, rel: str) -> Storage:
        """A storage rooted at ``rel`` below this one, sharing its settings (and, for fsspec,
        its filesystem instance: one client per root, not one per checkpoint)."""
        clean = check_rel_path(rel)
        sub = self._copy()
        sub.url = self.url.rstrip("/") + "/" + clean
        sub.root = self.full(clean)
        return sub

    def parent(self) -> Storage:
        """The storage rooted one directory up, sharing this one's settings: where an
        incremental checkpoint's sibling checkpoints are (its referenced files)."""
        url, root = self.url.rstrip("/"), self.root.rstrip("/")
        if "/" not in url.split("://", 1)[-1] or "/" not in root:
            raise StorageError("resolve", self.display(), "a storage root has no parent")
        up = self._copy()
        for attr in [a for a in vars(up) if callable(getattr(type(up), a, None))]:
            delattr(up, attr)  # a method patched on this instance (a read counter) stays here
        up.url = url.rsplit("/", 1)[0] or "/"
        up.root = root.rsplit("/", 1)[0] or "/"
        return up

    def full(self, rel: str = "") -> str:
        """The backend's absolute path of ``rel`` (validated: see :func:`check_rel_path`)."""
        rel = check_rel_path(rel)
        if not rel:
            return self.root
        return self.root + rel if self.root.endswith("/") else f"{self.root}/{rel}"

    def display(self, rel: str = "") -> str:
        """A human-readable location for messages (the URL form)."""
        rel = rel.strip("/")
        return f"{self.url.rstrip('/')}/{rel}" if rel else self.url

    def with_retry(self, retry: RetryPolicy) -> Storage:
        """This storage (the same root and filesystem) retrying by ``retry``: e.g. one attempt
        for a write from a stream that cannot restart, whose first error must surface as it
        is rather than as a failed restart."""
        other = copy.copy(self)
        other.retry = retry
        return other

    def _call(self, op: str, rel: str, fn: Callable[[], Any]) -> Any:
        return retry_call(self.retry, op, self.display(rel), fn)

    def write_bytes(
        self, rel: str, data: Buffer, *, exclusive: bool = False, durable: bool | None = None
    ) -> Written:
        """Write ``data`` to ``rel`` (see :meth:`write_stream`)."""
        return self.write_stream(rel, lambda: (data,), exclusive=exclusive, durable=durable)

    def replace_bytes(self, rel: str, data: Buffer) -> Written:
        """Write ``data`` to ``rel`` durably, replacing the file there as one step: a reader
        (or a crash) sees the previous bytes or all of the new ones, never a part. What
        commits a save that replaces a checkpoint under the same name: its new manifest."""
        written: Written = self._call("write", rel, lambda: self._replace(self.full(rel), data))
        return written

    def delete_tree(self, rel: str) -> None:
        """Delete a directory and everything below it; missing is not an error. Symbolic
        links are removed, never followed. What is written into it meanwhile (after the
        listing this deletes from: another save claiming a freed name) is left, and so is the
        directory then (see :meth:`remove_dir`)."""
        if not check_rel_path(rel):
            raise StorageError("delete", self.display(rel), "refusing to delete the storage root")
        if self._is_link(rel):
            self.delete(rel)
            return
        for entry in self.listdir(rel):
            child = f"{rel.rstrip('/')}/{entry.name}"
            if entry.is_dir:
                self.delete_tree(child)
            else:
                self.delete(child)
        self.remove_dir(rel)

    def remove_dir(self, rel: str) -> None:
        """Remove the directory ``rel`` if it is empty; one that is missing, or holds anything
        (written by someone else meanwhile), is left as it is. Object stores have no
        directories: nothing to do there."""
        if not check_rel_path(rel):
            raise StorageError("delete", self.display(rel), "refusing to delete the storage root")
        self._call("delete", rel, lambda: self._rmdir(self.full(rel)))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"

    # ------------------------------------------------------------------ the interface

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
        """Write the chunks produced by ``chunks()`` to ``rel``, hashing them on the way.

        ``chunks`` is a factory so a transient failure can restart the file from its first
        byte. With ``exclusive`` the file appears atomically and only if it did not exist;
        otherwise :class:`~lightning_elastic.errors.CheckpointExistsError` is raised.
        ``durable=False`` skips the fsyncs (for advisory files). ``direct`` says the chunks are
        page-aligned host buffers (local disks may then bypass the page cache). ``size``: the
        bytes expected, a hint (a local root keeping spares reuses one of that size).
        """
        raise NotImplementedError

    def read_bytes(self, rel: str, start: int = 0, length: int | None = None) -> bytes:
        """``length`` bytes of ``rel`` from ``start`` (all when ``None``); short is an error."""
        raise NotImplementedError

    def read_into(self, rel: str, offset: int, out: memoryview) -> None:
        """Fill ``out`` with the bytes of ``rel`` from ``offset``; short is an error."""
        raise NotImplementedError

    def read_ranges(self, rel: str, ranges: Sequence[tuple[int, memoryview]]) -> None:
        """Fill each ``(offset, out)`` of ``ranges`` from ``rel`` (a load's reads of one file,
        in offset order); short is an error. Backends that can open a file once for all of
        them override this."""
        for offset, out in ranges:
            self.read_into(rel, offset, out)

    def hash_file(self, rel: str, algorithm: str) -> Written:
        """Size and checksum of ``rel``, read in chunks."""
        raise NotImplementedError

    def exists(self, rel: str) -> bool:
        """Whether ``rel`` exists (a dangling link counts as existing)."""
        raise NotImplementedError

    def size(self, rel: str) -> int:
        """Size of the file ``rel`` in bytes."""
        raise NotImplementedError

    def listdir(self, rel: str = "") -> list[Entry]:
        """Entries directly below ``rel``, sorted by name; empty when it does not exist."""
        raise NotImplementedError

    def delete(self, rel: str) -> None:
        """Delete one file (or link); a missing file is not an error (deletes are idempotent)."""
        raise NotImplementedError

    def retire(self, rel: str) -> None:
        """Delete one file that no process writes any more (a file a deleted manifest listed:
        complete when committed). A local root keeping spares may keep it for a later write to
        overwrite (:class:`~lightning_elastic.core.storage.local.SparePool`); a plain
        :meth:`delete` never does, since a writer that still holds a file (a stale copy of the
        job, a straggler of a failed save) would keep writing into it."""
        self.delete(rel)

    def _replace(self, path: str, data: Buffer) -> Written:
        raise NotImplementedError

    def _rmdir(self, path: str) -> None:
        """Remove the directory at the backend path ``path`` if it exists and is empty (else
        leave it: no error)."""
        raise NotImplementedError

    def _copy(self) -> Storage:
        """A shallow copy sharing connections (for :meth:`child`)."""
        raise NotImplementedError

    def _is_link(self, rel: str) -> bool:
        return False


def backend_for(url: str, fs: Any = None) -> type[Storage]:
    """The backend class for ``url`` (or for an injected fsspec filesystem)."""
    from fsspec.implementations.local import LocalFileSystem

    from lightning_elastic.core.storage.fsspec import FsspecStorage
    from lightning_elastic.core.storage.local import LocalStorage

    if fs is not None:
        return LocalStorage if isinstance(fs, LocalFileSystem) else FsspecStorage
    protocol = url.split("://", 1)[0] if "://" in url else "file"
    return LocalStorage if protocol in ("file", "local") else FsspecStorage
