"""Rank 0's history writes, off the training loop: each record is handed to one background
thread, so a slow store (an object store's PUT, a busy NFS server) never stalls a step;
progress records are throttled and never queued behind a slow write.

Which rank calls what: rank 0 only (the :class:`~lightning_elastic.core.observe.monitor.
HealthMonitor` makes one when it has a history), from the training thread; the writes run on
the recorder's thread, in the order they were handed over. :meth:`HistoryRecorder.now` and
:meth:`HistoryRecorder.crashed` write on the calling thread: a launch killed in its first
step, or a process dying of an exception, still leaves its record.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from lightning_elastic.core.format.catalog import Catalog
from lightning_elastic.core.observe.history import RunHistory

__all__ = ["HistoryRecorder"]

log = logging.getLogger(__name__)


class HistoryRecorder:
    """Background writes to one :class:`~lightning_elastic.core.observe.history.RunHistory`.

    Args:
        history: rank 0's run history.
        progress_every_s: seconds between two progress records; ``None``: every step on a
            local or shared file system (a small write, skipped while the previous one is
            still going), every second on an object store (~86,000 PUTs a day).
    """

    def __init__(self, history: RunHistory, *, progress_every_s: float | None) -> None:
        self.history = history
        every = progress_every_s
        self.progress_every_s = (
            (0.0 if history.storage.is_local else 1.0) if every is None else every
        )
        self._writer: ThreadPoolExecutor | None = None
        self._progress_write: Future[Any] | None = None
        self._progress_at = -math.inf
        self._catalog: Catalog | None = None
        # a progress record written at once (a crash) is final: a background one of an older
        # step, queued or running, must not land after it (the newest record is what the next
        # launch reads as "interrupted at"; seen: a crash at step 7 recorded as step 6)
        self._progress_lock = threading.Lock()
        self._final_step: int | None = None

    def record(self, kind: str, **fields: Any) -> None:
        """Record an event of ``kind`` in the background."""
        history = self.history
        self._background(lambda: history.record(kind, **fields))

    def commit(self, **fields: Any) -> None:
        """Record a commit, with what this run keeps after it (listed in the background)."""
        history = self.history
        self._background(lambda: history.record("commit", **fields, **self._retained()))

    def now(self, kind: str, *, step: int, **fields: Any) -> None:
        """Record an event and the progress at ``step`` on this thread (a launch's start)."""
        self.history.record(kind, step=step, **fields)
        self._progress_at = time.monotonic()
        self.history.progress(step, force=True)

    def progress(self, step: int, *, force: bool = False, planned: bool = False) -> None:
        """The run reached ``step`` (throttled to :attr:`progress_every_s` unless ``force``;
        ``planned``: the launch ends by plan here)."""
        now = time.monotonic()
        pending = self._progress_write is not None and not self._progress_write.done()
        if not force and (pending or now - self._progress_at < self.progress_every_s):
            return  # throttled here, and never queued behind a slow write
        self._progress_at = now
        self._progress_write = self._background(lambda: self._write_progress(step, planned))

    def _write_progress(self, step: int, planned: bool) -> None:
        with self._progress_lock:
            if self._final_step is None:
                self.history.progress(step, force=True, planned=planned)

    def crashed(self, step: int) -> None:
        """Training ends with an exception at ``step``: its progress, written now (the process
        may not live to run the background thread)."""
        with self._progress_lock:  # after a background write in progress, before any queued
            self._final_step = step
            self.history.progress(step, force=True, planned=False)

    def flush(self, timeout: float | None = None) -> None:
        """Wait for the writes handed over so far."""
        if self._writer is not None:
            self._writer.submit(lambda: None).result(timeout)

    def close(self) -> None:
        """Finish the writes (each is bounded by the storage's timeouts)."""
        writer, self._writer = self._writer, None
        if writer is not None:
            writer.shutdown(wait=True)

    def _retained(self) -> dict[str, int | None]:
        """This run's valid checkpoints now (after retention): bytes and count (in the writer
        thread: a listing, manifests are cached)."""
        if self._catalog is None:
            self._catalog = Catalog(self.history.storage)
        try:
            mine = [
                info
                for info in self._catalog.valid()
                if info.manifest is not None and info.run_id == self.history.run_id
            ]
        except Exception as exc:  # observability never fails training
            log.warning("could not list the checkpoints for the run history: %r", exc)
            return {"retained_bytes": None, "retained": None}
        total = sum(info.manifest.total_bytes for info in mine if info.manifest is not None)
        return {"retained_bytes": total, "retained": len(mine)}

    def _background(self, write: Callable[[], Any]) -> Future[Any]:
        if self._writer is None:
            self._writer = ThreadPoolExecutor(1, thread_name_prefix="lightning-elastic-history")
        return self._writer.submit(write)
