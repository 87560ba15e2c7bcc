"""Following the references of an incremental checkpoint to the files of earlier checkpoints.

A manifest's ``references`` (:class:`~lightning_elastic.core.format.manifest.ReferenceRecord`)
name files in sibling checkpoint directories of the same root. Everything that reads a
checkpoint's files - verification, loading, consolidation, the tiers' copies - reads a
referenced file from its own directory (:func:`routes`) and checks it against the record the
referencing manifest holds, so a missing or damaged referenced file makes the referencing
checkpoint corrupt (quarantined, and a resume falls back), exactly as one of its own files.

Retention keeps what kept checkpoints refer to: :func:`referenced_closure`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from lightning_elastic.core.format.manifest import (
    MANIFEST_FILE,
    FileRecord,
    Manifest,
    ReferenceRecord,
)
from lightning_elastic.core.storage.base import Storage
from lightning_elastic.errors import IntegrityError, StorageNotFoundError

__all__ = [
    "check_references",
    "read_manifest",
    "reference_records",
    "referenced_closure",
    "routes",
    "shown",
]


def read_manifest(ckpt: Storage) -> Manifest:
    """The manifest of the checkpoint directory ``ckpt``, parsed and validated."""
    return Manifest.from_json(ckpt.read_bytes(MANIFEST_FILE), ckpt.display(MANIFEST_FILE))


def routes(ckpt: Storage, manifest: Manifest) -> dict[str, Storage]:
    """Where each referenced file of ``manifest`` (the manifest of the checkpoint directory
    ``ckpt``) lives: its checkpoint's directory beside ``ckpt``."""
    if not manifest.references:
        return {}
    root = ckpt.parent()
    return {r.path: root.child(r.checkpoint) for r in manifest.references}


def reference_records(manifest: Manifest) -> tuple[FileRecord, ...]:
    """The referenced files as file records (path, size, checksum, rank), to verify."""
    return tuple(FileRecord(r.path, r.size, r.checksum, r.rank) for r in manifest.references)


def shown(manifest: Manifest, path: str) -> str:
    """How a problem with ``path`` names it: a referenced file with its checkpoint."""
    for r in manifest.references:
        if r.path == path:
            return f"{r.checkpoint}/{r.path}"
    return path


def check_references(root: Storage, references: Iterable[ReferenceRecord]) -> None:
    """Raise :class:`IntegrityError` unless every referenced file is in ``root`` with its
    recorded size (the coordinator, just before it commits an incremental save)."""
    for r in references:
        try:
            size = root.child(r.checkpoint).size(r.path)
        except StorageNotFoundError:
            raise IntegrityError(r.checkpoint, r.path, "referenced file is missing") from None
        if size != r.size:
            raise IntegrityError(
                r.checkpoint, r.path, f"referenced file has {size} bytes, expected {r.size}"
            )


def referenced_closure(manifests: Mapping[str, Manifest | None], kept: Iterable[str]) -> set[str]:
    """``kept`` and every checkpoint a kept one refers to, transitively (a checkpoint kept
    for its files is whole, so its own references are kept too). ``manifests``: name to
    manifest of every checkpoint in the root (``None`` where it has none)."""
    closure = set(kept)
    todo = list(closure)
    while todo:
        manifest = manifests.get(todo.pop())
        if manifest is None:
            continue
        for name in manifest.referenced_checkpoints:
            if name not in closure:
                closure.add(name)
                todo.append(name)
    return closure
