"""The report as one self-contained HTML page: the text summary, the figure embedded as a
base64 PNG (no network resource, no script), and the tables. Every value from storage is
escaped; without matplotlib the page says so and keeps its tables."""

from __future__ import annotations

import base64
import html
from collections.abc import Callable, Sequence
from typing import Any

from lightning_elastic.report.figures import overview_png
from lightning_elastic.report.text import duration, render_text, show, size

__all__ = ["render_html"]

_STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em; color: #222; max-width: 1250px; }
pre { background: #f6f6f6; padding: 1em; overflow-x: auto; }
table { border-collapse: collapse; margin: 0.5em 0 2em; font-size: 0.9em; }
th, td { border: 1px solid #ccc; padding: 0.25em 0.6em; text-align: left; }
th { background: #eee; } td.num { text-align: right; }
.bad { color: #b00; } .note { color: #666; }
img { max-width: 100%; }
"""

_BAD = ("corrupt", "incomplete", "unreadable")
Column = tuple[str, Callable[[dict[str, Any]], str], bool]  # header, cell, numeric


def render_html(report: dict[str, Any]) -> str:
    """The page for ``report`` (from :func:`~lightning_elastic.report.build_report`)."""
    title = f"lightning-elastic run report: {report['root']}"
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>{_e(title)}</title><style>{_STYLE}</style></head><body>",
        f"<h1>{_e(title)}</h1>",
        f"<p class=note>generated {_e(report['generated'])}</p>",
        f"<h2>Summary</h2><pre>{_e(render_text(report))}</pre>",
        "<h2>Figures</h2>",
        _figure(report),
        "<h2>Checkpoints</h2>",
        _table(report["checkpoints"], _CHECKPOINT_COLUMNS, "no checkpoint"),
        "<h2>Resumes and lost work</h2>",
        _table(report["resumes"], _RESUME_COLUMNS, "no resume recorded"),
        "<h2>Sessions</h2>",
        _table(report["sessions"], _SESSION_COLUMNS, "no session recorded"),
        "<h2>Corrupt, quarantined and incomplete checkpoints</h2>",
        _table(report["problems"], _PROBLEM_COLUMNS, "none"),
        "<h2>Save failures</h2>",
        _table(report["save_failures"], _FAILURE_COLUMNS, "none recorded"),
        "<h2>Stragglers</h2>",
        _table(report["stragglers"], _STRAGGLER_COLUMNS, "none recorded"),
        "<h2>Cadence decisions</h2>",
        _table(report["cadence"], _CADENCE_COLUMNS, "none recorded"),
        "<h2>Replica groups</h2>",
        _table(report.get("replicas", []), _REPLICA_COLUMNS, "none recorded"),
        "</body></html>",
    ]
    return "\n".join(parts) + "\n"


def _figure(report: dict[str, Any]) -> str:
    try:
        png = overview_png(report)
    except Exception as exc:  # values no run produces (a hand-edited history): tables only
        return (
            "<p class=note>The figure could not be drawn from this data "
            f"({html.escape(repr(exc))}); the tables below hold the same data.</p>"
        )
    if png is None:
        return (
            "<p class=note>Figures need matplotlib, which is not installed here: "
            "<code>pip install 'lightning_elastic[report]'</code>. The tables below hold the "
            "same data.</p>"
        )
    data = base64.b64encode(png).decode("ascii")
    return f'<img alt="run report figures" src="data:image/png;base64,{data}">'


def _table(rows: Sequence[dict[str, Any]], columns: Sequence[Column], empty: str) -> str:
    if not rows:
        return f"<p class=note>{_e(empty)}</p>"
    head = "".join(f"<th>{_e(h)}</th>" for h, _, _ in columns)
    body = []
    for row in rows:
        cls = " class=bad" if row.get("status") in _BAD else ""
        cells = "".join(
            f"<td{' class=num' if num else ''}>{_e(cell(row))}</td>" for _, cell, num in columns
        )
        body.append(f"<tr{cls}>{cells}</tr>")
    return f"<table><tr>{head}</tr>\n" + "\n".join(body) + "</table>"


def _e(value: Any) -> str:
    return html.escape(show(value, 400))


def _get(key: str, limit: int = 80) -> Callable[[dict[str, Any]], str]:
    return lambda row: show(row.get(key), limit)


def _secs(key: str) -> Callable[[dict[str, Any]], str]:
    return lambda row: duration(row.get(key))


def _bytes(key: str) -> Callable[[dict[str, Any]], str]:
    return lambda row: size(row.get(key))


def _world(row: dict[str, Any]) -> str:
    before, after = row.get("previous_world_size"), row.get("world_size")
    return f"{before} -> {after}" if before not in (None, after) else show(after)


def _planned(row: dict[str, Any]) -> str:
    planned = row.get("planned")
    return "planned" if planned is True else "unplanned" if planned is False else "unknown"


_CHECKPOINT_COLUMNS: list[Column] = [
    ("name", _get("name"), False),
    ("step", _get("step"), True),
    ("committed (UTC)", _get("created"), False),
    ("run", _get("run_id", 24), False),
    ("world size", _get("world_size"), True),
    ("size", _bytes("bytes"), True),
    ("blocked", _secs("blocked_s"), True),
    ("staging", _secs("staging_s"), True),
    ("writing", _secs("writing_s"), True),
    ("commit phase", _secs("commit_s"), True),
    ("call to commit", _secs("total_s"), True),
    ("resumed from", _get("resumed_from"), False),
    ("status", _get("status"), False),
]
_RESUME_COLUMNS: list[Column] = [
    ("resumed (UTC)", _get("resumed"), False),
    ("run", _get("run_id", 24), False),
    ("from checkpoint", _get("checkpoint"), False),
    ("checkpoint step", _get("checkpoint_step"), True),
    ("interrupted at step", _get("interrupted_step"), True),
    ("lost steps", _get("lost_steps"), True),
    ("lost time", _secs("lost_s"), True),
    ("world size", _world, True),
    ("recovery", _secs("recovery_s"), True),
    ("cause", _planned, False),
    ("derived from progress", _get("derived"), False),
]
_SESSION_COLUMNS: list[Column] = [
    ("session", _get("session"), False),
    ("run", _get("run_id", 24), False),
    ("started (UTC)", _get("started"), False),
    ("first step", _get("start_step"), True),
    ("last step", _get("last_step"), True),
    ("world size", _get("world_size"), True),
    ("hosts", lambda r: show(", ".join(map(str, r.get("hosts") or [])), 120), False),
    ("resumed from", _get("resumed_from"), False),
    ("commits", _get("commits"), True),
    ("ended", _get("end_reason"), False),
]
_PROBLEM_COLUMNS: list[Column] = [
    ("name", _get("name"), False),
    ("step", _get("step"), True),
    ("run", _get("run_id", 24), False),
    ("status", _get("status"), False),
    ("problem", _get("problem", 300), False),
]
_FAILURE_COLUMNS: list[Column] = [
    ("at (UTC)", _get("at"), False),
    ("step", _get("step"), True),
    ("phase", _get("phase"), False),
    ("error", _get("error", 300), False),
]
_STRAGGLER_COLUMNS: list[Column] = [
    ("at (UTC)", _get("at"), False),
    ("step", _get("step"), True),
    ("rank", _get("rank"), True),
    ("host", _get("host"), False),
    ("slower than median", lambda r: show(r.get("factor")) + "x", True),
    ("local", _secs("local_s"), True),
    ("median", _secs("median_s"), True),
    ("where", _get("where"), False),
]
_REPLICA_COLUMNS: list[Column] = [
    ("at (UTC)", _get("at"), False),
    ("group", _get("group"), False),
    ("event", _get("event"), False),
    ("step", _get("step"), True),
    ("groups", _get("participants"), True),
    ("stall", _secs("stall_s"), True),
    ("transfer", _secs("transfer_s"), True),
    ("bytes", _get("transfer_bytes"), True),
    ("group rebuild", _secs("configure_s"), True),
]
_CADENCE_COLUMNS: list[Column] = [
    ("at (UTC)", _get("at"), False),
    ("step", _get("step"), True),
    ("interval", _secs("interval_s"), True),
    ("cost per save", _secs("cost_s"), True),
    ("MTBF", _secs("mtbf_s"), True),
    ("bound", _get("bound"), False),
]
