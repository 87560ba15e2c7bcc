"""Goodput of replica groups (``strategy="elastic_ft"``) under membership changes: a
Lighthouse and two groups of one process on this machine (``tests/replicas/group_worker.py``:
a tiny model, ``--step-time`` per step, a checkpoint every ``--every`` steps), and every
``--period`` seconds an event on group B:

* ``loss``: B is SIGKILLed; a fresh B starts ``--rejoin`` s later and heals from A;
* ``planned``: B is drained (SIGTERM: it leaves at the next step boundary, exit 143); a fresh
  B starts ``--rejoin`` s later;
* ``none``: no event (the fault-free rate).

Goodput = the steps group A committed / (wall time x the fault-free steps per second); A never
restarts. Per event: A's stall (the gap between its committed steps around the event, less a
normal step), the failed attempt's detection, the quorum and the process-group rebuild that
followed; per join: B's heal (quorum, state transfer and bytes, rebuild), its start to its
first committed step, and what the join cost A (A's gap at that step, less a normal step).
Used by ``bench_goodput.py --ft``.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import signal
import statistics
import time
from pathlib import Path
from typing import Any

from tests.replicas.harness import Group, Lighthouse, read_events, read_journal


def run_ft(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    """One replica-group run of ``args.mode`` in ``root``; see the module docstring."""
    lighthouse = Lighthouse(heartbeat_s=args.heartbeat, join_s=args.join)
    env = {
        "SAMPLES": 1_000_000,  # one long epoch: epoch ends are not what is measured
        "BATCH": 4,
        "EPOCHS": 1000,
        "STEP_SLEEP": args.step_time,
        "CKPT": root / "ckpt",
        "CKPT_EVERY": args.every,
    }
    a = Group(root, lighthouse, "a", **env)
    groups = [Group(root, lighthouse, "b", **env)]
    starts = {groups[0].journal: time.time()}
    events: list[tuple[str, float]] = []
    try:
        _wait(lambda: _participants(a) >= 2, 300, "two groups in step", a, groups[0])
        began = time.time()
        end, next_event = began + args.duration, began + args.period
        while time.time() < end:
            time.sleep(0.05)
            if args.mode == "none" or time.time() < next_event:
                continue
            node = groups[-1]
            events.append((args.mode, time.time()))
            if args.mode == "loss":
                node.kill()
            else:
                node.signal(signal.SIGTERM)
                with contextlib.suppress(Exception):
                    node.wait(120)
            time.sleep(args.rejoin)
            events.append(("join", time.time()))
            groups.append(Group(root, lighthouse, "b", **env))
            starts[groups[-1].journal] = time.time()
            next_event = events[-2][1] + args.period
        stopped = time.time()
    finally:
        for group in [a, *groups]:
            if group.process.poll() is None:
                group.kill()
        lighthouse.close()
    steps = [r for r in read_journal(a.journal) if began <= r["t"] <= stopped]
    times = sorted(r["t"] for r in steps)
    normal = statistics.median(b - a for a, b in itertools.pairwise(times))
    a_events = read_events(a.journal)
    per_event = [_event(kind, at, times, normal, a_events) for kind, at in events]
    joins = [_join(g, starts[g.journal]) for g in groups[1:]]
    return {
        "path": "replica groups",
        "mode": args.mode,
        "wall_s": stopped - began,
        "steps_kept": len(steps),
        "steps_re_executed": 0,  # survivors never reload a checkpoint
        "events": len(events),
        "normal_step_s": normal,
        "per_event": per_event,
        "joins": joins,
    }


def _participants(group: Group) -> int:
    records = group.records()
    return int(records[-1].get("participants") or 0) if records else 0


def _wait(condition: Any, timeout: float, what: str, *groups: Group) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}: " + groups[0].tail())
        time.sleep(0.2)


def _event(
    kind: str, at: float, times: list[float], normal: float, events: list[dict[str, Any]]
) -> dict[str, Any]:
    """A's stall at the event (its longest gap between committed steps in the 10 s after it,
    less a normal step) and the quorum events it recorded then."""
    window = [t for t in times if at - normal <= t <= at + 10.0]
    gaps = [b - a for a, b in itertools.pairwise(window)]
    near = [e for e in events if at - 1.0 <= e["t"] <= at + 10.0]
    failed = [e for e in near if e["event"] == "failed"]
    changes = [e for e in near if e["event"] == "change"]
    return {
        "event": kind,
        "stall_s": max(0.0, max(gaps, default=normal) - normal),
        "detection_s": sum(e["stall_s"] for e in failed),
        "quorum_s": sum(e["stall_s"] for e in changes),
        "rebuild_s": sum(e.get("configure_s", 0.0) for e in changes),
        "failed_attempts": len(failed),
    }


def _join(group: Group, started: float) -> dict[str, Any]:
    records = group.records()
    heal = next((e for e in read_events(group.journal) if e["event"] == "join"), {})
    return {
        "start_to_first_step_s": (records[0]["t"] - started) if records else None,
        "heal_quorum_s": heal.get("stall_s"),
        "transfer_s": heal.get("transfer_s"),
        "transfer_bytes": heal.get("transfer_bytes"),
        "rebuild_s": heal.get("configure_s"),
    }


def summary(result: dict[str, Any], fault_free_steps_per_s: float) -> dict[str, Any]:
    """Goodput and the median of each part of the per-event split."""
    goodput = result["steps_kept"] / (result["wall_s"] * fault_free_steps_per_s)

    def medians(rows: list[dict[str, Any]]) -> dict[str, float]:
        keys = [k for k in (rows[0] if rows else {}) if isinstance(rows[0][k], (int, float))]
        return {
            k: statistics.median(r[k] for r in rows if isinstance(r[k], (int, float))) for k in keys
        }

    return {
        **{k: v for k, v in result.items() if k not in ("per_event", "joins")},
        "goodput": goodput,
        "median_event": medians([e for e in result["per_event"] if e["event"] != "join"]),
        "median_join_cost_to_others": medians(
            [e for e in result["per_event"] if e["event"] == "join"]
        ),
        "median_join": medians(result["joins"]),
    }


def compare(args: argparse.Namespace, restart_run: Any, restart_summary: Any) -> dict[str, Any]:
    """``--ft``: the fault-free and the ``args.mode`` runs of both paths, one after the other
    in this process (replica groups first), each path's goodput against its own fault-free
    rate."""
    import tempfile

    out: dict[str, Any] = {}
    for path, run, summarize in (
        ("replica groups", run_ft, summary),
        ("restart", restart_run, restart_summary),
    ):
        rates: dict[str, float] = {}
        for mode in ("none", args.mode):
            trial = argparse.Namespace(**{**vars(args), "mode": mode})
            with tempfile.TemporaryDirectory(prefix="goodput-") as tmp:
                result = run(trial, Path(tmp))
            if mode == "none":
                rates[path] = result["steps_kept"] / result["wall_s"]
                if args.mode == "none":
                    break
                continue
            out[path] = {**summarize(result, rates[path]), "fault_free_steps_per_s": rates[path]}
            if path == "replica groups":
                out[path]["per_event"] = result["per_event"]
                out[path]["joins"] = result["joins"]
            else:
                out[path]["recovery"] = result["recovery"]
    return out
