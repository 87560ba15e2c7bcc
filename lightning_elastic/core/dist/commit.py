"""Rank 0's half of the two-phase commit: collect every rank's report, write the DCP metadata
and then the manifest (exclusive create: its appearance is the commit), publish the decision.

Which rank calls what: only the coordinator (rank 0), from its background writer after its own
shard is written (:func:`lightning_elastic.core.save.pipeline.finish_save`); the other ranks
wait for the published decision through the
:class:`~lightning_elastic.core.dist.channel.CommitChannel`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.metadata
import platform
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import MetadataIndex

from lightning_elastic.core.forksafe import fork_safe_logger
from lightning_elastic.core.dist.channel import CommitChannel, CommitDecision
from lightning_elastic.core.format.dcp_json import ItemLocation, metadata_to_json
from lightning_elastic.core.format.references import check_references
from lightning_elastic.core.dist.lease import check_lease
from lightning_elastic.core.format.catalog import Catalog
from lightning_elastic.core.format.manifest import (
    MANIFEST_FILE,
    MAX_SEQUENCE,
    FileRecord,
    Manifest,
    RankRecord,
    ReferenceRecord,
    Timings,
    dcp_metadata_file_name,
    shard_file_name,
)
from lightning_elastic.core.policy.housekeeping import discard_uncommitted
from lightning_elastic.core.save.request import PlannedSave, RunState, SaveTarget
from lightning_elastic.core.gcpause import paused_gc
from lightning_elastic.core.storage.base import Storage
from lightning_elastic.errors import CheckpointTimeoutError, Phase, RankFailure, StaleWriterError

__all__ = ["collect_and_commit", "commit_as_coordinator", "library_versions"]

log = fork_safe_logger(__name__)  # also logs from the writer thread


def commit_as_coordinator(
    target: SaveTarget, run: RunState, planned: PlannedSave, ckpt: Storage
) -> tuple[CommitDecision, Manifest | None]:
    """Rank 0: collect every report and commit if all are good (the manifest carries ``run``'s
    id, lineage and lease generation); publish the decision."""
    what = target.storage.display(planned.name)
    manifest = None

    def commit(reports: Mapping[int, Any]) -> None:
        nonlocal manifest
        body = _write_dcp_metadata(target, planned, ckpt, reports)
        manifest = _write_manifest(target, run, planned, ckpt, body)

    timeout_s = target.config.timeout_s
    channel = target.channel
    decision = collect_and_commit(
        channel, planned.save_id, planned.deadline, what, commit, timeout_s
    )
    if not decision.committed:
        decision = _stale_first(target.storage, run, decision)
    channel.publish(planned.save_id, decision)
    if not decision.committed:
        # With every rank reported nobody writes any more: remove it all (frees space on
        # ENOSPC). With ranks missing, keep the staging record so a later save can attribute
        # and remove whatever the stragglers still write.
        discard_uncommitted(
            target.storage, planned.name, planned.save_id, keep_record=bool(decision.missing)
        )
    return decision, manifest


def collect_and_commit(
    channel: CommitChannel,
    save_id: str,
    deadline: float,
    what: str,
    commit: Callable[[Mapping[int, Any]], None],
    timeout_s: float,
) -> CommitDecision:
    """Rank 0: every rank's report, then ``commit(reports)`` when all are good; the decision
    (a timeout names the silent ranks, a stale writer says so, anything else is rank 0's
    failure in the commit phase)."""
    try:
        reports = channel.collect(save_id, deadline, what)
        failures = [RankFailure.from_json(r["failure"]) for r in reports.values() if not r["ok"]]
        if failures:
            return CommitDecision(False, tuple(failures))
        commit(reports)
        return CommitDecision(True)
    except CheckpointTimeoutError as exc:
        return CommitDecision(False, (), tuple(exc.missing_ranks), timeout_s)
    except StaleWriterError as exc:
        log.error("refusing to commit %s: %s", what, exc)
        return CommitDecision(False, tuple(exc.failures.values()))
    except Exception as exc:
        log.error("rank 0 failed to commit %s", what, exc_info=True)
        return CommitDecision(False, (RankFailure.from_exception(0, Phase.COMMIT, exc),))


def _stale_first(storage: Storage, run: RunState, decision: CommitDecision) -> CommitDecision:
    """A refused save of a stale writer says so, whatever else failed: the newer job's cleanup
    removes what a stale copy writes, so its saves can fail in any phase, and the old copy
    must still learn that it is stale (and stop)."""
    stale = StaleWriterError.__name__
    lease = run.lease
    if lease is None or any(f.error_type == stale for f in decision.failures):
        return decision
    try:
        check_lease(storage, lease)
    except StaleWriterError as exc:  # rank 0's failure becomes the stale verdict
        failures = (*decision.failures, *exc.failures.values())
        return dataclasses.replace(decision, failures=failures)
    except Exception:
        log.debug("could not check the lease after a failed save", exc_info=True)
    return decision


def _write_dcp_metadata(
    target: SaveTarget, planned: PlannedSave, ckpt: Storage, reports: Mapping[int, Any]
) -> _Commit:
    """Rank 0, every report good: the DCP metadata of the save, with every rank's write
    results, as ``<save_id>-dcp_metadata.json``; the manifest's files and ranks."""
    commit_start = time.monotonic()
    storage_data: dict[MetadataIndex, ItemLocation] = {}
    references: dict[str, ReferenceRecord] = {}
    files, ranks = [], []
    with paused_gc():  # CPU only, ~10^5 objects at 20,000 tensors: see core/gcpause.py
        for rank in sorted(reports):
            report = reports[rank]
            ranks.append(RankRecord(**report["rank"]))
            if report["file"] is not None:
                size, checksum = report["file"]
                name = shard_file_name(planned.save_id, rank)
                files.append(FileRecord(name, size, checksum, rank))
            for encoded in report["results"]:
                index, location = decode_result(encoded)
                storage_data[index] = location
            for path, checkpoint, size, checksum, holder in report.get("references", ()):
                references[path] = ReferenceRecord(checkpoint, path, size, checksum, holder)
        assert planned.dcp_metadata is not None
        metadata = dataclasses.replace(
            planned.dcp_metadata, storage_data=storage_data, version="1.0.0"
        )
        body = metadata_to_json(metadata, planned.skeleton).encode()
    dcp_file = dcp_metadata_file_name(planned.save_id)
    checksum = target.config.checksum
    written = ckpt.write_stream(dcp_file, lambda: (body,), checksum=checksum)
    assert written.checksum is not None
    files.append(FileRecord(dcp_file, written.size, written.checksum, None))
    refs = tuple(references[p] for p in sorted(references))
    check_references(target.storage, refs)
    return _Commit(tuple(files), tuple(ranks), dcp_file, commit_start, refs)


@dataclasses.dataclass(frozen=True)
class _Commit:
    files: tuple[FileRecord, ...]
    ranks: tuple[RankRecord, ...]
    dcp_file: str
    started: float
    references: tuple[ReferenceRecord, ...] = ()


def _write_manifest(
    target: SaveTarget, run: RunState, planned: PlannedSave, ckpt: Storage, body: _Commit
) -> Manifest:
    """Rank 0: the manifest, written last with exclusive create (the commit), or replacing the
    manifest of the checkpoint this save replaces, after the lease check (a newer job of this
    run wins: refuse)."""
    request, config, ranks, lease = planned.request, target.config, body.ranks, run.lease
    now = time.monotonic()
    manifest = Manifest(
        run_id=run.run_id,
        save_id=planned.save_id,
        name=planned.name.rsplit("/", 1)[-1],
        step=request.step,
        epoch=request.epoch,
        created_unix=time.time(),
        world_size=target.coordinator.world_size,
        ranks=ranks,
        files=body.files,
        checksum_algorithm=config.checksum,
        timings=Timings(
            staging_s=max(r.staging_s for r in ranks),
            writing_s=max(r.writing_s for r in ranks),
            commit_s=now - body.started,
            total_s=now - planned.started,
        ),
        versions=library_versions(),
        compression=config.compression,
        metrics=dict(request.metrics),
        metadata=dict(request.metadata),
        resumed_from=run.resumed_from,
        sequence=next_sequence(target.catalog, run.sequence_floor),
        parent=run.parent,
        generation=None if lease is None else lease.generation,
        dcp_metadata=body.dcp_file,
        references=body.references,
    )
    if lease is not None:
        check_lease(target.storage, lease)
    if planned.replaces:  # the old checkpoint stays committed up to this very write
        ckpt.replace_bytes(MANIFEST_FILE, manifest.to_json().encode())
        target.catalog.forget(planned.name)
    else:
        ckpt.write_bytes(MANIFEST_FILE, manifest.to_json().encode(), exclusive=True)
    return manifest


def next_sequence(catalog: Catalog, floor: int = 0) -> int:
    """One more than the newest commit sequence in the root (commit order, not steps), and
    above ``floor`` (multi-tier: the newest sequence of every tier, so one checkpoint has one
    place in commit order wherever a copy of it lives).

    Two jobs committing at the same instant may draw the same number; ties are ordered by
    creation time, then name."""
    sequences = [i.manifest.sequence for i in catalog.scan() if i.manifest is not None]
    return min(max(*sequences, floor, 0) + 1, MAX_SEQUENCE)  # saturate: ties go by time


def encode_result(result: Any) -> list[Any]:
    """A DCP ``WriteResult`` as a JSON list (for the rank's report through the store)."""
    index, loc = result.index, result.storage_data
    assert isinstance(loc, ItemLocation)
    offset = None if index.offset is None else list(index.offset)
    return [index.fqn, offset, index.index, loc.file, loc.offset, loc.length, list(loc.transforms)]


def decode_result(encoded: Sequence[Any]) -> tuple[MetadataIndex, ItemLocation]:
    """The inverse of :func:`encode_result`."""
    fqn, offset, hint, file, pos, length, transforms = encoded
    return MetadataIndex(fqn, offset, hint), ItemLocation(file, pos, length, tuple(transforms))


def library_versions() -> dict[str, str]:
    """Versions recorded in every manifest."""
    versions = {"python": platform.python_version(), "torch": torch.__version__}
    for dist_name in ("lightning", "lightning_elastic", "torchmetrics", "fsspec"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            versions[dist_name] = importlib.metadata.version(dist_name)
    return versions
