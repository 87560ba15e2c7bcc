"""Storage over any fsspec filesystem (``s3://``, ``gs://``, ``memory://``, ``faulty://``, ...).

Object stores (flat key spaces: S3, GCS, Azure, memory) get ``mode="xb"`` for exclusive
creates (S3 ``If-None-Match: *``) and never see a rename or a directory operation. Other
fsspec filesystems (e.g. SFTP, HDFS) create parent directories; their exclusive publish
must not show a partial file (see :meth:`FsspecStorage.write_stream`).
"""

from __future__ import annotations

import contextlib
import copy
import os
import uuid
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import fsspec

from lightning_elastic.core.storage.base import Buffer, Entry, Storage, Written
from lightning_elastic.core.storage.checksum import new_hasher
from lightning_elastic.core.storage.local import drain
from lightning_elastic.core.storage.retry import RetryPolicy
from lightning_elastic.errors import CheckpointExistsError, StorageError

__all__ = ["FsspecStorage"]

_READ_CHUNK = 8 << 20
_OBJECT_STORES = {"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "adl", "oss", "memory"}
# Object stores without explicit timeouts can block forever on a dead connection.
_S3_DEFAULT_CONFIG = {"connect_timeout": 10, "read_timeout": 60, "retries": {"max_attempts": 3}}


class FsspecStorage(Storage):
    """:class:`Storage` through an fsspec filesystem; rebuilt after a fork (s3fs/aiohttp are
    not fork-safe)."""

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
        self._injected_fs = fs
        self._fs: fsspec.AbstractFileSystem | None = None
        self._pid = -1
        if fs is not None:
            self.root = self.url.split("://", 1)[-1].rstrip("/") or "/"
        else:
            self.fs  # noqa: B018 - resolve now so a bad URL fails at construction

    @property
    def fs(self) -> fsspec.AbstractFileSystem:
        """The filesystem (one client per root and process)."""
        if self._injected_fs is not None:
            return self._injected_fs
        if self._fs is None or self._pid != os.getpid():
            options = dict(self.storage_options)
            if self.url.startswith(("s3://", "s3a://")):
                options.setdefault("config_kwargs", dict(_S3_DEFAULT_CONFIG))
            options.setdefault("skip_instance_cache", True)
            try:
                fs, root = fsspec.core.url_to_fs(self.url, **options)
            except (ValueError, ImportError) as exc:
                raise StorageError("open", self.url, exc, hint="check the URL and extras") from exc
            self._fs, self.root, self._pid = fs, root.rstrip("/") or "/", os.getpid()
        return self._fs

    @property
    def is_object_store(self) -> bool:
        """Flat key spaces where directories do not exist (and renames are copies)."""
        protocols = self.fs.protocol
        names = {protocols} if isinstance(protocols, str) else set(protocols)
        return bool(names & _OBJECT_STORES)

    def _copy(self) -> Storage:
        fs = self.fs  # resolve first: the child shares it
        sub = copy.copy(self)
        if self._injected_fs is None:  # copy() went through __getstate__, which drops these
            sub._fs, sub._pid = fs, self._pid
        return sub

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_fs"] = None  # rebuilt lazily in the receiving process
        state["_pid"] = -1
        return state

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
        path = self.full(rel)
        written: Written = self._call(
            "write", rel, lambda: self._write(path, chunks(), checksum, exclusive)
        )
        return written

    def _write(
        self, path: str, chunks: Iterable[Buffer], checksum: str | None, exclusive: bool
    ) -> Written:
        fs = self.fs
        parent = path.rsplit("/", 1)[0]
        if not self.is_object_store:  # on S3, makedirs would try to create the bucket
            fs.makedirs(parent, exist_ok=True)
        if exclusive:
            fs.invalidate_cache(parent)
            if fs.exists(path):
                raise CheckpointExistsError(f"{path} already exists")
            if not self.is_object_store:
                return self._write_then_rename(path, chunks, checksum)
        try:
            handle = fs.open(path, "xb" if exclusive else "wb")
        except FileExistsError:
            raise CheckpointExistsError(f"{path} already exists") from None
        try:
            written = drain(chunks, checksum, handle.write)
        except BaseException:
            # Never let a failed write be committed by close(): abort the upload instead.
            discard = getattr(handle, "discard", None)
            with contextlib.suppress(Exception):
                discard() if discard is not None else handle.close()
            # Our open succeeded, so whatever exists at ``path`` now is ours (some backends
            # create the file at open, exclusive or not): remove it.
            with contextlib.suppress(Exception):
                fs.rm_file(path)
            raise
        try:
            handle.close()
        except FileExistsError:
            raise CheckpointExistsError(f"{path} already exists") from None
        fs.invalidate_cache(parent)
        return written

    def _write_then_rename(
        self, path: str, chunks: Iterable[Buffer], checksum: str | None
    ) -> Written:
        """Exclusive publish on filesystems that are not object stores (SFTP, HDFS, ...):
        their files are visible while being written, so write a temporary name and rename
        it. fsspec has no rename-if-absent: a writer racing between the check and the
        rename could replace the file, which the claim of the directory (one writer per
        directory) rules out for our own files."""
        fs = self.fs
        tmp = f"{path}.tmp-{uuid.uuid4().hex[:12]}"
        try:
            with fs.open(tmp, "wb") as handle:
                written = drain(chunks, checksum, handle.write)
            fs.invalidate_cache(path.rsplit("/", 1)[0])
            if fs.exists(path):
                raise CheckpointExistsError(f"{path} already exists")
            fs.mv(tmp, path)
        finally:
            with contextlib.suppress(Exception):
                if fs.exists(tmp):
                    fs.rm_file(tmp)
        return written

    def _replace(self, path: str, data: Buffer) -> Written:
        """Object stores: one PUT (an object appears whole, old or new). Other filesystems
        show a file while it is written: a temporary name, then moved over ``path``."""
        fs = self.fs
        parent = path.rsplit("/", 1)[0]
        if self.is_object_store:
            with fs.open(path, "wb") as handle:
                written = drain((data,), None, handle.write)
            fs.invalidate_cache(parent)
            return written
        fs.makedirs(parent, exist_ok=True)
        tmp = f"{path}.tmp-{uuid.uuid4().hex[:12]}"
        try:
            with fs.open(tmp, "wb") as handle:
                written = drain((data,), None, handle.write)
            fs.mv(tmp, path)
        finally:
            with contextlib.suppress(Exception):
                if fs.exists(tmp):
                    fs.rm_file(tmp)
        fs.invalidate_cache(parent)
        return written

    # ------------------------------------------------------------------ reads

    def read_bytes(self, rel: str, start: int = 0, length: int | None = None) -> bytes:
        path = self.full(rel)
        end = None if length is None else start + length
        data: bytes = self._call(
            "read", rel, lambda: bytes(self.fs.cat_file(path, start=start, end=end))
        )
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
        if not want:  # an empty range is no request (S3 answers one with the whole object)
            return

        def read() -> int:
            data = self.fs.cat_file(path, start=offset, end=offset + want)
            out.cast("B")[: len(data)] = data
            return len(data)

        got = self._call("read", rel, read)
        if got != want:
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
            with self.fs.open(path, "rb") as f:
                while chunk := f.read(_READ_CHUNK):
                    hasher.update(chunk)
                    size += len(chunk)
            return Written(size, hasher.hexdigest())

        result: Written = self._call("read", rel, digest)
        return result

    # ------------------------------------------------------------------ namespace

    def exists(self, rel: str) -> bool:
        path = self.full(rel)

        def check() -> bool:
            self.fs.invalidate_cache(path)
            return bool(self.fs.exists(path))

        result: bool = self._call("exists", rel, check)
        return result

    def size(self, rel: str) -> int:
        path = self.full(rel)

        def stat() -> int:
            self.fs.invalidate_cache(path)
            return int(self.fs.size(path))

        result: int = self._call("stat", rel, stat)
        return result

    def listdir(self, rel: str = "") -> list[Entry]:
        path = self.full(rel)

        def ls() -> list[Entry]:
            fs = self.fs
            fs.invalidate_cache(path)
            try:
                infos = fs.ls(path, detail=True)
            except FileNotFoundError:
                return []
            out = []
            for info in infos:
                name = str(info["name"]).rstrip("/").rsplit("/", 1)[-1]
                if str(info["name"]).rstrip("/") == path.rstrip("/"):
                    continue  # some backends list the directory itself
                if info.get("islink"):  # e.g. sftp: never followed
                    out.append(Entry(name, False, 0, is_link=True))
                    continue
                is_dir = info.get("type") == "directory"
                out.append(Entry(name, is_dir, int(info.get("size") or 0), mtime=_mtime(info)))
            return out

        result: list[Entry] = self._call("list", rel, ls)
        return sorted(result, key=lambda e: e.name)

    def delete(self, rel: str) -> None:
        path = self.full(rel)

        def rm() -> None:
            with contextlib.suppress(FileNotFoundError):
                self.fs.rm_file(path)

        self._call("delete", rel, rm)

    def _rmdir(self, path: str) -> None:
        with contextlib.suppress(FileNotFoundError, OSError):
            self.fs.rmdir(path)
        self.fs.invalidate_cache(path)


def _mtime(info: Mapping[str, Any]) -> float | None:
    """Modification time from an fsspec listing (``mtime``, S3's ``LastModified``, ...)."""
    for key in ("mtime", "LastModified", "last_modified", "updated", "created"):
        value = info.get(key)
        if value is None:
            continue
        if isinstance(value, (int, float)):
            return float(value)
        timestamp = getattr(value, "timestamp", None)  # datetime
        if callable(timestamp):
            return float(timestamp())
    return None
