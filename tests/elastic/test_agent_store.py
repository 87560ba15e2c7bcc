"""Process-group keys in torchrun's agent store: the agent keeps its store (and the keys of every
worker group before) for as long as it runs, so our strategies initialize the default group
under a prefix of the worker group (``attempt_store``)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch.distributed as dist

from lightning_elastic import ElasticFSDPStrategy, ElasticStrategy
from lightning_elastic.core.elastic.planned_exit import WORKER_GENERATION_ENV
from lightning_elastic.lightning.strategy import attempt_store
from tests.elastic.agents import hosting, kill_tree
from tests.hygiene import free_port
from tests.lightning.models import TinyModule

pytestmark = pytest.mark.timeout(240)


@pytest.fixture
def agent_store(monkeypatch: pytest.MonkeyPatch):
    """A store server standing for the agent's, and a single worker's torchrun environment."""
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    for name, value in {
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "TORCHELASTIC_RUN_ID": "agent-store",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(server.port),
        "WORLD_SIZE": "1",
        "RANK": "0",
        "LOCAL_RANK": "0",
        "GROUP_RANK": "0",
        "LOCAL_WORLD_SIZE": "1",
        "TORCHELASTIC_RESTART_COUNT": "2",
    }.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv(WORKER_GENERATION_ENV, raising=False)
    return server


def store() -> dist.Store:
    """``attempt_store()`` that gives up on a missing key after 5 s (instead of 30 minutes)."""
    client = attempt_store()
    client.set_timeout(timedelta(seconds=5))
    return client


def test_the_workers_of_one_round_share_its_prefix_whatever_their_agents_restart_counts(
    agent_store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each agent counts its own restarts: a node restarted after its worker failed counts one
    more than a node restarted because the first was waiting for the next round, and a group
    whose ranks looked under different prefixes never formed (the two-node run below)."""
    monkeypatch.setenv(WORKER_GENERATION_ENV, "7")
    store().set("address", "rank 0 of round 7")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    assert store().get("address") == b"rank 0 of round 7"
    monkeypatch.setenv(WORKER_GENERATION_ENV, "8")
    assert not store().check(["address"]), "a key of the round before"


def test_without_the_launcher_the_restart_count_keeps_the_attempts_apart(agent_store) -> None:
    store().set("address", "rank 0 of attempt 2")
    assert agent_store.list_keys() == ["lightning_elastic/attempt_2/address"]


@pytest.mark.parametrize("strategy", [ElasticStrategy, ElasticFSDPStrategy])
def test_every_strategy_of_ours_initializes_its_group_under_the_rounds_prefix(
    agent_store, monkeypatch: pytest.MonkeyPatch, strategy
) -> None:
    """``ElasticFSDPStrategy``'s Lightning base initializes the group elsewhere than DDP's: it
    used torch's keys, unprefixed."""
    monkeypatch.setenv(WORKER_GENERATION_ENV, "7")
    trainer = pl.Trainer(
        strategy=strategy(), accelerator="cpu", devices=1, logger=False, enable_progress_bar=False
    )
    trainer.strategy.connect(TinyModule())
    try:
        trainer.strategy.setup_environment()
        keys = agent_store.list_keys()
        assert dist.is_initialized() and keys
        assert all(key.startswith("lightning_elastic/round_7/") for key in keys), keys
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


@pytest.mark.parametrize(
    ("args", "preset", "seen"),
    [
        (["--nnodes=1:3"], None, "1"),
        (["--nnodes=2"], None, "1"),
        (["--nnodes=1:3"], "0", "0"),  # the user's choice stays
        (["--nnodes=1"], None, None),
        (["--standalone"], None, None),
    ],
)
def test_the_launcher_turns_torchs_shared_store_off_for_a_job_of_several_nodes(
    monkeypatch: pytest.MonkeyPatch, args, preset, seen
) -> None:
    """With torch's shared store a node that joined after the first round waited for a master
    address nobody wrote, and the running nodes timed out on it: the job ended at its first
    rejoin (pytorch/pytorch#135712). The long warm-start run in test_torchrun.py joins three
    times with the variable unset."""
    from lightning_elastic import launcher

    parser, config = launcher.torchrun_entry()[:2]
    observed = []
    monkeypatch.setattr(
        launcher,
        "torchrun_entry",
        lambda: (parser, config, lambda _: observed.append(os.environ.get(SHARING))),
    )
    if preset is None:
        monkeypatch.delenv(SHARING, raising=False)
    else:
        monkeypatch.setenv(SHARING, preset)
    assert launcher.main([*args, "--nproc-per-node=1", "train.py"]) == 0
    assert observed == [seen]
    assert os.environ.get(SHARING) == preset  # as before, after the run


SHARING = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"
LAUNCH = "import sys; from lightning_elastic.cli import main; sys.exit(main())"


def test_a_group_forms_after_a_restart_that_one_agent_counted_and_the_other_did_not(
    tmp_path: Path,
) -> None:
    """Two ``lightning-elastic run`` agents as nodes, torch's shared agent store
    (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=0``): node B's worker fails, node A's agent restarts
    its worker because B waits for the next round (A counts no restart, B one), and in the new
    round A's rank 0 starts 6 s late. Both ranks look under the round's prefix, find nothing of
    the round before, and form the group (under the restart counts' prefixes they waited for
    each other until the timeout, and the job failed; with torch's own keys, the script's
    ``plain``, the group had not formed after 200 s)."""
    port = free_port()
    script = Path(__file__).with_name("scripts") / "slow_rank_restart.py"
    cmd = [
        sys.executable,
        *["-c", LAUNCH, "run"],
        "--nnodes=2",
        "--nproc-per-node=1",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{port}",
        "--rdzv-id=agent-store",
        "--max-restarts=1",
        "--monitor-interval=0.2",
        *[str(script), "prefixed"],
    ]
    env = {**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "0", "OMP_NUM_THREADS": "1"}
    nodes: list[subprocess.Popen] = []
    outs = []
    try:
        for _ in range(2):
            nodes.append(
                subprocess.Popen(
                    cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
                )
            )
            if len(nodes) == 1:  # the first one hosts the rendezvous store
                hosting(nodes[0], port)
        deadline = time.monotonic() + 200
        for node in nodes:
            try:
                out = node.communicate(timeout=max(1.0, deadline - time.monotonic()))[0]
            except subprocess.TimeoutExpired:  # the logs say where it stands
                kill_tree(node)
                out = node.communicate()[0] + b"\n[still running after 200 s: killed]"
            outs.append(out.decode(errors="replace"))
    finally:
        for node in nodes:  # and its workers: sessions of their own
            kill_tree(node)
            if node.stdout is not None:
                node.stdout.close()
    logs = "\n".join(o[-3000:] for o in outs)  # the agents' logs: which worker exited how
    assert [node.returncode for node in nodes] == [0, 0], logs
    done = [line for out in outs for line in out.splitlines() if line.startswith("rank ")]
    # (once, with the other xdist worker busy, a second round followed the one that
    # succeeded, both agents counting one restart: these logs will say why)
    assert sorted(line.split()[1] for line in done) == ["0", "1"], f"{done}\n{logs}"
    assert all("agent store True sum 2" in line for line in done), done
    assert sorted(line.split()[3] for line in done) == ["0", "1"], "the agents' counts agreed"
