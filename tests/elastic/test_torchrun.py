"""torchrun elastic end to end: nodes leave and join; training goes on at each world size."""

import collections
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lightning_elastic.cli import main as cli_main

pytestmark = pytest.mark.timeout(600)
ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "elastic" / "scripts" / "elastic_train.py"
N = 120


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def journal(root: Path) -> list[dict]:
    records = []
    for path in sorted((root / "journal").glob("*.jsonl")):
        for line in path.read_text().splitlines():
            if line.strip():
                records.append({**json.loads(line), "file": path.name})
    return sorted(records, key=lambda r: r["t"])


def wait_for(predicate, timeout: float, what: str) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def effective_steps(records: list[dict]) -> dict[int, dict]:
    """The steps that count: each step as trained by the last worker group that trained it
    (a later group resumed from a checkpoint and replaced what came after it)."""
    latest: dict[int, float] = {}
    for record in records:
        if record["kind"] == "step":
            latest[record["step"]] = max(latest.get(record["step"], 0.0), record["inc"])
    steps: dict[int, dict] = {}
    for record in records:
        if record["kind"] == "step" and record["inc"] == latest[record["step"]]:
            steps.setdefault(record["step"], {"epoch": record["epoch"], "ids": []})
            steps[record["step"]]["ids"] += record["ids"]
    return steps


def assert_each_epoch_once(root: Path, last_step: int) -> None:
    steps = effective_steps(journal(root))
    assert sorted(steps) == list(range(last_step)), "a step is missing"
    per_epoch: dict[int, collections.Counter] = collections.defaultdict(collections.Counter)
    for record in steps.values():
        per_epoch[record["epoch"]].update(record["ids"])
    complete = [e for e in per_epoch if e < max(per_epoch)]
    for epoch in complete:
        assert per_epoch[epoch] == collections.Counter(range(N)), (
            f"epoch {epoch} not seen exactly once"
        )


def agent(root: Path, port: int, max_steps: int, log: Path) -> subprocess.Popen:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes=1:2",
        "--nproc-per-node=1",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{port}",
        "--rdzv-id=elastic-e2e",
        "--rdzv-conf=join_timeout=120,last_call_timeout=2",
        "--max-restarts=3",
        "--monitor-interval=0.5",
        str(SCRIPT),
        "--root",
        str(root),
        "--max-steps",
        str(max_steps),
        "--every",
        "3",
        "--step-sleep",
        "0.15",
    ]
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(
        cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env, start_new_session=True
    )


def test_node_leaves_and_rejoins(tmp_path) -> None:
    port, max_steps = free_port(), 75
    first = agent(tmp_path, port, max_steps, tmp_path / "agent-a.log")
    time.sleep(1.0)  # agent A hosts the rendezvous store
    second = agent(tmp_path, port, max_steps, tmp_path / "agent-b.log")
    try:

        def steps_at(world: int, at_least: int) -> bool:
            return any(
                r["kind"] == "step" and r["world"] == world and r["step"] >= at_least
                for r in journal(tmp_path)
            )

        wait_for(lambda: steps_at(2, 10), 240, "training at world size 2")
        os.killpg(second.pid, signal.SIGKILL)  # node B is lost
        killed_at = time.time()
        second.wait()
        wait_for(
            lambda: any(r["kind"] == "start" and r["world"] == 1 for r in journal(tmp_path)),
            240,
            "restart at 1",
        )
        start_1 = next(r for r in journal(tmp_path) if r["kind"] == "start" and r["world"] == 1)
        wait_for(lambda: steps_at(1, start_1["step"] + 6), 240, "progress at world size 1")
        third = agent(tmp_path, port, max_steps, tmp_path / "agent-b2.log")  # node B is back
        wait_for(
            lambda: any(
                r["kind"] == "start" and r["world"] == 2 and r["t"] > start_1["t"]
                for r in journal(tmp_path)
            ),
            240,
            "scale back up to 2",
        )
        assert first.wait(timeout=300) == 0, (tmp_path / "agent-a.log").read_text()[-3000:]
        assert third.wait(timeout=60) == 0, (tmp_path / "agent-b2.log").read_text()[-3000:]
    finally:
        for proc in (first, second):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    records = journal(tmp_path)
    assert max(r["step"] for r in records if r["kind"] == "end") == max_steps
    assert_each_epoch_once(tmp_path, max_steps)
    assert cli_main(["verify", str(tmp_path / "ckpts")]) == 0
    # recovery after losing node B: kill -> restart/rendezvous -> imports -> load -> first step
    first_step = next(r for r in records if r["kind"] == "step" and r["world"] == 1 and r["first"])
    split = {
        "restart_rendezvous_s": start_1["t_start"] - killed_at,
        "imports_s": start_1["t_imported"] - start_1["t_start"],
        "setup_and_load_s": start_1["t"] - start_1["t_imported"],
        "first_step_s": first_step["t"] - start_1["t"],
        "total_s": first_step["t"] - killed_at,
    }
    print("RECOVERY " + json.dumps(split))
    (tmp_path.parent / "recovery.json").write_text(json.dumps(split))


def test_standalone_restarts_at_2_then_3(tmp_path) -> None:
    def run(nproc: int, max_steps: int) -> None:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={nproc}",
            str(SCRIPT),
            "--root",
            str(tmp_path),
            "--max-steps",
            str(max_steps),
            "--every",
            "4",
        ]
        env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]

    run(2, 8)  # stops mid-epoch 0 (15 steps per epoch at 2 ranks)
    run(3, 30)  # resumes at step 8 with 3 ranks
    starts = [r for r in journal(tmp_path) if r["kind"] == "start"]
    assert {(r["world"], r["step"]) for r in starts} == {(2, 0), (3, 8)}
    assert_each_epoch_once(tmp_path, 30)
