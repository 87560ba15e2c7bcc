"""The fork gate (core/forksafe.py): forks wait for the writer's gated units, children get a
fresh gate, saves start no threads and import nothing on the writer thread."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from lightning_elastic import CheckpointEngine, KeepLastN
from lightning_elastic.core import forksafe
from lightning_elastic.core.forksafe import (
    fork_gate,
    fork_safe_logger,
    holds_fork_gate,
    python_fork_hang_fixed,
)

pytestmark = [
    pytest.mark.timeout(60),
    pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork"),
    # Python >= 3.12 warns when a process with threads forks: that is the situation tested
    pytest.mark.filterwarnings("ignore:.*fork.*:DeprecationWarning"),
]

WRITER = "lightning-elastic-writer"


def fork(child: Callable[[], bool]) -> int:
    """Fork; the child exits 0 when ``child()`` returns true, 1 otherwise (or on an error)."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover (the child)
        code = 1
        try:
            code = 0 if child() else 1
        finally:
            os._exit(code)
    return pid


def exit_code(pid: int, timeout: float = 10.0) -> int:
    """The child's exit code; a child still running after ``timeout`` is killed (a hang)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.005)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    raise AssertionError(f"child {pid} hung for {timeout} s")


def gate_free_for_another_thread(timeout: float = 2.0) -> bool:
    """Whether a new thread can enter the gate within ``timeout`` seconds."""
    entered = threading.Event()

    def enter() -> None:
        with fork_gate():
            entered.set()

    threading.Thread(target=enter, daemon=True).start()
    return entered.wait(timeout)


def hold_gate(seconds: float) -> tuple[threading.Thread, threading.Event, list[float]]:
    """A thread inside the gate for ``seconds``; ``left`` gets the moment it leaves."""
    inside = threading.Event()
    left: list[float] = []

    def hold() -> None:
        with fork_gate():
            inside.set()
            time.sleep(seconds)
            left.append(time.monotonic())

    thread = threading.Thread(target=hold, daemon=True)
    thread.start()
    assert inside.wait(5)
    return thread, inside, left


# ------------------------------------------------------------------ the gate


def test_a_fork_waits_until_another_thread_leaves_the_gate() -> None:
    thread, _, left = hold_gate(0.3)
    pid = fork(lambda: True)
    forked = time.monotonic()
    thread.join(5)
    assert left and forked >= left[0]  # an ungated fork returns in a millisecond
    assert exit_code(pid) == 0


def test_the_forked_child_gets_a_fresh_gate_that_any_of_its_threads_can_enter() -> None:
    pid = fork(lambda: not holds_fork_gate() and gate_free_for_another_thread())
    assert exit_code(pid) == 0
    assert gate_free_for_another_thread()  # and the parent's gate was released after the fork


def test_a_fork_inside_the_gate_on_the_same_thread_neither_deadlocks_nor_breaks_the_gate() -> None:
    in_child = False
    try:
        with fork_gate(), fork_gate():  # re-entrant, as a synchronous save's nested units
            pid = os.fork()
            in_child = pid == 0
            # the child is still inside both blocks, as the forking thread was
            inside = in_child and holds_fork_gate() and not gate_free_for_another_thread(0.2)
        if in_child:  # pragma: no cover (the child): leaving them released its new gate
            left = not holds_fork_gate() and gate_free_for_another_thread()
            os._exit(0 if inside and left else 1)
    except BaseException:
        if in_child:  # pragma: no cover
            os._exit(1)
        raise
    assert exit_code(pid) == 0
    assert not holds_fork_gate() and gate_free_for_another_thread()


def test_a_fork_that_waits_too_long_for_the_gate_forks_anyway_and_says_so(
    monkeypatch, caplog
) -> None:
    monkeypatch.setattr(forksafe, "FORK_WAIT_S", 0.1)
    thread, _, _ = hold_gate(1.0)
    with caplog.at_level(logging.WARNING, logger=forksafe.__name__):
        start = time.monotonic()
        pid = fork(lambda: True)
        waited = time.monotonic() - start
    assert exit_code(pid) == 0
    assert 0.1 <= waited < 0.9
    assert "forking anyway" in caplog.text
    thread.join(5)
    assert gate_free_for_another_thread()  # nothing released twice or left held


def test_records_of_a_fork_safe_logger_are_handled_inside_the_gate() -> None:
    logger = fork_safe_logger("lightning_elastic.tests.forksafe")
    assert fork_safe_logger(logger.name) is logger is logging.getLogger(logger.name)
    seen: list[tuple[str, int, bool]] = []

    class Spy(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append((record.funcName, record.lineno, holds_fork_gate()))

    spy = Spy()
    logger.addHandler(spy)
    logger.setLevel(logging.INFO)
    try:
        logger.info("hello")
        line = sys._getframe().f_lineno - 1
    finally:
        logger.removeHandler(spy)
    # the record still names its caller, not the gate
    assert seen == [("test_records_of_a_fork_safe_logger_are_handled_inside_the_gate", line, True)]


# ------------------------------------------------------------------ with the engine


def engine(root: Path, **options: object) -> CheckpointEngine:
    return CheckpointEngine(root, retention=[KeepLastN(1)], **options)  # type: ignore[arg-type]


def test_a_fork_waits_while_the_writer_writes_a_log_record(tmp_path: Path) -> None:
    emitting, go = threading.Event(), threading.Event()
    released: list[float] = []

    class SlowStream(logging.Handler):
        """Stands for a stream whose lock the writer holds while it writes."""

        def emit(self, record: logging.LogRecord) -> None:
            if threading.current_thread().name.startswith(WRITER) and not emitting.is_set():
                emitting.set()
                go.wait(5)
                released.append(time.monotonic())

    handler = SlowStream()
    package = logging.getLogger("lightning_elastic")
    package.addHandler(handler)
    old_level = package.level
    package.setLevel(logging.INFO)
    try:
        with engine(tmp_path) as eng:
            state = {"w": torch.ones(1000)}
            eng.save(state, step=1).result()
            handle = eng.save(state, step=2)  # its retention deletes step 1: a record
            assert handle is not None and emitting.wait(10)
            threading.Timer(0.3, go.set).start()
            pid = fork(lambda: True)
            forked = time.monotonic()
            handle.result()
    finally:
        package.removeHandler(handler)
        package.setLevel(old_level)
    assert exit_code(pid) == 0
    assert released and forked >= released[0]


def test_forks_during_synchronous_and_asynchronous_saves_never_hang(tmp_path: Path, caplog) -> None:
    stop = threading.Event()
    codes: list[int] = []

    def fork_in_a_loop() -> None:
        while not stop.is_set():
            codes.append(exit_code(fork(lambda: gate_free_for_another_thread())))

    caplog.set_level(logging.INFO, logger="lightning_elastic")
    forker = threading.Thread(target=fork_in_a_loop, daemon=True)
    forker.start()
    try:
        state = {"w": torch.randn(1 << 16)}
        with engine(tmp_path / "sync", async_save=False) as eng:  # units on the main thread
            for step in range(1, 6):
                eng.save(state, step=step)
        with engine(tmp_path / "async") as eng:
            for step in range(1, 6):
                eng.save(state, step=step).result()
    finally:
        stop.set()
        forker.join(20)
    assert not forker.is_alive()
    assert codes and set(codes) == {0}
    assert "retention: deleting" in caplog.text  # gated records were written meanwhile


def _os_threads() -> int:
    return len(os.listdir("/proc/self/task"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="needs /proc")
def test_saves_start_and_end_no_threads(tmp_path: Path) -> None:
    """Starting or ending a thread takes the interpreter's HEAD_LOCK (gh-112275): the
    writer is one thread per engine, never one per save."""
    with engine(tmp_path) as eng:
        state = {"w": torch.randn(1 << 16)}
        eng.save(state, step=1).result()
        before = (threading.active_count(), _os_threads())
        writers = {t.ident for t in threading.enumerate() if t.name.startswith(WRITER)}
        for step in range(2, 7):
            eng.save(state, step=step).result()
            assert (threading.active_count(), _os_threads()) == before
        assert {t.ident for t in threading.enumerate() if t.name.startswith(WRITER)} == writers


def test_nothing_is_imported_on_the_writer_thread(tmp_path: Path) -> None:
    """A thread importing a module holds its import lock; a forked child that imports the
    same module would wait for ever. The first saves import nothing in the writer."""
    script = textwrap.dedent(
        """
        import sys, threading
        import torch
        from lightning_elastic import CheckpointEngine, KeepLastN

        imports = []

        def audit(event, args):
            if event == "import":
                imports.append((threading.current_thread().name, args[0]))

        engine = CheckpointEngine(sys.argv[1], retention=[KeepLastN(1)], compression="zstd")
        sys.addaudithook(audit)
        for step in (1, 2, 3):
            engine.save({"w": torch.randn(100), "obj": {"k": step}}, step=step).result()
        engine.close()
        print([module for thread, module in imports if thread.startswith("lightning-elastic")])
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout + out.stderr


# ------------------------------------------------------------------ the Python versions


@pytest.mark.parametrize(
    ("version", "implementation", "fixed"),
    [
        ((3, 11, 7), "cpython", False),
        ((3, 11, 9), "cpython", False),
        ((3, 11, 10), "cpython", True),
        ((3, 10, 14), "cpython", False),
        ((3, 10, 15), "cpython", True),
        ((3, 9, 19), "cpython", False),
        ((3, 12, 0), "cpython", True),
        ((3, 13, 1), "cpython", True),
        ((3, 11, 7), "pypy", True),
    ],
)
def test_which_pythons_have_the_fork_hang_fixed(version, implementation, fixed) -> None:
    assert python_fork_hang_fixed(version, implementation) is fixed
