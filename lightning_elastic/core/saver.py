"""One save, in four phases: plan (collective), stage (blocking), write and commit (background).

Which rank calls what:

* ``plan_save`` - every rank, together, on the training thread. DCP's ``DefaultSavePlanner``
  builds each rank's local plan; rank 0 deduplicates them (each replicated tensor is written
  by exactly one rank, balancing bytes), picks the directory name, writes the staging record,
  and hands every rank its final plan.
* ``stage_save`` - every rank, blocking: copies the bytes of *its* items into the reused arena
  (async) or takes views of the live tensors (sync).
* ``finish_save`` - every rank, in the background writer (async) or inline (sync): writes its
  shard with a checksum computed on the way, reports through the store, and rank 0 commits
  (``dcp_metadata.json``, then ``manifest.json`` exclusively), publishes the decision and
  cleans up after a durable commit. Any failure becomes the same error on every rank.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.metadata
import logging
import os
import platform
import socket
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.storage import WriteResult

from lightning_elastic.core.catalog import Catalog
from lightning_elastic.core.commit import CommitChannel, Decision
from lightning_elastic.core.coordinator import Coordinator
from lightning_elastic.core.dcp_format import ItemLocation, metadata_to_json
from lightning_elastic.core.manifest import (
    DCP_METADATA_FILE,
    MANIFEST_FILE,
    STAGING_FILE,
    FileRecord,
    Manifest,
    RankRecord,
    Timings,
    shard_file_name,
)
from lightning_elastic.core.planning import PlanCache, PlannedSave, plan_save
from lightning_elastic.core.retention import RetentionPolicy, plan_deletions
from lightning_elastic.core.shardio import write_shard
from lightning_elastic.core.staging import Payload, StagingArena, direct_payload, stage_payload
from lightning_elastic.core.storage import Storage
from lightning_elastic.errors import (
    CheckpointTimeoutError,
    RankFailure,
)

__all__ = [
    "PlannedSave",
    "SaveContext",
    "SaveRequest",
    "SaveResult",
    "finish_save",
    "plan_save",
    "stage_save",
]

log = logging.getLogger(__name__)
# Grace period ranks != 0 add to the deadline, so rank 0's verdict (naming the guilty rank)
# normally arrives before their own timeout fires.
_GRACE_MIN_S = 2.0


@dataclass
class SaveContext:
    """The engine parts a save needs (shared by all saves of one engine)."""

    storage: Storage
    catalog: Catalog
    coordinator: Coordinator
    channel: CommitChannel
    run_id: str
    checksum: str
    compression: str | None
    timeout_s: float
    arena: StagingArena
    retention: Sequence[RetentionPolicy] = ()
    protected: set[str] = field(default_factory=set)
    resumed_from: str | None = None
    plan_cache: PlanCache | None = None


@dataclass(frozen=True)
class SaveRequest:
    step: int
    epoch: int | None = None
    metrics: Mapping[str, float] = field(default_factory=dict)
    metadata: Mapping[str, Any] = field(default_factory=dict)
    name: str | None = None
    overwrite: bool = False


@dataclass(frozen=True)
class SaveResult:
    """A committed save, as seen by one rank."""

    name: str
    location: str
    step: int
    bytes_written: int  # by this rank
    blocked_s: float  # time the caller was blocked on this rank
    staging_s: float
    writing_s: float
    total_s: float  # from the save call to the commit being known on this rank
    manifest: Manifest | None = None  # rank 0 only


def stage_save(ctx: SaveContext, planned: PlannedSave, copy: bool) -> Payload:
    if copy:
        return stage_payload(planned.plan.items, planned.planner, ctx.arena)
    return direct_payload(planned.plan.items, planned.planner)


def finish_save(
    ctx: SaveContext, planned: PlannedSave, payload: Payload, blocked_s: float, staging_s: float
) -> SaveResult:
    """Write this rank's shard, take part in the commit, and return or raise the outcome."""
    coord = ctx.coordinator
    ckpt = ctx.storage.child(planned.name)
    file_name = shard_file_name(planned.save_id, coord.rank)
    write_start = time.monotonic()
    report: dict[str, Any]
    try:
        shard = None
        if payload.items:
            shard = write_shard(
                ckpt, file_name, payload, checksum=ctx.checksum, compression=ctx.compression
            )
        writing_s = time.monotonic() - write_start
        report = {
            "ok": True,
            "file": None if shard is None else [shard.written.size, shard.written.checksum],
            "results": [] if shard is None else [_encode_result(r) for r in shard.results],
            "rank": dataclasses.asdict(
                _rank_record(
                    coord.rank, 0 if shard is None else shard.written.size, staging_s, writing_s
                )
            ),
        }
    except Exception as exc:
        log.error("rank %d failed to write %s", coord.rank, ckpt.display(file_name), exc_info=True)
        report = {
            "ok": False,
            "failure": RankFailure.from_exception(coord.rank, "write", exc).to_json(),
        }
        writing_s = time.monotonic() - write_start
        try:
            ckpt.delete(file_name)  # free the space a partial shard holds (ENOSPC)
        except Exception:
            log.debug("could not remove partial %s", file_name, exc_info=True)
    what = ctx.storage.display(planned.name)
    ctx.channel.report(planned.save_id, report)
    manifest = None
    try:
        if coord.is_coordinator:
            decision, manifest = _commit(ctx, planned, ckpt)
        else:
            grace = max(_GRACE_MIN_S, 0.1 * ctx.timeout_s)
            decision = ctx.channel.await_decision(planned.save_id, planned.deadline + grace, what)
    finally:
        ctx.channel.ack(planned.save_id)
    if not decision.committed:
        raise decision.error(what)
    if manifest is not None:
        _housekeeping(ctx, planned, manifest)
    return SaveResult(
        name=planned.name,
        location=what,
        step=planned.request.step,
        bytes_written=0 if report.get("file") is None else int(report["file"][0]),
        blocked_s=blocked_s,
        staging_s=staging_s,
        writing_s=writing_s,
        total_s=time.monotonic() - planned.started,
        manifest=manifest,
    )


# ----------------------------------------------------------------------------- rank 0


def _commit(
    ctx: SaveContext, planned: PlannedSave, ckpt: Storage
) -> tuple[Decision, Manifest | None]:
    """Rank 0: collect every report and commit if all are good; publish the decision."""
    what = ctx.storage.display(planned.name)
    manifest = None
    try:
        reports = ctx.channel.collect(planned.save_id, planned.deadline, what)
        failures = [RankFailure.from_json(r["failure"]) for r in reports.values() if not r["ok"]]
        if failures:
            decision = Decision(False, tuple(failures))
        else:
            manifest = _write_commit(ctx, planned, ckpt, reports)
            decision = Decision(True)
    except CheckpointTimeoutError as exc:
        decision = Decision(False, (), tuple(exc.missing_ranks), ctx.timeout_s)
    except Exception as exc:
        log.error("rank 0 failed to commit %s", what, exc_info=True)
        decision = Decision(False, (RankFailure.from_exception(0, "commit", exc),))
    ctx.channel.publish(planned.save_id, decision)
    if not decision.committed:
        # With every rank reported nobody writes any more: remove it all (frees space on
        # ENOSPC). With ranks missing, keep the staging record so a later save can attribute
        # and remove whatever the stragglers still write.
        _discard(ctx, planned.name, keep_record=bool(decision.missing))
    return decision, manifest


def _write_commit(
    ctx: SaveContext, planned: PlannedSave, ckpt: Storage, reports: Mapping[int, Any]
) -> Manifest:
    commit_start = time.monotonic()
    storage_data: dict[MetadataIndex, ItemLocation] = {}
    files, ranks = [], []
    for rank in sorted(reports):
        report = reports[rank]
        ranks.append(RankRecord(**report["rank"]))
        if report["file"] is not None:
            size, checksum = report["file"]
            files.append(FileRecord(shard_file_name(planned.save_id, rank), size, checksum, rank))
        for encoded in report["results"]:
            index, location = _decode_result(encoded)
            storage_data[index] = location
    assert planned.dcp_metadata is not None
    metadata = dataclasses.replace(planned.dcp_metadata, storage_data=storage_data, version="1.0.0")
    body = metadata_to_json(metadata, planned.skeleton).encode()
    written = ckpt.write_stream(DCP_METADATA_FILE, lambda: (body,), checksum=ctx.checksum)
    assert written.checksum is not None
    files.append(FileRecord(DCP_METADATA_FILE, written.size, written.checksum, None))
    request = planned.request
    now = time.monotonic()
    manifest = Manifest(
        run_id=ctx.run_id,
        save_id=planned.save_id,
        name=planned.name.rsplit("/", 1)[-1],
        step=request.step,
        epoch=request.epoch,
        created_unix=time.time(),
        world_size=ctx.coordinator.world_size,
        ranks=tuple(ranks),
        files=tuple(files),
        checksum_algorithm=ctx.checksum,
        timings=Timings(
            staging_s=max(r.staging_s for r in ranks),
            writing_s=max(r.writing_s for r in ranks),
            commit_s=now - commit_start,
            total_s=now - planned.started,
        ),
        versions=library_versions(),
        compression=ctx.compression,
        metrics=dict(request.metrics),
        metadata=dict(request.metadata),
        resumed_from=ctx.resumed_from,
    )
    ckpt.write_bytes(MANIFEST_FILE, manifest.to_json().encode(), exclusive=True)
    return manifest


def _housekeeping(ctx: SaveContext, planned: PlannedSave, manifest: Manifest) -> None:
    """After a durable commit: drop the staging record and strays, leftovers, then retention.
    Failures here never undo the commit; they are logged as warnings."""
    ckpt = ctx.storage.child(planned.name)
    try:
        keep = {f.path for f in manifest.files} | {MANIFEST_FILE}
        for entry in ckpt.listdir():
            if not entry.is_dir and entry.name not in keep:
                ckpt.delete(entry.name)
        infos = ctx.catalog.scan()
        for info in infos:
            stale = info.staging is not None and info.staging.save_id != planned.save_id
            if info.status == "incomplete" and stale and info.run_id == ctx.run_id:
                log.info("removing leftover of a crashed save: %s", info.location)
                _discard(ctx, info.name, keep_record=False)
        doomed = plan_deletions(infos, ctx.retention, run_id=ctx.run_id, protected=ctx.protected)
        for info in doomed:
            log.info("retention: deleting %s (step %s)", info.location, info.step)
            delete_checkpoint(ctx.storage, ctx.catalog, info.name)
    except Exception as exc:
        log.warning("cleanup after committing %s failed: %r", ckpt.display(), exc, exc_info=True)


def delete_checkpoint(storage: Storage, catalog: Catalog, name: str) -> None:
    """Manifest first (the checkpoint stops existing), then the data."""
    storage.delete(f"{name}/{MANIFEST_FILE}")
    catalog.forget(name)
    storage.delete_tree(name)


def _discard(ctx: SaveContext, name: str, *, keep_record: bool) -> None:
    """Remove an uncommitted directory (never one that holds a manifest)."""
    storage = ctx.storage
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


# ----------------------------------------------------------------------------- helpers


def _encode_result(result: WriteResult) -> list[Any]:
    index, loc = result.index, result.storage_data
    assert isinstance(loc, ItemLocation)
    offset = None if index.offset is None else list(index.offset)
    return [index.fqn, offset, index.index, loc.file, loc.offset, loc.length, list(loc.transforms)]


def _decode_result(encoded: Sequence[Any]) -> tuple[MetadataIndex, ItemLocation]:
    fqn, offset, hint, file, pos, length, transforms = encoded
    return MetadataIndex(fqn, offset, hint), ItemLocation(file, pos, length, tuple(transforms))


def _rank_record(rank: int, nbytes: int, staging_s: float, writing_s: float) -> RankRecord:
    local_rank = os.environ.get("LOCAL_RANK")
    return RankRecord(
        rank=rank,
        host=socket.gethostname(),
        pid=os.getpid(),
        local_rank=int(local_rank) if local_rank and local_rank.isdigit() else None,
        bytes_written=nbytes,
        staging_s=staging_s,
        writing_s=writing_s,
    )


def library_versions() -> dict[str, str]:
    versions = {"python": platform.python_version(), "torch": torch.__version__}
    for dist_name in ("lightning", "lightning_elastic", "torchmetrics", "fsspec"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            versions[dist_name] = importlib.metadata.version(dist_name)
    return versions
