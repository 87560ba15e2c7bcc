"""One save in flight per engine: its handle, and the background writer thread it runs in.

Which rank calls what: every rank, from the training thread. :meth:`SaveLane.ready` at the
start of each save (with ``when_busy="skip"`` one all-reduce decides, so all ranks skip or
none; otherwise the save in flight is waited for and its error raised, on every rank);
:meth:`SaveLane.start` runs the background part of the save inline (a blocking save) or
submits it to the writer thread; :meth:`SaveLane.wait` and :meth:`SaveLane.close` before a
load, at the end. A save given up because its lazy snapshot saw a tensor change
(:class:`~lightning_elastic.errors.SnapshotChangedError`, the same on every rank) is not
raised by them: it is kept for the engine (:meth:`SaveLane.take_abandoned`), which turns lazy
snapshots off; its handle's ``result()`` still raises it.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from lightning_elastic.core.dist.coordinator import Coordinator
from lightning_elastic.core.forksafe import fork_safe_logger
from lightning_elastic.core.save.request import SaveResult
from lightning_elastic.errors import CheckpointSaveError, Phase, SnapshotChangedError

__all__ = ["WHEN_BUSY", "SaveHandle", "SaveLane"]

log = fork_safe_logger(__name__)
WHEN_BUSY = ("wait", "skip")


class SaveHandle:
    """A save that was started; :meth:`result` waits for its commit (or raises its error)."""

    def __init__(self, future: Future[SaveResult], name: str, step: int, blocked_s: float) -> None:
        self._future = future
        self.name = name
        self.step = step
        self.blocked_s = blocked_s
        self.error_seen = False  # the caller already got the error from result()

    def done(self) -> bool:
        """Whether the save has finished, committed or failed (no waiting)."""
        return self._future.done()

    def succeeded(self) -> bool:
        """Finished and committed (no waiting)."""
        return self._future.done() and self._future.exception() is None

    def result(self, timeout: float | None = None) -> SaveResult:
        """Wait (at most ``timeout`` seconds, ``None``: no limit) for the commit and return its
        result, or raise the save's error."""
        try:
            return self._future.result(timeout)
        except Exception:
            if self._future.done():
                self.error_seen = True
            raise

    def __repr__(self) -> str:
        state = "done" if self.done() else "in flight"
        return f"SaveHandle({self.name!r}, step={self.step}, {state})"


class SaveLane:
    """The save in flight of one engine and its writer thread (see the module docstring)."""

    def __init__(self, coordinator: Coordinator, when_busy: str) -> None:
        self.coordinator = coordinator
        self.when_busy = when_busy
        self._executor: ThreadPoolExecutor | None = None
        self._inflight: SaveHandle | None = None
        self._abandoned: SnapshotChangedError | None = None

    def ready(self) -> bool:
        """Every rank: whether a new save may start now (``False``: skipped, all ranks)."""
        handle = self._inflight
        if handle is None:
            return True
        if self.when_busy == "skip" and not self.coordinator.all(
            handle.done(), Phase.SAVE_BUSY, error=CheckpointSaveError
        ):
            log.info("skipping a save: %r is still in flight on some rank", handle)
            return False
        self._inflight = None
        if not handle.error_seen:
            self._result(handle)  # raises the previous save's error, on every rank
        else:
            self._note(handle)
        return True

    def idle(self) -> bool:
        """Whether no save is in flight."""
        return self._inflight is None

    def take_abandoned(self) -> SnapshotChangedError | None:
        """The error of a save given up on a changed snapshot since the last call, if any."""
        exc, self._abandoned = self._abandoned, None
        return exc

    def _note(self, handle: SaveHandle) -> None:
        """A finished save whose error the caller saw already: still the engine's to note."""
        exc = handle._future.exception()
        if isinstance(exc, SnapshotChangedError):
            self._abandoned = exc

    def _result(self, handle: SaveHandle) -> SaveResult | None:
        try:
            return handle.result()
        except SnapshotChangedError as exc:
            self._abandoned = exc
            return None

    def start(
        self,
        finish: Callable[[float], SaveResult],
        *,
        name: str,
        step: int,
        called: float,
        blocking: bool,
    ) -> SaveHandle:
        """Run ``finish(blocked_s)`` (the background part of the save called at ``called``):
        inline when ``blocking`` (its error is raised here), else in the writer thread."""
        future: Future[SaveResult]
        if blocking:
            future = Future()
            try:
                future.set_result(finish(time.monotonic() - called))
            except BaseException as exc:
                future.set_exception(exc)
                raise
            return SaveHandle(future, name, step, time.monotonic() - called)
        blocked_s = time.monotonic() - called
        future = self._writer().submit(finish, blocked_s)
        self._inflight = SaveHandle(future, name, step, blocked_s)
        return self._inflight

    def wait(self) -> SaveResult | None:
        """Wait for the save in flight; raise its error unless the caller has seen it."""
        handle, self._inflight = self._inflight, None
        if handle is not None and not (handle.error_seen and handle.done()):
            return self._result(handle)
        if handle is not None:
            self._note(handle)
        return None

    def close(self) -> None:
        """Stop the writer thread (after :meth:`wait`)."""
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None

    def _writer(self) -> ThreadPoolExecutor:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(
                1, thread_name_prefix="lightning-elastic-writer", initializer=_background_priority
            )
        return self._executor


def _background_priority() -> None:
    """Lower the writer thread's CPU priority (Linux applies nice per thread): when training
    and writing compete for few cores, training should win; idle cores still write at full
    speed."""
    with contextlib.suppress(AttributeError, OSError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
