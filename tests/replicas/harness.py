"""Replica groups as real processes: a Lighthouse in the test process, groups started as
``python group_worker.py`` (one process) or torchrun (several), their journals read back."""

from __future__ import annotations

import collections
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.hygiene import job_environ

WORKER = Path(__file__).with_name("group_worker.py")
ROOT = Path(__file__).resolve().parents[2]

os.environ.setdefault("RUST_LOG", "warn")  # torchft logs every quorum at INFO otherwise
ft = pytest.importorskip("torchft", reason="replica groups need torchft (the ft extra)")


class Lighthouse:
    """torchft's Lighthouse on a free port of this process (a 1 s heartbeat timeout)."""

    def __init__(self, *, heartbeat_s: float = 1.0, join_s: float = 0.5, groups: int = 1) -> None:
        from lightning_elastic.lighthouse import Lighthouse as Server

        self.server = Server(
            heartbeat_timeout=heartbeat_s, join_timeout=join_s, min_replica_groups=groups
        )
        self.address = self.server.address

    def close(self) -> None:
        self.server.close()


class Group:
    """One replica group's processes (a worker, or a torchrun agent and its workers); each
    start of a group writes its own journal."""

    started = 0

    def __init__(
        self, tmp: Path, lighthouse: Lighthouse, name: str, *, nproc: int = 1, **env: Any
    ) -> None:
        self.name = name
        Group.started += 1
        self.journal = tmp / f"journal-{name}-{Group.started}.jsonl"
        self.log = tmp / f"{name}-{Group.started}.log"
        environ = {
            **job_environ(),  # a group is a job of its own
            "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
            "LIGHTNING_ELASTIC_LIGHTHOUSE": lighthouse.address,
            "LIGHTNING_ELASTIC_REPLICA_GROUP": name,
            "JOURNAL": str(self.journal),
            "RUST_LOG": "warn",
            **{k: str(v) for k, v in env.items()},
        }
        command = [sys.executable, str(WORKER)]
        if nproc > 1:
            command = [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                f"--nproc-per-node={nproc}",
                "--max-restarts=3",
                "--monitor-interval=0.2",
                str(WORKER),
            ]
        with open(self.log, "ab") as out:
            self.process = subprocess.Popen(
                command, env=environ, stdout=out, stderr=subprocess.STDOUT, cwd=tmp
            )

    def records(self) -> list[dict[str, Any]]:
        return read_journal(self.journal)

    def steps(self) -> int:
        return max((r["step"] for r in self.records()), default=0)

    def pids(self) -> set[int]:
        return {r["pid"] for r in self.records()}

    def wait(self, timeout: float = 120) -> int:
        try:
            return self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"{self.name} did not end: {self.tail()}") from None

    def signal(self, signum: int) -> None:
        """Send ``signum`` to the group's processes (a torchrun agent's workers too)."""
        import psutil

        for proc in self._tree():
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.send_signal(signum)  # (psutil checks that the pid names the same process)

    def kill(self) -> None:
        self.signal(signal.SIGKILL)
        self.process.wait(timeout=30)

    def tail(self, chars: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-chars:] if self.log.exists() else ""

    def _tree(self) -> list[Any]:
        """The group's running processes (``psutil.Process``). None once the group's process
        was reaped: its pid may name another test's process by now (the suite's pids wrap)."""
        import psutil

        if self.process.poll() is not None:
            return []
        try:
            root = psutil.Process(self.process.pid)
            return [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []


def journals(tmp: Path) -> list[dict[str, Any]]:
    """Every journal record under ``tmp``."""
    return [r for path in sorted(tmp.glob("journal-*.jsonl")) for r in read_journal(path)]


def read_journal(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue  # a line cut by a SIGKILL
        if record.get("kind", "step") == "step":
            records.append(record)
    return records


def read_events(path: Path) -> list[dict[str, Any]]:
    """The quorum events a group's journal holds (its ReplicaGroup.events, as they came)."""
    if not path.exists():
        return []
    events = []
    for line in path.read_text().splitlines():
        with contextlib.suppress(ValueError):
            record = json.loads(line)
            if record.get("kind") == "event":
                events.append(record)
    return events


def wait_until(condition: Callable[[], bool], timeout: float, what: str, *groups: Group) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            tails = "\n".join(f"--- {g.name}\n{g.tail()}" for g in groups)
            raise AssertionError(f"timed out waiting for {what}\n{tails}")
        time.sleep(0.1)


def by_step(records: list[dict[str, Any]]) -> dict[int, list[dict[str, Any]]]:
    steps: dict[int, list[dict[str, Any]]] = collections.defaultdict(list)
    for record in records:
        steps[record["step"]].append(record)
    return steps


def check_in_step(records: list[dict[str, Any]]) -> None:
    """Every group that committed a step holds the same parameters after it."""
    for step, entries in by_step(records).items():
        digests = {e["params"] for e in entries}
        assert len(digests) == 1, f"step {step}: groups differ: {entries}"


def check_exactly_once(records: list[dict[str, Any]], samples: int, epochs: Iterator[int]) -> None:
    """Every sample in exactly one committed step of each of ``epochs``."""
    trained: dict[int, list[int]] = collections.defaultdict(list)
    where: dict[tuple[int, int], list[tuple[str, int, int]]] = collections.defaultdict(list)
    seen: set[tuple[int, int, int, str]] = set()
    for r in records:
        key = (r["step"], r["rank"], r["pid"], r["group"])
        if key in seen:
            continue
        seen.add(key)
        trained[r["epoch"]].extend(r["ids"])
        for i in r["ids"]:
            where[(r["epoch"], i)].append((r["group"], r["pid"], r["step"]))
    for epoch in epochs:
        counts = collections.Counter(trained[epoch])
        twice = sorted(i for i, n in counts.items() if n > 1)
        never = sorted(set(range(samples)) - set(counts))
        by = {i: where[(epoch, i)] for i in twice[:4]}
        assert not twice and not never, f"epoch {epoch}: twice {twice} {by}, never {never}"


@contextlib.contextmanager
def solo_group(
    monkeypatch: pytest.MonkeyPatch, name: str = "solo", *, groups: int = 1
) -> Iterator[Lighthouse]:
    """One replica group in this process (a Lighthouse of its own, whose quorums need
    ``groups`` groups): a fit inside the block runs under strategy="elastic_ft"; its process
    group is destroyed after, since later tests of this pytest process expect none."""
    import torch.distributed as dist

    lighthouse = Lighthouse(groups=groups)
    monkeypatch.setenv("LIGHTNING_ELASTIC_LIGHTHOUSE", lighthouse.address)
    monkeypatch.setenv("LIGHTNING_ELASTIC_REPLICA_GROUP", name)
    monkeypatch.setenv("RUST_LOG", "warn")
    try:
        yield lighthouse
    finally:
        lighthouse.close()
        if dist.is_initialized():
            dist.destroy_process_group()
