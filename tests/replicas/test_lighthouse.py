"""`lightning-elastic lighthouse` and the in-process Lighthouse: torchft's own server, started
with the options that matter, refused with a clear error on bad ones, stopped cleanly."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
import urllib.request
from typing import Any

import psutil
import pytest

from lightning_elastic.cli import main
from lightning_elastic.errors import ConfigError
from tests.hygiene import free_port, listens

pytest.importorskip("torchft", reason="replica groups need torchft (the ft extra)")


@pytest.mark.parametrize(
    "argv",
    [
        ["--bind", "nope"],
        ["--bind", "host:99999"],
        ["--heartbeat-timeout", "0"],
        ["--heartbeat-timeout", "nan"],
        ["--join-timeout", "-1"],
        ["--quorum-tick", "1e400"],
        ["--min-replica-groups", "0"],
    ],
)
def test_bad_options_are_refused_with_exit_code_2(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["lighthouse", *argv]) == 2
    assert "error:" in capsys.readouterr().err


def test_the_in_process_lighthouse_serves_its_status_page_until_closed() -> None:
    from lightning_elastic.lighthouse import Lighthouse

    with Lighthouse() as lighthouse:
        assert lighthouse.address.startswith("http://127.0.0.1:")
        with urllib.request.urlopen(lighthouse.address, timeout=10) as page:
            assert page.status == 200
    # closed: this process no longer listens on the port (a connection to it could reach a
    # server another process bound there since: the other xdist worker's Lighthouse did)
    assert not listens(psutil.Process(), int(lighthouse.address.rpartition(":")[2]))
    with pytest.raises(ConfigError, match="min_replica_groups"):
        Lighthouse(min_replica_groups=0)


def test_a_closed_lighthouses_port_can_be_bound_again_at_once() -> None:
    """torchft's shutdown lets the listener go ~10 ms after it returns; close() waits for it."""
    from lightning_elastic.lighthouse import Lighthouse

    port = free_port()
    for _ in range(10):
        with (
            Lighthouse(bind=f"127.0.0.1:{port}") as lighthouse,
            urllib.request.urlopen(lighthouse.address, timeout=10) as page,
        ):
            assert page.status == 200


@pytest.mark.timeout(120)
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_the_verb_serves_in_the_foreground_and_stops_cleanly_on_a_signal(signum: int) -> None:
    process = subprocess.Popen(
        [sys.executable, "-m", "lightning_elastic.cli", "lighthouse", "--bind", "127.0.0.1:0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert process.stdout is not None
    deadline = time.monotonic() + 90
    line = ""
    while "serving on" not in line and time.monotonic() < deadline:
        line = process.stdout.readline()
    assert "serving on" in line, line
    process.send_signal(signum)
    out, _ = process.communicate(timeout=30)
    assert process.returncode == 0, out
    assert "lighthouse: stopped" in out


@pytest.mark.timeout(60)
@pytest.mark.parametrize("wrong", ["refused", "not-a-lighthouse", "unknown-host"])
def test_a_wrong_lighthouse_address_fails_clearly_within_the_connect_timeout(
    wrong: str,
) -> None:
    """Nothing listening, another HTTP server, a host that does not resolve: a
    ReplicaGroupError naming the address and the option within the connect timeout (torchft's
    Manager alone waited the whole quorum timeout, 300 s by default, for the second)."""
    import http.server
    import threading

    from torch.distributed import TCPStore  # type: ignore[attr-defined]

    from lightning_elastic.core.replicas.group import ReplicaGroup, ReplicaOptions
    from lightning_elastic.errors import ReplicaGroupError

    other = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.SimpleHTTPRequestHandler)
    threading.Thread(target=other.serve_forever, daemon=True).start()
    free = free_port()  # not one the OS hands out for port 0 (another worker's server)
    address = {
        "refused": f"http://127.0.0.1:{free}",
        "not-a-lighthouse": f"http://127.0.0.1:{other.server_address[1]}",
        "unknown-host": "http://no-such-lighthouse.invalid:29510",
    }[wrong]
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    began = time.monotonic()
    try:
        with pytest.raises(ReplicaGroupError, match="no Lighthouse answered at") as caught:
            ReplicaGroup(
                ReplicaOptions(lighthouse=address, name="g", connect_timeout=3),
                get_state=dict,
                put_state=lambda state: None,
                group_rank=0,
                group_size=1,
                store_addr="127.0.0.1",
                store_port=int(store.port),
            )
    finally:
        other.shutdown()
        other.server_close()
    assert time.monotonic() - began < 3 + 5
    assert address in str(caught.value) and "LIGHTNING_ELASTIC_LIGHTHOUSE" in str(caught.value)


@pytest.mark.timeout(120)
def test_a_group_waiting_for_its_quorum_leaves_at_once_on_ctrl_c(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Ctrl-C while the first quorum waits for a second group: Lightning's graceful shutdown
    exits, and nothing holds the process afterwards (torchft's quorum thread was joined at
    interpreter exit: a Ctrl-C'd group hung for the whole quorum timeout)."""
    import threading

    import lightning.pytorch as pl
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_elastic import ElasticFTStrategy
    from tests.replicas.harness import solo_group

    class Tiny(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Linear(2, 1)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return self.net(batch[0]).sum()

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.1)

        def train_dataloader(self) -> DataLoader:  # type: ignore[type-arg]
            return DataLoader(TensorDataset(torch.randn(8, 2)), batch_size=4)

    def quorum_threads() -> list[threading.Thread]:
        return [t for t in threading.enumerate() if "quorum" in t.name and t.is_alive()]

    def interrupt_once_waiting() -> None:
        deadline = time.monotonic() + 90
        while not quorum_threads() and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(1.0)  # inside the quorum's wait
        signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)  # type: ignore[arg-type]

    handler = signal.getsignal(signal.SIGINT)
    try:
        with solo_group(monkeypatch, groups=2):
            threading.Thread(target=interrupt_once_waiting, daemon=True).start()
            trainer = pl.Trainer(
                strategy=ElasticFTStrategy(step_timeout=5, quorum_timeout=60),
                accelerator="cpu",
                devices=1,
                max_epochs=1,
                logger=False,
                enable_checkpointing=False,
                enable_progress_bar=False,
                enable_model_summary=False,
            )
            with pytest.raises(SystemExit):
                trainer.fit(Tiny())
            assert trainer.interrupted
            waiting = quorum_threads()
            assert waiting and all(t.daemon for t in waiting), waiting
    finally:
        signal.signal(signal.SIGINT, handler)
