"""One save, in four phases: plan (collective), stage (blocking), write and commit (background).

Which rank calls what:

* ``plan_save`` (:mod:`~lightning_elastic.core.save.plan`) - every rank, together, on the
  training thread. DCP's ``DefaultSavePlanner`` builds each rank's local plan; rank 0
  deduplicates them (each replicated tensor is written by exactly one rank, balancing bytes),
  picks the directory name, writes the staging record, and hands every rank its final plan.
* ``stage_save`` - every rank, blocking: copies the bytes of *its* items into the reused host
  arena (async) or takes views of the live tensors (sync). A lazy snapshot
  (:mod:`~lightning_elastic.core.save.snapshot`) copies only the unguarded tensors here and
  leaves the rest to the writer thread, which copies them first thing in ``finish_save``.
* ``finish_save`` - every rank, in the background writer (async) or inline (sync): writes its
  shard with a checksum computed on the way, reports through the store, and rank 0 commits
  (:mod:`~lightning_elastic.core.dist.commit`), publishes the decision and cleans up after a
  durable commit (:mod:`~lightning_elastic.core.policy.housekeeping`). Any failure becomes
  the same error on every rank.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import time
from typing import Any

from lightning_elastic.core.dist.commit import commit_as_coordinator, encode_result
from lightning_elastic.core.forksafe import fork_safe_logger
from lightning_elastic.core.format.manifest import Manifest, RankRecord, shard_file_name
from lightning_elastic.core.gcpause import paused_gc
from lightning_elastic.core.policy.housekeeping import after_commit
from lightning_elastic.core.save.request import PlannedSave, RunState, SaveResult, SaveTarget
from lightning_elastic.core.save.snapshot import LazyRule, _TensorChanged
from lightning_elastic.core.save.stage import (
    Payload,
    direct_payload,
    stage_lazily,
    stage_payload,
)
from lightning_elastic.core.save.write import write_shard
from lightning_elastic.errors import Phase, RankFailure, SnapshotChangedError

__all__ = ["finish_save", "housekeep", "stage_save"]

log = fork_safe_logger(__name__)  # also logs from the writer thread
# Grace period ranks != 0 add to the deadline, so rank 0's verdict (naming the guilty rank)
# normally arrives before their own timeout fires.
_GRACE_MIN_S = 2.0


def stage_save(
    target: SaveTarget, planned: PlannedSave, copy: bool, lazy: LazyRule | None = None
) -> Payload:
    """This rank's items as one payload: copied into the host arena, or views of the live
    tensors (``copy=False``, for a save that writes before returning). With ``lazy`` (and
    ``copy``), the tensors it accepts are copied later, by the writer thread, from the
    :class:`~lightning_elastic.core.save.snapshot.LazySnapshot` left in ``planned.snapshot``."""
    if copy and lazy is not None:
        payload, planned.snapshot = stage_lazily(
            planned.plan.items, planned.planner, target.arena, lazy
        )
        return payload
    if copy:
        return stage_payload(planned.plan.items, planned.planner, target.arena)
    return direct_payload(planned.plan.items, planned.planner)


def finish_save(
    target: SaveTarget,
    run: RunState,
    planned: PlannedSave,
    payload: Payload,
    blocked_s: float,
    staging_s: float,
    *,
    housekeeping: bool = True,
) -> SaveResult:
    """Write this rank's shard, take part in the commit, and return or raise the outcome.
    ``housekeeping=False``: rank 0 leaves :func:`housekeep` (claims, leftovers, retention)
    after its commit to the caller."""
    coord, channel = target.coordinator, target.channel
    ckpt = target.storage.child(planned.name)
    write_start = time.monotonic()
    snapshot = planned.snapshot
    report = _write_and_report(target, planned, payload, staging_s)
    written = report.pop("written", ())  # DCP's results of this rank's own file
    selection = report.pop("selection", None)  # incremental: what it wrote and referred to
    if selection is not None and report["ok"]:
        report["references"] = target.increments.references(selection)  # type: ignore[union-attr]
        report["results"] += [encode_result(r) for r in selection.results()]
    writing_s = time.monotonic() - write_start
    waited_s = 0.0
    if snapshot is not None:
        staging_s += snapshot.copy_s
        writing_s -= snapshot.copy_s
        waited_s = snapshot.waited_s
    what = target.storage.display(planned.name)
    channel.report(planned.save_id, report)
    manifest: Manifest | None = None
    try:
        if coord.is_coordinator:
            decision, manifest = commit_as_coordinator(target, run, planned, ckpt)
        else:
            grace = max(_GRACE_MIN_S, 0.1 * target.config.timeout_s)
            decision = channel.await_decision(planned.save_id, planned.deadline + grace, what)
    finally:
        channel.ack(planned.save_id)
    if not decision.committed:
        if target.increments is not None:
            target.increments.reset()  # the next save is full
        raise decision.error(what)
    if selection is not None and planned.request.name is not None and planned.request.overwrite:
        # a checkpoint that may be replaced is no base: one referring to it would forbid its
        # next replacement (ModelCheckpoint's "last" in this root); the next save is full
        target.increments.reset()  # type: ignore[union-attr]
    elif selection is not None:
        assert target.increments is not None
        shard = report.get("file")
        target.increments.committed(
            selection,
            {} if planned.increment is None else planned.increment.evidence,
            planned.name,
            written,
            None
            if shard is None
            else (shard_file_name(planned.save_id, coord.rank), shard[0], shard[1], coord.rank),
        )
    run.committed(planned.name)  # the next save continues this one
    if manifest is not None and housekeeping:
        housekeep(target, run, manifest)
    return SaveResult(
        name=planned.name,
        location=what,
        step=planned.request.step,
        bytes_written=0 if report.get("file") is None else int(report["file"][0]),
        blocked_s=blocked_s + waited_s,
        staging_s=staging_s,
        writing_s=writing_s,
        total_s=time.monotonic() - planned.started,
        manifest=manifest,
        snapshot="lazy" if snapshot is not None else planned.snapshot_mode,
        snapshot_wait_s=waited_s,
    )


def housekeep(target: SaveTarget, run: RunState, manifest: Manifest) -> None:
    """After ``manifest`` was committed in ``target.storage``: its claim and strays,
    leftovers, then the target's retention (never a checkpoint ``run`` protects: a frozen
    copy of the set, which the training thread may change meanwhile)."""
    after_commit(
        target.storage,
        target.catalog,
        manifest,
        name=manifest.name,
        run_id=run.run_id,
        retention=target.config.retention,
        protected=run.protected,
        grace_s=target.config.leftover_grace_s,
    )


def _write_and_report(
    target: SaveTarget, planned: PlannedSave, payload: Payload, staging_s: float
) -> dict[str, Any]:
    """Write this rank's shard; the report for rank 0 (``ok`` with file and DCP results, or
    the failure). A failed write removes its partial file (frees the space on ENOSPC)."""
    coord, config = target.coordinator, target.config
    ckpt = target.storage.child(planned.name)
    file_name = shard_file_name(planned.save_id, coord.rank)
    start = time.monotonic()
    snapshot = planned.snapshot
    try:
        if snapshot is not None:  # the lazy part of the staging copy, first
            snapshot.run()
            staging_s += snapshot.copy_s
            start = time.monotonic()
        selection = None
        if target.increments is not None:  # incremental: write only what changed (the
            # staged bytes are hashed: with a lazy snapshot, after its copy)
            selection = target.increments.select(payload, planned.increment, planned.name)
            payload = selection.payload
        shard = None
        if payload.items:
            shard = write_shard(
                ckpt, file_name, payload, checksum=config.checksum, compression=config.compression
            )
        if snapshot is not None:
            snapshot.check()  # an in-place update that ended during the write
        record = _rank_record(
            coord.rank,
            0 if shard is None else shard.written.size,
            staging_s,
            time.monotonic() - start,
        )
        with paused_gc():  # CPU only: see core/gcpause.py
            results = [] if shard is None else [encode_result(r) for r in shard.results]
        return {
            "ok": True,
            "file": None if shard is None else [shard.written.size, shard.written.checksum],
            "results": results,
            "rank": dataclasses.asdict(record),
            "written": () if shard is None else shard.results,  # stays on this rank
            "selection": selection,  # stays on this rank
        }
    except Exception as exc:
        failure = RankFailure.from_exception(coord.rank, Phase.WRITE, exc)
        if isinstance(exc, _TensorChanged):  # not an I/O failure: the commit says which
            failure = RankFailure(coord.rank, Phase.WRITE, SnapshotChangedError.__name__, str(exc))
            log.warning("rank %d: %s", coord.rank, exc)
        else:
            shown = ckpt.display(file_name)
            log.error("rank %d failed to write %s", coord.rank, shown, exc_info=True)
        try:
            ckpt.delete(file_name)
        except Exception:
            log.debug("could not remove partial %s", file_name, exc_info=True)
        return {"ok": False, "failure": failure.to_json()}
    finally:
        if snapshot is not None:
            snapshot.release()


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
