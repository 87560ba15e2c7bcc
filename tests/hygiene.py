"""What one test can leave in the pytest process for the tests after it."""

from __future__ import annotations

import contextlib
import itertools
import os
import random
import socket
from pathlib import Path

import psutil

# what Lightning's in-process fits leave in os.environ (_init_dist_connection writes
# MASTER_ADDR/MASTER_PORT and nothing removes them): a later test's child processes inherited
# the port of a store still open in this process and failed with EADDRINUSE
DIST_ENV = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK")


def job_environ() -> dict[str, str]:
    """This process's environment for a child that is a job of its own: without this
    process's torch.distributed variables."""
    return {k: v for k, v in os.environ.items() if k not in DIST_ENV}


def free_port() -> int:
    """A port for a server a child process will open later (a rendezvous store, an agent):
    free now, below the kernel's ephemeral range, so no connection this machine opens in the
    meantime is given it (a port the OS picked with ``bind(0)`` is in that range, and any
    client's connect could take it before the child binds it); each pytest-xdist worker draws
    from a range of its own and walks it, so neither two workers nor two calls in a row hand
    out the same port."""
    low = _EPHEMERAL_LOW
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    index = int(worker[2:]) if worker[2:].isdigit() else 0
    span = 1000
    start = 20000 + (index % 10) * span
    if start + span > low:  # an ephemeral range that starts unusually low: the OS's pick
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return int(s.getsockname()[1])
    for _ in range(span):
        port = start + next(_walk) % span
        with contextlib.suppress(OSError), socket.socket() as s:
            s.bind(("127.0.0.1", port))
            return port
    raise RuntimeError(f"no free port in {start}-{start + span - 1}")


def listens(root: psutil.Process, port: int) -> bool:
    """Whether ``root`` or a process under it listens on TCP ``port`` (a process that exits
    meanwhile counts as not listening)."""
    for proc in [root, *root.children(recursive=True)]:
        with contextlib.suppress(psutil.Error):
            for conn in proc.net_connections("tcp"):
                if conn.status == psutil.CONN_LISTEN and conn.laddr.port == port:
                    return True
    return False


def _ephemeral_low() -> int:
    with contextlib.suppress(OSError, ValueError):
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    return 32768


_EPHEMERAL_LOW = _ephemeral_low()
_walk = itertools.count(random.randrange(1000))
