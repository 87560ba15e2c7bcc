"""Deleting checkpoints, and the cleanup rank 0 runs after a durable commit.

Which rank calls what: only the coordinator (rank 0) after it published a commit, or a tool
(the CLI's ``prune``, a strategy's ``remove_checkpoint``) on one process. Nothing here is
collective, and nothing here imports torch (the CLI uses it).

Deleting goes manifest first, then data: a crash in between leaves an incomplete directory
(cleaned later), never a committed checkpoint with missing files.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Sequence

from lightning_elastic.core.format.catalog import INCOMPLETE, Catalog
from lightning_elastic.core.format.manifest import MANIFEST_FILE, STAGING_FILE, Manifest
from lightning_elastic.core.policy.retention import RetentionPolicy, plan_deletions
from lightning_elastic.core.storage.base import Storage

__all__ = ["after_commit", "delete_checkpoint", "discard_uncommitted"]

log = logging.getLogger(__name__)


def delete_checkpoint(storage: Storage, catalog: Catalog, name: str) -> None:
    """Manifest first (the checkpoint stops existing), then the data."""
    storage.delete(f"{name}/{MANIFEST_FILE}")
    catalog.forget(name)
    storage.delete_tree(name)


def discard_uncommitted(storage: Storage, name: str, *, keep_record: bool) -> None:
    """Remove an uncommitted directory (never one that holds a manifest). With
    ``keep_record`` the staging record stays, so a later save can still attribute whatever
    ranks that never reported write there."""
    try:
        if storage.exists(f"{name}/{MANIFEST_FILE}"):
            return
        if not keep_record:
            storage.delete_tree(name)
            return
        for entry in storage.listdir(name):
            if entry.name != STAGING_FILE:
                storage.delete(f"{name}/{entry.name}")
    except Exception:
        log.debug("could not remove uncommitted %s", name, exc_info=True)


def after_commit(
    storage: Storage,
    catalog: Catalog,
    manifest: Manifest,
    *,
    name: str,
    run_id: str,
    retention: Sequence[RetentionPolicy],
    protected: Collection[str],
) -> None:
    """After a durable commit of ``name``: drop its staging record and strays, this run's
    leftovers of crashed saves, then what retention no longer keeps. Failures here never
    undo the commit; they are logged as warnings."""
    ckpt = storage.child(name)
    try:
        keep = {f.path for f in manifest.files} | {MANIFEST_FILE}
        for entry in ckpt.listdir():
            if not entry.is_dir and entry.name not in keep:
                ckpt.delete(entry.name)
        infos = catalog.scan()
        for info in infos:
            stale = info.staging is not None and info.staging.save_id != manifest.save_id
            if info.status == INCOMPLETE and stale and info.run_id == run_id:
                log.info("removing leftover of a crashed save: %s", info.location)
                discard_uncommitted(storage, info.name, keep_record=False)
        doomed = plan_deletions(infos, retention, run_id=run_id, protected=protected)
        for info in doomed:
            log.info("retention: deleting %s (step %s)", info.location, info.step)
            delete_checkpoint(storage, catalog, info.name)
    except Exception as exc:
        log.warning("cleanup after committing %s failed: %r", ckpt.display(), exc, exc_info=True)
