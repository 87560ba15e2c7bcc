"""The live state a healing replica group fetches from a peer, over HTTP, loaded safely.

torchft's Manager hands a healing group's state through a ``CheckpointTransport`` (duck-typed:
``metadata``, ``send_checkpoint``, ``recv_checkpoint``, ``disallow_checkpoint``,
``shutdown``). Its own HTTP transport unpickles what a peer sends with ``weights_only=False``:
anyone who can answer on that port runs code in every joining process. This one serializes
the state once per heal with ``torch.save`` and loads it with the same allowlisted
``weights_only`` loader as our checkpoints (:func:`~lightning_elastic.core.load.safe.
load_object`), unless the job was started with ``trusted=True``.

Which rank calls what: rank ``r`` of the group the Lighthouse chose as the source serves
(:meth:`LiveStateTransport.send_checkpoint`, called by torchft in its quorum thread); rank
``r`` of each healing group fetches from it (:meth:`~LiveStateTransport.recv_checkpoint`,
also in torchft's quorum thread). The payload is an immutable snapshot: the source's training
may go on while it is served.

What anyone who reaches the port can do, and cannot: read the state being served (keep the
port inside the job's network, as the Lighthouse's); not run code in a joining process (the
safe loader), not make it allocate more than the memory it has left (a payload must say its
length, and one larger than the available memory is refused before it is read), not hold a
server thread longer than the step timeout (a request for a step not served yet waits that
long at most; a connection that sends nothing is closed after it).
"""

from __future__ import annotations

import http.client
import io
import logging
import os
import re
import socket
import threading
import time
import urllib.error
import urllib.request
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import torch

from lightning_elastic.core.load.safe import UnsafeObjectError, load_object
from lightning_elastic.errors import ConfigError

__all__ = ["ADVERTISE_ENV", "LiveStateTransport", "TransferStats", "direct_opener"]

log = logging.getLogger(__name__)

# the host name peers reach this process under (default: the host name)
ADVERTISE_ENV = "LIGHTNING_ELASTIC_ADVERTISE_HOST"
_PATH = "/lightning_elastic/live/"


class TransferStats:
    """What the transport moved: bytes and seconds of the last send and receive (read by the
    health metrics; written from torchft's quorum thread)."""

    def __init__(self) -> None:
        self.sent_bytes = 0
        self.sent_serialize_s = 0.0
        self.received_bytes = 0
        self.received_s = 0.0
        self.receives = 0


class LiveStateTransport:
    """Serves this rank's live state to healing peers and fetches a peer's; see the module
    docstring."""

    def __init__(self, *, timeout: timedelta, trusted: bool = False) -> None:
        self.timeout = timeout
        self.trusted = trusted
        self.stats = TransferStats()
        self._lock = threading.Condition()
        self._payload: bytes | None = None
        self._step = -1
        self._served = -1  # the newest step ever staged
        transport = self
        seconds = timeout.total_seconds()

        class Handler(BaseHTTPRequestHandler):
            timeout = seconds  # a client that sends nothing does not hold a thread

            def do_GET(self) -> None:
                payload, serving = transport._wait_for(_step_of(self.path))
                if payload is None:
                    self.send_error(404, f"serving step {serving}, not {self.path!r}")
                    return
                self.send_response(200)
                self.send_header("Content-Type", "application/octet-stream")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, format: str, *args: Any) -> None:
                log.debug("live state server: " + format, *args)

        self._server = ThreadingHTTPServer(("", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="le-live-state", daemon=True
        )
        self._thread.start()
        host = os.environ.get(ADVERTISE_ENV) or socket.gethostname()
        self._address = f"http://{host}:{self._server.server_address[1]}{_PATH}"

    def metadata(self) -> str:
        """Where peers fetch this rank's state (``http://host:port/...``)."""
        return self._address

    def send_checkpoint(
        self, dst_ranks: list[int], step: int, state_dict: Any, timeout: timedelta
    ) -> None:
        """Snapshot ``state_dict`` (serialized now) and serve it as ``step``."""
        began = time.perf_counter()
        buffer = io.BytesIO()
        torch.save(state_dict, buffer)
        payload = buffer.getvalue()
        with self._lock:
            self._payload, self._step = payload, step
            self._served = max(self._served, step)
            self._lock.notify_all()
        self.stats.sent_bytes = len(payload)
        self.stats.sent_serialize_s = time.perf_counter() - began
        log.info("serving live state of step %d (%d bytes) to %s", step, len(payload), dst_ranks)

    def disallow_checkpoint(self) -> None:
        """The step committed: stop serving (and free) the snapshot."""
        with self._lock:
            self._payload, self._step = None, -1

    def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout: timedelta) -> Any:
        """Fetch peer ``src_rank``'s state of ``step`` from ``metadata`` and load it safely."""
        url = f"{metadata}{step}"
        began = time.perf_counter()
        try:
            with direct_opener().open(url, timeout=timeout.total_seconds()) as response:
                payload = _read_payload(response, url)
        except (urllib.error.URLError, OSError, http.client.HTTPException) as exc:
            raise ConnectionError(f"fetching the live state from {url} failed: {exc}") from exc
        try:
            state = load_object(io.BytesIO(payload), f"live state from {url}", trusted=self.trusted)
        except UnsafeObjectError as exc:
            if not exc.types:  # not a torch.save archive at all: torn, or not from a peer
                raise ConnectionError(
                    f"what {url} sent is not a live state ({exc.reason}); the next quorum "
                    "tries again"
                ) from exc
            raise ConfigError(
                f"the live state from {url} holds objects the safe loader refuses ({exc}); "
                "allowlist them with torch.serialization.add_safe_globals, or start every "
                "group with trusted=True if you trust every peer"
            ) from exc
        self.stats.received_bytes = len(payload)
        self.stats.received_s = time.perf_counter() - began
        self.stats.receives += 1
        return state

    def _wait_for(self, step: int) -> tuple[bytes | None, int]:
        """The payload of ``step`` once it is staged (a peer may ask before this process has
        serialized it: the quorum tells both at once), or ``None`` when that step is past or
        does not come within the timeout."""
        with self._lock:
            self._lock.wait_for(
                lambda: step <= self._served or step < 0, timeout=self.timeout.total_seconds()
            )
            payload = self._payload if step == self._step and step >= 0 else None
            return payload, self._step

    def shutdown(self, wait: bool = True) -> None:
        """Stop serving."""
        self._server.shutdown()
        self._server.server_close()
        if wait:
            self._thread.join(timeout=5)


def direct_opener() -> urllib.request.OpenerDirector:
    """A urllib opener that ignores ``http_proxy``/``https_proxy``: the Lighthouse and the
    peers are inside the job's network, and a login node's proxy settings must not route
    (or leak) them through a proxy."""
    return urllib.request.build_opener(urllib.request.ProxyHandler({}))


def _step_of(path: str) -> int:
    """The step a request asks for; ``-2`` for anything but ``/lightning_elastic/live/N``."""
    if not path.startswith(_PATH):
        return -2
    tail = path[len(_PATH) :]
    return int(tail) if re.fullmatch(r"[0-9]{1,18}", tail) else -2


def _read_payload(response: Any, url: str) -> bytes:
    """The body of ``response``, refused (``ConnectionError``) without a length or with one
    larger than the memory this machine has available."""
    length = response.headers.get("Content-Length")
    if length is None or not re.fullmatch(r"[0-9]{1,20}", length.strip()):
        raise ConnectionError(f"{url} sent a live state without a valid Content-Length")
    size = int(length)
    available = _available_memory()
    if available is not None and size > available:
        raise ConnectionError(
            f"{url} announced a live state of {size} bytes, more than the {available} bytes "
            "of memory available here: refused"
        )
    payload = response.read(size)
    if len(payload) != size:
        raise ConnectionError(f"{url} sent {len(payload)} of the {size} bytes it announced")
    return bytes(payload)


def _available_memory() -> int | None:
    """Bytes of memory available to new allocations (``None`` where the OS does not say)."""
    try:
        return int(os.sysconf("SC_AVPHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))
    except (AttributeError, ValueError, OSError):
        return None
