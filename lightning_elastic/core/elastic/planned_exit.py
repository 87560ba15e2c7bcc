"""Planned exits: a worker that leaves after an agreed checkpoint says so, so a launcher can
tell a membership change from a failure.

Which rank calls what: every worker that exits with ``128 + signum`` after the agreed
signal checkpoint calls :func:`record_planned_exit` (each writes its own marker); the
launcher (:mod:`lightning_elastic.launcher`) reads the markers of the workers it saw exit.
Outside that launcher (plain torchrun, SLURM) the environment variable is unset and nothing is
written.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

__all__ = [
    "PLANNED_EXIT_ENV",
    "WORKER_GENERATION_ENV",
    "read_planned_exit",
    "record_planned_exit",
]

# what `lightning-elastic run` tells its workers: the rendezvous round they were started in
# (the agent's store outlives them; process-group keys go under it)
WORKER_GENERATION_ENV = "LIGHTNING_ELASTIC_WORKER_GENERATION"

PLANNED_EXIT_ENV = "LIGHTNING_ELASTIC_PLANNED_EXIT_DIR"


def record_planned_exit(exitcode: int, step: int, *, pid: int | None = None) -> Path | None:
    """Leave a marker that this process is about to exit with ``exitcode`` after committing the
    checkpoint of ``step`` (atomically: a reader never sees half of it); ``None`` when no
    launcher asked for markers."""
    folder = os.environ.get(PLANNED_EXIT_ENV)
    if not folder:
        return None
    pid = os.getpid() if pid is None else pid
    path = Path(folder) / f"{pid}.json"
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps({"pid": pid, "exitcode": int(exitcode), "step": int(step)}))
    os.replace(tmp, path)
    return path


def read_planned_exit(folder: str | Path, pid: int) -> dict[str, Any] | None:
    """The marker process ``pid`` left in ``folder``, or ``None`` (none, or unreadable)."""
    try:
        data = json.loads((Path(folder) / f"{pid}.json").read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None
