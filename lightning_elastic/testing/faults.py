"""An fsspec filesystem that fails on purpose, in the spirit of DCP's ``FaultyStorageWriter``.

Wrap any filesystem and list the faults::

    fs = FaultyFileSystem(LocalFileSystem(), [Fault("write", "*.distcp", "ENOSPC", ranks=(1,))])
    storage = Storage(path, fs=fs)

A fault matches an operation on a path (``fnmatch`` pattern) on some ranks (``RANK`` from the
environment), lets ``skip`` matching calls through, then fires ``times`` times (0 = always).
It raises ``OSError`` with the named errno, ``TimeoutError`` (``"timeout"``), stalls
(``"stall"``, ``seconds``) or SIGKILLs the process (``"kill"``). Importing this module registers
the ``faulty://`` protocol (local files underneath): ``Storage("faulty:///tmp/x",
storage_options={"faults": [...]})``.
"""

from __future__ import annotations

import errno
import fnmatch
import os
import signal
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import fsspec
from fsspec import AbstractFileSystem

__all__ = ["OPS", "Fault", "FaultyFileSystem"]

OPS = ("open", "write", "close", "closed", "read", "list", "exists", "delete", "mkdir", "rename")


@dataclass(frozen=True)
class Fault:
    """A fault to inject into ``op`` on paths matching ``path`` (see the module docstring)."""

    op: str
    path: str = "*"
    error: str = "EIO"
    times: int = 1
    skip: int = 0
    ranks: tuple[int, ...] | None = None
    seconds: float = 0.0

    def __post_init__(self) -> None:
        if self.op not in OPS:
            raise ValueError(f"unknown op {self.op!r}; one of {OPS}")


class FaultyFileSystem(AbstractFileSystem):  # type: ignore[misc]
    """Delegates to ``target``, injecting ``faults``. Counters are per process."""

    protocol = "faulty"
    cachable = False

    def __init__(
        self, target: AbstractFileSystem | None = None, faults: Sequence[Fault] = (), **kwargs: Any
    ) -> None:
        super().__init__()
        if target is None:
            from fsspec.implementations.local import LocalFileSystem

            target = LocalFileSystem()
        self.target = target
        self.faults = list(faults)
        self._seen = [0] * len(self.faults)
        self._lock = threading.Lock()
        self.fired: list[tuple[str, str, str]] = []

    def inject(self, op: str, path: str) -> None:
        """Fire the faults that match ``op`` on ``path`` on this rank (the filesystem and its files
        call it around each operation they delegate)."""
        rank = int(os.environ.get("RANK", "0"))
        for i, fault in enumerate(self.faults):
            if fault.op != op or not fnmatch.fnmatch(str(path), fault.path):
                continue
            if fault.ranks is not None and rank not in fault.ranks:
                continue
            with self._lock:
                self._seen[i] += 1
                n = self._seen[i]
            if n <= fault.skip or (fault.times and n > fault.skip + fault.times):
                continue
            self.fired.append((op, str(path), fault.error))
            self._fire(fault, op, str(path))

    @staticmethod
    def _fire(fault: Fault, op: str, path: str) -> None:
        if fault.error == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if fault.error == "stall":
            time.sleep(fault.seconds)
            return
        if fault.error == "timeout":
            raise TimeoutError(f"injected timeout during {op} of {path}")
        code = getattr(errno, fault.error)
        raise OSError(code, f"injected {fault.error} during {op}", path)

    # ---------------------------------------------------------------- delegated API

    def _open(self, path: str, mode: str = "rb", **kwargs: Any) -> Any:
        self.inject("open", path)
        inner = self.target.open(path, mode, **kwargs)
        return _FaultyFile(self, inner, path)

    def cat_file(
        self, path: str, start: int | None = None, end: int | None = None, **kw: Any
    ) -> Any:
        self.inject("read", path)
        return self.target.cat_file(path, start=start, end=end, **kw)

    def ls(self, path: str, detail: bool = True, **kwargs: Any) -> Any:
        self.inject("list", path)
        return self.target.ls(path, detail=detail, **kwargs)

    def info(self, path: str, **kwargs: Any) -> Any:
        self.inject("exists", path)
        return self.target.info(path, **kwargs)

    def exists(self, path: str, **kwargs: Any) -> bool:
        self.inject("exists", path)
        return bool(self.target.exists(path, **kwargs))

    def size(self, path: str) -> Any:
        self.inject("exists", path)
        return self.target.size(path)

    def rm_file(self, path: str) -> None:
        self.inject("delete", path)
        self.target.rm_file(path)

    def rmdir(self, path: str) -> None:
        self.inject("delete", path)
        self.target.rmdir(path)

    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        self.inject("mkdir", path)
        self.target.makedirs(path, exist_ok=exist_ok)

    def mkdir(self, path: str, create_parents: bool = True, **kwargs: Any) -> None:
        self.inject("mkdir", path)
        self.target.mkdir(path, create_parents=create_parents, **kwargs)

    def mv(self, path1: str, path2: str, **kwargs: Any) -> None:
        self.inject("rename", path2)
        self.target.mv(path1, path2, **kwargs)

    def invalidate_cache(self, path: str | None = None) -> None:
        self.target.invalidate_cache(path)


class _FaultyFile:
    def __init__(self, fs: FaultyFileSystem, inner: Any, path: str) -> None:
        self._fs = fs
        self._inner = inner
        self._path = path

    def write(self, data: Any) -> Any:
        self._fs.inject("write", self._path)
        return self._inner.write(data)

    def read(self, *args: Any) -> Any:
        self._fs.inject("read", self._path)
        return self._inner.read(*args)

    def close(self) -> None:
        self._fs.inject("close", self._path)
        self._inner.close()
        self._fs.inject("closed", self._path)  # the file is complete: "after the write"

    def discard(self) -> None:
        discard = getattr(self._inner, "discard", None)
        if discard is not None:
            discard()
        else:
            self._inner.close()

    def __enter__(self) -> _FaultyFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


# URLs like "faulty:///tmp/ckpts" with storage_options={"faults": [...]} reach it through any
# API that takes a URL (DistributedCheckpoint, CheckpointEngine, the CLI).
fsspec.register_implementation("faulty", FaultyFileSystem, clobber=True)
