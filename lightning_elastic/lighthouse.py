"""``lightning-elastic lighthouse``: torchft's Lighthouse in the foreground, for replica groups
(``strategy="elastic_ft"``).

The Lighthouse decides, at every optimizer step, which replica groups take part (the quorum):
it is torchft's own server, started here with the options that matter and stopped cleanly on
SIGTERM or Ctrl-C; it holds no training state (a restarted Lighthouse knows no group, and the
groups' next quorum requests repopulate it). Give its address to every group
(``$LIGHTNING_ELASTIC_LIGHTHOUSE`` or ``ElasticFTStrategy(lighthouse=...)``).

Options:
  --bind HOST:PORT            where to listen (default ``[::]:29510``)
  --min-replica-groups N      the fewest groups a quorum may have (default 1)
  --heartbeat-timeout S       a group that sent no heartbeat for this long is out (default 1.0);
                              groups heartbeat every 0.1 s from a thread of their own
  --join-timeout S            after a change, how long to wait for every live group to ask for
                              the next quorum before forming it without the late ones (0.5)
  --quorum-tick S             how often a pending quorum is reconsidered (0.05)
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from collections.abc import Sequence
from typing import Any

from lightning_elastic.errors import ConfigError

__all__ = ["main"]

EXIT_USAGE = 2


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lightning-elastic lighthouse",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--bind", default="[::]:29510", metavar="HOST:PORT")
    parser.add_argument("--min-replica-groups", type=int, default=1, metavar="N")
    parser.add_argument("--heartbeat-timeout", type=float, default=1.0, metavar="S")
    parser.add_argument("--join-timeout", type=float, default=0.5, metavar="S")
    parser.add_argument("--quorum-tick", type=float, default=0.05, metavar="S")
    return parser


def _milliseconds(seconds: float, name: str) -> int:
    if not (seconds > 0) or seconds > 86400:
        raise ConfigError(f"{name} must be a number of seconds in (0, 86400], got {seconds}")
    return max(1, round(seconds * 1000))


def _check_bind(bind: str) -> str:
    host, sep, port = bind.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ConfigError(f"--bind must be HOST:PORT (e.g. [::]:29510), got {bind!r}")
    return bind


def serve(args: argparse.Namespace, *, ready: Any = None) -> int:
    """Start the Lighthouse, print its address, serve until SIGTERM/SIGINT (or until
    ``ready`` — a ``threading.Event`` for tests — is set), then shut it down."""
    stop = ready if ready is not None else threading.Event()
    previous = {}
    if ready is None:  # before the imports: a SIGTERM during them stops cleanly too
        for signum in (signal.SIGTERM, signal.SIGINT):
            previous[signum] = signal.signal(signum, lambda *_: stop.set())
    try:
        _serve(args, stop)
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    print("lighthouse: stopped", flush=True)
    return 0


def _serve(args: argparse.Namespace, stop: threading.Event) -> None:
    from lightning_elastic.core.replicas import _compat as ft

    if args.min_replica_groups < 1:
        raise ConfigError(f"--min-replica-groups must be >= 1, got {args.min_replica_groups}")
    options: dict[str, Any] = {
        "bind": _check_bind(args.bind),
        "min_replicas": int(args.min_replica_groups),
        "heartbeat_timeout_ms": _milliseconds(args.heartbeat_timeout, "--heartbeat-timeout"),
        "join_timeout_ms": _milliseconds(args.join_timeout, "--join-timeout"),
        "quorum_tick_ms": _milliseconds(args.quorum_tick, "--quorum-tick"),
    }
    ft.require()
    if stop.is_set():
        return
    try:
        server = ft.lighthouse_server(**options)
    except Exception as exc:
        raise ConfigError(f"the Lighthouse could not start on {args.bind}: {exc}") from exc
    try:
        print(f"lighthouse: serving on {server.address()} (bind {args.bind})", flush=True)
        while not stop.wait(0.2):
            pass
    finally:
        server.shutdown()


def main(argv: Sequence[str] | None = None) -> int:
    """Run the verb on ``argv`` (the arguments after ``lighthouse``)."""
    try:
        args = _parser().parse_args(list(sys.argv[1:] if argv is None else argv))
        return serve(args)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
