"""The checkpoint manifest: versioned JSON written from frozen dataclasses, never pickle.

On-disk layout of one checkpoint directory (names are the constants below)::

    <root>/<name>/
        <save_id>-rank00000.distcp   tensor and object bytes written by rank 0
        <save_id>-rank00001.distcp   ... one file per rank that had something to write
        dcp_metadata.json            the DCP metadata (tensor layout, file offsets), as JSON
        manifest.json                written last, exclusively: its presence commits the checkpoint
        _staging.json                present while a save is in flight (run id, save id)
        _quarantine.json             present when a verification found the checkpoint corrupt

A directory without a complete, parseable ``manifest.json`` is not a checkpoint.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from lightning_elastic.errors import ManifestError, UnsupportedFormatError

__all__ = [
    "DCP_METADATA_FILE",
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "MANIFEST_FILE",
    "QUARANTINE_FILE",
    "STAGING_FILE",
    "FileRecord",
    "Manifest",
    "QuarantineRecord",
    "RankRecord",
    "StagingRecord",
    "Timings",
    "check_json_safe",
    "shard_file_name",
]

FORMAT_NAME = "lightning_elastic.checkpoint"
FORMAT_VERSION = 1
MANIFEST_FILE = "manifest.json"
DCP_METADATA_FILE = "dcp_metadata.json"
STAGING_FILE = "_staging.json"
QUARANTINE_FILE = "_quarantine.json"
SHARD_SUFFIX = ".distcp"


def shard_file_name(save_id: str, rank: int) -> str:
    return f"{save_id}-rank{rank:05d}{SHARD_SUFFIX}"


@dataclass(frozen=True)
class FileRecord:
    """One file of the checkpoint, relative to its directory, with size and checksum."""

    path: str
    size: int
    checksum: str
    rank: int | None = None


@dataclass(frozen=True)
class RankRecord:
    """What one rank was and did during the save."""

    rank: int
    host: str
    pid: int
    local_rank: int | None
    bytes_written: int
    staging_s: float
    writing_s: float


@dataclass(frozen=True)
class Timings:
    """Seconds spent per phase; staging/writing are the maximum over ranks."""

    staging_s: float
    writing_s: float
    commit_s: float
    total_s: float


@dataclass(frozen=True)
class Manifest:
    """Everything known about one committed checkpoint."""

    run_id: str
    save_id: str
    name: str
    step: int
    epoch: int | None
    created_unix: float
    world_size: int
    ranks: tuple[RankRecord, ...]
    files: tuple[FileRecord, ...]
    checksum_algorithm: str
    timings: Timings
    versions: Mapping[str, str]
    compression: str | None = None
    metrics: Mapping[str, float] = field(default_factory=dict)
    metadata: Mapping[str, Any] = field(default_factory=dict)
    resumed_from: str | None = None
    format_version: int = FORMAT_VERSION

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    def file(self, path: str) -> FileRecord:
        for record in self.files:
            if record.path == path:
                return record
        raise KeyError(path)

    def to_json(self) -> str:
        body = asdict(self)
        body["total_bytes"] = self.total_bytes
        return json.dumps({"format": FORMAT_NAME, **body}, indent=1, sort_keys=True) + "\n"

    @classmethod
    def from_json(cls, text: str | bytes, where: str) -> Manifest:
        """Parse and validate; raises :class:`ManifestError` or :class:`UnsupportedFormatError`."""
        data = _load_object(text, where, "manifest")
        version = data.get("format_version")
        if data.get("format") != FORMAT_NAME or not isinstance(version, int):
            raise ManifestError(f"{where} is not a lightning_elastic manifest")
        if version > FORMAT_VERSION:
            raise UnsupportedFormatError(
                f"{where} uses checkpoint format version {version}, but this lightning_elastic "
                f"reads versions up to {FORMAT_VERSION}: upgrade lightning_elastic to a release "
                f"that supports format version {version}"
            )
        try:
            return cls(
                run_id=_str(data["run_id"]),
                save_id=_str(data["save_id"]),
                name=_str(data["name"]),
                step=_int(data["step"]),
                epoch=None if data["epoch"] is None else _int(data["epoch"]),
                created_unix=float(data["created_unix"]),
                world_size=_int(data["world_size"]),
                ranks=tuple(RankRecord(**r) for r in data["ranks"]),
                files=tuple(FileRecord(**f) for f in data["files"]),
                checksum_algorithm=_str(data["checksum_algorithm"]),
                timings=Timings(**data["timings"]),
                versions=dict(data["versions"]),
                compression=data.get("compression"),
                metrics={str(k): float(v) for k, v in dict(data.get("metrics", {})).items()},
                metadata=dict(data.get("metadata", {})),
                resumed_from=data.get("resumed_from"),
                format_version=version,
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ManifestError(f"{where} is malformed: {type(exc).__name__}: {exc}") from exc


@dataclass(frozen=True)
class StagingRecord:
    """Written by the coordinator before any shard, so leftovers can be attributed to a run."""

    run_id: str
    save_id: str
    step: int
    created_unix: float

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes, where: str) -> StagingRecord:
        data = _load_object(text, where, "staging record")
        try:
            return cls(
                run_id=_str(data["run_id"]),
                save_id=_str(data["save_id"]),
                step=_int(data["step"]),
                created_unix=float(data["created_unix"]),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ManifestError(f"{where} is malformed: {exc}") from exc


@dataclass(frozen=True)
class QuarantineRecord:
    """Why a checkpoint was set aside. The data is kept for inspection, never deleted."""

    file: str
    reason: str
    quarantined_unix: float

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes, where: str) -> QuarantineRecord:
        try:
            data = _load_object(text, where, "quarantine record")
            return cls(str(data["file"]), str(data["reason"]), float(data["quarantined_unix"]))
        except (ManifestError, KeyError, TypeError, ValueError):
            # A damaged marker still means "quarantined".
            return cls("?", "unreadable quarantine record", 0.0)


def check_json_safe(value: Any, what: str) -> None:
    """Raise ``TypeError`` naming the first path in ``value`` that JSON cannot represent."""

    def walk(obj: Any, path: str) -> None:
        if obj is None or isinstance(obj, (str, bool, int)):
            return
        if isinstance(obj, float):
            if not math.isfinite(obj):
                raise TypeError(f"{what}{path} is {obj}, which JSON cannot represent")
            return
        if isinstance(obj, Mapping):
            for key, item in obj.items():
                if not isinstance(key, str):
                    raise TypeError(f"{what}{path} has a non-string key {key!r}")
                walk(item, f"{path}[{key!r}]")
            return
        if isinstance(obj, Sequence) and not isinstance(obj, (bytes, bytearray)):
            for i, item in enumerate(obj):
                walk(item, f"{path}[{i}]")
            return
        raise TypeError(f"{what}{path} is a {type(obj).__name__}, which is not JSON-safe")

    walk(value, "")


def _load_object(text: str | bytes, where: str, what: str) -> dict[str, Any]:
    try:
        data = json.loads(text)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ManifestError(f"{what} {where} is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ManifestError(f"{what} {where} is not a JSON object")
    return data


def _str(value: Any) -> str:
    if not isinstance(value, str):
        raise TypeError(f"expected a string, got {value!r}")
    return value


def _int(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"expected an integer, got {value!r}")
    return value
