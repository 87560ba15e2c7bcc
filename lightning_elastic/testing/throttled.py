"""An fsspec filesystem that is as slow as an object store, for benchmarks of the tiers.

Local files underneath; every byte read or written passes a token bucket of ``bandwidth``
bytes/s (one bucket per direction, shared by every instance with that rate in the process: a
rank's NIC share to S3, whatever number of files or threads it uses), and every
round trip (open, list, info, exists, delete, rename) sleeps ``latency`` seconds first::

    import lightning_elastic.testing.throttled  # registers throttled://

    storage = Storage("throttled:///tmp/ckpts", storage_options={"bandwidth": 100e6})

Defaults: unlimited bandwidth (``None``), 0.02 s latency (an S3 round trip within a region).
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import fsspec
from fsspec import AbstractFileSystem

__all__ = ["ThrottledFileSystem", "TokenBucket"]


class TokenBucket:
    """``rate`` bytes/s with ``burst_s`` seconds of credit; :meth:`take` sleeps until the bytes
    are paid for. Thread-safe; callers queue in arrival order (a virtual clock)."""

    def __init__(self, rate: float, burst_s: float = 0.0) -> None:
        if rate <= 0:
            raise ValueError(f"bandwidth must be positive, got {rate}")
        self.rate = float(rate)
        self.burst_s = burst_s
        self._next = 0.0  # when the bytes taken so far are paid for
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> float:
        """Pay for ``nbytes``; the seconds slept."""
        with self._lock:
            now = time.monotonic()
            start = max(self._next, now - self.burst_s)
            self._next = start + nbytes / self.rate
            delay = self._next - now
        if delay > 0:
            time.sleep(delay)
            return delay
        return 0.0


_buckets: dict[tuple[int, str, float], TokenBucket] = {}
_buckets_lock = threading.Lock()


def _bucket(direction: str, rate: float) -> TokenBucket:
    """The process's bucket for ``direction`` at ``rate`` (per pid: a forked child starts full)."""
    key = (os.getpid(), direction, rate)
    with _buckets_lock:
        bucket = _buckets.get(key)
        if bucket is None:
            bucket = _buckets[key] = TokenBucket(rate)
        return bucket


class ThrottledFileSystem(AbstractFileSystem):  # type: ignore[misc]
    """Delegates to ``target`` (default: local files) at ``bandwidth`` bytes/s per direction
    and process, ``latency`` seconds per round trip (module docstring)."""

    protocol = "throttled"
    cachable = False

    def __init__(
        self,
        target: AbstractFileSystem | None = None,
        bandwidth: float | None = None,
        latency: float = 0.02,
        **kwargs: Any,
    ) -> None:
        super().__init__()
        if target is None:
            from fsspec.implementations.local import LocalFileSystem

            target = LocalFileSystem()
        if latency < 0:
            raise ValueError(f"latency must be >= 0, got {latency}")
        self.target = target
        self.bandwidth = None if bandwidth is None else float(bandwidth)
        self.latency = latency
        if self.bandwidth is not None:
            _bucket("read", self.bandwidth)  # validates it

    def round_trip(self) -> None:
        """One request's latency."""
        if self.latency:
            time.sleep(self.latency)

    def transfer(self, direction: str, nbytes: int) -> None:
        """Pay for ``nbytes`` read or written."""
        if self.bandwidth is not None and nbytes:
            _bucket(direction, self.bandwidth).take(nbytes)

    # ---------------------------------------------------------------- delegated API

    def _open(self, path: str, mode: str = "rb", **kwargs: Any) -> Any:
        self.round_trip()
        return _ThrottledFile(self, self.target.open(path, mode, **kwargs))

    def cat_file(
        self, path: str, start: int | None = None, end: int | None = None, **kw: Any
    ) -> Any:
        self.round_trip()  # a ranged GET: one request
        data = self.target.cat_file(path, start=start, end=end, **kw)
        self.transfer("read", len(data))
        return data

    def ls(self, path: str, detail: bool = True, **kwargs: Any) -> Any:
        self.round_trip()
        return self.target.ls(path, detail=detail, **kwargs)

    def info(self, path: str, **kwargs: Any) -> Any:
        self.round_trip()
        return self.target.info(path, **kwargs)

    def exists(self, path: str, **kwargs: Any) -> bool:
        self.round_trip()
        return bool(self.target.exists(path, **kwargs))

    def size(self, path: str) -> Any:
        self.round_trip()
        return self.target.size(path)

    def rm_file(self, path: str) -> None:
        self.round_trip()
        self.target.rm_file(path)

    def rmdir(self, path: str) -> None:
        self.round_trip()
        self.target.rmdir(path)

    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        self.target.makedirs(path, exist_ok=exist_ok)  # no request on an object store

    def mkdir(self, path: str, create_parents: bool = True, **kwargs: Any) -> None:
        self.target.mkdir(path, create_parents=create_parents, **kwargs)

    def mv(self, path1: str, path2: str, **kwargs: Any) -> None:
        self.round_trip()  # a server-side copy; the bytes do not cross this process's link
        self.target.mv(path1, path2, **kwargs)

    def invalidate_cache(self, path: str | None = None) -> None:
        self.target.invalidate_cache(path)


class _ThrottledFile:
    def __init__(self, fs: ThrottledFileSystem, inner: Any) -> None:
        self._fs = fs
        self._inner = inner

    def write(self, data: Any) -> Any:
        self._fs.transfer("write", memoryview(data).nbytes)
        return self._inner.write(data)

    def read(self, *args: Any) -> Any:
        data = self._inner.read(*args)
        self._fs.transfer("read", len(data))
        return data

    def __enter__(self) -> _ThrottledFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self._inner.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


fsspec.register_implementation("throttled", ThrottledFileSystem, clobber=True)
