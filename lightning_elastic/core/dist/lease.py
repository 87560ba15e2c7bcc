"""Fencing two live writers of one run: a lease per job, with a generation number.

Which rank calls what: only rank 0, which writes every commit. :func:`take_lease` when the
engine learns its run (at the first save, or when a load adopts a checkpoint's run);
:func:`check_lease` right before each manifest is written.

A lease is a file ``<root>/.leases/<run_id>/gen-<n>.json`` created exclusively (``link()`` on
local disks, ``If-None-Match`` on S3), carrying host, pid, start time and ``n``. A job takes
the next generation; the newest generation is the run's one live writer. A writer whose
generation is no longer the newest is *stale*: its commits are refused with
:class:`~lightning_elastic.errors.StaleWriterError` naming the newer writer, so the newer job
wins. That is what happens when SLURM requeues a job whose old copy is still running, or when
Kubernetes starts a pod while the old one is still terminating: the old copy's next commit
fails and it stops; nothing it wrote after the new job started is ever committed.

The check and the manifest's creation are two storage operations: a stale writer whose check
passed an instant before the new job took its lease can still commit that one save. It is a
valid checkpoint (every file verified), ordered by its commit sequence like any other.
"""

from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import asdict, dataclass

from lightning_elastic.core.format.manifest import is_plain_name
from lightning_elastic.core.storage.base import Storage
from lightning_elastic.errors import (
    CheckpointExistsError,
    ManifestError,
    Phase,
    RankFailure,
    StaleWriterError,
)

__all__ = ["LEASES_DIR", "Lease", "check_lease", "lease_leftovers", "take_lease"]

LEASES_DIR = ".leases"
_KEEP_OLD = 2  # older generations kept for messages; the rest are deleted


@dataclass(frozen=True)
class Lease:
    """One job's claim to write a run."""

    run_id: str
    generation: int
    host: str
    pid: int
    started_unix: float

    def describe(self) -> str:
        """The lease as messages show it: generation, host, pid and start time (UTC)."""
        started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.started_unix))
        return f"generation {self.generation} (host {self.host}, pid {self.pid}, since {started})"


def _folder(run_id: str) -> str:
    if not is_plain_name(run_id):
        raise ManifestError(f"run id {run_id!r} is not usable as a folder name")
    return f"{LEASES_DIR}/{run_id}"


def _generation(name: str) -> int | None:
    if name.startswith("gen-") and name.endswith(".json") and name[4:-5].isdigit():
        return int(name[4:-5])
    return None


def _generations(storage: Storage, run_id: str) -> list[int]:
    found = (_generation(e.name) for e in storage.listdir(_folder(run_id)))
    return sorted(g for g in found if g is not None)


def lease_leftovers(storage: Storage, *, older_than: float) -> list[str]:
    """Files under ``.leases`` that are not leases (a crash while one was written leaves its
    temporary copy) and were last modified before ``older_than`` (unix time)."""
    out = []
    for run in storage.listdir(LEASES_DIR):
        if not run.is_dir:
            continue
        for entry in storage.listdir(f"{LEASES_DIR}/{run.name}"):
            stale = entry.mtime is not None and entry.mtime < older_than
            if not entry.is_dir and _generation(entry.name) is None and stale:
                out.append(f"{LEASES_DIR}/{run.name}/{entry.name}")
    return out


def _read(storage: Storage, run_id: str, generation: int) -> Lease | None:
    try:
        data = json.loads(storage.read_bytes(f"{_folder(run_id)}/gen-{generation:09d}.json"))
        return Lease(**data)
    except Exception:
        return None


def take_lease(storage: Storage, run_id: str) -> Lease:
    """The next generation of ``run_id`` for this job (older leases beyond a few are removed)."""
    folder = _folder(run_id)
    for _ in range(100):
        known = _generations(storage, run_id)
        generation = (known[-1] if known else 0) + 1
        lease = Lease(run_id, generation, socket.gethostname(), os.getpid(), time.time())
        try:
            storage.write_bytes(
                f"{folder}/gen-{generation:09d}.json",
                json.dumps(asdict(lease)).encode(),
                exclusive=True,
            )
        except CheckpointExistsError:
            continue  # another job took this generation at the same moment: take the next
        for old in known[:-_KEEP_OLD]:
            storage.delete(f"{folder}/gen-{old:09d}.json")
        return lease
    raise CheckpointExistsError(f"could not take a lease for run {run_id!r}: too many contenders")


def check_lease(storage: Storage, lease: Lease) -> None:
    """Raise :class:`StaleWriterError` when a newer job holds the run."""
    known = _generations(storage, lease.run_id)
    if known and known[-1] > lease.generation:
        newer = _read(storage, lease.run_id, known[-1])
        who = newer.describe() if newer is not None else f"generation {known[-1]}"
        message = (
            f"this job (lease {lease.describe()}) is no longer the writer of run "
            f"{lease.run_id!r}: a newer job holds {who}; its commits win, this one is refused "
            "(stop this copy of the job)"
        )
        failure = RankFailure(0, Phase.COMMIT, StaleWriterError.__name__, message)
        raise StaleWriterError(storage.display(), [failure])
