"""The collector pause around large saves and loads (core/gcpause.py)."""

import gc
import threading

import pytest

from lightning_elastic.core.gcpause import paused_gc


@pytest.fixture(autouse=True)
def collector_back_on():
    yield
    gc.enable()


def test_paused_inside_restored_after_even_on_error() -> None:
    gc.enable()
    with pytest.raises(RuntimeError), paused_gc():
        assert not gc.isenabled()
        with paused_gc():  # re-entrant
            assert not gc.isenabled()
        assert not gc.isenabled()
        raise RuntimeError("boom")
    assert gc.isenabled()


def test_a_collector_the_user_disabled_stays_disabled() -> None:
    gc.disable()
    with paused_gc():
        pass
    assert not gc.isenabled()


def test_overlapping_threads_restore_it_only_when_the_last_one_leaves() -> None:
    gc.enable()
    inside, leave = threading.Event(), threading.Event()

    def other() -> None:
        with paused_gc():
            inside.set()
            leave.wait(10)

    thread = threading.Thread(target=other)
    with paused_gc():
        thread.start()
        assert inside.wait(10)
    assert not gc.isenabled()  # the other thread is still inside
    leave.set()
    thread.join(10)
    assert gc.isenabled()


def test_a_child_forked_during_another_threads_pause_gets_the_collector_back() -> None:
    """A DataLoader worker forked while the writer builds metadata (found by review)."""
    import os

    gc.enable()
    inside, leave = threading.Event(), threading.Event()

    def writer() -> None:
        with paused_gc():
            inside.set()
            leave.wait(10)

    thread = threading.Thread(target=writer)
    thread.start()
    assert inside.wait(10)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: only this thread exists
        os.write(write, b"1" if gc.isenabled() else b"0")
        with paused_gc():  # and its own pauses work
            pass
        os.write(write, b"1" if gc.isenabled() else b"0")
        os._exit(0)
    os.waitpid(pid, 0)
    assert os.read(read, 2) == b"11"
    leave.set()
    thread.join(10)
    assert gc.isenabled()
