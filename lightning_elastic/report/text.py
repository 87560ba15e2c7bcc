"""The report's text summary (what ``lightning-elastic report`` prints), and the formatting
helpers the HTML page shares. Every value may be ``None`` (unknown); none raises."""

from __future__ import annotations

import math
from typing import Any

from lightning_elastic.core.observe.history import HISTORY_DIR

__all__ = ["duration", "render_text", "show", "size"]


def render_text(report: dict[str, Any]) -> str:
    """The summary of ``report`` (from :func:`~lightning_elastic.report.build_report`), one
    line per fact, details indented below it."""
    lines = [_title(report), *_checkpoints(report), *_sessions(report), *_resumes(report)]
    lines += _problems(report) + _events(report) + _storage(report) + _history(report)
    return "\n".join(lines)


def _title(report: dict[str, Any]) -> str:
    runs = report["runs"]
    if report["run_id"] is not None:
        which = f"run {show(report['run_id'])}"
    else:
        which = f"{len(runs)} run(s): {', '.join(show(r, 24) for r in runs)}" if runs else "no run"
    return f"run report of {show(report['root'], 200)} ({which})"


def _checkpoints(report: dict[str, Any]) -> list[str]:
    t = report["totals"]
    valid = [c for c in report["checkpoints"] if c["status"] in ("valid", "deleted")]
    counts = t["checkpoints"]
    others = ", ".join(
        f"{n} {s}" + (" by retention or prune" if s == "deleted" else "")
        for s, n in sorted(counts.items())
        if s != "valid"
    )
    steps = [c["step"] for c in valid if c["step"] is not None]
    line = f"checkpoints: {counts.get('valid', 0)} valid ({size(t['valid_bytes'])})"
    line += f", {others}" if others else ""
    if steps:
        line += f"; steps {min(steps)} to {max(steps)}"
    checked = {"none": "manifests only", "size": "sizes checked", "full": "checksums checked"}
    line += f" ({checked.get(report['checked'], report['checked'])})"
    out = [line]
    if valid:
        out.append(
            f"  per save (medians): {size(t['median_bytes'])}, training blocked "
            f"{duration(t['median_blocked_s'])} (max {duration(t['max_blocked_s'])}), save call "
            f"to commit {duration(t['median_total_s'])}, commit phase "
            f"{duration(t['median_commit_s'])}"
        )
    return out


def _sessions(report: dict[str, Any]) -> list[str]:
    t, sessions = report["totals"], report["sessions"]
    if not sessions:
        return []
    first, last = t["first_time"], t["last_time"]
    span = duration(last - first) if first is not None and last is not None else "-"
    worlds = " -> ".join(str(w) for w in t["world_sizes"]) or "-"
    return [
        f"sessions: {len(sessions)} from {show(sessions[0]['started'])} over {span}; "
        f"world size {worlds}"
    ]


def _resumes(report: dict[str, Any]) -> list[str]:
    resumes, t = report["resumes"], report["totals"]
    if not resumes:
        return ["resumes: none"] if report["sessions"] else []
    out = [f"resumes: {len(resumes)}"]
    for r in resumes:
        world = show(r["world_size"])
        if r["previous_world_size"] not in (None, r["world_size"]):
            world = f"{show(r['previous_world_size'])} -> {world}"
        kind = {True: "planned", False: "unplanned", None: "cause unknown"}[r["planned"]]
        note = ", derived from progress records" if r["derived"] else ""
        out.append(
            f"  {show(r['resumed'])}  from {show(r['checkpoint'], 40)} (step "
            f"{show(r['checkpoint_step'])}), world size {world}: lost {show(r['lost_steps'])} "
            f"steps / {duration(r['lost_s'])}, recovery {duration(r['recovery_s'])} "
            f"({kind}{note})"
        )
    unknown = t.get("lost_unknown") or 0
    out.append(
        f"lost work: {show(t['lost_steps'])} steps, {duration(t['lost_s'])} over "
        f"{t.get('interruptions', len(resumes))} unplanned interruption(s)"
        + (f" (unknown for {unknown}: no progress record after its checkpoint)" if unknown else "")
    )
    return out


def _problems(report: dict[str, Any]) -> list[str]:
    problems = report["problems"]
    if not problems:
        return ["problems: none"]
    out = [f"problems: {len(problems)} checkpoint(s) not valid"]
    for c in problems:
        out.append(f"  {show(c['name'], 40)}: {c['status']}: {show(c['problem'], 160)}")
    return out


def _events(report: dict[str, Any]) -> list[str]:
    out = []
    failures = report["save_failures"]
    if failures:
        f = failures[-1]
        out.append(
            f"save failures: {len(failures)} (last at step {show(f.get('step'))}, phase "
            f"{show(f.get('phase'))}: {show(f.get('error'), 120)})"
        )
    stragglers = report["stragglers"]
    if stragglers:
        ranks: dict[str, int] = {}
        for s in stragglers:
            key = f"rank {show(s.get('rank'))} on {show(s.get('host'), 40)}"
            ranks[key] = ranks.get(key, 0) + 1
        worst = ", ".join(f"{k} ({n}x)" for k, n in sorted(ranks.items(), key=lambda kv: -kv[1]))
        out.append(f"stragglers: {len(stragglers)} report(s): {show(worst, 200)}")
    replicas = report.get("replicas") or []
    if replicas:
        kinds: dict[str, int] = {}
        for r in replicas:
            kinds[str(r.get("event"))] = kinds.get(str(r.get("event")), 0) + 1
        stalls = [
            float(r["stall_s"]) for r in replicas if isinstance(r.get("stall_s"), (int, float))
        ]
        out.append(
            f"replica groups: {len(replicas)} event(s) ("
            + ", ".join(f"{k} {n}" for k, n in sorted(kinds.items()))
            + f"), longest stall {duration(max(stalls) if stalls else None)}"
        )
    cadence = report["cadence"]
    if cadence:
        c = cadence[-1]
        out.append(
            f"cadence: {len(cadence)} decision(s), last every {duration(c.get('interval_s'))} "
            f"(cost {duration(c.get('cost_s'))}, MTBF {duration(c.get('mtbf_s'))}, bound "
            f"{show(c.get('bound'))})"
        )
    return out


def _storage(report: dict[str, Any]) -> list[str]:
    points = report["storage"]
    if not points:
        return []
    latest: dict[Any, int] = {}
    peak = 0
    for p in points:
        latest[p["run_id"]] = p["bytes"] or 0
        peak = max(peak, sum(latest.values()))
    source = "commit records" if points[0]["source"] == "history" else "manifests present"
    # now: what the valid checkpoints present hold (a prune or a deletion by hand since the
    # last commit record is not in the history)
    now = report["totals"]["valid_bytes"]
    return [f"storage: {size(now)} retained now, peak {size(max(peak, now))} ({source})"]


def _history(report: dict[str, Any]) -> list[str]:
    h = report["history"]
    if not h["events"]:
        return [
            f"history: none recorded in {HISTORY_DIR}/ (sessions, resumes and lost work are "
            "unknown; the DistributedCheckpoint callback records them)"
            + (f"; {h['skipped']} unreadable object(s) skipped" if h["skipped"] else "")
        ]
    return [f"history: {h['events']} events, {h['skipped']} unreadable object(s) skipped"]


# ----------------------------------------------------------------------------- formatting


def show(value: Any, limit: int = 80) -> str:
    """``value`` on one line, at most ``limit`` characters (``-`` when unknown)."""
    text = "-" if value is None else str(value)
    text = "".join(c if c.isprintable() else " " for c in text)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def size(n: Any) -> str:
    """Bytes as ``12.3 MiB``."""
    if isinstance(n, bool) or not isinstance(n, (int, float)) or not math.isfinite(n):
        return "-"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return "-"


def duration(seconds: Any) -> str:
    """Seconds as ``0.21 s``, ``41.2 s``, ``3.5 min`` or ``2.1 h``."""
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)):
        return "-"
    if not math.isfinite(seconds):
        return "-"
    if abs(seconds) < 10:
        return f"{seconds:.2f} s"
    if abs(seconds) < 120:
        return f"{seconds:.1f} s"
    if abs(seconds) < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"
