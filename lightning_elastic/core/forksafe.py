"""Fork safety: what the background writer may hold when the training thread forks.

A ``DataLoader`` with ``num_workers > 0`` and non-persistent workers forks new workers at
every epoch start, from the training thread, while a save may be writing in the background.
A forked child has only the forking thread; every lock another thread held at that instant
stays locked in the child for ever. What our writer thread can hold, measured on CPython
3.11.7 with ``benchmarks/bench_fork.py`` (2 cores; a child still running after 3 s is hung):

* **CPython's ``HEAD_LOCK``** (gh-112275: a child that inherits it hangs inside
  ``os.fork()``, in ``PyOS_AfterFork_Child -> _PyEval_ReInitThreads ->
  _PyThreadState_DeleteExcept``; fixed in 3.10.15, 3.11.10 and 3.12). Not by our writer: a
  Python thread takes it only with the GIL held (to create or delete its thread state), and
  ``os.fork()`` holds the GIL. Only a thread that enters Python from C/C++ (``PyGILState_Ensure``
  or pybind11 on a thread without a thread state) takes it without the GIL: 5 of 1,000 forks
  hung with two such threads running, 0 of 1,000 with Python threads started and joined in a
  loop, 0 of 900 during our saves (and 0 of 3,000 forks inside a 2-rank DDP training with a
  save every 2 steps). The writer is one thread per engine, kept for the engine's life, so
  saves create no thread states. Only the user can avoid the CPython bug
  (:func:`python_fork_hang_fixed`; ``persistent_workers=True`` or the ``forkserver`` context).
* **The lock of a buffered ``sys.stderr``/``sys.stdout``**, while the writer emits a log
  record: the stream's lock is held across ``write(2)`` (GIL released) and until the writer
  has the GIL back, so a fork then leaves the child's stream locked, and the child hangs at
  its next write or flush (a worker's warning; multiprocessing flushes both streams when a
  worker exits). With a thread logging to stderr in a loop, 10 of the first 26 forks hung;
  through :func:`fork_safe_logger`, 0 of 1,000. Logging re-initialises its handler locks in
  the child, not the stream's; ``PYTHONUNBUFFERED=1`` leaves the streams without such a lock.
  This is what the fork gate below is for: records of :func:`fork_safe_logger` loggers are
  handled inside it.
* **Import locks**, while the writer imports a module (a child importing the same module
  waits for ever). Nothing is imported on the writer thread during a save (tested with an
  audit hook); keep it so by importing at module level or on the training thread.
* Not hazards: glibc's ``malloc`` (fork takes its arena locks), the c10d store client's mutex
  and hashing or writing a chunk (no lock a worker ever takes). Gating every written chunk as
  well only made forks wait for the chunk: p99 fork time during saves 56 ms instead of 28-34
  ms, a save of 64 MiB 0.30 s instead of 0.23-0.25 s.

Which thread calls what: any thread enters :func:`fork_gate` around a short unit of work
that must not be cut by a fork (the handling of one log record); never across a blocking
wait (a store wait, a retry sleep, a collective), or every fork would wait as long. The
thread that forks (``os.fork``, so multiprocessing's ``fork`` context too) enters the gate in
a ``before`` fork handler, so the fork happens while no other thread is inside the gate; the
parent leaves it after the fork, the child gets a new gate (held as deep as the forking
thread held it before the fork). A fork waits at most :data:`FORK_WAIT_S` for the gate, then
forks anyway and logs a warning, rather than stalling training.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time
from collections.abc import Iterator

__all__ = [
    "FORK_WAIT_S",
    "fork_gate",
    "fork_safe_logger",
    "holds_fork_gate",
    "python_fork_hang_fixed",
]

# A unit inside the gate is microseconds to milliseconds (one log record); this only bounds
# a gate held by something that hangs (a stderr pipe nobody reads).
FORK_WAIT_S = 10.0

log = logging.getLogger(__name__)  # not gated: it only logs from the forking thread

_gate = threading.RLock()
_depth = threading.local()  # how deep the current thread is inside fork_gate()
_forking = threading.local()  # whether this thread's before-fork handler got the gate


@contextlib.contextmanager
def fork_gate() -> Iterator[None]:
    """Run the block while no fork can happen in this process (re-entrant); a fork from
    another thread waits until the block ends. Keep the block short and free of waits."""
    _gate.acquire()
    _depth.value = getattr(_depth, "value", 0) + 1
    try:
        yield
    finally:
        _depth.value -= 1
        _gate.release()  # the module's gate: a forked child has a new one, held as deep


def holds_fork_gate() -> bool:
    """Whether the current thread is inside :func:`fork_gate`."""
    return getattr(_depth, "value", 0) > 0


def fork_safe_logger(name: str) -> logging.Logger:
    """``logging.getLogger(name)``, whose records are handled (formatted and written by every
    handler on the way up) inside :func:`fork_gate`: a fork never leaves a child with a
    stream lock that our thread held. For modules whose code runs on the writer thread."""
    logger = logging.getLogger(name)
    if not isinstance(vars(logger).get("handle"), _GatedHandle):
        setattr(logger, "handle", _GatedHandle(logger))  # noqa: B010 (a method, per instance)
    return logger


class _GatedHandle:
    """``Logger.handle`` of one logger, inside the fork gate (the caller's file and line were
    found before ``handle`` is called, so records still name them)."""

    def __init__(self, logger: logging.Logger) -> None:
        self._logger = logger

    def __call__(self, record: logging.LogRecord) -> None:
        with fork_gate():
            type(self._logger).handle(self._logger, record)


def python_fork_hang_fixed(
    version: tuple[int, ...] | None = None, implementation: str | None = None
) -> bool:
    """Whether this interpreter (or the given ``version`` and ``implementation``) has the fix
    for CPython gh-112275, a forked child hanging in ``os.fork()`` when another thread held
    the interpreter's ``HEAD_LOCK``: CPython 3.10.15, 3.11.10, 3.12 and later. Other
    implementations count as fixed (the bug is CPython's)."""
    version = tuple(sys.version_info[:3]) if version is None else tuple(version)
    implementation = sys.implementation.name if implementation is None else implementation
    if implementation != "cpython":
        return True
    fixed_in = {(3, 8): 20, (3, 9): 20, (3, 10): 15, (3, 11): 10}
    minor = version[:2]
    if minor in fixed_in:
        return len(version) > 2 and version[2] >= fixed_in[minor]
    return minor >= (3, 12)


def _before_fork() -> None:
    start = time.monotonic()
    acquired = _gate.acquire(timeout=FORK_WAIT_S)
    _forking.acquired = acquired
    if not acquired:
        log.warning(
            "a fork waited %.0f s for a checkpoint writer to leave the fork gate; forking "
            "anyway (the child may inherit a held lock)",
            time.monotonic() - start,
        )


def _after_fork_in_parent() -> None:
    if getattr(_forking, "acquired", False):
        _forking.acquired = False
        _gate.release()


def _after_fork_in_child() -> None:
    global _gate
    _forking.acquired = False
    gate = threading.RLock()
    for _ in range(getattr(_depth, "value", 0)):  # the forking thread was inside fork_gate()
        gate.acquire()
    _gate = gate


def _register() -> None:
    if hasattr(os, "register_at_fork"):
        os.register_at_fork(
            before=_before_fork,
            after_in_parent=_after_fork_in_parent,
            after_in_child=_after_fork_in_child,
        )


_register()
