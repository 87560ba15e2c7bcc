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
import socket
import threading
import time
from typing import Any

from lightning_elastic.errors import ConfigError

__all__ = ["Lighthouse", "add_arguments", "serve"]


class Lighthouse:
    """torchft's Lighthouse in this process (for one machine, tests and notebooks): serves
    until :meth:`close` (or the end of a ``with`` block); :attr:`address` is what groups
    connect to (``http://127.0.0.1:PORT`` when bound to all interfaces or to loopback).

    Args:
        bind: ``host:port`` to listen on (port 0: any free port).
        min_replica_groups: the fewest groups a quorum may have.
        heartbeat_timeout: seconds without a heartbeat before a group is out.
        join_timeout: after a change, seconds to wait for every live group before forming the
            quorum without the late ones.
        quorum_tick: seconds between looks at a pending quorum.
    """

    def __init__(
        self,
        bind: str = "[::]:0",
        *,
        min_replica_groups: int = 1,
        heartbeat_timeout: float = 1.0,
        join_timeout: float = 0.5,
        quorum_tick: float = 0.05,
    ) -> None:
        from lightning_elastic.core.options import check_count
        from lightning_elastic.core.replicas import _compat as ft

        ft.require()
        self.server = ft.lighthouse_server(
            bind=_check_bind(bind),
            min_replicas=check_count(min_replica_groups, "min_replica_groups"),
            heartbeat_timeout_ms=_milliseconds(heartbeat_timeout, "heartbeat_timeout"),
            join_timeout_ms=_milliseconds(join_timeout, "join_timeout"),
            quorum_tick_ms=_milliseconds(quorum_tick, "quorum_tick"),
        )
        host = bind.rpartition(":")[0]
        port = self.server.address().rpartition(":")[2]
        self._bind_host, self._port = host, int(port)
        local = host in ("[::]", "0.0.0.0", "127.0.0.1", "localhost", "[::1]")
        self.address = f"http://127.0.0.1:{port}" if local else self.server.address()

    def close(self) -> None:
        """Stop serving; returns once the port is free (torchft's shutdown lets its listener
        go ~10 ms later, seen up to 16 ms: a Lighthouse started on the same port right after
        found it taken), waiting at most ``_RELEASE_S``."""
        self.server.shutdown()
        _wait_released(self._bind_host, self._port)

    def __enter__(self) -> Lighthouse:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The verb's options (see the module docstring), on ``parser``."""
    parser.add_argument("--bind", default="[::]:29510", metavar="HOST:PORT", help="%(default)s")
    parser.add_argument(
        "--min-replica-groups", type=int, default=1, metavar="N", help="default %(default)s"
    )
    parser.add_argument(
        "--heartbeat-timeout", type=float, default=1.0, metavar="S", help="default %(default)s"
    )
    parser.add_argument(
        "--join-timeout", type=float, default=0.5, metavar="S", help="default %(default)s"
    )
    parser.add_argument(
        "--quorum-tick", type=float, default=0.05, metavar="S", help="default %(default)s"
    )


def _milliseconds(seconds: float, name: str) -> int:
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)):
        raise ConfigError(f"{name} must be a number of seconds in (0, 86400], got {seconds!r}")
    if not (seconds > 0) or seconds > 86400:
        raise ConfigError(f"{name} must be a number of seconds in (0, 86400], got {seconds}")
    return max(1, round(seconds * 1000))


_RELEASE_S = 5.0


def _wait_released(host: str, port: int) -> None:
    """Until ``host:port`` can be bound again (``SO_REUSEADDR``: connections in TIME_WAIT do
    not count, a listener does), at most :data:`_RELEASE_S`; a port another process took
    meanwhile ends the wait at that bound too."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host.strip("[]") or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
    except OSError:
        return
    deadline = time.monotonic() + _RELEASE_S
    while True:
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(address)
                return
            except OSError:
                if time.monotonic() >= deadline:
                    return
        time.sleep(0.002)


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
    if stop.is_set():
        return
    try:
        lighthouse = Lighthouse(
            args.bind,
            min_replica_groups=args.min_replica_groups,
            heartbeat_timeout=args.heartbeat_timeout,
            join_timeout=args.join_timeout,
            quorum_tick=args.quorum_tick,
        )
    except ConfigError:
        raise
    except Exception as exc:
        raise ConfigError(f"the Lighthouse could not start on {args.bind}: {exc}") from exc
    try:
        print(
            f"lighthouse: serving on {lighthouse.server.address()} (bind {args.bind})", flush=True
        )
        while not stop.wait(0.2):
            pass
    finally:
        lighthouse.close()
