"""Multi-tier checkpoints under torchrun: two agents play two nodes (``$LIGHTNING_ELASTIC_NODE``
"a" and "b", each with its own node-local dir), and each way of losing work resumes from the
tier it should, bitwise.

Cost: the faults run as one chain in one run directory (each resume is checked on its own
incarnation, and every step any incarnation trains is compared with the reference), so the
module is 7 worker-group starts: the reference and six incarnations of the chain.

The chain (saves every 2 steps, every 3rd save persisted, and the first save after resuming
from a checkpoint the persistent tier lacks; local_keep=2):

====  ==============================================  ==============================
step  fault                                           resume expected
====  ==============================================  ==============================
5     (a) node b's worker exits (restart 0)           step 4, local on both nodes
9     (b) node b's agent killed, its local dir wiped  step 8, b from a's replicas
15    (c) both agents killed, both local dirs wiped   the newest persisted (10)
19    (d) the local dirs are copied (newest: 18) ...
23    ... both killed, the old local dirs put back    the newer persisted one (22)
25    (e) both killed, a shard in a's newest flipped  step 24, a's file from b
====  ==============================================  ==============================

Before each fault every rank waits for its engine (tests/elastic/scripts/tier_train.py), so
the resume point is known; the expected checkpoints are also read back from the directories
rather than only assumed from the cadence.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.elastic import journal
from tests.elastic.agents import kill_tree, stop, wait_for
from tests.hygiene import free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "elastic" / "scripts" / "tier_train.py"
N = 30
CRASH, LOSE_B, LOSE_BOTH, SNAPSHOT, OLD_LOCAL, CORRUPT = 5, 9, 15, 19, 23, 25
PAUSES = (LOSE_B, LOSE_BOTH, SNAPSHOT, OLD_LOCAL, CORRUPT)
WAIT_S = 120


def name(step: int) -> str:
    return f"step_{step:09d}"


def committed(root: Path) -> list[int]:
    """The steps of the checkpoints in ``root`` that have a manifest (committed)."""
    return sorted(int(p.parent.name.split("_")[1]) for p in root.glob("step_*/manifest.json"))


@dataclass
class Cluster:
    """Two torchrun agents, one per node, on one rendezvous; agent "a" hosts its store."""

    root: Path
    max_steps: int
    faults: tuple[str, ...] = ()
    agents: dict[str, subprocess.Popen] = field(default_factory=dict)
    all_agents: list[subprocess.Popen] = field(default_factory=list)
    port: int = 0
    launches: int = 0

    def start(self, *nodes: str) -> None:
        for node in nodes:
            if node == "a":  # a new rendezvous (the old store died with agent a)
                self.port, self.launches = free_port(), self.launches + 1
            self.launch(node)
            if node == "a":
                wait_for(self.store_up, WAIT_S, "agent a's rendezvous store")

    def store_up(self) -> bool:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.port), 1):
            return True
        return False

    def launch(self, node: str) -> None:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes=2",  # min 2: a survivor waits for the replacement of a lost node
            "--nproc-per-node=1",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{self.port}",
            f"--rdzv-id=tiers-{self.launches}",
            "--rdzv-conf=join_timeout=120,last_call_timeout=1,keep_alive_interval=1,"
            "keep_alive_max_attempt=3",
            "--max-restarts=3",
            "--monitor-interval=0.2",
            str(SCRIPT),
            f"--root={self.root}",
            f"--max-steps={self.max_steps}",
            *self.faults,
        ]
        env = {
            **os.environ,
            "LIGHTNING_ELASTIC_NODE": node,
            "PYTHONWARNINGS": "ignore",
            "OMP_NUM_THREADS": "1",
            # see tests/elastic/test_torchrun.py (pytorch/pytorch#135712)
            "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
        }
        log = self.root / f"agent-{node}-{len(self.all_agents)}.log"
        with log.open("w") as out:
            proc = subprocess.Popen(
                cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        self.agents[node] = proc
        self.all_agents.append(proc)

    def kill(self, *nodes: str) -> None:
        for node in nodes:
            kill_tree(self.agents.pop(node))

    def logs(self) -> str:
        return "\n".join(
            f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(self.root.glob("agent-*"))
        )

    def wait_done(self) -> None:
        for node, proc in self.agents.items():
            assert proc.wait(timeout=WAIT_S) == 0, f"agent {node} failed\n{self.logs()}"

    def paused(self, step: int) -> None:
        """Wait until both ranks stopped at ``step`` (their saves before it committed)."""
        markers = self.root / "markers"

        def both() -> bool:
            if any(p.poll() is not None for p in self.agents.values()):
                raise AssertionError(f"an agent exited before step {step}\n{self.logs()}")
            return all((markers / f"paused-{step}-rank{r}").exists() for r in (0, 1))

        wait_for(both, WAIT_S, f"both ranks at step {step}")

    def go(self, step: int) -> None:
        (self.root / "markers" / f"go-{step}").touch()


def records(root: Path) -> list[dict]:
    return journal.read(root / "journal")


def incarnations(recs: list[dict]) -> dict[float, dict[int, dict]]:
    """Each worker group's recovery records, by group then rank, oldest group first."""
    groups: dict[float, dict[int, dict]] = defaultdict(dict)
    for r in recs:
        if r["kind"] == "recovery":
            assert r["rank"] not in groups[r["inc"]], f"two recovery records of one rank: {r}"
            groups[r["inc"]][r["rank"]] = r
    return dict(sorted(groups.items()))


def losses(recs: list[dict], inc: float | None = None) -> dict[tuple[int, int], str]:
    """(rank, step) -> the loss (float.hex) of every step journaled (by the group ``inc``)."""
    out: dict[tuple[int, int], str] = {}
    for r in recs:
        if r["kind"] == "step" and inc in (None, r["inc"]):
            out[(r["rank"], r["step"])] = r["loss"]
    return out


def assert_bitwise(recs: list[dict], reference: dict[tuple[int, int], str]) -> None:
    """Every step every incarnation journaled has the reference's loss, bit for bit."""
    for r in recs:
        if r["kind"] == "step":
            key = (r["rank"], r["step"])
            assert r["loss"] == reference[key], (
                f"rank {key[0]} step {key[1]} (group {r['inc']}, node {r['node']}): "
                f"{float.fromhex(r['loss'])!r} != reference {float.fromhex(reference[key])!r}"
            )


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[tuple[int, int], str]:
    """An uninterrupted run to step N at world size 2 (two agents, one process each)."""
    root = tmp_path_factory.mktemp("reference")
    cluster = Cluster(root, N)
    try:
        cluster.start("a", "b")
        cluster.wait_done()
    finally:
        stop(cluster.all_agents)
    recs = records(root)
    groups = incarnations(recs)
    assert len(groups) == 1, f"the reference restarted\n{cluster.logs()}"
    assert [g["recovery"] for g in groups[min(groups)].values()] == [None, None]
    out = losses(recs)
    assert sorted(out) == [(rank, step) for rank in (0, 1) for step in range(N)]
    return out


@dataclass
class Chain:
    root: Path
    recs: list[dict]
    groups: dict[float, dict[int, dict]]
    by_fault: dict[str, float]  # fault -> the group that resumed after it
    expected: dict[str, int]  # fault -> the step it must resume from
    corrupt_size: int


@pytest.fixture(scope="module")
def chain(tmp_path_factory) -> Chain:
    root = tmp_path_factory.mktemp("chain")
    faults = ("--crash-node=b", f"--crash-step={CRASH}", f"--pause-at={','.join(map(str, PAUSES))}")
    cluster = Cluster(root, N, faults)
    local = {node: root / f"local_{node}" for node in "ab"}
    persistent = root / "persistent"
    marks: dict[str, float] = {}
    expected: dict[str, int] = {}
    try:
        # (a) node b's worker exits at CRASH; torchrun restarts the group on the same nodes
        cluster.start("a", "b")
        expected["crash"] = 4
        cluster.paused(LOSE_B)
        # (b) node b is lost and replaced by an empty node of the same id
        expected["lose_b"] = max(committed(local["a"]))
        cluster.kill("b")
        shutil.rmtree(local["b"])
        marks["lose_b"] = time.time()
        cluster.go(LOSE_B)  # rank 0 goes on, fails in the next collective, waits for a new b
        cluster.start("b")
        cluster.paused(LOSE_BOTH)
        # (c) both nodes are lost with their local tiers
        cluster.kill("a", "b")
        assert committed(persistent), "nothing persisted before (c): the cadence changed?"
        expected["lose_both"] = max(committed(persistent))
        assert expected["lose_both"] < max(committed(local["a"])), "(c) needs a newer local"
        for path in local.values():
            shutil.rmtree(path)
        marks["lose_both"] = time.time()
        cluster.start("a", "b")
        cluster.paused(SNAPSHOT)
        # (d) an old copy of the local tiers comes back after newer saves were persisted
        old = {node: root / f"old_local_{node}" for node in "ab"}
        for node in "ab":
            shutil.copytree(local[node], old[node], symlinks=True)
        old_newest = max(committed(old["a"]))
        cluster.go(SNAPSHOT)
        cluster.paused(OLD_LOCAL)
        cluster.kill("a", "b")
        expected["old_local"] = max(committed(persistent))
        assert expected["old_local"] > old_newest, "(d) needs a persisted save after the copy"
        for node in "ab":
            shutil.rmtree(local[node])
            old[node].rename(local[node])
        marks["old_local"] = time.time()
        cluster.start("a", "b")
        cluster.paused(CORRUPT)
        # (e) one shard of node a's newest local checkpoint is corrupt (same size)
        cluster.kill("a", "b")
        expected["corrupt"] = max(committed(local["a"]))
        assert expected["corrupt"] not in committed(persistent), "(e) needs a local-only save"
        shard = sorted((local["a"] / name(expected["corrupt"])).glob("*.distcp"))[0]
        data = bytearray(shard.read_bytes())
        for i in range(len(data) // 2, len(data) // 2 + 16):
            data[i] ^= 0xFF
        shard.write_bytes(bytes(data))
        marks["corrupt"] = time.time()
        cluster.start("a", "b")
        cluster.wait_done()
    finally:
        stop(cluster.all_agents)
    recs = records(root)
    groups = incarnations(recs)
    assert len(groups) >= 2, f"no restart after the crash\n{cluster.logs()}"
    by_fault = {"crash": sorted(groups)[1]}  # the group torchrun restarted
    by_fault.update({fault: min(g for g in groups if g > t) for fault, t in marks.items()})
    return Chain(root, recs, groups, by_fault, expected, len(data))


def recovery_of(chain: Chain, fault: str) -> dict[str, dict]:
    """The resumed group's recovery dicts by node, checked for shape and the expected step."""
    group = chain.groups[chain.by_fault[fault]]
    assert sorted(group) == [0, 1], f"not every rank journaled its recovery: {group}"
    out = {}
    for r in group.values():
        rec = r["recovery"]
        assert rec is not None, f"{fault}: rank {r['rank']} started fresh"
        assert rec["node"] == r["node"] and set(rec["bytes"]) == {"local", "peer", "persistent"}
        assert (rec["checkpoint"], rec["step"], r["step"]) == (
            name(chain.expected[fault]),
            chain.expected[fault],
            chain.expected[fault],
        ), f"{fault}: rank {r['rank']} resumed from {rec}"
        out[r["node"]] = rec
    assert sorted(out) == ["a", "b"], group
    return out


def test_a_restarted_worker_group_resumes_from_the_local_tier(chain, reference) -> None:
    """(a) torchrun restarts the group on the same nodes: no byte is read remotely."""
    rec = recovery_of(chain, "crash")
    for node in "ab":
        assert rec[node]["tier"] == rec[node]["plan_tier"] == "local", rec[node]
        assert rec[node]["bytes"]["persistent"] == rec[node]["bytes"]["peer"] == 0, rec[node]
        assert rec[node]["bytes"]["local"] > 0, rec[node]
    assert_bitwise([r for r in chain.recs if r["inc"] == chain.by_fault["crash"]], reference)


def test_a_replaced_node_fetches_its_files_from_the_replicas_of_the_other(chain, reference) -> None:
    """(b) node b comes back empty: everything from node a, nothing from the persistent tier."""
    rec = recovery_of(chain, "lose_b")
    assert rec["b"]["tier"] == "peer" and rec["b"]["bytes"]["peer"] > 0, rec["b"]
    assert rec["b"]["bytes"]["local"] == 0, rec["b"]
    assert rec["a"]["tier"] == "local", rec["a"]
    assert {r["plan_tier"] for r in rec.values()} == {"peer"}, rec
    assert all(r["bytes"]["persistent"] == 0 for r in rec.values()), rec
    assert_bitwise([r for r in chain.recs if r["inc"] == chain.by_fault["lose_b"]], reference)


def test_losing_both_nodes_resumes_from_the_newest_persisted_checkpoint(chain, reference) -> None:
    """(c) both local tiers are gone: the last persisted save (older than the last local)."""
    rec = recovery_of(chain, "lose_both")
    for node in "ab":
        assert rec[node]["tier"] == rec[node]["plan_tier"] == "persistent", rec[node]
        assert rec[node]["bytes"]["persistent"] > 0, rec[node]
    assert_bitwise([r for r in chain.recs if r["inc"] == chain.by_fault["lose_both"]], reference)


def test_a_local_tier_older_than_the_persistent_one_is_passed_over(chain, reference) -> None:
    """(d) the put-back local copies hold only older saves: the persisted one is newer."""
    rec = recovery_of(chain, "old_local")
    for node in "ab":
        assert rec[node]["tier"] == rec[node]["plan_tier"] == "persistent", rec[node]
    assert_bitwise([r for r in chain.recs if r["inc"] == chain.by_fault["old_local"]], reference)


def test_a_corrupt_local_copy_is_fetched_again_from_the_other_node(chain, reference) -> None:
    """(e) the same checkpoint is resumed: node a's corrupt shard (only it) comes from node b."""
    rec = recovery_of(chain, "corrupt")
    assert rec["a"]["tier"] == "peer", rec["a"]
    assert rec["a"]["bytes"]["peer"] == chain.corrupt_size, rec["a"]
    assert rec["b"]["tier"] == "local", rec["b"]
    assert all(r["bytes"]["persistent"] == 0 for r in rec.values()), rec
    final = [r for r in chain.recs if r["inc"] == chain.by_fault["corrupt"]]
    assert {(r["rank"], r["step"]) for r in final if r["kind"] == "step"} == {
        (rank, step) for rank in (0, 1) for step in range(chain.expected["corrupt"], N)
    }
    assert_bitwise(final, reference)


def test_every_step_of_every_incarnation_is_the_reference_bitwise(chain, reference) -> None:
    """The whole chain: each fault resumed once, and no step differs from the reference."""
    fresh = chain.groups[min(chain.groups)]
    assert [r["recovery"] for r in fresh.values()] == [None, None]
    assert list(chain.groups)[1:] == sorted(chain.by_fault.values()), (
        "a fault did not resume exactly once",
        chain.groups,
    )
    assert set(losses(chain.recs)) == set(reference)
    assert_bitwise(chain.recs, reference)
