"""Verification of a checkpoint against its manifest.

Modes: ``"full"`` re-reads every file and compares size and checksum; ``"size"`` checks that
every file is present with the recorded size (one listing); ``"none"`` trusts the manifest.
An incremental checkpoint's referenced files (in earlier checkpoints' directories) are
checked like its own, against the referencing manifest.
The functions here are pure over a :class:`Storage`; spreading files over ranks and
quarantining is the caller's business (see :mod:`~lightning_elastic.core.load.load`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from lightning_elastic.core.format.manifest import FileRecord, Manifest
from lightning_elastic.core.format.references import reference_records, shown
from lightning_elastic.core.storage.base import Storage
from lightning_elastic.errors import ConfigError, IntegrityError, StorageNotFoundError

__all__ = ["VERIFY_MODES", "Problem", "check_verify_mode", "raise_first", "verify_files"]

VERIFY_MODES = ("full", "size", "none")


@dataclass(frozen=True)
class Problem:
    """One file that does not match the manifest."""

    file: str
    reason: str


def check_verify_mode(mode: str) -> str:
    """``mode``, checked: raises :class:`ConfigError` unless it is one of :data:`VERIFY_MODES`."""
    if mode not in VERIFY_MODES:
        raise ConfigError(f"verify must be one of {VERIFY_MODES}, got {mode!r}")
    return mode


def verify_files(
    storage: Storage,
    manifest: Manifest,
    mode: str,
    files: Sequence[FileRecord] | None = None,
    *,
    routes: Mapping[str, Storage] | None = None,
) -> list[Problem]:
    """Check ``files`` (default: all of the manifest's, its referenced files included) of the
    checkpoint at ``storage``. ``routes``: where referenced files live
    (:func:`~lightning_elastic.core.format.references.routes`); a problem with one names it
    with its checkpoint (``step_000010/<file>``)."""
    check_verify_mode(mode)
    records = (*manifest.files, *reference_records(manifest)) if files is None else files
    if mode == "none" or not records:
        return []
    routes = routes or {}
    referenced = {r.path for r in manifest.references}
    missing = [r.path for r in records if r.path in referenced and r.path not in routes]
    if missing:
        raise ValueError(f"no route to the referenced file(s) {missing}")
    if mode == "size":
        listings: dict[int, dict[str, int]] = {}
        problems = []
        for record in records:
            where = routes.get(record.path, storage)
            sizes = listings.get(id(where))
            if sizes is None:
                sizes = listings[id(where)] = {
                    e.name: e.size for e in where.listdir() if not e.is_dir
                }
            name = shown(manifest, record.path)
            if record.path not in sizes:
                problems.append(Problem(name, "file is missing"))
            elif sizes[record.path] != record.size:
                problems.append(
                    Problem(
                        name,
                        f"size is {sizes[record.path]} bytes, the manifest says {record.size}",
                    )
                )
        return problems
    problems = []
    for record in records:
        name = shown(manifest, record.path)
        try:
            where = routes.get(record.path, storage)
            digest = where.hash_file(record.path, manifest.checksum_algorithm)
        except StorageNotFoundError:
            problems.append(Problem(name, "file is missing"))
            continue
        if digest.size != record.size:
            problems.append(
                Problem(name, f"size is {digest.size} bytes, the manifest says {record.size}")
            )
        elif digest.checksum != record.checksum:
            problems.append(
                Problem(
                    name,
                    f"{manifest.checksum_algorithm} checksum is {digest.checksum}, "
                    f"the manifest says {record.checksum}",
                )
            )
    return problems


def raise_first(location: str, problems: Sequence[Problem]) -> None:
    """Raise :class:`IntegrityError` for the first problem, if any."""
    if problems:
        first = sorted(problems, key=lambda p: p.file)[0]
        raise IntegrityError(location, first.file, first.reason)
