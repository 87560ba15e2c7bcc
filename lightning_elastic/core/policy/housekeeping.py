"""Deleting checkpoints, and collecting what crashed saves and concurrent writers leave.

Which rank calls what: only the coordinator (rank 0) after it published a commit
(:func:`after_commit`), or a tool on one process (the CLI's ``prune``, a strategy's
``remove_checkpoint``: :func:`delete_checkpoint`, :func:`collect_garbage`). Nothing here is
collective, and nothing here imports torch (the CLI uses it).

Rules (docs/guarantees.md states them for users):

* deleting goes manifest first, then data: a crash in between leaves an incomplete
  directory, never a committed checkpoint with missing files;
* a save that failed removes only its own files (its save id), and its directory only when
  the directory's claim is its own;
* a directory without a manifest is garbage when it is this run's and not the save in
  flight, or - whoever left it - once it is older than the grace period (a save of another
  job may still be writing it until then);
* a committed directory's strays (files its manifest does not list: a claim left by a crash
  between the manifest and the cleanup, ``manifest.json.tmp-*``) are removed after the grace
  period (at once for the checkpoint just committed); the files a manifest lists are never
  touched except by retention and ``prune``;
* an empty folder with an engine-given name (``step_*``: a crash between creating it and
  claiming it, or while retention removed it) and a lease's temporary file are removed after
  the grace period;
* a folder holding none of our files (logs, another tool's checkpoints) is never touched.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Sequence

from lightning_elastic.core.dist.lease import LEASES_DIR, lease_leftovers
from lightning_elastic.core.forksafe import fork_safe_logger
from lightning_elastic.core.format.catalog import (
    INCOMPLETE,
    Catalog,
    CheckpointInfo,
    is_checkpoint_name,
    is_save_file,
)
from lightning_elastic.core.format.manifest import (
    MANIFEST_FILE,
    QUARANTINE_FILE,
    STAGING_FILE,
    Manifest,
    StagingRecord,
)
from lightning_elastic.core.policy.retention import RetentionPolicy, plan_deletions
from lightning_elastic.core.storage.base import Storage

__all__ = [
    "DEFAULT_GRACE_S",
    "after_commit",
    "apply_retention",
    "collect_garbage",
    "delete_checkpoint",
    "discard_uncommitted",
]

log = fork_safe_logger(__name__)  # also logs from the writer thread
DEFAULT_GRACE_S = 3600.0


def delete_checkpoint(
    storage: Storage,
    catalog: Catalog,
    name: str,
    *,
    listed: Collection[str] = (),
    save_id: str | None = None,
) -> bool:
    """Manifest first (the checkpoint stops existing), then the data; ``False`` when it was
    kept (referred to, below). ``listed``: the files
    its manifest listed (complete when committed, so nobody writes them): retired, which
    lets a local root reuse them (:meth:`Storage.retire`); any other file is deleted.

    ``save_id``: the commit the caller chose to delete, as its scan saw it. A name is not a
    checkpoint's identity: between that scan and this call, someone else (a ``prune``, the
    run's own retention in another process) may have deleted it and another run may have
    claimed the freed name, written there or even committed. A directory holding another
    save's files is that save's by now: of it, only ``save_id``'s own files are deleted (its
    manifest, its claim and anything else are left alone). Without ``save_id``, the commit
    the directory holds now is deleted.

    Once the manifest is gone the name is free, and another run sharing the root may claim
    it while the data is still being deleted (its claim succeeds once the old files are
    gone). What is deleted is therefore what the directory held *before* the manifest went
    (the manifest itself only if it was there then), less another save's claim and a record
    still being written (its temporary file); the directory itself only when nothing else is
    left in it.

    A checkpoint another one refers to (an incremental save reads unchanged tensors from its
    files) is not deleted: it stays as long as a checkpoint referring to it does."""
    referrers = sorted(
        i.name
        for i in catalog.scan()
        if i.manifest is not None and i.name != name and name in i.manifest.referenced_checkpoints
    )
    if referrers:  # an incremental checkpoint reads from it: it stays while that one does
        log.info("keeping %s: %s refer(s) to its files", storage.display(name), referrers)
        return False
    held = storage.listdir(name)
    saves = {e.name.split("-", 1)[0] for e in held if is_save_file(e.name)}
    doomed = saves if save_id is None else {save_id}
    catalog.forget(name)
    if saves - doomed:  # another save's directory now: leave everything of it
        for entry in held:
            if is_save_file(entry.name) and entry.name.split("-", 1)[0] in doomed:
                storage.delete(f"{name}/{entry.name}")
        return True
    if any(e.name == MANIFEST_FILE for e in held):
        storage.delete(f"{name}/{MANIFEST_FILE}")
    for path in listed:
        storage.retire(f"{name}/{path}")
    retired = {*listed, MANIFEST_FILE}
    for entry in held:
        rel = f"{name}/{entry.name}"
        if entry.name in retired or _in_flight_record(entry.name):
            continue
        if entry.name == STAGING_FILE:
            claim = _claim_of(storage, name)
            if claim is not None and claim.save_id not in doomed:
                continue  # another save claimed the freed name: its directory now
        if entry.is_dir:
            storage.delete_tree(rel)
        else:
            storage.delete(rel)
    storage.remove_dir(name)  # unless another save's files are in it by now
    return True


def _in_flight_record(file: str) -> bool:
    """A claim or manifest being published (``_staging.json.tmp-*``): another save's."""
    return file.startswith((f"{STAGING_FILE}.tmp-", f"{MANIFEST_FILE}.tmp-"))


def discard_uncommitted(storage: Storage, name: str, save_id: str, *, keep_record: bool) -> None:
    """After save ``save_id`` failed: remove what it wrote (never a manifest's directory).
    With ``keep_record`` its claim stays, so ranks that never reported cannot write into a
    directory another save could claim; garbage collection removes it later."""
    try:
        if storage.exists(f"{name}/{MANIFEST_FILE}"):
            _remove_own(storage, name, save_id)  # a loser never touches a winner's files
            return
        claim = _claim_of(storage, name)
        if claim is not None and claim.save_id != save_id:
            _remove_own(storage, name, save_id)  # the directory is someone else's
        elif keep_record:
            _remove_own(storage, name, save_id)
        else:
            storage.delete_tree(name)
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
    grace_s: float = DEFAULT_GRACE_S,
) -> None:
    """After a durable commit of ``name``: drop its claim and strays, collect leftovers, then
    apply retention. Failures here never undo the commit; they are logged as warnings."""
    try:
        _remove_strays(storage, name, manifest, grace_s=0.0, now=time.time())
        collect_garbage(
            storage, catalog, run_id=run_id, in_flight=(manifest.save_id,), grace_s=grace_s
        )
        apply_retention(
            storage, catalog, run_id=run_id, retention=retention, protected={*protected, name}
        )
    except Exception as exc:
        log.warning("cleanup after committing %s failed: %r", name, exc, exc_info=True)


def apply_retention(
    storage: Storage,
    catalog: Catalog,
    *,
    run_id: str,
    retention: Sequence[RetentionPolicy],
    protected: Collection[str],
) -> None:
    """Delete what ``retention`` no longer keeps of this run's checkpoints (``protected``
    are kept whatever the policies say)."""
    doomed = plan_deletions(catalog.scan(), retention, run_id=run_id, protected=protected)
    # newest first: a doomed incremental checkpoint goes before the doomed base it refers to
    # (oldest first, delete_checkpoint kept the base for its referrer, and it outlived it)
    for info in reversed(doomed):
        log.info("retention: deleting %s (step %s)", info.location, info.step)
        manifest = info.manifest
        listed = [f.path for f in manifest.files] if manifest is not None else []
        save_id = manifest.save_id if manifest is not None else None
        delete_checkpoint(storage, catalog, info.name, listed=listed, save_id=save_id)


def collect_garbage(
    storage: Storage,
    catalog: Catalog,
    *,
    run_id: str | None = None,
    in_flight: Collection[str] = (),
    grace_s: float = DEFAULT_GRACE_S,
    dry_run: bool = False,
    now: float | None = None,
) -> list[str]:
    """Remove leftovers (see the module rules); returns the locations removed."""
    now = time.time() if now is None else now
    removed = []
    for info in catalog.scan():
        if info.status == INCOMPLETE:
            if _is_garbage(storage, info, run_id, in_flight, grace_s, now):
                removed.append(info.location)
                if not dry_run:
                    log.info("removing leftover of a crashed save: %s", info.location)
                    storage.delete_tree(info.name)
        elif info.manifest is not None:
            strays = _remove_strays(
                storage, info.name, info.manifest, grace_s=grace_s, now=now, dry_run=dry_run
            )
            removed += [storage.display(f"{info.name}/{s}") for s in strays]
    for rel in _empty_checkpoint_folders(storage, now - grace_s) + lease_leftovers(
        storage, older_than=now - grace_s
    ):
        removed.append(storage.display(rel))
        if not dry_run:
            log.info("removing leftover %s", storage.display(rel))
            if rel.startswith(LEASES_DIR):
                storage.delete(rel)
            else:
                storage.delete_tree(rel)
    return removed


def _empty_checkpoint_folders(storage: Storage, older_than: float) -> list[str]:
    out = []
    for entry in storage.listdir():
        if entry.is_dir and is_checkpoint_name(entry.name):
            stale = entry.mtime is not None and entry.mtime < older_than
            if stale and not storage.listdir(entry.name):
                out.append(entry.name)
    return out


def _is_garbage(
    storage: Storage,
    info: CheckpointInfo,
    run_id: str | None,
    in_flight: Collection[str],
    grace_s: float,
    now: float,
) -> bool:
    staging = info.staging
    if staging is not None and staging.save_id in in_flight:
        return False
    if staging is not None and run_id is not None and staging.run_id == run_id:
        return True  # this run's own crashed save (a stale copy of the job is fenced)
    born = staging.created_unix if staging is not None else _newest_mtime(storage, info.name)
    return born is not None and now - born > grace_s


def _remove_strays(
    storage: Storage,
    name: str,
    manifest: Manifest,
    *,
    grace_s: float,
    now: float,
    dry_run: bool = False,
) -> list[str]:
    keep = {f.path for f in manifest.files} | {MANIFEST_FILE, QUARANTINE_FILE}
    strays = []
    for entry in storage.listdir(name):
        if entry.name in keep or entry.is_dir:
            continue
        if grace_s > 0 and (entry.mtime is None or now - entry.mtime <= grace_s):
            continue
        strays.append(entry.name)
        if not dry_run:
            storage.delete(f"{name}/{entry.name}")
    return strays


def _remove_own(storage: Storage, name: str, save_id: str) -> None:
    for entry in storage.listdir(name):
        if entry.name.startswith(f"{save_id}-"):
            storage.delete(f"{name}/{entry.name}")


def _claim_of(storage: Storage, name: str) -> StagingRecord | None:
    try:
        rel = f"{name}/{STAGING_FILE}"
        return StagingRecord.from_json(storage.read_bytes(rel), storage.display(rel))
    except Exception:
        return None


def _newest_mtime(storage: Storage, name: str) -> float | None:
    times = [e.mtime for e in storage.listdir(name) if e.mtime is not None]
    return max(times) if times else None
