"""The checkpoint manifest: versioned JSON written from frozen dataclasses, never pickle.

On-disk layout of one checkpoint directory (names are the constants below)::

    <root>/<name>/
        _staging.json                   created exclusively by the save that claims the directory
                                        (run id, save id); removed after the commit
        <save_id>-rank00000.distcp      tensor and object bytes written by rank 0
        <save_id>-rank00001.distcp      ... one file per rank that had something to write
        <save_id>-dcp_metadata.json     the DCP metadata (tensor layout, file offsets), as JSON
        manifest.json                   written last, exclusively: its presence commits
                                        (an incremental save's manifest also lists, under
                                        ``references``, files of earlier checkpoints of the
                                        run that hold its unchanged tensors)
        _quarantine.json                present when a verification found the checkpoint corrupt
    <root>/.leases/<run_id>/gen-<n>.json  one per job of a run (see core/dist/lease.py)
    <root>/_history/...                 the run history (see core/observe/history.py)

Every file a save writes carries its save id or sits in the directory it claimed, so two
writers never write the same file. A directory without a complete manifest that passes strict
validation (types, ranges, plain file names, its own checksum, the HMAC when a key is set) is
not a checkpoint.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from lightning_elastic.errors import ManifestError, UnsupportedFormatError, UntrustedManifestError

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
    "ReferenceRecord",
    "StagingRecord",
    "Timings",
    "check_json_safe",
    "dcp_metadata_file_name",
    "is_plain_name",
    "shard_file_name",
]

FORMAT_NAME = "lightning_elastic.checkpoint"
# 2: save-unique DCP metadata file, commit sequence and lineage, writer generation, the
# manifest's own checksum (and optional HMAC). 3: ``references`` (incremental saves); a
# manifest without references is still written as version 2, so full checkpoints stay
# readable by releases that read version 2. Version 1 manifests are still read.
FORMAT_VERSION = 3
_PLAIN_VERSION = 2  # what a manifest without references is written as
MANIFEST_FILE = "manifest.json"
DCP_METADATA_FILE = "dcp_metadata.json"  # version 1; version 2 names it per save
STAGING_FILE = "_staging.json"
QUARANTINE_FILE = "_quarantine.json"
SHARD_SUFFIX = ".distcp"
HMAC_KEY_ENV = "LIGHTNING_ELASTIC_HMAC_KEY"
_KNOWN_COMPRESSIONS = (None, "zstd")
_KNOWN_CHECKSUMS = ("xxh3_64", "xxh3_128", "crc32", "sha256")
_MAX_INT = 2**62
MAX_SEQUENCE = 2**53  # commits in one root; a higher one was edited in
_MAX_WORLD_SIZE = 2**24
_MAX_UNIX = 1e11  # year ~5100: anything later is not a timestamp
_MAX_SECONDS = 1e9


def shard_file_name(save_id: str, rank: int) -> str:
    """The shard file that ``rank`` writes in save ``save_id``: ``<save_id>-rank00001.distcp``."""
    return f"{save_id}-rank{rank:05d}{SHARD_SUFFIX}"


def dcp_metadata_file_name(save_id: str) -> str:
    """The DCP metadata file of save ``save_id``: ``<save_id>-dcp_metadata.json``."""
    return f"{save_id}-dcp_metadata.json"


def is_plain_name(name: str) -> bool:
    """A file or directory name that stays where it is put: no separators, no ``..``."""
    return (
        bool(name)
        and name not in (".", "..")
        and "/" not in name
        and "\\" not in name
        and "\x00" not in name
    )


@dataclass(frozen=True)
class FileRecord:
    """One file of the checkpoint, relative to its directory, with size and checksum."""

    path: str
    size: int
    checksum: str
    rank: int | None = None


@dataclass(frozen=True)
class ReferenceRecord:
    """A file of an earlier checkpoint of the same run that this one reads unchanged tensors
    from (an incremental save): the sibling directory ``checkpoint`` in the same root, the
    file's name there, and its size and checksum as that checkpoint committed them. The DCP
    metadata gives the byte range of each item in it. Verification checks the referenced
    file against this record, so a checkpoint whose referenced file is missing or damaged is
    corrupt like one whose own file is."""

    checkpoint: str
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
    """Everything known about one committed checkpoint.

    ``sequence`` orders commits in one root directory ("newest" is the highest sequence, never
    the highest step); ``parent`` names the checkpoint this one continues (the one the run
    resumed from, or its previous save); ``generation`` is the writer's lease generation.
    """

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
    sequence: int = 0
    parent: str | None = None
    generation: int | None = None
    dcp_metadata: str = DCP_METADATA_FILE
    format_version: int = _PLAIN_VERSION  # FORMAT_VERSION when there are references
    references: tuple[ReferenceRecord, ...] = ()

    def __post_init__(self) -> None:
        if self.references and self.format_version < FORMAT_VERSION:
            object.__setattr__(self, "format_version", FORMAT_VERSION)

    @property
    def total_bytes(self) -> int:
        """The size of all the checkpoint's own files together, in bytes (referenced files
        of earlier checkpoints not included: :attr:`referenced_bytes`)."""
        return sum(f.size for f in self.files)

    @property
    def referenced_bytes(self) -> int:
        """The size of the earlier checkpoints' files this one reads from, in bytes."""
        return sum(r.size for r in self.references)

    @property
    def referenced_checkpoints(self) -> frozenset[str]:
        """The names of the checkpoints this one reads unchanged tensors from."""
        return frozenset(r.checkpoint for r in self.references)

    def to_json(self, hmac_key: bytes | None = None) -> str:
        """The manifest as JSON, with its own checksum (and an HMAC when a key is given or
        set in ``LIGHTNING_ELASTIC_HMAC_KEY``). Without references it is a version 2
        manifest (as before references existed)."""
        body: dict[str, Any] = {"format": FORMAT_NAME, **asdict(self)}
        if not self.references:
            del body["references"]
        body["total_bytes"] = self.total_bytes
        body["manifest_checksum"] = _content_digest(body)
        key = hmac_key if hmac_key is not None else _env_key()
        if key:
            body["hmac"] = _hmac(key, body)
        return json.dumps(body, indent=1, sort_keys=True, allow_nan=False) + "\n"

    @classmethod
    def from_json(cls, text: str | bytes, where: str, hmac_key: bytes | None = None) -> Manifest:
        """Parse and validate strictly; raises :class:`ManifestError` (the checkpoint is then
        ``corrupt``) or :class:`UnsupportedFormatError`. With an HMAC key (argument or
        ``LIGHTNING_ELASTIC_HMAC_KEY``) a manifest without a matching HMAC is refused."""
        data = _load_object(text, where, "manifest")
        version = data.get("format_version")
        if data.get("format") != FORMAT_NAME or type(version) is not int or version < 1:
            raise ManifestError(f"{where} is not a lightning_elastic manifest")
        if version > FORMAT_VERSION:
            raise UnsupportedFormatError(
                f"{where} uses checkpoint format version {version}, but this lightning_elastic "
                f"reads versions up to {FORMAT_VERSION}: upgrade lightning_elastic to a release "
                f"that supports format version {version}"
            )
        try:
            _check_integrity(data, version, hmac_key, where)
            return _parse(cls, data, version)
        except (KeyError, TypeError, ValueError) as exc:
            raise ManifestError(f"{where} is malformed: {type(exc).__name__}: {exc}") from exc


def _parse(cls: type[Manifest], data: Mapping[str, Any], version: int) -> Manifest:
    world_size = _int(data["world_size"], "world_size", low=1, high=_MAX_WORLD_SIZE)
    ranks = tuple(_rank(r) for r in _list(data["ranks"], "ranks"))
    files = tuple(_file(f, world_size) for f in _list(data["files"], "files"))
    if len({f.path for f in files}) != len(files):
        raise ValueError("files lists a path twice")
    if any(r.rank >= world_size for r in ranks):
        raise ValueError(f"a rank record is outside world_size {world_size}")
    checksum_algorithm = _str(data["checksum_algorithm"], "checksum_algorithm")
    if checksum_algorithm not in _KNOWN_CHECKSUMS:
        raise ValueError(f"unknown checksum algorithm {checksum_algorithm!r}")
    compression = data.get("compression")
    if compression not in _KNOWN_COMPRESSIONS:
        raise ValueError(f"unknown compression {compression!r}")
    timings = _dict(data["timings"], "timings")
    dcp_metadata = _name(data.get("dcp_metadata", DCP_METADATA_FILE), "dcp_metadata")
    if dcp_metadata not in {f.path for f in files}:
        raise ValueError(f"the DCP metadata file {dcp_metadata!r} is not among the files")
    name = _name(data["name"], "name")
    references: tuple[ReferenceRecord, ...] = ()
    if version >= 3:
        references = tuple(_reference(r, world_size) for r in _list(data["references"], "refs"))
    _check_references(references, files, name)
    return cls(
        run_id=_str(data["run_id"], "run_id"),
        save_id=_str(data["save_id"], "save_id"),
        name=name,
        step=_int(data["step"], "step"),
        epoch=None if data["epoch"] is None else _int(data["epoch"], "epoch"),
        created_unix=_float(data["created_unix"], "created_unix", high=_MAX_UNIX),
        world_size=world_size,
        ranks=ranks,
        files=files,
        checksum_algorithm=checksum_algorithm,
        timings=Timings(
            **{k: _float(timings[k], f"timings.{k}") for k in Timings.__dataclass_fields__}
        ),
        versions={
            _str(k, "versions"): _str(v, "versions")
            for k, v in _dict(data["versions"], "versions").items()
        },
        compression=compression,
        metrics={
            _str(k, "metrics"): _float(v, f"metrics.{k}", low=-math.inf, high=math.inf)
            for k, v in _dict(data.get("metrics", {}), "metrics").items()
        },
        metadata=_dict(data.get("metadata", {}), "metadata"),
        resumed_from=_optional_name(data.get("resumed_from"), "resumed_from"),
        sequence=_int(data.get("sequence", 0), "sequence", high=MAX_SEQUENCE),
        parent=_optional_name(data.get("parent"), "parent"),
        generation=(
            None if data.get("generation") is None else _int(data["generation"], "generation")
        ),
        dcp_metadata=dcp_metadata,
        format_version=version,
        references=references,
    )


def _reference(value: Any, world_size: int) -> ReferenceRecord:
    f = _file(value, world_size)
    r = _dict(value, "references[]")
    return ReferenceRecord(_name(r["checkpoint"], "checkpoint"), f.path, f.size, f.checksum, f.rank)


def _check_references(
    references: Sequence[ReferenceRecord], files: Sequence[FileRecord], name: str
) -> None:
    """A referenced file is another checkpoint's and named once: its save-unique name never
    collides with this checkpoint's own files."""
    paths = [r.path for r in references]
    if len(set(paths)) != len(paths):
        raise ValueError("references list a file twice")
    if set(paths) & {f.path for f in files}:
        raise ValueError("a referenced file has the name of one of the checkpoint's own files")
    if any(r.checkpoint == name for r in references):
        raise ValueError("a checkpoint refers to itself")


def _rank(value: Any) -> RankRecord:
    r = _dict(value, "ranks[]")
    return RankRecord(
        rank=_int(r["rank"], "rank"),
        host=_str(r["host"], "host"),
        pid=_int(r["pid"], "pid"),
        local_rank=None if r["local_rank"] is None else _int(r["local_rank"], "local_rank"),
        bytes_written=_int(r["bytes_written"], "bytes_written"),
        staging_s=_float(r["staging_s"], "staging_s"),
        writing_s=_float(r["writing_s"], "writing_s"),
    )


def _file(value: Any, world_size: int) -> FileRecord:
    f = _dict(value, "files[]")
    checksum = _str(f["checksum"], "checksum")
    if not checksum or len(checksum) > 128 or any(c not in "0123456789abcdef" for c in checksum):
        raise ValueError(f"checksum {checksum!r} is not a lowercase hex digest")
    rank = None if f.get("rank") is None else _int(f["rank"], "rank", high=world_size - 1)
    return FileRecord(_name(f["path"], "file path"), _int(f["size"], "size"), checksum, rank)


def _check_integrity(
    data: Mapping[str, Any], version: int, hmac_key: bytes | None, where: str
) -> None:
    if version >= 2 or "manifest_checksum" in data:  # a relabelled v2 keeps its checksum
        recorded = data.get("manifest_checksum")
        if recorded != _content_digest(data):
            raise ManifestError(
                f"{where} does not match its own checksum: it was edited or damaged"
            )
    key = hmac_key if hmac_key is not None else _env_key()
    if key:
        recorded = data.get("hmac")
        if not isinstance(recorded, str) or not hmac.compare_digest(recorded, _hmac(key, data)):
            raise UntrustedManifestError(
                f"{where} has no valid HMAC for the key in {HMAC_KEY_ENV}: it was not written "
                "by a holder of the key, or it was modified"
            )


def _canonical(body: Mapping[str, Any]) -> bytes:
    content = {k: v for k, v in body.items() if k not in ("manifest_checksum", "hmac")}
    return json.dumps(content, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


def _content_digest(body: Mapping[str, Any]) -> str:
    return hashlib.sha256(_canonical(body)).hexdigest()


def _hmac(key: bytes, body: Mapping[str, Any]) -> str:
    return hmac.new(key, _canonical(body), hashlib.sha256).hexdigest()


def _env_key() -> bytes | None:
    value = os.environ.get(HMAC_KEY_ENV)
    return value.encode() if value else None


@dataclass(frozen=True)
class StagingRecord:
    """Written by the coordinator before any shard, so leftovers can be attributed to a run."""

    run_id: str
    save_id: str
    step: int
    created_unix: float

    def to_json(self) -> str:
        """The record as JSON (sorted keys)."""
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes, where: str) -> StagingRecord:
        """Parse and validate; raises :class:`ManifestError` naming ``where`` when malformed."""
        data = _load_object(text, where, "staging record")
        try:
            return cls(
                run_id=_str(data["run_id"]),
                save_id=_str(data["save_id"]),
                step=_int(data["step"]),
                created_unix=_float(data["created_unix"], "created_unix", high=_MAX_UNIX),
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
        """The record as JSON (sorted keys)."""
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes, where: str) -> QuarantineRecord:
        """Parse the record; an unreadable one still reads back (file ``"?"``), since the
        marker alone means the checkpoint is quarantined."""
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
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, UnicodeDecodeError, digits
        raise ManifestError(f"{what} {where} is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ManifestError(f"{what} {where} is not a JSON object")
    return data


def _str(value: Any, what: str = "value") -> str:
    if not isinstance(value, str):
        raise TypeError(f"{what}: expected a string, got {value!r}")
    return value


def _int(value: Any, what: str = "value", *, low: int = 0, high: int = _MAX_INT) -> int:
    if type(value) is not int:
        raise TypeError(f"{what}: expected an integer, got {value!r}")
    if not low <= value <= high:
        raise ValueError(f"{what}: {value} is outside [{low}, {high}]")
    return value


def _float(
    value: Any, what: str = "value", *, low: float = 0.0, high: float = _MAX_SECONDS
) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{what}: expected a number, got {value!r}")
    number = float(value)
    if not math.isfinite(number) or not low <= number <= high:
        raise ValueError(f"{what}: {value!r} is not a finite number in [{low}, {high}]")
    return number


def _dict(value: Any, what: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise TypeError(f"{what}: expected an object, got {type(value).__name__}")
    return value


def _list(value: Any, what: str) -> list[Any]:
    if not isinstance(value, list):
        raise TypeError(f"{what}: expected a list, got {type(value).__name__}")
    return value


def _name(value: Any, what: str) -> str:
    name = _str(value, what)
    if not is_plain_name(name):
        raise ValueError(f"{what} {name!r} is not a plain file name")
    return name


def _optional_name(value: Any, what: str) -> str | None:
    return None if value is None else _name(value, what)
