"""How the command line shows what it found: values as text, sizes, times, tables, the rows
of ``ls``, and what each ``--check`` level compared.

Everything here takes whatever a manifest held (a hand-edited one may hold anything) and never
raises. Shared by every verb; imports neither torch nor Lightning.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from lightning_elastic.core.format.catalog import VALID

if TYPE_CHECKING:
    from lightning_elastic.cli.checks import Row
    from lightning_elastic.core.format.integrity import Problem

__all__ = [
    "CHECKED",
    "HEADER",
    "as_tuple",
    "describe",
    "get",
    "indent",
    "is_int",
    "iso",
    "items",
    "jsonable",
    "num",
    "row",
    "secs",
    "show",
    "size",
    "table",
    "timestamp",
    "what_was_checked",
]

# What each --check level compared, as ls/inspect/verify print it.
CHECKED = {"none": "manifest only", "size": "sizes checked", "full": "checksums checked"}


def get(fn: Callable[[], Any]) -> Any:
    """``fn()``, or ``None`` when it raises (a field a hand-edited manifest made unreadable)."""
    try:
        return fn()
    except Exception:
        return None


def is_int(value: Any) -> bool:
    """Whether ``value`` is an int and not a bool."""
    return type(value) is int


def timestamp(value: Any) -> float | None:
    """``value`` as Unix seconds when it can be one (``time.gmtime`` accepts it)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    if not math.isfinite(value) or not 0 <= value <= 1e11:
        return None
    return float(value)


def iso(unix: float | None) -> str | None:
    """Unix seconds as ``YYYY-MM-DD HH:MM:SS`` (UTC), or ``None``."""
    if unix is None:
        return None
    try:
        return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(unix))
    except (OverflowError, OSError, ValueError):
        return None


def show(value: Any, limit: int = 80) -> str:
    """``value`` as one line of at most ``limit`` characters (``-`` for ``None``)."""
    text = "-" if value is None else str(value)
    text = text.replace("\n", " ")
    return text if len(text) <= limit else text[: limit - 3] + "..."


def num(value: Any, spec: str = "g") -> str:
    """A number formatted with ``spec``; anything else through :func:`show`."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return show(value)
    if spec.endswith("f") and math.isfinite(value) and abs(value) >= 1e9:
        spec = ".4g"  # 1e300 seconds as 300 digits helps nobody
    try:
        return show(format(value, spec))
    except (ValueError, TypeError, OverflowError):
        return show(value)


def secs(value: Any) -> str:
    """Seconds with three decimals and an ``s``."""
    text = num(value, ".3f")
    return f"{text}s" if isinstance(value, (int, float)) and not isinstance(value, bool) else text


def items(value: Any) -> list[tuple[Any, Any]]:
    """A mapping's items sorted by key, or ``[]`` when ``value`` is not a mapping."""
    try:
        return sorted(value.items(), key=lambda kv: str(kv[0]))
    except Exception:
        return []


def jsonable(value: Any) -> Any:
    """``value`` with what strict JSON cannot hold replaced (non-finite floats -> null,
    unknown types -> their string)."""
    if value is None or isinstance(value, (str, bool, int)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    return str(value)


def size(n: Any) -> str:
    """A byte count in human units (``1.5 MiB``)."""
    if isinstance(n, bool) or not isinstance(n, (int, float)) or not math.isfinite(n):
        return "-" if n is None else show(n)
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            if unit == "B":
                return f"{value:.0f} {unit}"
            return f"{value:.1f} {unit}" if abs(value) < 1e6 else f"{value:.3g} {unit}"
        value /= 1024
    return str(n)


def table(rows: list[list[str]], header: list[str]) -> str:
    """``rows`` under ``header`` as aligned text columns."""
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows, strict=False)]
    lines = [
        "  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
        for r in [header, *rows]
    ]
    return "\n".join(lines)


def indent(text: str) -> str:
    """``text`` indented by two spaces, every line."""
    return "  " + text.replace("\n", "\n  ")


def as_tuple(value: Any) -> tuple[Any, ...]:
    """``value`` as a tuple when it is a list or tuple, else ``()``."""
    return tuple(value) if isinstance(value, (tuple, list)) else ()


def describe(problems: list[Problem]) -> str:
    """The first problem (by file) in one line, and how many more there are."""
    first = sorted(problems, key=lambda p: p.file)[0]
    more = f" (and {len(problems) - 1} more file(s))" if len(problems) > 1 else ""
    return f"{first.file}: {first.reason}{more}"


def what_was_checked(mode: str, path: str) -> str:
    """One line saying what a check of ``mode`` read and what it did not."""
    if mode == "full":
        return "checked: manifests, file sizes and checksums"
    what = "manifests and file sizes" if mode == "size" else "manifests only (not the files)"
    return f"checked: {what}; checksums not read (run `lightning-elastic verify {path}`)"


def row(r: Row) -> list[str]:
    """A :class:`Row` as the text table's cells (see ``HEADER``)."""
    d = r.to_json()
    status = r.status
    if r.status == VALID.value and r.checked == "none":
        status = "valid (manifest only)"
    return [
        r.info.name,
        show(d["step"]),
        show(d["epoch"]),
        show(d["world_size"]),
        show(d["run_id"], 24),
        size(d["bytes"]) + (f" (+{size(d['referenced_bytes'])} ref)" if d["references"] else ""),
        show(d["created"]),
        status,
    ]


HEADER = ["NAME", "STEP", "EPOCH", "WORLD", "RUN", "SIZE", "CREATED (UTC)", "STATUS"]
