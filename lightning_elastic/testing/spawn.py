"""Run a function on N ranks (gloo, CPU) in fresh processes, with a hard timeout.

Processes come from a forkserver that has already imported torch and Lightning (when it is
installed), so a rank starts in a fraction of a second instead of paying their imports (torch
about 2 s, Lightning about 5 s of CPU per rank; the forkserver pays them once per process).
The parent owns the rendezvous ``TCPStore`` (on a port the OS picks, so there are no port
races) and can read it. A rank that hangs is made to dump its threads' stacks (faulthandler)
and is killed, with every process it started (a process group per rank).

``fn`` must be importable by reference (a module-level function); its result is pickled.
"""

from __future__ import annotations

import contextlib
import faulthandler
import multiprocessing as mp
import os
import pickle
import queue
import signal
import sys
import time
import traceback
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from lightning_elastic.core._compat import tcp_store_class

__all__ = ["RankError", "WorkerFailure", "WorkerTimeout", "run_distributed"]

# A module that cannot be imported is skipped by the forkserver (a core-only install).
_PRELOAD = [
    "torch",
    "torch.distributed",
    "torch.distributed.checkpoint",
    "lightning_elastic",
    "lightning.pytorch",
    "lightning_elastic.lightning",
]
_context: Any = None


def _mp_context() -> Any:
    global _context
    if _context is None:
        _context = mp.get_context("forkserver")
        extra = [m for m in os.environ.get("LE_PRELOAD", "").split(",") if m]
        _context.set_forkserver_preload(_PRELOAD + extra)
    return _context


@dataclass(frozen=True)
class RankError:
    """An exception raised on one rank: its type, message, traceback and the object itself."""

    rank: int
    type_name: str
    message: str
    traceback: str
    exception: BaseException | None


class WorkerFailure(AssertionError):
    """One or more ranks raised, or exited without a result."""

    def __init__(self, errors: Mapping[int, RankError | str]) -> None:
        self.errors = dict(errors)
        parts = []
        for rank in sorted(self.errors):
            err = self.errors[rank]
            parts.append(
                f"--- rank {rank}:\n{err.traceback if isinstance(err, RankError) else err}"
            )
        super().__init__("distributed run failed\n" + "\n".join(parts))


class WorkerTimeout(WorkerFailure):
    """Some ranks did not finish within the timeout (their stacks went to stderr)."""


def _worker(
    rank: int,
    world_size: int,
    port: int,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    env: Mapping[str, str],
    results: Any,
    pg_timeout_s: float,
) -> None:
    faulthandler.register(signal.SIGUSR2, all_threads=True)
    # a process group of its own: the parent ends the rank with whatever it started (a
    # DataLoader's workers from a forkserver are that server's children, and the server and
    # its children keep each other alive once the rank is gone)
    os.setpgid(0, 0)
    os.environ.update(env)
    os.environ.update(
        {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_WORLD_SIZE": str(world_size),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
        }
    )
    import torch.distributed as dist

    TCPStore = tcp_store_class()
    payload: tuple[str, Any]
    try:
        store = TCPStore(
            "127.0.0.1", port, world_size, is_master=False, timeout=timedelta(seconds=60)
        )
        dist.init_process_group(
            "gloo",
            store=store,
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=pg_timeout_s),
        )
        value = fn(*args, **kwargs)
        payload = ("ok", pickle.dumps(value))
    except BaseException as exc:
        try:
            blob: bytes | None = pickle.dumps(exc)
        except Exception:
            blob = None
        payload = ("error", (type(exc).__name__, str(exc), traceback.format_exc(), blob))
    results.put((rank, payload))
    results.close()
    results.join_thread()
    sys.stdout.flush()
    sys.stderr.flush()
    # No process-group teardown: a peer may be dead (fault tests), and exiting without it
    # cannot hang; background threads must not keep the rank alive either.
    os._exit(0)


def _kill_leftovers(rank: Any) -> None:
    """SIGKILL what the ended ``rank`` started and left behind in its process group. A rank
    already reaped frees its pid: once its group is empty too, another process may take that
    pid and lead a group of its own (a rank of another test calls ``setpgid``, a torchrun
    worker ``setsid``); the suite's pids wrap (``pid_max`` 32768), so a pid that names a live
    process again names that process's group, not ours, and is left alone (Linux reuses no
    pid while a process group of that id exists)."""
    if rank.exitcode is not None:  # reaped
        try:
            os.kill(rank.pid, 0)
        except ProcessLookupError:
            pass  # no such process: a group of that id can only be the rank's
        except OSError:
            return
        else:
            return  # the pid is another process's now
    with contextlib.suppress(OSError):
        os.killpg(rank.pid, signal.SIGKILL)


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 120.0,
    env: Mapping[str, str] | None = None,
    may_die: Collection[int] = (),
    pg_timeout: float = 60.0,
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` ranks; return the per-rank results.

    Ranks in ``may_die`` may exit without a result (e.g. a test SIGKILLs them); their result
    is ``None``. Any other rank raising or vanishing raises :class:`WorkerFailure` with
    every rank's traceback; not finishing within ``timeout`` raises :class:`WorkerTimeout`.
    """
    TCPStore = tcp_store_class()
    ctx = _mp_context()
    server = TCPStore(
        "127.0.0.1",
        0,
        world_size,
        is_master=True,
        wait_for_workers=False,
        timeout=timedelta(seconds=60),
    )
    results = ctx.Queue()
    procs = [
        ctx.Process(
            target=_worker,
            args=(
                r,
                world_size,
                server.port,
                fn,
                args,
                kwargs,
                dict(env or {}),
                results,
                pg_timeout,
            ),
            name=f"rank{r}",
        )
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    outcome: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            _drain(results, outcome, 0.1)
            pending = [r for r in range(world_size) if r not in outcome]
            if not pending:
                break
            gone = [r for r in pending if not procs[r].is_alive()]
            if gone:
                _drain(results, outcome, 0.5)  # a rank may have exited right after its put
                gone = [r for r in gone if r not in outcome]
                if len(gone) == len(pending) or any(r not in may_die for r in gone):
                    break  # everyone is done, or an unexpected death: stop waiting
        alive = [r for r in range(world_size) if r not in outcome and procs[r].is_alive()]
        timed_out = time.monotonic() >= deadline
        for r in alive:
            os.kill(procs[r].pid, signal.SIGUSR2)  # dump stacks
        if alive:
            time.sleep(0.5)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(5)
            _kill_leftovers(p)
        results.close()
        del server
    errors: dict[int, RankError | str] = {}
    values: list[Any] = [None] * world_size
    for r in range(world_size):
        if r in alive:
            errors[r] = (
                f"still running after {timeout}s (stacks on stderr)"
                if timed_out
                else "killed: another rank exited unexpectedly"
            )
            continue
        if r not in outcome:
            if r not in may_die:
                errors[r] = f"exited with code {procs[r].exitcode} without a result"
            continue
        status, body = outcome[r]
        if status == "ok":
            values[r] = pickle.loads(body)
        else:
            type_name, message, tb, blob = body
            exc = None
            if blob is not None:
                try:
                    exc = pickle.loads(blob)
                except Exception:
                    exc = None
            errors[r] = RankError(r, type_name, message, tb, exc)
    if errors:
        raise WorkerTimeout(errors) if timed_out and alive else WorkerFailure(errors)
    return values


def _drain(results: Any, outcome: dict[int, Any], wait: float) -> None:
    end = time.monotonic() + wait
    while True:
        try:
            rank, payload = results.get(timeout=max(0.0, min(0.05, end - time.monotonic())))
            outcome[rank] = payload
        except queue.Empty:
            if time.monotonic() >= end:
                return
