"""What a restart cost: the checkpoint a launch resumed from, what the previous launches of the
run left in its history (where the last one was when it stopped, how often the run restarted,
its MTBF), and the ``resume`` record that puts the two together (lost steps and seconds, and
the recovery split into downtime, start-up, setup, selection, verification, read and the
first step).

Pure functions over the run history (:mod:`~lightning_elastic.core.observe.history`) and a
load's result; no Lightning, no collective. Which rank calls what: rank 0 reads the history
(:func:`past_launches`) and the monitor broadcasts what it found; every rank builds its own
record (:func:`resume_record`), rank 0 writes it.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from lightning_elastic.core.policy.cadence import mtbf_from_history

if TYPE_CHECKING:
    from lightning_elastic.core.load.load import LoadResult
    from lightning_elastic.core.observe.history import RunHistory

__all__ = [
    "Interrupted",
    "LoadCost",
    "PastLaunches",
    "Resumed",
    "past_launches",
    "process_start_unix",
    "resume_record",
]

log = logging.getLogger(__name__)


class LoadCost(Protocol):
    """What loading the resumed checkpoint cost this rank, split (the Lightning session's
    ``ResumeCost`` is one)."""

    @property
    def seconds(self) -> float:
        """The whole load: selection, verification and read."""
        ...

    @property
    def selection_s(self) -> float:
        """Choosing the checkpoint."""
        ...

    @property
    def verify_s(self) -> float:
        """Verifying it."""
        ...

    @property
    def read_s(self) -> float:
        """Reading (and resharding) it."""
        ...


@dataclass(frozen=True)
class Resumed:
    """The checkpoint a launch resumed from, and what loading it cost (rank 0's view)."""

    name: str
    step: int
    world_size: int
    taken_unix: float  # when its step was reached (its commit time less the save's duration)
    load_s: float  # selection + verification + read
    select_s: float
    verify_s: float
    read_s: float

    @classmethod
    def of(cls, result: LoadResult | None, cost: LoadCost | None) -> Resumed | None:
        """From a load's result and its cost (``None``: the launch started fresh)."""
        if result is None or cost is None:
            return None
        manifest = result.manifest
        timings = getattr(manifest, "timings", None)
        took = timings.total_s if timings is not None else 0.0
        return cls(
            name=result.info.name,
            step=int(manifest.step),
            world_size=int(manifest.world_size),
            taken_unix=float(manifest.created_unix) - took,
            load_s=cost.seconds,
            select_s=cost.selection_s,
            verify_s=cost.verify_s,
            read_s=cost.read_s,
        )

    @classmethod
    def from_load(cls, result: LoadResult, *, seconds: float | None = None) -> Resumed:
        """From what ``CheckpointEngine.load`` returned; ``seconds``: the whole load as the
        caller timed it (default: its verification and read, no selection)."""
        total = result.verify_s + result.load_s if seconds is None else seconds
        resumed = cls.of(result, _Cost(total, result.verify_s, result.load_s))
        assert resumed is not None
        return resumed


@dataclass(frozen=True)
class _Cost:
    seconds: float
    verify_s: float
    read_s: float

    @property
    def selection_s(self) -> float:
        return max(0.0, self.seconds - self.verify_s - self.read_s)


@dataclass(frozen=True)
class Interrupted:
    """The last progress record of the previous launches: its step, its time, and whether
    the launch ended by plan (the end of training, a signal) rather than by a crash."""

    step: int
    time: float
    planned: bool


@dataclass(frozen=True)
class PastLaunches:
    """What the previous launches of a run left in its history (picklable: broadcast)."""

    last: Interrupted | None = None
    restarts: int = 0  # launches that resumed before this one
    world_size_changes: int = 0  # resumes at another world size
    mtbf_s: float | None = None  # the run's mean time between unplanned interruptions


def past_launches(history: RunHistory, *, resuming: bool) -> PastLaunches:
    """What the previous launches left, from one read of the run's start, resume and progress
    records (read before this launch writes its own): the last progress record, the launches
    that resumed before this one (from their start events, so one killed in its first step
    counts) and the resumes at another world size, and the run's MTBF: the time since its
    first start over its unplanned interruptions, this launch's included (``resuming``) when
    the previous one did not end by itself. Never raises: an unreadable history is nothing."""
    from lightning_elastic.core.observe.history import read_history

    try:
        events, _skipped = read_history(
            history.storage, run_id=history.run_id, kinds=("start", "resume", "progress")
        )
    except Exception as exc:  # observability never fails training
        log.warning("could not read the run history: %r", exc)
        return PastLaunches()
    last = None
    progress = [e for e in events if e.kind == "progress"]
    if progress:
        previous = progress[-1]  # oldest first: the newest record of any session
        planned = bool(previous.fields.get("planned", False))
        last = Interrupted(int(previous.fields.get("step", 0)), previous.time, planned)
    starts = [e for e in events if e.kind == "start"]
    resumes = [e for e in events if e.kind == "resume"]
    changes = sum(
        1 for e in resumes if e.fields.get("world_size") != e.fields.get("previous_world_size")
    )
    unplanned_now = resuming and last is not None and not last.planned
    failures = sum(1 for e in resumes if e.fields.get("planned") is False) + unplanned_now
    mtbf = mtbf_from_history(failures, time.time() - starts[0].time) if starts else None
    restarted = sum(1 for e in starts if e.fields.get("resumed_from") is not None)
    return PastLaunches(last, restarted, changes, mtbf)


def resume_record(
    resumed: Resumed,
    last: Interrupted | None,
    *,
    world_size: int,
    setup_unix: float,
    loaded_unix: float,
) -> dict[str, Any]:
    """The fields of the ``resume`` history record: the checkpoint, the two world sizes,
    where the previous launch was interrupted and what that lost (unknown, not 0, without a
    progress record at or after the checkpoint's step), and the recovery's parts (seconds;
    ``first_step_s`` is filled in when the first step is done). ``setup_unix``: when the
    trainer's setup began; ``loaded_unix``: when training started after the load."""
    fields: dict[str, Any] = {
        "checkpoint": resumed.name,
        "checkpoint_step": resumed.step,
        "world_size": world_size,
        "previous_world_size": resumed.world_size,
        "interrupted_step": None,
        "interrupted_time": None,
        "lost_steps": None,
        "lost_s": None,
        "planned": None,
    }
    if last is not None:
        fields["planned"] = last.planned
        # a progress record older than the checkpoint (a launch killed within a second of
        # its start) says nothing about what was lost: unknown, not 0
        if last.step >= resumed.step:
            fields.update(
                interrupted_step=last.step,
                interrupted_time=last.time,
                lost_steps=last.step - resumed.step,
                lost_s=max(0.0, last.time - resumed.taken_unix),
            )
    started = process_start_unix()
    interrupted = fields["interrupted_time"]
    fields["recovery"] = {
        "downtime_s": None if started is None or interrupted is None else started - interrupted,
        "startup_s": None if started is None else setup_unix - started,
        "setup_s": max(0.0, loaded_unix - setup_unix - resumed.load_s),
        "select_s": resumed.select_s,
        "verify_s": resumed.verify_s,
        "load_s": resumed.read_s,
        "first_step_s": None,
    }
    return fields


def process_start_unix() -> float | None:
    """When this process started (Linux ``/proc``), ``None`` elsewhere."""
    try:
        with open("/proc/self/stat", encoding="ascii") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        with open("/proc/uptime", encoding="ascii") as f:
            uptime = float(f.read().split()[0])
        ticks = os.sysconf("SC_CLK_TCK")
        return time.time() - uptime + int(fields[19]) / ticks
    except (OSError, ValueError, IndexError):
        return None
