"""What the warm-start fork server runs (``lightning-elastic run --warm-start``) before it serves
its first fork: it imports the modules named in the ``LIGHTNING_ELASTIC_PRELOAD`` environment
variable, each on its own, and arranges that a signal meant for the agent neither kills the
server nor reaches the workers through it. Importing this module does all of it, so the launcher
does not import it.

A module that fails to import is reported on stderr and left to the workers, which import it
themselves (and fail there, with their own traceback, if it is broken): a preload never takes the
server, and with it every worker start, down.

Signals and sessions, as torchrun has them: torchrun starts each worker with
``start_new_session=True``, so a signal sent to the agent's process group (a shell's Ctrl-C,
``kill -TERM -<pgid>``, a supervisor stopping the agent) reaches the agent alone, and the agent
forwards it to each worker once. A forked worker would otherwise inherit the server's process
group and session, which are the agent's; so each worker forked by this server calls
``setsid()`` first thing in the child (an ``os.register_at_fork`` hook: before any of its Python
code runs) and gets the signal dispositions the server started with. The server itself stays in
the agent's group (a group ``SIGKILL`` still takes it) but ignores the signals the agent handles
(torchelastic's ``TORCHELASTIC_SIGNALS_TO_HANDLE``: SIGTERM, SIGINT, SIGHUP, SIGQUIT), as
multiprocessing's resource tracker does: had it died of one, every worker would have seen its
exit status become 255 and got SIGINT (torch's parent-death signal) in the middle of the agreed
checkpoint. It ends when the agent and every worker have gone (multiprocessing's alive pipe).
"""

from __future__ import annotations

import importlib
import os
import signal
import sys
from collections.abc import Callable
from types import FrameType
from typing import Any

__all__ = [
    "AGENT_ENV",
    "PRELOAD_ENV",
    "SIGNALS_ENV",
    "Disposition",
    "agent_signals",
    "become_server",
    "preload",
]

PRELOAD_ENV = "LIGHTNING_ELASTIC_PRELOAD"  # launcher.PRELOAD_ENV (not imported: see above)
#: the agent's pid: only a process the agent started (its server) becomes a server on import
AGENT_ENV = "LIGHTNING_ELASTIC_WARM_AGENT"  # launcher.AGENT_ENV
#: torchelastic's list of the signals its agent catches and forwards to the workers
SIGNALS_ENV = "TORCHELASTIC_SIGNALS_TO_HANDLE"
_AGENT_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT"  # torch's default for SIGNALS_ENV


def preload(names: str) -> list[str]:
    """Import each of the comma-separated ``names``; the ones that failed."""
    failed = []
    for name in filter(None, (n.strip() for n in names.split(","))):
        try:
            importlib.import_module(name)
        except BaseException as exc:  # a module may even call sys.exit at import
            failed.append(name)
            print(
                f"lightning-elastic run --warm-start: could not preload {name} "
                f"({type(exc).__name__}: {exc}); the workers import it themselves",
                file=sys.stderr,
                flush=True,
            )
    return failed


def agent_signals() -> list[signal.Signals]:
    """The signals torchelastic's agent handles (its environment variable, else its default)."""
    found = []
    for name in os.environ.get(SIGNALS_ENV, _AGENT_SIGNALS).split(","):
        sig = getattr(signal, name.strip(), None)
        if isinstance(sig, signal.Signals):
            found.append(sig)
    return found


#: what ``signal.signal`` takes and returns (``None``: a handler not set from Python)
Disposition = Callable[[int, FrameType | None], Any] | int | None


def become_server(signals: list[signal.Signals]) -> dict[int, Disposition]:
    """Ignore ``signals`` in this process (the server) and make each child it forks a session
    of its own with the dispositions this process had; the dispositions replaced."""
    server = os.getpid()
    started: dict[int, Disposition] = {
        int(sig): signal.signal(sig, signal.SIG_IGN) for sig in signals
    }

    def in_child() -> None:
        if os.getppid() != server:
            return  # forked by a worker (a DataLoader's worker): it stays in that worker's group
        os.setsid()
        for signum, disposition in started.items():
            # SIGINT is also put back by multiprocessing (to what the server had before it
            # ignored it): both the same, the disposition the interpreter started with
            if disposition is not None:
                signal.signal(signum, disposition)

    os.register_at_fork(after_in_child=in_child)
    return started


def _serve() -> None:
    started = become_server(agent_signals())
    preload(os.environ.get(PRELOAD_ENV, ""))
    # multiprocessing's server loop ignores SIGINT itself, after saving the disposition it finds
    # as the one its children get back: give it the original one
    disposition = started.get(signal.SIGINT)
    if disposition is not None:
        signal.signal(signal.SIGINT, disposition)


if os.environ.get(AGENT_ENV) == str(os.getppid()):
    _serve()
