"""The report's figure: eight panels drawn with matplotlib (imported here only, with the Agg
canvas: no display, no pyplot global state), returned as PNG bytes."""

from __future__ import annotations

import io
from typing import Any

__all__ = ["overview_png"]

_RECOVERY = (
    ("startup_s", "start-up"),
    ("setup_s", "setup"),
    ("select_s", "selection"),
    ("verify_s", "verification"),
    ("load_s", "load"),
    ("first_step_s", "first step"),
)


def overview_png(report: dict[str, Any], *, dpi: int = 90) -> bytes | None:
    """The report's figure as PNG, or ``None`` when matplotlib is not installed."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        return None
    fig = Figure(figsize=(13, 15), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(4, 2)
    clock = _Clock(report)
    # present and deleted by retention alike (the latter known from their commit events)
    valid = [c for c in report["checkpoints"] if c["status"] in ("valid", "deleted")]
    _size_over(axes[0][0], valid, report, clock, by_step=False)
    _seconds_over(axes[0][1], valid, report, clock, by_step=False)
    _size_over(axes[1][0], valid, report, clock, by_step=True)
    _seconds_over(axes[1][1], valid, report, clock, by_step=True)
    _world_size(axes[2][0], report, clock)
    _storage(axes[2][1], report, clock)
    _lost_work(axes[3][0], report)
    _recovery(axes[3][1], report)
    title = f"lightning-elastic run report: {report['root']}"
    fig.suptitle(title if len(title) < 110 else title[:107] + "...")
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    return buf.getvalue()


class _Clock:
    """Wall time as a readable offset from the first thing the report knows of."""

    def __init__(self, report: dict[str, Any]) -> None:
        t = report["totals"]
        self.t0 = t["first_time"] or 0.0
        span = (t["last_time"] or self.t0) - self.t0
        self.div, self.unit = (1.0, "s") if span < 300 else (60.0, "min")
        if span >= 3 * 3600:
            self.div, self.unit = 3600.0, "h"

    def __call__(self, unix: float) -> float:
        return (unix - self.t0) / self.div

    def label(self) -> str:
        return f"wall time since the first record ({self.unit})"


def _bytes_scale(values: list[int]) -> tuple[float, str]:
    top = max(values, default=0)
    for div, unit in ((2**40, "TiB"), (2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if top >= div:
            return float(div), unit
    return 1.0, "B"


def _empty(ax: Any, title: str, why: str) -> None:
    ax.set_title(title)
    ax.text(0.5, 0.5, why, ha="center", va="center", transform=ax.transAxes, color="grey")
    ax.set_xticks([])
    ax.set_yticks([])


def _resume_lines(ax: Any, report: dict[str, Any], clock: _Clock) -> None:
    for i, r in enumerate(report["resumes"]):
        label = "resume" if i == 0 else None
        ax.axvline(clock(r["time"]), color="tab:red", linestyle="--", linewidth=1, label=label)


def _size_over(
    ax: Any, valid: list[dict[str, Any]], report: dict[str, Any], clock: _Clock, *, by_step: bool
) -> None:
    title = "checkpoint size over " + ("step" if by_step else "wall time")
    key = "step" if by_step else "time"
    rows = [c for c in valid if c[key] is not None and c["bytes"] is not None]
    if not rows:
        _empty(ax, title, "no valid checkpoint")
        return
    div, unit = _bytes_scale([c["bytes"] for c in rows])
    xs = [c["step"] if by_step else clock(c["time"]) for c in rows]
    ax.plot(xs, [c["bytes"] / div for c in rows], "o-", markersize=4, label="committed checkpoint")
    bad = [c for c in report["problems"] if c[key] is not None]
    if bad:
        bx = [c["step"] if by_step else clock(c["time"]) for c in bad]
        ax.plot(bx, [0] * len(bad), "x", color="tab:red", markersize=9, label="corrupt/incomplete")
    if not by_step:
        _resume_lines(ax, report, clock)
    ax.set_title(title)
    ax.set_xlabel("step" if by_step else clock.label())
    ax.set_ylabel(unit)
    ax.set_ylim(bottom=0)
    ax.legend(loc="best", fontsize="small")


def _seconds_over(
    ax: Any, valid: list[dict[str, Any]], report: dict[str, Any], clock: _Clock, *, by_step: bool
) -> None:
    title = "save seconds over " + ("step" if by_step else "wall time")
    key = "step" if by_step else "time"
    rows = [c for c in valid if c[key] is not None]
    if not rows:
        _empty(ax, title, "no valid checkpoint")
        return
    xs = [c["step"] if by_step else clock(c["time"]) for c in rows]
    series = (
        ("blocked_s", "training blocked", "o-"),
        ("total_s", "save call to commit", "s-"),
    )
    for field, label, style in series:
        pts = [(x, c.get(field)) for x, c in zip(xs, rows, strict=True) if c.get(field) is not None]
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], style, markersize=4, label=label)
    if not by_step:
        _resume_lines(ax, report, clock)
    ax.set_title(title)
    ax.set_xlabel("step" if by_step else clock.label())
    ax.set_ylabel("seconds")
    ax.set_ylim(bottom=0)
    ax.legend(loc="best", fontsize="small")


def _world_size(ax: Any, report: dict[str, Any], clock: _Clock) -> None:
    title = "world size over time, resumes and lost work"
    segments = report["world_size"]
    if not segments:
        _empty(ax, title, "no world size known")
        return
    for i, s in enumerate(segments):
        x0, x1 = clock(s["start"]), clock(s["end"])
        if x1 > x0:
            ax.hlines(
                s["world_size"],
                x0,
                x1,
                color="tab:blue",
                linewidth=3,
                label="session" if i == 0 else None,
            )
        else:
            ax.plot(
                [x0],
                [s["world_size"]],
                "o",
                color="tab:blue",
                label="checkpoint" if i == 0 else None,
            )
    labels = {"lost": "lost work", "down": "down (interruption to resume)"}
    by_name = {(c["run_id"], c["name"]): c["time"] for c in report["checkpoints"]}
    for r in report["resumes"]:
        stop, ckpt_time = r["interrupted_time"], by_name.get((r["run_id"], r["checkpoint"]))
        if stop is not None and ckpt_time is not None and stop > ckpt_time:
            ax.axvspan(
                clock(ckpt_time),
                clock(stop),
                color="tab:red",
                alpha=0.25,
                label=labels.pop("lost", None),
            )
        if stop is not None and r["time"] > stop:
            ax.axvspan(
                clock(stop),
                clock(r["time"]),
                color="grey",
                alpha=0.25,
                label=labels.pop("down", None),
            )
    _resume_lines(ax, report, clock)
    top = max(s["world_size"] for s in segments)
    ax.set_ylim(0, top + 1)
    ax.set_title(title)
    ax.set_xlabel(clock.label())
    ax.set_ylabel("ranks")
    ax.legend(loc="lower right", fontsize="small")


def _storage(ax: Any, report: dict[str, Any], clock: _Clock) -> None:
    title = "storage used by retention over time"
    points = [p for p in report["storage"] if p["bytes"] is not None]
    if not points:
        _empty(ax, title, "no commit recorded")
        return
    div, unit = _bytes_scale([p["bytes"] for p in points])
    runs: dict[Any, list[dict[str, Any]]] = {}
    for p in points:
        runs.setdefault(p["run_id"], []).append(p)
    for run, pts in runs.items():
        label = f"run {run}" if len(runs) > 1 else "retained checkpoints"
        ax.step(
            [clock(p["time"]) for p in pts],
            [p["bytes"] / div for p in pts],
            "o-",
            where="post",
            markersize=3,
            label=label,
        )
    source = points[0]["source"]
    ax.set_title(title + ("" if source == "history" else f" ({source})"))
    ax.set_xlabel(clock.label())
    ax.set_ylabel(unit)
    ax.set_ylim(bottom=0)
    ax.legend(loc="best", fontsize="small")


def _lost_work(ax: Any, report: dict[str, Any]) -> None:
    title = "lost work per interruption"
    resumes = [r for r in report["resumes"] if r["lost_s"] is not None or r["lost_steps"]]
    if not resumes:
        _empty(ax, title, "no interruption recorded")
        return
    xs = list(range(len(resumes)))
    bars = ax.bar(xs, [r["lost_s"] or 0.0 for r in resumes], color="tab:red", alpha=0.7)
    for bar, r in zip(bars, resumes, strict=True):
        steps = "?" if r["lost_steps"] is None else r["lost_steps"]
        ax.annotate(
            f"{steps} steps",
            (bar.get_x() + bar.get_width() / 2, bar.get_height()),
            ha="center",
            va="bottom",
            fontsize="small",
        )
    ax.set_xticks(xs, [_resume_label(r) for r in resumes], fontsize="small")
    ax.set_title(title)
    ax.set_ylabel("seconds of training lost")


def _recovery(ax: Any, report: dict[str, Any]) -> None:
    title = "recovery time per resume"
    resumes = [r for r in report["resumes"] if r["recovery_s"] is not None]
    if not resumes:
        _empty(ax, title, "no recovery timings recorded")
        return
    xs = list(range(len(resumes)))
    bottom = [0.0] * len(resumes)
    for key, label in _RECOVERY:
        heights = [r["recovery"].get(key) or 0.0 for r in resumes]
        if any(heights):
            ax.bar(xs, heights, bottom=bottom, label=label)
            bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
    ax.set_xticks(xs, [_resume_label(r) for r in resumes], fontsize="small")
    ax.set_title(title)
    ax.set_ylabel("seconds")
    ax.legend(loc="best", fontsize="small")


def _resume_label(r: dict[str, Any]) -> str:
    world = str(r["world_size"] or "?")
    if r["previous_world_size"] not in (None, r["world_size"]):
        world = f"{r['previous_world_size']}->{world}"
    return (
        f"step {r['checkpoint_step'] if r['checkpoint_step'] is not None else '?'}\n{world} ranks"
    )
