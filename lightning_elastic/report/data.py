"""The report's data: checkpoints, sessions, world size, resumes with their lost work,
problems and storage over time, as plain JSON values.

Sources, and which one wins: a checkpoint's size, step, world size and phase timings come
from its manifest; the seconds the training step was blocked from the history's ``commit``
event when there is one (the manifest holds the staging time, which is the blocked time of
an asynchronous save). Resumes come from ``resume`` events; a session that started from a
checkpoint without one (a history written by an older release, a lost event) gets its lost
work derived from the previous session's last progress record, marked ``derived``. Storage
over time comes from ``commit`` events' ``retained_bytes``, else from the manifests still
present (a lower bound: what retention deleted is not counted).

Everything read from storage is validated already (catalog, :func:`read_history`), but the
fields of an event are free-form JSON: each is checked for its type here, and a value of the
wrong type reads as unknown (``None``).
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from lightning_elastic.core.format.catalog import CheckpointInfo
from lightning_elastic.core.observe.history import Event

__all__ = ["REPORT_VERSION", "CheckpointRow", "build_report"]

REPORT_VERSION = 1
_RECOVERY_PHASES = ("startup_s", "setup_s", "select_s", "verify_s", "load_s", "first_step_s")


@dataclass(frozen=True)
class CheckpointRow:
    """A checkpoint as the report sees it: the catalog's info and the status the CLI gave it
    after its checks (``valid``, ``corrupt``, ``incomplete``, ``unreadable``)."""

    info: CheckpointInfo
    status: str
    problem: str | None


def build_report(
    root: str,
    checkpoints: Sequence[CheckpointRow],
    events: Sequence[Event],
    *,
    skipped: int = 0,
    run_id: str | None = None,
    checked: str = "size",
    now: float | None = None,
) -> dict[str, Any]:
    """The report of ``root`` as JSON values (see docs/monitoring.md, "Run report")."""
    commits = _commit_events(events)
    ckpts = [_checkpoint(row, commits) for row in checkpoints]
    ckpts += _deleted(commits, {(c["run_id"], c["name"]) for c in ckpts})
    ckpts.sort(key=lambda c: (c["time"] is None, c["time"] or 0.0, c["name"]))
    sessions = _sessions(events)
    resumes = _resumes(events, sessions, ckpts)
    valid = [c for c in ckpts if c["status"] == "valid"]
    committed = [c for c in ckpts if c["status"] in ("valid", "deleted")]
    body: dict[str, Any] = {
        "version": REPORT_VERSION,
        "root": root,
        "generated": _iso(time.time() if now is None else now),
        "run_id": run_id,
        "runs": sorted({r for r in [*(c["run_id"] for c in ckpts), *_runs(events)] if r}),
        "checked": checked,
        "history": {"events": len(events), "skipped": skipped},
        "checkpoints": ckpts,
        "problems": [c for c in ckpts if c["status"] not in ("valid", "deleted")],
        "sessions": sessions,
        "world_size": _world_size(sessions, valid),
        "resumes": resumes,
        "save_failures": _of_kind(events, "save_failed"),
        "stragglers": _of_kind(events, "straggler"),
        "cadence": _of_kind(events, "cadence"),
        "replicas": _of_kind(events, "replica"),
        "storage": _storage(events, valid),
    }
    body["totals"] = _totals(body, valid, committed, events)
    return body


# ----------------------------------------------------------------------------- checkpoints


def _commit_events(events: Sequence[Event]) -> dict[tuple[str | None, str], Event]:
    return {
        (e.run_id, e.fields["name"]): e
        for e in events
        if e.kind == "commit" and isinstance(e.fields.get("name"), str)
    }


def _checkpoint(row: CheckpointRow, commits: dict[tuple[str | None, str], Event]) -> dict[str, Any]:
    info, m = row.info, row.info.manifest
    out: dict[str, Any] = {
        "name": info.name,
        "status": row.status,
        "problem": row.problem,
        "step": _int(_safe(lambda: info.step)),
        "run_id": _str(_safe(lambda: info.run_id)),
        "time": _num(_safe(lambda: info.created_unix)) or None,
        "created": None,
        "world_size": None,
        "bytes": None,
        "sequence": None,
        "resumed_from": None,
        "blocked_s": None,
        "blocked_from": None,
    }
    out["created"] = _iso(out["time"])
    if m is not None:
        t = m.timings
        out.update(
            world_size=_int(m.world_size),
            bytes=_int(_safe(lambda: m.total_bytes)),
            sequence=_int(m.sequence),
            resumed_from=_str(m.resumed_from),
            staging_s=_num(t.staging_s),
            writing_s=_num(t.writing_s),
            commit_s=_num(t.commit_s),
            total_s=_num(t.total_s),
        )
        event = commits.get((out["run_id"], info.name))
        blocked = _num(event.fields.get("blocked_s")) if event is not None else None
        if blocked is not None:
            out.update(blocked_s=blocked, blocked_from="history")
        else:
            out.update(blocked_s=out["staging_s"], blocked_from="manifest staging time")
    return out


def _deleted(
    commits: dict[tuple[str | None, str], Event], present: set[tuple[str | None, str]]
) -> list[dict[str, Any]]:
    """The committed checkpoints that are gone (retention, ``prune``), from their ``commit``
    events: the event's ``commit_s`` is the time from the save call to the durable commit,
    which the manifest calls ``total_s``."""
    rows = []
    for key, e in commits.items():
        if key in present:
            continue
        f = e.fields
        rows.append(
            {
                "name": key[1],
                "status": "deleted",
                "problem": None,
                "step": _int(f.get("step")),
                "run_id": e.run_id,
                "time": e.time,
                "created": _iso(e.time),
                "world_size": _int(f.get("world_size")),
                "bytes": _int(f.get("bytes")),
                "sequence": None,
                "resumed_from": None,
                "blocked_s": _num(f.get("blocked_s")),
                "blocked_from": "history",
                "staging_s": None,
                "writing_s": None,
                "commit_s": None,
                "total_s": _num(f.get("commit_s")),
            }
        )
    return rows


# ----------------------------------------------------------------------------- sessions


def _sessions(events: Sequence[Event]) -> list[dict[str, Any]]:
    by_session: dict[str, list[Event]] = {}
    for e in events:
        by_session.setdefault(e.session, []).append(e)
    sessions = [_session(sid, evs) for sid, evs in by_session.items()]
    return sorted(sessions, key=lambda s: (s["start_time"], s["session"]))


def _session(sid: str, evs: list[Event]) -> dict[str, Any]:
    start = _first(evs, "start")
    resume = _first(evs, "resume")
    end = _last(evs, "end")
    steps = [s for s in (_int(e.fields.get("step")) for e in evs) if s is not None]
    world = _first_value(evs, "world_size", ("start", "resume", "commit"))
    hosts = start.fields.get("hosts") if start is not None else None
    return {
        "session": sid,
        "run_id": evs[0].run_id,
        "start_time": evs[0].time,
        "last_time": max(e.time for e in evs),
        "started": _iso(evs[0].time),
        "start_step": _int(start.fields.get("step")) if start is not None else None,
        "last_step": max(steps) if steps else None,
        "world_size": _int(world),
        "hosts": sorted({h for h in hosts if isinstance(h, str)})
        if isinstance(hosts, list)
        else [],
        "resumed_from": _str(start.fields.get("resumed_from")) if start is not None else None,
        "resumed_step": _int(start.fields.get("resumed_step")) if start is not None else None,
        "resumed": resume is not None,
        "end_reason": _str(end.fields.get("reason")) if end is not None else None,
        "commits": sum(1 for e in evs if e.kind == "commit"),
    }


def _world_size(
    sessions: list[dict[str, Any]], valid: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """One segment per session (``start`` to ``end`` time); from the checkpoints' world sizes
    when there is no history."""
    segments = [
        {
            "start": s["start_time"],
            "end": s["last_time"],
            "world_size": s["world_size"],
            "session": s["session"],
            "run_id": s["run_id"],
            "source": "history",
        }
        for s in sessions
        if s["world_size"] is not None
    ]
    if segments:
        return segments
    points = sorted((c["time"], c["world_size"], c["run_id"]) for c in valid if c["time"])
    return [
        {"start": t, "end": t, "world_size": w, "session": None, "run_id": r, "source": "manifest"}
        for t, w, r in points
        if w is not None
    ]


# ----------------------------------------------------------------------------- resumes


def _resumes(
    events: Sequence[Event], sessions: list[dict[str, Any]], ckpts: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    out = [_resume(e) for e in events if e.kind == "resume"]
    seen = {r["session"] for r in out}
    created = {(c["run_id"], c["name"]): c["time"] for c in ckpts}
    previous: dict[str | None, dict[str, Any]] = {}
    for s in sessions:
        prev = previous.get(s["run_id"])
        previous[s["run_id"]] = s
        if s["session"] in seen or s["resumed_from"] is None:
            continue
        out.append(_derived_resume(s, prev, created.get((s["run_id"], s["resumed_from"]))))
    return sorted(out, key=lambda r: r["time"])


def _resume(e: Event) -> dict[str, Any]:
    f = e.fields
    raw = f.get("recovery")
    recovery: dict[str, Any] = raw if isinstance(raw, dict) else {}
    phases = {k: _num(recovery.get(k)) for k in _RECOVERY_PHASES}
    known = [v for v in phases.values() if v is not None]
    return {
        "time": e.time,
        "resumed": _iso(e.time),
        "session": e.session,
        "run_id": e.run_id,
        "checkpoint": _str(f.get("checkpoint")),
        "checkpoint_step": _int(f.get("checkpoint_step")),
        "interrupted_step": _int(f.get("interrupted_step")),
        "interrupted_time": _num(f.get("interrupted_time")),
        "lost_steps": _int(f.get("lost_steps")),
        "lost_s": _num(f.get("lost_s")),
        "planned": f.get("planned") if isinstance(f.get("planned"), bool) else None,
        "world_size": _int(f.get("world_size")),
        "previous_world_size": _int(f.get("previous_world_size")),
        "recovery": phases,
        "recovery_s": sum(known) if known else None,
        "derived": False,
    }


def _derived_resume(
    s: dict[str, Any], prev: dict[str, Any] | None, checkpoint_time: float | None
) -> dict[str, Any]:
    """A resume the history has no ``resume`` event for: the lost work from the previous
    session's last record (its last step and time) and the checkpoint's step and time."""
    last_step = prev["last_step"] if prev is not None else None
    last_time = prev["last_time"] if prev is not None else None
    resumed_step = s["resumed_step"]
    lost_steps = None
    if last_step is not None and resumed_step is not None:
        lost_steps = max(0, last_step - resumed_step)
    lost_s = None
    if last_time is not None and checkpoint_time is not None:
        lost_s = max(0.0, last_time - checkpoint_time)
    return {
        "time": s["start_time"],
        "resumed": s["started"],
        "session": s["session"],
        "run_id": s["run_id"],
        "checkpoint": s["resumed_from"],
        "checkpoint_step": resumed_step,
        "interrupted_step": last_step,
        "interrupted_time": last_time,
        "lost_steps": lost_steps,
        "lost_s": lost_s,
        "planned": None,
        "world_size": s["world_size"],
        "previous_world_size": prev["world_size"] if prev is not None else None,
        "recovery": dict.fromkeys(_RECOVERY_PHASES),
        "recovery_s": None,
        "derived": True,
    }


# ----------------------------------------------------------------------------- the rest


def _storage(events: Sequence[Event], valid: list[dict[str, Any]]) -> list[dict[str, Any]]:
    points = [
        {
            "time": e.time,
            "run_id": e.run_id,
            "bytes": _int(e.fields.get("retained_bytes")),
            "count": _int(e.fields.get("retained")),
            "source": "history",
        }
        for e in events
        if e.kind == "commit" and _int(e.fields.get("retained_bytes")) is not None
    ]
    if points:
        return points
    total: dict[str | None, tuple[int, int]] = {}
    out = []
    for c in sorted((c for c in valid if c["time"] and c["bytes"] is not None), key=_by_time):
        size, count = total.get(c["run_id"], (0, 0))
        total[c["run_id"]] = (size + c["bytes"], count + 1)
        out.append(
            {
                "time": c["time"],
                "run_id": c["run_id"],
                "bytes": size + c["bytes"],
                "count": count + 1,
                "source": "manifests present",
            }
        )
    return out


def _totals(
    body: dict[str, Any],
    valid: list[dict[str, Any]],
    committed: list[dict[str, Any]],
    events: Sequence[Event],
) -> dict[str, Any]:
    ckpts, resumes = body["checkpoints"], body["resumes"]
    times = [e.time for e in events] + [c["time"] for c in ckpts if c["time"]]
    # lost work is what failures cost: a planned resume (a resize, a deliberate rollback, a
    # refit after a finished run) is listed with its steps but not summed
    unplanned = [r for r in resumes if r["planned"] is not True]
    lost_steps = [r["lost_steps"] for r in unplanned if r["lost_steps"] is not None]
    lost_s = [r["lost_s"] for r in unplanned if r["lost_s"] is not None]
    counts: dict[str, int] = {}
    for c in ckpts:
        counts[c["status"]] = counts.get(c["status"], 0) + 1
    return {
        "checkpoints": counts,
        "valid_bytes": sum(c["bytes"] or 0 for c in valid),
        "first_time": min(times) if times else None,
        "last_time": max(times) if times else None,
        "sessions": len(body["sessions"]),
        "resumes": len(resumes),
        "lost_steps": sum(lost_steps) if lost_steps else None,
        "lost_s": sum(lost_s) if lost_s else None,
        "lost_unknown": sum(1 for r in unplanned if r["lost_steps"] is None),
        "interruptions": len(unplanned),
        "save_failures": len(body["save_failures"]),
        "stragglers": len(body["stragglers"]),
        "median_bytes": _median([c["bytes"] for c in committed]),
        "median_blocked_s": _median([c["blocked_s"] for c in committed]),
        "max_blocked_s": max(
            (c["blocked_s"] for c in committed if c["blocked_s"] is not None), default=None
        ),
        "median_total_s": _median([c.get("total_s") for c in committed]),
        "median_commit_s": _median([c.get("commit_s") for c in valid]),
        "world_sizes": _distinct([s["world_size"] for s in body["world_size"]]),
    }


def _of_kind(events: Sequence[Event], kind: str) -> list[dict[str, Any]]:
    return [
        {**e.fields, "time": e.time, "at": _iso(e.time), "session": e.session, "run_id": e.run_id}
        for e in events
        if e.kind == kind
    ]


def _runs(events: Sequence[Event]) -> list[str | None]:
    return [e.run_id for e in events]


def _first(evs: list[Event], kind: str) -> Event | None:
    return next((e for e in evs if e.kind == kind), None)


def _last(evs: list[Event], kind: str) -> Event | None:
    return next((e for e in reversed(evs) if e.kind == kind), None)


def _first_value(evs: list[Event], key: str, kinds: tuple[str, ...]) -> Any:
    return next((e.fields.get(key) for e in evs if e.kind in kinds and key in e.fields), None)


def _distinct(values: list[Any]) -> list[Any]:
    """``values`` without consecutive repeats (4, 4, 2, 3, 3 -> 4, 2, 3)."""
    out: list[Any] = []
    for v in values:
        if v is not None and (not out or out[-1] != v):
            out.append(v)
    return out


def _median(values: list[Any]) -> float | None:
    numbers = [v for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)]
    return statistics.median(numbers) if numbers else None


def _by_time(c: dict[str, Any]) -> float:
    return float(c["time"])


def _safe(fn: Any) -> Any:
    try:
        return fn()
    except Exception:
        return None


_MAX_COUNT = 2**53  # steps, bytes, ranks: beyond this a value is not one a run produced
_MAX_SECONDS = 1e12


def _int(value: Any) -> int | None:
    """A count (steps, bytes, ranks): an int in ``[0, 2**53]``, else unknown (a hand-edited
    history's ``world_size=10**30`` or ``lost_steps=-5`` must not reach sums and plots)."""
    return value if type(value) is int and 0 <= value <= _MAX_COUNT else None


def _num(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) and abs(value) <= _MAX_SECONDS else None


def _str(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def _iso(unix: Any) -> str | None:
    value = _num(unix)
    if value is None or not 0 <= value <= 1e11:
        return None
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(value))
