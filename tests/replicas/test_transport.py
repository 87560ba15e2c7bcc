"""The live-state transport a healing replica group fetches a peer's state through, under
hostile input: a fake peer's payload (code to run, garbage, a huge or missing length, a torn
body) is refused without running anything or allocating it, and requests a real peer never
sends (another step, a silent connection, a step number of 5,000 digits) cannot hang the server
or stop it serving the joiner it is there for. In one process, no torchft needed."""

from __future__ import annotations

import io
import os
import pickle
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
import torch

from lightning_elastic.core.replicas.transport import LiveStateTransport
from lightning_elastic.errors import ConfigError

pytestmark = pytest.mark.timeout(60)

TIMEOUT = timedelta(seconds=2)


@pytest.fixture
def transport() -> Iterator[LiveStateTransport]:
    server = LiveStateTransport(timeout=TIMEOUT)
    yield server
    server.shutdown()


def _local(transport: LiveStateTransport) -> str:
    return transport.metadata().replace(socket.gethostname(), "127.0.0.1", 1)


def _get(url: str, timeout: float = 10) -> tuple[int, bytes]:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(url, timeout=timeout) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, b""


def test_a_joiner_receives_the_state_of_the_step_being_served(
    transport: LiveStateTransport,
) -> None:
    state = {"model": {"w": torch.arange(6.0)}, "progress": {"step": 3}, "run_id": "r"}
    transport.send_checkpoint([1], 3, state, TIMEOUT)
    state["model"]["w"].add_(1)  # the source trains on: what it serves is a snapshot
    got = transport.recv_checkpoint(0, _local(transport), 3, TIMEOUT)
    assert torch.equal(got["model"]["w"], torch.arange(6.0)) and got["progress"] == {"step": 3}
    transport.disallow_checkpoint()
    assert _get(f"{_local(transport)}3")[0] == 404  # committed: no longer served


def test_requests_for_other_steps_are_refused_without_holding_the_server(
    transport: LiveStateTransport,
) -> None:
    """A request for a step not served yet waits the step timeout at most; a past step, a
    negative one, a path that is not a step, and a 5,000-digit step are refused at once; a
    silent connection is closed after the timeout; meanwhile the real joiner is served."""
    base = _local(transport)
    transport.send_checkpoint([1], 7, {"w": torch.ones(2)}, TIMEOUT)
    silent = socket.create_connection(("127.0.0.1", int(base.split(":")[2].split("/")[0])))
    future: dict[str, Any] = {}

    def ask_future() -> None:
        began = time.monotonic()
        future["status"] = _get(f"{base}1000000")[0]
        future["waited"] = time.monotonic() - began

    waiting = threading.Thread(target=ask_future)
    waiting.start()
    began = time.monotonic()
    for path in ("6", "-1", "abc", "../../etc/passwd", "9" * 5000, "%D9%A3"):
        assert _get(f"{base}{path}")[0] == 404, path
    assert _get(base.replace("/lightning_elastic/live/", "/nope"))[0] == 404
    state = transport.recv_checkpoint(0, base, 7, TIMEOUT)  # the joiner, unhindered
    assert torch.equal(state["w"], torch.ones(2))
    assert time.monotonic() - began < TIMEOUT.total_seconds()
    waiting.join(timeout=30)
    assert future["status"] == 404 and future["waited"] < TIMEOUT.total_seconds() + 3
    silent.settimeout(TIMEOUT.total_seconds() + 5)
    assert silent.recv(100) == b""  # the server hung up on the silent client
    silent.close()


class _Bomb:
    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, ("echo pwned > pwned.txt",))


def _torch_bytes(obj: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


class _FakePeer(BaseHTTPRequestHandler):
    """Serves ``/<kind>/<step>`` as a hostile peer would."""

    payloads = {
        "bomb": _torch_bytes({"model": _Bomb()}),
        "garbage": b"not a state" * 100,
        "pickle": pickle.dumps({"model": {}}),
    }

    def do_GET(self) -> None:
        kind = self.path.split("/")[1]
        self.send_response(200)
        if kind == "huge":  # announces a petabyte, then streams zeros
            self.send_header("Content-Length", str(10**15))
            self.end_headers()
            try:
                for _ in range(64):
                    self.wfile.write(bytes(1 << 20))
            except OSError:
                pass
            return
        if kind == "unannounced":
            self.end_headers()
            self.wfile.write(_torch_bytes({"w": torch.ones(1)}))
            return
        payload = _torch_bytes({"w": torch.ones(1000)})[:100] if kind == "torn" else b""
        payload = self.payloads.get(kind, payload)
        self.send_header("Content-Length", str(len(payload) + (50 if kind == "torn" else 0)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture(scope="module")
def fake_peer() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _FakePeer)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.mark.parametrize(
    ("kind", "error", "match"),
    [
        ("bomb", ConfigError, "posix.system, not on the safe-loading allowlist"),
        ("garbage", ConnectionError, "not a live state"),
        ("pickle", ConnectionError, "not a live state"),
        ("huge", ConnectionError, "more than the .* bytes of memory available"),
        ("unannounced", ConnectionError, "without a valid Content-Length"),
        ("torn", ConnectionError, "failed"),
    ],
)
def test_a_fake_peers_payload_is_refused_safely(
    fake_peer: str,
    transport: LiveStateTransport,
    tmp_path: Any,
    monkeypatch: pytest.MonkeyPatch,
    kind: str,
    error: type[Exception],
    match: str,
) -> None:
    """Code to run: ConfigError (every later heal would get the same: the joiner stops with
    it); anything else: ConnectionError (the next quorum tries again), nothing allocated
    beyond what was announced and fits."""
    monkeypatch.chdir(tmp_path)
    began = time.monotonic()
    with pytest.raises(error, match=match):
        transport.recv_checkpoint(0, f"{fake_peer}/{kind}/", 3, TIMEOUT)
    assert time.monotonic() - began < 10
    assert not (tmp_path / "pwned.txt").exists()


def test_the_transport_ignores_the_proxy_settings(
    transport: LiveStateTransport, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A login node's http_proxy must not route a peer's state through a proxy."""
    monkeypatch.setenv("http_proxy", "http://127.0.0.1:1")
    monkeypatch.setenv("HTTP_PROXY", "http://127.0.0.1:1")
    monkeypatch.delenv("no_proxy", raising=False)
    monkeypatch.delenv("NO_PROXY", raising=False)
    monkeypatch.setattr(urllib.request, "_opener", None)  # urlopen's, built from the env once
    transport.send_checkpoint([1], 2, {"w": torch.zeros(1)}, TIMEOUT)
    assert torch.equal(
        transport.recv_checkpoint(0, _local(transport), 2, TIMEOUT)["w"], torch.zeros(1)
    )
