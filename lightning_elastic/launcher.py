"""``lightning-elastic run``: torchrun, except that a planned membership change does not use up
the failure budget.

With plain torchrun, draining a node (SIGTERM to its agent) makes every worker take the
agreed checkpoint and exit ``143``; the surviving agents see their workers *fail* and spend
one of ``--max-restarts`` on the restart, so a job drained N times dies although nothing
failed. This launcher is torchrun (same arguments, same elastic agent, same c10d rendezvous)
with one main difference: a worker group whose failed workers all left a planned-exit marker (see
:mod:`lightning_elastic.core.elastic.planned_exit`; ``DistributedCheckpoint`` writes it right
before exiting after the agreed checkpoint, with the exit code it is about to use) is restarted
without counting a failure. Anything else (a crash, a SIGKILL, an exit code that does not match
the marker) counts as before. Two smaller ones: the workers learn their rendezvous round
(``LIGHTNING_ELASTIC_WORKER_GENERATION``, under which our strategies keep their process group's
keys in the agent's store), and a job that may run on several nodes gets
``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` unless it is set (torch's shared store ends the job
at the first rejoin: see :func:`_store_environment`).

With ``--warm-start`` the workers are forked from a server process that imported torch,
Lightning and this package once (Python's ``forkserver``, started by the agent before its first
rendezvous), instead of each starting a fresh interpreter and importing them again: a restart
of the worker group after a membership change then costs a fork, not seconds of imports (see
docs/elastic.md for the measured difference). ``--preload MOD,...`` adds modules to import
there (e.g. the model's own package). The script runs as ``python train.py`` would run it
(``__name__ == "__main__"``, ``sys.argv``, its folder first on ``sys.path``, exit handlers at
the end, a ``KeyboardInterrupt`` ends it by SIGINT), with two differences a script may notice:
modules imported by the server were imported before the worker's environment (``RANK``,
``LOCAL_RANK``...) was set, so a module that reads such a variable at import time sees the
agent's value; and ``stdin`` is ``/dev/null``. Not with ``--no-python`` or ``-m``. The agent
joins its first rendezvous only once the server has imported them (a joining node does not stop
the running group to wait for its imports). Signals are as with torchrun: each worker is a
session of its own, so a signal to the agent's process group reaches the agent alone, which
forwards it to each worker once; the server ignores the signals the agent forwards (see
:mod:`lightning_elastic._preload`).

Usage: ``lightning-elastic run [--warm-start] [--preload MODS] [torchrun arguments] train.py
[script arguments]``.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import logging
import multiprocessing
import multiprocessing.forkserver
import os
import runpy
import signal
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from types import TracebackType
from typing import Any

from torch.distributed.elastic.agent.server.api import WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

from lightning_elastic.core._compat import (
    elastic_agent_class,
    give_back_restart,
    rendezvous_round,
    run_exit_handlers,
    torchrun_entry,
    torchrun_script_runner,
)
from lightning_elastic.core.elastic.planned_exit import (
    PLANNED_EXIT_ENV,
    WORKER_GENERATION_ENV,
    read_planned_exit,
)
from lightning_elastic.errors import WarmStartError

__all__ = [
    "AGENT_ENV",
    "PRELOAD",
    "PRELOAD_ENV",
    "UNSHARED_STORE_ENV",
    "PlannedExitAgent",
    "WarmServer",
    "main",
    "run_script",
]

log = logging.getLogger(__name__)

#: the environment variable that tells lightning_elastic._preload what to import
PRELOAD_ENV = "LIGHTNING_ELASTIC_PRELOAD"
#: set to the agent's pid for its fork server (``lightning_elastic._preload`` reads it)
AGENT_ENV = "LIGHTNING_ELASTIC_WARM_AGENT"
#: what ``--warm-start`` imports once in the fork server (those installed)
PRELOAD = ("torch", "lightning.pytorch", "lightning_elastic.lightning")
#: torch's switch from one store for the rendezvous and every round's workers (its default) to
#: a store of each worker group's own, hosted by its rank 0
UNSHARED_STORE_ENV = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"


class PlannedExitAgent(LocalElasticAgent):
    """torch's local elastic agent, counting a worker group that exited after an agreed
    checkpoint as a membership change (a restart that keeps the failure budget)."""

    def _monitor_workers(self, worker_group: Any) -> Any:
        result = super()._monitor_workers(worker_group)
        if result.state in (WorkerState.FAILED, WorkerState.UNHEALTHY) and self._planned(result):
            # the agent's loop spends one restart on a failed group: give it back
            left = give_back_restart(self)
            log.warning(
                "worker group left after an agreed checkpoint (planned exit of ranks %s): "
                "restarting without counting a failure (%d restarts left)",
                sorted(result.failures),
                left - 1,
            )
        return result

    def _start_workers(self, worker_group: Any) -> Any:
        """Start the workers knowing the rendezvous round: our strategies keep their process
        group's keys under it in the agent's store, which outlives the workers (a restarted
        rank read a dead rank's address there: gloo's ``connectFullMesh ... Connection
        refused``). A restart after a planned exit keeps ``TORCHELASTIC_RESTART_COUNT``; the
        round always moves."""
        round_ = rendezvous_round(worker_group.spec.rdzv_handler)
        if round_ is not None:
            os.environ[WORKER_GENERATION_ENV] = str(round_)
        return super()._start_workers(worker_group)

    @staticmethod
    def _planned(result: Any) -> bool:
        folder = os.environ.get(PLANNED_EXIT_ENV)
        if not folder or not result.failures:
            return False
        for failure in result.failures.values():
            marker = read_planned_exit(folder, failure.pid)
            if marker is None or marker.get("exitcode") != failure.exitcode:
                return False
        return True


def run_script(script: str, *args: str) -> None:
    """Run ``script`` in this (forked, warm) worker as ``python script args`` would: as
    ``__main__``, with ``sys.argv`` and ``sys.path[0]`` set as the interpreter sets them, and
    the exit handlers run at the end (a multiprocessing child leaves through ``os._exit``,
    which skips them: loggers would not flush). ``sys.exit()``/``sys.exit(0)`` end it as a
    success: torch's worker wrapper counts only ``SystemExit(0)`` as one, and a worker that
    exits 0 without returning leaves the agent waiting for its result forever (which is also
    why a script must not leave through ``os._exit(0)`` under a warm start). A
    ``KeyboardInterrupt`` (Ctrl-C, SIGINT) that the script lets out ends the process as it
    ends the interpreter: the traceback, the exit handlers, then death by SIGINT (torch's
    worker wrapper would take it for a success and leave the agent waiting for ever)."""
    sys.argv = [script, *args]
    # multiprocessing made "forkserver" this process's start method (it starts every child
    # with its parent's); the script gets the interpreter's default, as under torchrun (a
    # DataLoader's workers would otherwise start through a server of their own, importing the
    # script again: without a __main__ guard it fails)
    multiprocessing.set_start_method(None, force=True)
    folder = os.path.dirname(os.path.realpath(script))
    if sys.path and sys.path[0] != folder:
        sys.path.insert(0, folder)
    interrupted = False
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:
        if exc.code not in (None, 0):
            raise
    except KeyboardInterrupt as exc:
        interrupted = True
        exc = exc.with_traceback(_from_script(exc.__traceback__))  # what excepthook prints
        sys.excepthook(type(exc), exc, exc.__traceback__)
    finally:
        run_exit_handlers()
    if interrupted:
        _exit_by_sigint()


def _from_script(tb: TracebackType | None) -> TracebackType | None:
    """``tb`` without its frames of this module and runpy: the traceback starts in the script,
    as the interpreter's does."""
    ours = (__file__, runpy.__file__, "<frozen runpy>")
    while tb is not None and tb.tb_next is not None and tb.tb_frame.f_code.co_filename in ours:
        tb = tb.tb_next
    return tb


def _exit_by_sigint() -> None:
    """End this process as CPython ends after an uncaught ``KeyboardInterrupt``: killed by
    SIGINT (the parent sees the signal; ``exit_sigint`` in CPython's Modules/main.c)."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGINT)
    os._exit(128 + signal.SIGINT)  # as CPython, in case the signal did not end it


def _installed(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # a dotted name whose package is missing, or ""
        return False


def _parser() -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = torchrun_entry()[0]
    parser.prog = "lightning-elastic run"
    ours = parser.add_argument_group("lightning-elastic")
    ours.add_argument(
        "--warm-start",
        action="store_true",
        help="fork the workers from a process that imported torch, Lightning and "
        "lightning_elastic once, instead of starting a fresh interpreter per worker and restart",
    )
    ours.add_argument(
        "--preload",
        default="",
        metavar="MODULES",
        help="comma-separated modules the warm-start server also imports (implies --warm-start)",
    )
    return parser


class WarmServer:
    """The fork server of a warm start: started before the agent, importing ``modules``;
    :meth:`wait` returns once they are imported (the agent starts, and joins, only then)."""

    def __init__(self, modules: Sequence[str]) -> None:
        self.modules = list(modules)
        self._started = 0.0
        self._ready = False

    def start(self) -> None:
        """Start the server; it imports the modules while this process goes on (the server's
        environment is this process's, which :func:`main` keeps for the whole run: a server
        that multiprocessing starts again, after this one died, sets itself up the same way)."""
        # the server imports them through lightning_elastic._preload, which reports a module
        # that fails to import instead of letting it take the server down
        multiprocessing.set_forkserver_preload(["lightning_elastic._preload"])
        self._started = time.monotonic()
        multiprocessing.forkserver.ensure_running()

    def wait(self) -> float:
        """Block until the server has imported its modules (it forks only then: a no-op child,
        forked and reaped); the seconds waited, 0 once it was ready.

        Raises:
            WarmStartError: the server died first (its own output, above, may say why).
        """
        if self._ready:
            return 0.0
        began = time.monotonic()
        try:
            probe = multiprocessing.get_context("forkserver").Process(
                target=os.getpid, name="warm-start-probe", daemon=True
            )
            probe.start()
            probe.join()
        except Exception as exc:
            how = _server_status() or f" ({exc!r})"
            raise WarmStartError(
                f"--warm-start: the fork server died while importing {', '.join(self.modules)}"
                f"{how}. A module that ends the interpreter when imported (os._exit, a crash in "
                "an extension) cannot be preloaded: leave it out of --preload, or run without "
                "--warm-start to see the workers fail on it"
            ) from exc
        self._ready = True
        now = time.monotonic()
        log.info(
            "warm start: the server imported %s in %.2f s; this agent waited %.2f s for it "
            "before joining the rendezvous",
            ", ".join(self.modules),
            now - self._started,
            now - began,
        )
        return now - began


def _server_status() -> str:
    """How the fork server this process started ended (``": exit code 3"``, ``": killed by
    SIGSEGV"``), or ``""`` when that cannot be told (multiprocessing keeps its pid privately:
    ``ForkServer._forkserver_pid``, Python 3.9 - 3.13)."""
    server = getattr(multiprocessing.forkserver, "_forkserver", None)
    pid = getattr(server, "_forkserver_pid", None)
    if not isinstance(pid, int):
        return ""
    for _ in range(50):  # its socket closes a moment before it can be reaped
        try:
            done, status = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            return ""
        if done:
            break
        time.sleep(0.02)
    else:
        return ""
    if os.WIFSIGNALED(status):
        return f": killed by {signal.Signals(os.WTERMSIG(status)).name}"
    return f": exit code {os.waitstatus_to_exitcode(status)}"


def _warm_start(args: argparse.Namespace) -> tuple[WarmServer, dict[str, str]]:
    """Turn ``args`` into a warm start (torchrun's ``--run-path`` with the forkserver start
    method); the server to start and the environment it needs (kept for the whole run)."""
    if args.no_python or args.module:
        raise ValueError("--warm-start runs a Python script file: not with --no-python or -m")
    extra = [m.strip() for m in args.preload.split(",") if m.strip()]
    for name in extra:
        if not _installed(name):
            raise ValueError(f"--preload: no module named {name!r} in this environment")
    modules = [m for m in PRELOAD if _installed(m.split(".")[0])] + extra
    args.run_path = True
    args.start_method = "forkserver"
    # torchrun sets OMP_NUM_THREADS for the workers when it builds its config; the server must
    # see it before it imports torch (OpenMP reads it when the library loads)
    torchrun_entry()[1](argparse.Namespace(**vars(args)))
    env = {
        "PYTHONUNBUFFERED": "1",  # what torchrun's `python -u` gives the workers
        PRELOAD_ENV: ",".join(modules),
        AGENT_ENV: str(os.getpid()),  # the server is the child that sees its parent's pid here
    }
    return WarmServer(modules), env


def _store_environment(args: argparse.Namespace) -> dict[str, str]:
    """``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` for a job that may run on more than one node,
    unless it is set already: with torch's shared store, a node that joins after the first
    round waits for a master address nobody writes (pytorch/pytorch#135712), and the nodes
    already running time out waiting for it (seen with torch 2.13: a drained or lost node came
    back, and the whole job ended, every agent with ``DistStoreError: wait timeout``)."""
    if UNSHARED_STORE_ENV in os.environ or args.standalone:
        return {}
    try:
        most = int(str(args.nnodes).split(":")[-1])
    except ValueError:
        return {}  # torchrun refuses it
    return {UNSHARED_STORE_ENV: "1"} if most > 1 else {}


def main(argv: Sequence[str] | None = None) -> int:
    """Run torchrun's command line ``argv`` with :class:`PlannedExitAgent`; the exit code is
    0, 1 when the job failed, 2 for a bad option (a one-line error)."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    run = torchrun_entry()[2]
    args = _parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    with (
        tempfile.TemporaryDirectory(prefix="lightning-elastic-exits-") as folder,
        _environ(**{PLANNED_EXIT_ENV: folder}),  # the workers inherit the agent's environment
        _environ(**_store_environment(args)),
        contextlib.ExitStack() as stack,
    ):
        try:
            runner: contextlib.AbstractContextManager[None] = contextlib.nullcontext()
            if args.warm_start or args.preload:
                server, env = _warm_start(args)
                stack.enter_context(_environ(**env))  # after PLANNED_EXIT_ENV: passed on too
                server.start()
                # the agent joins its first rendezvous only once the server has imported its
                # modules: a joining node stops the running group only when its workers can
                # start at once (its imports overlap the group's training instead of holding
                # the new group back); and a server that died fails this node before it has
                # touched the rendezvous (an agent that fails closes it for every node)
                server.wait()
                runner = torchrun_script_runner(run_script)
            with elastic_agent_class(PlannedExitAgent), runner:
                run(args)
        except ChildFailedError as exc:
            print(f"error: the job failed:\n{exc}", file=sys.stderr)
            return 1
        except WarmStartError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
        except ValueError as exc:  # a bad rendezvous option (found when the agent starts) or ours
            print(f"error: {exc}", file=sys.stderr)
            return 2
    return 0


@contextlib.contextmanager
def _environ(**values: str) -> Iterator[None]:
    """Within the block, ``os.environ`` holds ``values``; as before after it."""
    saved = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
