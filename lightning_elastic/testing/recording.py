"""Record every mutating storage operation, then rebuild what a crash after any of them leaves.

Crash-point enumeration in two steps. First a real (multi-process) run saves through a
:class:`RecordingFileSystem`, which delegates to a local filesystem and appends one JSON line
per mutating operation (open for writing, each write with its bytes, close, rename, delete,
directory creation and removal) to a shared log::

    fs = RecordingFileSystem(log="/tmp/ops.jsonl")
    storage = Storage("/tmp/ckpts", fs=fs)          # or Storage("recording:///tmp/ckpts",
                                                    #   storage_options={"log": ...})

Every operation is performed *and* logged while its process holds an exclusive ``flock`` on
the log, so the order of the lines is one global order across ranks and threads, consistent
with what each process observed. Then :func:`read_log` and :func:`crash_states` replay every
prefix of that log into an in-memory model of the directory tree (POSIX semantics: a file
exists from its open, a rename moves the open file with it, a deleted file that is still open
is gone from the tree): the state a crash right after operation ``k`` leaves. The
``"unclosed-torn"`` and ``"unclosed-lost"`` variants keep half of, or none of, the bytes
of files that were not closed yet at the crash (buffered or unsynced bytes lost).
:func:`materialize` writes a state to a fresh directory for the checks. Nothing here knows
the checkpoint format: file names are whatever the run wrote.

Importing this module registers the ``recording://`` protocol.
"""

from __future__ import annotations

import base64
import fcntl
import hashlib
import itertools
import json
import os
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import fsspec
from fsspec import AbstractFileSystem

__all__ = [
    "VARIANTS",
    "CrashState",
    "FsModel",
    "Op",
    "RecordingFileSystem",
    "crash_states",
    "materialize",
    "read_log",
]

VARIANTS = ("as-written", "unclosed-torn", "unclosed-lost")
_WRITE_MODES = ("w", "x", "a", "+")


class RecordingFileSystem(AbstractFileSystem):  # type: ignore[misc]
    """Delegates to ``target`` (a new ``LocalFileSystem`` by default), logging mutations to
    ``log`` (no log: a plain pass-through). Safe across processes and threads.

    With ``object_store`` it presents itself as an object store (its protocols include
    ``memory``), so :class:`~lightning_elastic.core.storage.fsspec.FsspecStorage` takes its
    S3 path (exclusive ``xb`` creates, no renames, no directories); replay that log with
    ``crash_states(..., object_store=True)`` (an object appears whole when it is closed).
    """

    protocol: str | tuple[str, ...] = "recording"
    cachable = False

    def __init__(
        self,
        target: AbstractFileSystem | None = None,
        log: str | None = None,
        object_store: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__()
        if target is None:
            from fsspec.implementations.local import LocalFileSystem

            target = LocalFileSystem(auto_mkdir=object_store)
        if object_store:  # what FsspecStorage.is_object_store looks at
            self.protocol = ("recording", "memory")
        self.object_store = object_store
        self.target = target
        self.log = None if log is None else os.fspath(log)
        self._lock = threading.Lock()
        self._fd = -1
        self._fd_pid = -1
        self._handles = itertools.count()

    # ---------------------------------------------------------------- logging

    def _log_fd(self) -> int:
        assert self.log is not None
        if self._fd < 0 or self._fd_pid != os.getpid():  # one description per process
            self._fd = os.open(self.log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            self._fd_pid = os.getpid()
        return self._fd

    @contextmanager
    def _recording(self) -> Iterator[list[dict[str, Any]]]:
        """Run the block (which performs one operation and appends what it did to the
        yielded list) holding the global lock; then log the records, still holding it."""
        records: list[dict[str, Any]] = []
        if self.log is None:
            yield records
            return
        with self._lock:
            fd = self._log_fd()
            fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                yield records
                if records:
                    lines = b"".join(json.dumps(self._stamp(r)).encode() + b"\n" for r in records)
                    os.write(fd, lines)
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)

    @staticmethod
    def _stamp(record: dict[str, Any]) -> dict[str, Any]:
        record.setdefault("rank", int(os.environ.get("RANK", "0")))
        record.setdefault("pid", os.getpid())
        record.setdefault("thread", threading.current_thread().name)
        record.setdefault("time", time.time())
        return record

    def _new_handle(self) -> str:
        return f"{os.getpid()}:{next(self._handles)}"

    # ---------------------------------------------------------------- mutations

    def _open(self, path: str, mode: str = "rb", **kwargs: Any) -> Any:
        if not any(m in mode for m in _WRITE_MODES):
            return self.target.open(path, mode, **kwargs)
        with self._recording() as records:
            inner = self.target.open(path, mode, **kwargs)
            handle = self._new_handle()
            records.append({"op": "open", "path": path, "mode": mode, "handle": handle})
        return _RecordingFile(self, inner, path, handle)

    def rm_file(self, path: str) -> None:
        with self._recording() as records:
            self.target.rm_file(path)
            records.append({"op": "rm_file", "path": path})

    def _rm(self, path: str) -> None:
        self.rm_file(path)

    def rm(self, path: Any, recursive: bool = False, maxdepth: int | None = None) -> None:
        paths = path if isinstance(path, list) else [path]
        for p in paths:
            with self._recording() as records:
                self.target.rm(p, recursive=recursive, maxdepth=maxdepth)
                records.append({"op": "rm", "path": p, "recursive": recursive})

    def rmdir(self, path: str) -> None:
        with self._recording() as records:
            self.target.rmdir(path)
            records.append({"op": "rmdir", "path": path})

    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        with self._recording() as records:
            self.target.makedirs(path, exist_ok=exist_ok)
            records.append({"op": "makedirs", "path": path})

    def mkdir(self, path: str, create_parents: bool = True, **kwargs: Any) -> None:
        with self._recording() as records:
            self.target.mkdir(path, create_parents=create_parents, **kwargs)
            records.append({"op": "makedirs", "path": path})

    def mv(self, path1: str, path2: str, **kwargs: Any) -> None:
        with self._recording() as records:
            self.target.mv(path1, path2, **kwargs)
            records.append({"op": "mv", "path": path1, "dest": path2})

    def cp_file(self, path1: str, path2: str, **kwargs: Any) -> None:
        """Copy ``path1`` to ``path2``, logged as one ``copy`` operation."""
        with self._recording() as records:
            self.target.cp_file(path1, path2, **kwargs)
            records.append({"op": "copy", "path": path1, "dest": path2})

    def touch(self, path: str, truncate: bool = True, **kwargs: Any) -> None:
        with self._recording() as records:
            self.target.touch(path, truncate=truncate, **kwargs)
            handle = self._new_handle()
            mode = "wb" if truncate else "ab"
            records.append({"op": "open", "path": path, "mode": mode, "handle": handle})
            records.append({"op": "close", "path": path, "handle": handle})

    def pipe_file(self, path: str, value: bytes, mode: str = "overwrite", **kwargs: Any) -> None:
        with self.open(path, "xb" if mode == "create" else "wb") as f:
            f.write(value)

    # ---------------------------------------------------------------- reads (not logged)

    def cat_file(
        self, path: str, start: int | None = None, end: int | None = None, **kw: Any
    ) -> Any:
        return self.target.cat_file(path, start=start, end=end, **kw)

    def ls(self, path: str, detail: bool = True, **kwargs: Any) -> Any:
        return self.target.ls(path, detail=detail, **kwargs)

    def info(self, path: str, **kwargs: Any) -> Any:
        return self.target.info(path, **kwargs)

    def exists(self, path: str, **kwargs: Any) -> bool:
        return bool(self.target.exists(path, **kwargs))

    def size(self, path: str) -> Any:
        return self.target.size(path)

    def invalidate_cache(self, path: str | None = None) -> None:
        self.target.invalidate_cache(path)


class _RecordingFile:
    """A file open for writing: each write (with its bytes) and the close are logged."""

    def __init__(self, fs: RecordingFileSystem, inner: Any, path: str, handle: str) -> None:
        self._fs = fs
        self._inner = inner
        self._path = path
        self._handle = handle
        self._closed = False

    def write(self, data: Any) -> Any:
        with self._fs._recording() as records:
            n = self._inner.write(data)
            raw = bytes(data)
            if isinstance(n, int):
                raw = raw[:n]
            flush = getattr(self._inner, "flush", None)
            if flush is not None:
                flush()  # the bytes reach the file before the record says so
            records.append(
                {
                    "op": "write",
                    "path": self._path,
                    "handle": self._handle,
                    "data": base64.b64encode(raw).decode(),
                }
            )
        return n

    def close(self) -> None:
        if self._closed:
            return
        with self._fs._recording() as records:
            self._inner.close()
            self._closed = True
            records.append({"op": "close", "path": self._path, "handle": self._handle})

    def discard(self) -> None:
        discard = getattr(self._inner, "discard", None)
        if discard is None:
            self.close()
            return
        with self._fs._recording() as records:
            discard()
            self._closed = True
            records.append({"op": "close", "path": self._path, "handle": self._handle})

    def __enter__(self) -> _RecordingFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


# ------------------------------------------------------------------------------- replay


@dataclass(frozen=True)
class Op:
    """One logged operation; paths relative to the recorded root."""

    index: int
    op: str
    path: str
    rank: int
    pid: int
    thread: str = ""
    dest: str | None = None
    mode: str | None = None
    handle: str | None = None
    data: bytes = b""
    recursive: bool = False

    def describe(self) -> str:
        """The operation as failure messages show it (index, rank, thread, op, paths)."""
        what = f"op #{self.index} (rank {self.rank}, {self.thread}): {self.op} {self.path!r}"
        if self.dest is not None:
            what += f" -> {self.dest!r}"
        if self.mode is not None:
            what += f" mode {self.mode}"
        if self.op == "write":
            what += f" ({len(self.data)} bytes)"
        return what


def read_log(log: str | os.PathLike[str], root: str | os.PathLike[str]) -> list[Op]:
    """The operations in ``log``, in their global order, with paths made relative to
    ``root`` (an operation outside it is an error: the replay would miss it)."""
    base = os.fspath(root).rstrip("/")

    def rel(path: str) -> str:
        clean = path.split("://", 1)[-1].rstrip("/")
        if clean == base:
            return ""
        if not clean.startswith(base + "/"):
            raise ValueError(f"logged operation on {path!r}, outside the root {base!r}")
        return clean[len(base) + 1 :]

    ops = []
    with open(log, encoding="utf-8") as f:
        for index, line in enumerate(f):
            r = json.loads(line)
            ops.append(
                Op(
                    index=index,
                    op=r["op"],
                    path=rel(r["path"]),
                    rank=int(r["rank"]),
                    pid=int(r["pid"]),
                    thread=str(r.get("thread", "")),
                    dest=None if r.get("dest") is None else rel(r["dest"]),
                    mode=r.get("mode"),
                    handle=r.get("handle"),
                    data=base64.b64decode(r["data"]) if "data" in r else b"",
                    recursive=bool(r.get("recursive", False)),
                )
            )
    return ops


@dataclass(eq=False)
class _Inode:
    data: bytearray = field(default_factory=bytearray)
    open_count: int = 0


def _parents(path: str) -> list[str]:
    parts = path.split("/")
    return ["/".join(parts[:i]) for i in range(1, len(parts))]


def _under(path: str, prefix: str) -> bool:
    return path == prefix or path.startswith(prefix + "/")


class FsModel:
    """A directory tree with POSIX semantics, driven by :class:`Op` records; with
    ``object_store`` a flat key space instead: an object appears, whole, when its writer
    closes it, and directories are only the prefixes of objects."""

    def __init__(self, *, object_store: bool = False) -> None:
        self.object_store = object_store
        self.files: dict[str, _Inode] = {}
        self.dirs: set[str] = set()
        self.handles: dict[str, _Inode] = {}

    def apply(self, op: Op) -> None:
        """Apply ``op`` to the tree."""
        getattr(self, f"_{op.op}")(op)

    def _add_dir(self, path: str) -> None:
        for p in [*_parents(path), path]:
            if p:
                self.dirs.add(p)

    def _open(self, op: Op) -> None:
        assert op.handle is not None
        mode = op.mode or "wb"
        if self.object_store:
            self.handles[op.handle] = _Inode()  # invisible until closed
            return
        self._add_dir("/".join(op.path.split("/")[:-1]))
        inode = self.files.get(op.path)
        if inode is None or "x" in mode:
            inode = self.files[op.path] = _Inode()
        elif "w" in mode:
            inode.data.clear()  # O_TRUNC keeps the inode (and whoever has it open)
        inode.open_count += 1
        self.handles[op.handle] = inode

    def _write(self, op: Op) -> None:
        assert op.handle is not None
        self.handles[op.handle].data += op.data

    def _close(self, op: Op) -> None:
        assert op.handle is not None
        inode = self.handles.pop(op.handle, None)
        if inode is None:
            return
        if self.object_store:
            self.files[op.path] = inode
        else:
            inode.open_count -= 1

    def _rm_file(self, op: Op) -> None:
        self.files.pop(op.path, None)

    def _rm(self, op: Op) -> None:
        for name in [f for f in self.files if _under(f, op.path)]:
            del self.files[name]
        self.dirs -= {d for d in self.dirs if _under(d, op.path)}

    def _rmdir(self, op: Op) -> None:
        self.dirs.discard(op.path)

    def _makedirs(self, op: Op) -> None:
        if not self.object_store:
            self._add_dir(op.path)

    def _mv(self, op: Op) -> None:
        assert op.dest is not None
        src, dest = op.path, op.dest
        if src in self.files:
            self._add_dir("/".join(dest.split("/")[:-1]))
            self.files[dest] = self.files.pop(src)
            return
        for name in [f for f in self.files if _under(f, src)]:
            self.files[dest + name[len(src) :]] = self.files.pop(name)
        for d in [d for d in self.dirs if _under(d, src)]:
            self.dirs.discard(d)
            self._add_dir(dest + d[len(src) :])

    def _copy(self, op: Op) -> None:
        assert op.dest is not None
        self._add_dir("/".join(op.dest.split("/")[:-1]))
        self.files[op.dest] = _Inode(bytearray(self.files[op.path].data))

    def snapshot(self, variant: str) -> tuple[dict[str, bytes], frozenset[str]]:
        """Files (with contents) and directories a crash now leaves, under ``variant``."""
        if variant not in VARIANTS:
            raise ValueError(f"unknown variant {variant!r}; one of {VARIANTS}")
        files = {}
        for path, inode in self.files.items():
            data = bytes(inode.data)
            if inode.open_count > 0 and variant == "unclosed-lost":
                data = b""
            elif inode.open_count > 0 and variant == "unclosed-torn":
                data = data[: len(data) // 2]
            files[path] = data
        dirs = set(self.dirs)
        for path in files:
            dirs.update(p for p in _parents(path) if p)
        return files, frozenset(dirs)

    def unclosed(self) -> list[str]:
        """The files still open for writing, sorted."""
        return sorted(p for p, inode in self.files.items() if inode.open_count > 0)


@dataclass(frozen=True)
class CrashState:
    """What a crash right after ``op`` (``None``: before any operation) leaves."""

    op: Op | None
    variant: str
    files: dict[str, bytes]
    dirs: frozenset[str]
    unclosed: tuple[str, ...]

    def describe(self) -> str:
        """The crash point as failure messages show it (after which op, variant, unclosed files)."""
        where = "before any operation" if self.op is None else f"after {self.op.describe()}"
        extra = f", unclosed {list(self.unclosed)}" if self.unclosed else ""
        return f"crash {where} [{self.variant}{extra}]"

    def fingerprint(self) -> str:
        """A hash of the tree (directories, file names and contents), equal for equal trees."""
        h = hashlib.sha256()
        for d in sorted(self.dirs):
            h.update(b"d\0" + d.encode() + b"\0")
        for path in sorted(self.files):
            h.update(b"f\0" + path.encode() + b"\0" + hashlib.sha256(self.files[path]).digest())
        return h.hexdigest()


def crash_states(
    ops: Sequence[Op],
    variants: Sequence[str] = VARIANTS,
    *,
    distinct: bool = True,
    object_store: bool = False,
) -> list[CrashState]:
    """The state after every prefix of ``ops`` (the empty one included), under each variant;
    with ``distinct`` only the first crash point leading to each distinct tree."""
    model = FsModel(object_store=object_store)
    out: list[CrashState] = []
    seen: set[str] = set()

    def take(op: Op | None) -> None:
        for variant in variants:
            files, dirs = model.snapshot(variant)
            state = CrashState(op, variant, files, dirs, tuple(model.unclosed()))
            key = state.fingerprint()
            if distinct and key in seen:
                continue
            seen.add(key)
            out.append(state)

    take(None)
    for op in ops:
        model.apply(op)
        take(op)
    return out


def materialize(state: CrashState, dest: str | os.PathLike[str]) -> None:
    """Write ``state``'s tree below ``dest`` (created; must not hold anything yet)."""
    base = os.fspath(dest)
    os.makedirs(base, exist_ok=True)
    for d in sorted(state.dirs):
        os.makedirs(os.path.join(base, d), exist_ok=True)
    for path, data in state.files.items():
        with open(os.path.join(base, path), "wb") as f:
            f.write(data)


# URLs like "recording:///tmp/ckpts" with storage_options={"log": "/tmp/ops.jsonl"} reach it
# through any API that takes a URL (child processes, the CLI).
fsspec.register_implementation("recording", RecordingFileSystem, clobber=True)
