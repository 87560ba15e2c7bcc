"""Helpers for tests that run torchrun agents as nodes."""

from __future__ import annotations

import contextlib
import subprocess
import time
from collections.abc import Callable

import psutil

from tests.hygiene import listens


def wait_for(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def hosting(node: subprocess.Popen, port: int, timeout: float = 120) -> None:
    """Wait until ``node`` (its agent, or a process under it) listens on the rendezvous port,
    so that the agents started after it join its store. A warm-started agent binds the port only
    once its server has imported torch and Lightning, seconds after it starts: after a fixed
    sleep a later node could host the store, and draining that node took the store from the
    others (seen: the host agent failed with RendezvousConnectionError)."""

    def listening() -> bool:
        assert node.poll() is None, "the agent meant to host the rendezvous store exited"
        return listens(psutil.Process(node.pid), port)

    try:
        wait_for(listening, timeout, f"the first agent to listen on port {port}")
    except BaseException:  # called before the caller's try: its workers are sessions of
        kill_tree(node)  # their own, and would outlive the failed test
        raise


def kill_tree(node: subprocess.Popen) -> None:
    """SIGKILL ``node`` and every process under it, and reap it. Nothing is signalled once
    ``node`` was reaped: its pid may name another test's process by now (the suite's pids
    wrap at 32768)."""
    if node.poll() is None:
        with contextlib.suppress(psutil.Error):
            root = psutil.Process(node.pid)
            for proc in [*root.children(recursive=True), root]:
                with contextlib.suppress(psutil.Error):
                    proc.kill()  # (psutil checks that the pid names the same process)
    node.wait()


def stop(agents: list[subprocess.Popen]) -> None:
    """Kill what is still running of ``agents`` (agent and workers) and reap them."""
    for proc in agents:
        kill_tree(proc)
