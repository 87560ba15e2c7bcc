"""Jobs of the concurrent-writer tests: each saves a run of steps into a shared root while
another job does the same, and reports every save's outcome (run by
:func:`~lightning_elastic.testing.spawn.run_distributed`, one call per job); and a storage
that runs another job's step at one exact storage operation (:class:`HookedStorage`)."""

from __future__ import annotations

import contextlib
import fnmatch
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from lightning_elastic.core.dist.coordinator import Coordinator
from lightning_elastic.core.engine import CheckpointEngine
from lightning_elastic.core.policy.retention import KeepLastN
from lightning_elastic.core.storage.base import Entry, Written
from lightning_elastic.core.storage.local import LocalStorage
from lightning_elastic.errors import ElasticCheckpointError

__all__ = ["HookedStorage", "JobReport", "JobSpec", "SaveOutcome", "hooked", "run_job", "state_for"]

_WAIT_S = 60.0  # how long a job waits for its peers at a barrier before giving up


def state_for(step: int, job: str) -> dict[str, Any]:
    """The (tiny) state job ``job`` saves at ``step``: every value tells whose save it was."""
    tag = float(sum(job.encode()))
    return {
        "w": torch.full((16,), float(step)) + tag,
        "b": torch.arange(8, dtype=torch.float32) * step,
        "meta": {"step": step, "job": job},
    }


@dataclass(frozen=True)
class JobSpec:
    """One job: which run it writes, which steps, and how it meets the other jobs."""

    root: str
    storage_options: dict[str, Any]
    run_id: str
    job: str
    steps: tuple[int, ...]
    sync_dir: str
    peers: tuple[str, ...]  # every job's label (this one included): the start barrier
    async_save: bool = False
    lockstep: bool = False  # meet every peer before each step (same step at the same time)
    pause_s: float = 0.0  # "training" between two saves
    after: tuple[str, int] | None = None  # start once job ``[0]`` committed ``[1]`` saves
    resume: bool = False  # a requeued job: load the run's newest, then save ``len(steps)``
    # steps continuing from it


@dataclass
class SaveOutcome:
    """One save as its job saw it (``name`` when committed, ``error_type`` when it raised)."""

    step: int
    started: float
    finished: float
    name: str | None = None
    save_id: str | None = None
    generation: int | None = None
    error_type: str | None = None
    typed: bool = True  # the error derives from ElasticCheckpointError
    message: str = ""
    listing: dict[str, int] | None = None  # rank 0: the directory right after the commit


@dataclass
class JobReport:
    job: str
    rank: int
    host: str
    pid: int
    run_id: str
    resumed: str | None = None
    leased_at: float | None = None  # a resuming job: its lease is taken when load returns
    outcomes: list[SaveOutcome] = field(default_factory=list)


def _touch(sync_dir: str, name: str) -> None:
    Path(sync_dir, name).touch()


def _wait_for(sync_dir: str, names: list[str]) -> None:
    deadline = time.monotonic() + _WAIT_S
    while not all(Path(sync_dir, n).exists() for n in names):
        if time.monotonic() > deadline:
            raise TimeoutError(f"peers never reached the barrier: waited for {names}")
        time.sleep(0.002)


def _meet(spec: JobSpec, label: str, rank: int, world: int) -> None:
    """Rank 0 of every job meets at ``label``; then each job's ranks meet."""
    if rank == 0:
        _touch(spec.sync_dir, f"{label}-{spec.job}")
        _wait_for(spec.sync_dir, [f"{label}-{p}" for p in spec.peers])
    if world > 1:
        dist.barrier()


def run_job(spec: JobSpec) -> JobReport:
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    timeout = timedelta(seconds=30)
    # A one-process job runs without torch.distributed, as a user's would.
    coordinator = Coordinator.single_process(timeout) if world == 1 else None
    report = JobReport(spec.job, rank, socket.gethostname(), os.getpid(), spec.run_id)
    engine = CheckpointEngine(
        spec.root,
        storage_options=spec.storage_options,
        coordinator=coordinator,
        run_id=spec.run_id,
        retention=[KeepLastN(2)],
        async_save=spec.async_save,
        timeout=timeout,
    )
    try:
        _meet(spec, "ready", rank, world)
        if spec.after is not None:
            other, count = spec.after
            if rank == 0:
                _wait_for(spec.sync_dir, [f"committed-{other}-{count}"])
            if world > 1:
                dist.barrier()
        steps = spec.steps
        if spec.resume:
            loaded = engine.load(None, trusted=True, take_over=True)
            report.leased_at = time.time()
            report.resumed = loaded.info.name
            steps = tuple(loaded.manifest.step + i for i in range(1, len(steps) + 1))
        committed = 0
        for step in steps:
            if spec.lockstep:
                _meet(spec, f"step{step}", rank, world)
            outcome = _save(engine, spec, step, rank)
            report.outcomes.append(outcome)
            if outcome.name is not None:
                committed += 1
                if rank == 0:
                    _touch(spec.sync_dir, f"committed-{spec.job}-{committed}")
            if spec.pause_s:
                time.sleep(spec.pause_s)
    finally:
        with contextlib.suppress(ElasticCheckpointError):  # recorded with its save already
            engine.close()
    return report


def _save(engine: CheckpointEngine, spec: JobSpec, step: int, rank: int) -> SaveOutcome:
    outcome = SaveOutcome(step=step, started=time.time(), finished=0.0)
    try:
        handle = engine.save(state_for(step, spec.job), step=step, rank_state={"rank": rank})
        assert handle is not None  # when_busy="wait": never skipped
        result = handle.result()
    except Exception as exc:
        outcome.finished = time.time()
        outcome.error_type = type(exc).__name__
        outcome.typed = isinstance(exc, ElasticCheckpointError)
        outcome.message = str(exc)
        return outcome
    outcome.finished = time.time()
    outcome.name = result.name
    if result.manifest is not None:  # rank 0
        outcome.save_id = result.manifest.save_id
        outcome.generation = result.manifest.generation
        ckpt = engine.storage.child(result.name)
        outcome.listing = {e.name: e.size for e in ckpt.listdir() if not e.is_dir}
    return outcome


class HookedStorage(LocalStorage):
    """Local storage that runs ``hooks["<op>:<path pattern>"]`` once, right after that
    operation (right before it, for ``before-write``). Paths are relative to the storage the
    operation runs on (a checkpoint's own files: to its directory)."""

    hooks: dict[str, Callable[[], None]]

    def _fire(self, op: str, rel: str) -> None:
        for pattern in list(self.hooks):
            if fnmatch.fnmatchcase(f"{op}:{rel}", pattern):
                self.hooks.pop(pattern)()
                return

    def listdir(self, rel: str = "") -> list[Entry]:
        entries = super().listdir(rel)
        self._fire("listdir", rel)
        return entries

    def delete(self, rel: str) -> None:
        super().delete(rel)
        self._fire("delete", rel)

    def retire(self, rel: str) -> None:
        super().retire(rel)
        self._fire("retire", rel)

    def write_stream(self, rel: str, *args: Any, **kwargs: Any) -> Written:
        self._fire("before-write", rel)
        return super().write_stream(rel, *args, **kwargs)


def hooked(root: Path) -> HookedStorage:
    storage = HookedStorage(str(root))
    storage.hooks = {}
    return storage
