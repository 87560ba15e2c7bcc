"""What checkpoints a root directory holds, and in which state.

Status words (also printed by the CLI):

* ``valid``: a complete, parseable manifest and no quarantine record (checksums are checked
  separately by :mod:`~lightning_elastic.core.format.integrity`);
* ``corrupt``: the manifest is unparseable or inconsistent, or the checkpoint was quarantined
  after a failed verification; it is never selected and never deleted automatically;
* ``incomplete``: no manifest (a save in flight, or one that crashed): not a checkpoint for
  loading or retention; leftovers of this run are cleaned after the next successful commit.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Iterable
from dataclasses import dataclass
from enum import Enum

from lightning_elastic.core.format.manifest import (
    MANIFEST_FILE,
    QUARANTINE_FILE,
    STAGING_FILE,
    Manifest,
    QuarantineRecord,
    StagingRecord,
)
from lightning_elastic.core.storage.base import Entry, Storage
from lightning_elastic.errors import (
    CheckpointNotFoundError,
    ManifestError,
    StorageError,
    StorageNotFoundError,
    TransientStorageError,
    UnsupportedFormatError,
    UntrustedManifestError,
)

__all__ = [
    "CORRUPT",
    "INCOMPLETE",
    "VALID",
    "Catalog",
    "CheckpointInfo",
    "Status",
    "checkpoint_name",
    "holds_checkpoint_files",
    "is_checkpoint_name",
    "split_location",
]

log = logging.getLogger(__name__)


class Status(str, Enum):
    """What a checkpoint directory is (the value is what the CLI prints)."""

    VALID = "valid"
    CORRUPT = "corrupt"
    INCOMPLETE = "incomplete"

    def __str__(self) -> str:
        return self.value


VALID = Status.VALID
CORRUPT = Status.CORRUPT
INCOMPLETE = Status.INCOMPLETE
_NAME = re.compile(r"^step_(\d+)(?:-(\d+))?$")
# files only a save writes: `<save id>-rank00000.distcp`, `<save id>-dcp_metadata.json`, ...
_SAVE_FILE = re.compile(r"^[0-9a-f]{16}-")
_RECORDS = (MANIFEST_FILE, STAGING_FILE, QUARANTINE_FILE)


def is_checkpoint_name(name: str) -> bool:
    """Whether ``name`` is one the engine gives (``step_000000100``, ``step_000000100-1``)."""
    return _NAME.match(name) is not None


def is_save_file(name: str) -> bool:
    """Whether ``name`` is that of a file a save writes (``<save id>-rank00000.distcp``)."""
    return _SAVE_FILE.match(name) is not None


def holds_checkpoint_files(names: Iterable[str]) -> bool:
    """Whether a directory with these file names is (or was becoming) a checkpoint: it holds
    a manifest, a claim, a quarantine record or a file named by a save. Any other folder under
    the root (logs, another tool's checkpoints) is not ours: never listed, never deleted."""
    return any(n.startswith(_RECORDS) or _SAVE_FILE.match(n) is not None for n in names)


def split_location(path: object) -> tuple[str, str]:
    """``root/name`` -> (root, name) for local paths and URLs (root ``"."`` when bare)."""
    root, _, name = str(path).rstrip("/").rpartition("/")
    return root or ".", name


def checkpoint_name(step: int, attempt: int = 0) -> str:
    """``step_000000100``; a second checkpoint at the same step gets ``-1``, ``-2``, ..."""
    return f"step_{step:09d}" if attempt == 0 else f"step_{step:09d}-{attempt}"


@dataclass(frozen=True)
class CheckpointInfo:
    """One checkpoint directory as seen by a scan."""

    name: str
    location: str
    status: Status
    manifest: Manifest | None = None
    problem: str | None = None
    staging: StagingRecord | None = None
    quarantine: QuarantineRecord | None = None
    unsupported: bool = False  # written by a newer lightning_elastic: not corrupt, unreadable
    untrusted: bool = False  # no valid HMAC for this reader's key: refused, never quarantined

    @property
    def step(self) -> int | None:
        """The training step: from the manifest, else the staging record, else the directory name
        (``None`` when none tells)."""
        if self.manifest is not None:
            return self.manifest.step
        if self.staging is not None:
            return self.staging.step
        match = _NAME.match(self.name)
        return int(match.group(1)) if match else None

    @property
    def run_id(self) -> str | None:
        """The run that wrote the checkpoint (manifest, else staging record), or ``None``."""
        if self.manifest is not None:
            return self.manifest.run_id
        return self.staging.run_id if self.staging is not None else None

    @property
    def created_unix(self) -> float:
        """When the checkpoint was committed (manifest) or claimed (staging record), in Unix
        seconds; 0.0 when unknown."""
        if self.manifest is not None:
            return self.manifest.created_unix
        return self.staging.created_unix if self.staging is not None else 0.0

    @property
    def sequence(self) -> int:
        """Commit order in the root (0 for version-1 checkpoints and uncommitted ones)."""
        return self.manifest.sequence if self.manifest is not None else 0

    def sort_key(self) -> tuple[bool, int, float, str]:
        """Oldest first in commit order: "newest" is the last committed, never the highest
        step (a rollback's new branch is newer than the abandoned one). Directories without a
        readable manifest (a save in flight, a damaged manifest) come after every committed
        one: their place is unknown, so selection looks at (and quarantines) them first."""
        return (self.manifest is None, self.sequence, self.created_unix, self.name)

    def to_json(self) -> dict[str, object]:
        """The summary row the CLI prints with ``--json``."""
        m = self.manifest
        return {
            "name": self.name,
            "path": self.location,
            "status": self.status.value,
            "step": self.step,
            "epoch": m.epoch if m else None,
            "world_size": m.world_size if m else None,
            "run_id": self.run_id,
            "bytes": m.total_bytes if m else None,
            "created": _iso(self.created_unix) if self.created_unix else None,
            "problem": self.problem,
        }


class Catalog:
    """Scans ``storage`` (the checkpoint root).

    A committed manifest never changes, so parsed manifests are cached; but a directory's
    name is not a checkpoint's identity: another run sharing the root deletes its checkpoint
    and this run may commit its own under the freed name, with a manifest of the same size.
    A cached manifest is therefore used only while the directory holds every file it lists,
    at the size it records - files named after its save id, unique to that commit - and is
    read again otherwise (see :meth:`_cached`)."""

    def __init__(self, storage: Storage) -> None:
        self.storage = storage
        # name -> (the manifest's size, the manifest, the sizes of the files it lists)
        self._manifests: dict[str, tuple[int, Manifest, dict[str, int]]] = {}

    def scan(self) -> list[CheckpointInfo]:
        """Every checkpoint-like directory (symbolic links and hidden folders are not), oldest
        first in commit order (see :meth:`CheckpointInfo.sort_key`)."""
        infos = []
        listed = set()
        for entry in self.storage.listdir():
            if entry.is_dir and not entry.name.startswith("."):
                listed.add(entry.name)
                info = self._inspect(entry.name, self.storage.listdir(entry.name))
                if info is not None:
                    infos.append(info)
        for name in set(self._manifests) - listed:  # deleted (by anyone): never seen again
            self._manifests.pop(name, None)
        return sorted(infos, key=CheckpointInfo.sort_key)

    def info(self, name: str) -> CheckpointInfo:
        """The checkpoint directory ``name``; raises :class:`CheckpointNotFoundError` when there is
        no checkpoint there."""
        entries = self.storage.listdir(name)
        info = self._inspect(name, entries)
        if info is None:
            raise CheckpointNotFoundError(
                f"no checkpoint at {self.storage.display(name)}: the directory is empty or missing"
            )
        return info

    def valid(self) -> list[CheckpointInfo]:
        """Valid checkpoints, newest first."""
        return [i for i in reversed(self.scan()) if i.status == VALID]

    def forget(self, name: str) -> None:
        """Drop the cached manifest of ``name`` (its manifest was deleted or is being replaced)."""
        self._manifests.pop(name, None)

    def quarantine(self, name: str, file: str, reason: str) -> None:
        """Mark ``name`` corrupt (kept on storage for inspection, never selected again)."""
        record = QuarantineRecord(file=file, reason=reason, quarantined_unix=time.time())
        self.storage.write_bytes(f"{name}/{QUARANTINE_FILE}", record.to_json().encode())
        log.warning("quarantined checkpoint %s: %s: %s", self.storage.display(name), file, reason)

    def _inspect(self, name: str, entries: list[Entry]) -> CheckpointInfo | None:
        files = {e.name: e for e in entries if not e.is_dir}
        if not holds_checkpoint_files(files):
            return None
        location = self.storage.display(name)
        staging = self._read_staging(name) if STAGING_FILE in files else None
        quarantine = None
        if QUARANTINE_FILE in files:
            try:
                raw = self._read(f"{name}/{QUARANTINE_FILE}")
            except StorageNotFoundError:
                return None  # deleted since it was listed
            quarantine = QuarantineRecord.from_json(raw, location)
        if MANIFEST_FILE not in files:
            return CheckpointInfo(
                name,
                location,
                INCOMPLETE,
                problem="no manifest (save in flight or crashed)",
                staging=staging,
            )
        try:
            manifest = self._read_manifest(name, files)
        except StorageNotFoundError:
            return None  # deleted since it was listed (another job's retention): gone
        except UnsupportedFormatError as exc:
            return CheckpointInfo(
                name, location, CORRUPT, problem=str(exc), staging=staging, unsupported=True
            )
        except ManifestError as exc:
            return CheckpointInfo(
                name,
                location,
                CORRUPT,
                problem=str(exc),
                staging=staging,
                quarantine=quarantine,
                untrusted=isinstance(exc, UntrustedManifestError),
            )
        except TransientStorageError:
            raise  # retried already; not a verdict on the checkpoint
        except StorageError as exc:
            # unreadable for good (a symbolic link planted as the manifest, no permission):
            # skipped like an untrusted manifest, but never quarantined (no lasting mark)
            return CheckpointInfo(
                name,
                location,
                CORRUPT,
                problem=f"unreadable manifest: {exc}",
                staging=staging,
                quarantine=quarantine,
                untrusted=True,
            )
        if quarantine is not None:
            problem = f"quarantined: {quarantine.file}: {quarantine.reason}"
            return CheckpointInfo(name, location, CORRUPT, manifest, problem, staging, quarantine)
        return CheckpointInfo(name, location, VALID, manifest, staging=staging)

    def _read_manifest(self, name: str, files: dict[str, Entry]) -> Manifest:
        cached = self._cached(name, files)
        if cached is not None:
            return cached
        rel = f"{name}/{MANIFEST_FILE}"
        raw = self._read(rel)
        manifest = Manifest.from_json(raw, self.storage.display(rel))
        if manifest.name != name.rsplit("/", 1)[-1]:
            # A copied or renamed directory is fine; note it but keep using the data.
            log.debug("checkpoint %s was saved as %s", name, manifest.name)
        if manifest.files:
            sizes = {f.path: f.size for f in manifest.files}
            self._manifests[name] = (len(raw), manifest, sizes)
        return manifest

    def _cached(self, name: str, files: dict[str, Entry]) -> Manifest | None:
        """The cached manifest of ``name`` when it is the one the directory holds now: the
        listed manifest has the size it had when read, files it records are there at their
        recorded sizes, and no other save's file is. Those files are named after the save
        (``<save id>-...``), and a save claims a directory only when no other save's file is
        in it, so a checkpoint committed under the same name by another save never passes.

        Some of the files may be missing: a node-local root (multi-tier) holds only its
        ranks' shards of each checkpoint; one file of the save is enough to tell it (with
        none, the manifest is read again: 0.45 ms each, 100 per scan of 100 checkpoints)."""
        size, cached, sizes = self._manifests.get(name, (-1, None, {}))
        if cached is None:
            return None
        own, held = f"{cached.save_id}-", 0
        fits = files[MANIFEST_FILE].size == size
        for file, entry in files.items():  # one pass: a listing is a few names
            recorded = sizes.get(file)
            if recorded is not None:
                fits, held = fits and entry.size == recorded, held + 1
            elif is_save_file(file) and not file.startswith(own):
                fits = False  # another save's file
        if fits and held:
            return cached
        self._manifests.pop(name, None)
        return None

    def _read_staging(self, name: str) -> StagingRecord | None:
        rel = f"{name}/{STAGING_FILE}"
        try:
            return StagingRecord.from_json(self._read(rel), self.storage.display(rel))
        except (ManifestError, StorageError):
            return None

    def _read(self, rel: str) -> bytes:
        return self.storage.read_bytes(rel)


def _iso(unix: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(unix))
