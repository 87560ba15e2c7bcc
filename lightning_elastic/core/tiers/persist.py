"""Persisting a checkpoint committed on the node-local tier to the persistent root.

Which rank calls what, in what order (every rank runs :func:`persist_checkpoint` in its own
persister thread for the same checkpoint; only the c10d store is used, never a collective, so
it runs beside training and beside the next local saves):

1. rank 0 claims the directory in the persistent root (a staging record, exclusive create, so
   leftovers of a crash are attributable) and posts "go", or why it skips (the name is taken
   there: a rollback's new branch reusing a step's name; the next save persists instead);
2. every rank uploads the files of the manifest it owns (its shard; rank 0 also the DCP
   metadata) from its node's local root, byte for byte, hashing on the way: a local copy that
   no longer matches the manifest's checksum fails the persist (it is never published);
3. every rank reports through the persist channel; rank 0 collects, checks this job's lease in
   the persistent root (a stale copy of the job is refused), writes the manifest last with
   exclusive create (the commit, as for a save without tiers), publishes the decision, and
   applies the persistent tier's retention; a refused persist removes what it wrote;
4. every rank raises the same error for a refused persist (surfaced on the next save).

The persisted manifest is the local one (same name, files, checksums, commit sequence and
creation time: one checkpoint has one place in commit order on every tier); only the lease
generation is the persistent root's.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass

from lightning_elastic.core.dist.channel import CommitChannel, CommitDecision
from lightning_elastic.core.dist.commit import collect_and_commit
from lightning_elastic.core.dist.lease import Lease, check_lease, take_lease
from lightning_elastic.core.forksafe import fork_safe_logger
from lightning_elastic.core.format.catalog import Catalog
from lightning_elastic.core.format.manifest import (
    MANIFEST_FILE,
    STAGING_FILE,
    Manifest,
    StagingRecord,
)
from lightning_elastic.core.policy.housekeeping import after_commit, discard_uncommitted
from lightning_elastic.core.policy.retention import RetentionPolicy
from lightning_elastic.core.storage.base import Storage
from lightning_elastic.errors import (
    CheckpointExistsError,
    IntegrityError,
    Phase,
    RankFailure,
)

__all__ = ["PersistentTier", "persist_checkpoint"]

log = fork_safe_logger(__name__)  # runs in the persister thread
_CHUNK = 16 * 2**20
_GRACE_MIN_S = 2.0


@dataclass
class PersistentTier:
    """The persistent root of a multi-tier engine and what persisting needs of it."""

    storage: Storage
    catalog: Catalog
    channel: CommitChannel
    retention: Sequence[RetentionPolicy] = ()
    lease: Lease | None = None  # rank 0: this job's claim to write the run there
    grace_s: float = 1200.0


def persist_checkpoint(
    tier: PersistentTier,
    *,
    local: Storage,
    manifest: Manifest,
    rank: int,
    timeout_s: float,
    protected: Collection[str],
) -> bool:
    """Every rank: persist ``manifest``'s checkpoint from ``local`` (this rank's node-local
    root) to ``tier`` (see the module docstring). ``True`` when committed, ``False`` when rank
    0 skipped it (the name is taken there).

    Raises:
        CheckpointSaveError: the persist was refused (every rank raises it).
    """
    name, save_id, ch = manifest.name, manifest.save_id, tier.channel
    what = tier.storage.display(name)
    deadline = time.monotonic() + timeout_s
    grace = max(_GRACE_MIN_S, 0.1 * timeout_s)
    try:
        claim_error: Exception | None = None
        if rank == 0:
            try:
                skip = _claim(tier, manifest)
            except Exception as exc:  # reported below as rank 0's failure: all ranks learn it
                skip, claim_error = "", exc
            ch.post(save_id, "go", skip)
        else:
            skip = ch.fetch(save_id, "go", deadline + grace, what)
        if skip:
            log.warning("not persisting %s: %s; the next save is persisted instead", what, skip)
            return False
        report = _upload(
            tier.storage.child(name), local.child(name), manifest, rank, ch.world_size, claim_error
        )
        ch.report(save_id, report)
        if rank == 0:
            decision = _commit(tier, manifest, deadline, protected)
        else:
            decision = ch.await_decision(save_id, deadline + grace, what)
    finally:
        ch.ack(save_id)
    if not decision.committed:
        raise decision.error(what)
    log.info("persisted %s (step %d)", what, manifest.step)
    return True


def _claim(tier: PersistentTier, manifest: Manifest) -> str:
    """Rank 0: write the staging record of the persist; why it is skipped, or ``""``."""
    name = manifest.name
    if tier.storage.exists(f"{name}/{MANIFEST_FILE}"):
        return f"{tier.storage.display(name)} already holds a checkpoint"
    record = StagingRecord(manifest.run_id, manifest.save_id, manifest.step, time.time())
    try:
        body = record.to_json().encode()
        tier.storage.write_bytes(f"{name}/{STAGING_FILE}", body, exclusive=True)
    except CheckpointExistsError:
        return f"{tier.storage.display(name)} is claimed by another save"
    return ""


def _upload(
    dst: Storage,
    src: Storage,
    manifest: Manifest,
    rank: int,
    world_size: int,
    claim_error: Exception | None,
) -> dict[str, object]:
    """Copy this rank's files of ``manifest`` from ``src`` to ``dst``, each checked against
    the manifest; the report for rank 0. A file that failed is removed from ``dst``."""
    # each rank its own shard; after a recovery at another world size (every node then holds
    # every file) saved rank r's by rank r % world size
    mine = [f for f in manifest.files if (f.rank or 0) % world_size == rank]
    current = ""
    try:
        if claim_error is not None:
            raise claim_error
        for record in mine:
            current = record.path
            written = dst.write_stream(
                record.path,
                lambda r=record: _chunks(src, r.path, r.size),  # type: ignore[misc]
                checksum=manifest.checksum_algorithm,
            )
            if written.size != record.size or written.checksum != record.checksum:
                raise IntegrityError(
                    manifest.name,
                    record.path,
                    f"the node-local copy has {written.size} bytes with checksum "
                    f"{written.checksum}, the manifest says {record.size} and {record.checksum}",
                )
        return {"ok": True}
    except Exception as exc:
        log.error("rank %d could not persist %s", rank, dst.display(current), exc_info=True)
        if current:
            try:
                dst.delete(current)
            except Exception:
                log.debug("could not remove partial %s", current, exc_info=True)
        failure = RankFailure.from_exception(rank, Phase.WRITE, exc)
        return {"ok": False, "failure": failure.to_json()}


def _chunks(src: Storage, rel: str, size: int) -> Iterator[bytes]:
    for start in range(0, size, _CHUNK):
        yield src.read_bytes(rel, start, min(_CHUNK, size - start))


def _commit(
    tier: PersistentTier, manifest: Manifest, deadline: float, protected: Collection[str]
) -> CommitDecision:
    """Rank 0: collect the reports, commit if all are good, publish; then housekeeping."""
    name, save_id = manifest.name, manifest.save_id
    what = tier.storage.display(name)
    persisted: Manifest | None = None

    def commit(reports: object) -> None:
        nonlocal persisted
        if tier.lease is None or tier.lease.run_id != manifest.run_id:
            tier.lease = take_lease(tier.storage, manifest.run_id)
        copy = dataclasses.replace(manifest, generation=tier.lease.generation)
        check_lease(tier.storage, tier.lease)  # a newer job of this run wins: refuse
        tier.storage.write_bytes(f"{name}/{MANIFEST_FILE}", copy.to_json().encode(), exclusive=True)
        persisted = copy

    decision = collect_and_commit(
        tier.channel, save_id, deadline, what, commit, tier.channel.timeout_s
    )
    tier.channel.publish(save_id, decision)
    if decision.committed and persisted is not None:
        after_commit(
            tier.storage,
            tier.catalog,
            persisted,
            name=name,
            run_id=manifest.run_id,
            retention=tier.retention,
            protected=protected,
            grace_s=tier.grace_s,
        )
    else:
        discard_uncommitted(tier.storage, name, save_id, keep_record=bool(decision.missing))
    return decision
