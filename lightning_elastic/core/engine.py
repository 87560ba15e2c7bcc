"""The checkpoint engine: stage -> write (DCP planning) -> commit, one save in flight.

Which rank calls what: construct, :meth:`CheckpointEngine.save`, :meth:`~CheckpointEngine.load`,
:meth:`~CheckpointEngine.wait` and :meth:`~CheckpointEngine.close` are called by every rank of
the group, in the same order, from the training thread. ``save`` returns as soon as this
rank's bytes are staged (async) or after the commit (sync); the write and the commit run in
one background thread per rank. A failure anywhere surfaces on every rank as the same typed
error at the next ``save``/``wait``/``close`` (or from the handle's ``result()``).

Where checkpoints live is the placement's (:mod:`~lightning_elastic.core.placement`: one
root, or tiers): the engine plans and stages every save into ``placement.target``, hands the
rest to ``placement.finish`` in the writer thread, and loads through the one load walk
(:mod:`~lightning_elastic.core.load.walk`), which asks the placement for candidates. The
engine owns the run state (:class:`~lightning_elastic.core.save.request.RunState`).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
import uuid
import warnings
from collections.abc import Iterable, Mapping, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from lightning_elastic.core.dist.coordinator import Coordinator
from lightning_elastic.core.format.catalog import Catalog, CheckpointInfo
from lightning_elastic.core.format.integrity import check_verify_mode
from lightning_elastic.core.gcpause import paused_gc
from lightning_elastic.core.load.load import LoadResult, Targets
from lightning_elastic.core.load.per_rank import PerRankRule
from lightning_elastic.core.load.select import RUN_NAMED, select_best
from lightning_elastic.core.load.walk import Filters, LoadRequest, load_walk
from lightning_elastic.core.options import check_run_name, check_seconds, tier_options
from lightning_elastic.core.placement import make_placement
from lightning_elastic.core.placement.base import check_writable
from lightning_elastic.core.policy.retention import RetentionPolicy
from lightning_elastic.core.save.inflight import WHEN_BUSY, SaveHandle, SaveLane
from lightning_elastic.core.save.pipeline import stage_save
from lightning_elastic.core.save.plan import PlanCache, plan_save
from lightning_elastic.core.save.replicated import ReplicationCheck
from lightning_elastic.core.save.request import RunState, SaveConfig, SaveResult
from lightning_elastic.core.save.snapshot import SNAPSHOT_MODES, LazyRule, LazySnapshot
from lightning_elastic.core.save.stage import HostArena
from lightning_elastic.core.save.state import checked_request, state_to_save
from lightning_elastic.core.storage.base import Storage
from lightning_elastic.core.storage.checksum import DEFAULT_ALGORITHM
from lightning_elastic.core.tiers.restore import Recovery
from lightning_elastic.errors import (
    CheckpointLoadError,
    ConfigError,
    Phase,
    SnapshotFallbackWarning,
)

__all__ = ["WHEN_BUSY", "CheckpointEngine", "SaveHandle"]

log = logging.getLogger(__name__)


class CheckpointEngine:
    """Sharded, asynchronous, two-phase-committed checkpoints under one root directory.

    Args:
        root: local directory or fsspec URL holding the checkpoints.
        storage_options: fsspec options (credentials, endpoint_url, ...).
        storage: a ready :class:`Storage` (overrides ``root``/``storage_options``).
        coordinator: a ready :class:`Coordinator`; by default one is created collectively,
            with a dedicated gloo group, from the initialized default process group.
        process_group: the group to checkpoint over (default: a new gloo group over all ranks).
        run_id: identifies this run's checkpoints (retention only touches its own); rank 0's
            value, or a fresh one, is adopted by all ranks. When given, :meth:`load` and
            :meth:`latest` consider only this run's checkpoints; when not, :meth:`load`
            continues the run of the checkpoint it loads (logged).
        async_save: stage and return, writing in the background (``True``), or write and
            commit before returning (``False``).
        snapshot: how an asynchronous save stages: ``"blocking"`` copies every tensor before
            :meth:`save` returns; ``"lazy"`` copies only the unguarded ones then and the
            guarded ones (``save(guarded=...)``, default all) in the writer thread, while
            training goes on. Whatever changes a guarded tensor first calls
            :meth:`wait_snapshot` (:func:`~lightning_elastic.core.save.snapshot.
            guard_optimizers` does it for optimizer steps); a tensor changed in place before
            its copy fails that save (not committed, never mixed) and turns lazy snapshots off
            with one :class:`~lightning_elastic.errors.SnapshotFallbackWarning`.
        when_busy: a save requested while another is in flight ``"wait"``s for it, or is
            ``"skip"``ped (decided by all ranks together, so all skip or none).
        compression: ``None`` or ``"zstd"`` (one frame per item, DCP's ``stream.zstd`` format).
        checksum: algorithm for the manifest's checksums (``"xxh3_64"``, ``"crc32"``, ...).
        retention: policies (``KeepLastN`` ...) applied by rank 0 after each durable commit.
        timeout: how long ranks wait for each other in a save or load before raising
            :class:`~lightning_elastic.errors.CheckpointTimeoutError` (a ``timedelta`` or
            seconds, at most a year).
        leftover_grace: age after which a directory without a manifest left by *another*
            job (or a stray file in a committed directory) is garbage (default: twice
            ``timeout``); this run's own leftovers are removed after its next commit.
        local_root: a node-local directory (``/dev/shm/...``, a local disk): turns on
            multi-tier checkpoints (docs/tiers.md). Every save commits there first and its
            shards are replicated to other nodes; ``root`` becomes the persistent tier, written
            every ``persist_every_n_saves``-th save; :meth:`load` recovers from the fastest
            tier holding the newest checkpoint.
        persist_every_n_saves: with ``local_root``: persist every k-th save (default 1; a save
            with ``persist=True`` always is).
        replicas: with ``local_root``: how many other nodes hold a copy of each rank's shard
            (default 1; capped at the number of other nodes).
        local_keep: with ``local_root``: checkpoints kept per node-local root (default 2).
        node: with ``local_root``: this process's node id (default ``$LIGHTNING_ELASTIC_NODE``,
            else the host name).
        full_every_n_saves: incremental saves (off by default): a tensor equal to the one the
            previous committed save holds is not written again, the manifest refers to it;
            every n-th save is full, so a load reads from at most n checkpoints (``None`` or
            1: every save is full). See docs/guarantees.md, "Incremental checkpoints".
    """

    def __init__(
        self,
        root: str | os.PathLike[str] | None = None,
        *,
        storage_options: Mapping[str, Any] | None = None,
        storage: Storage | None = None,
        coordinator: Coordinator | None = None,
        process_group: dist.ProcessGroup | None = None,
        run_id: str | None = None,
        async_save: bool = True,
        snapshot: str = "blocking",
        when_busy: str = "wait",
        compression: str | None = None,
        checksum: str = DEFAULT_ALGORITHM,
        retention: Sequence[RetentionPolicy] = (),
        timeout: timedelta | float = timedelta(minutes=10),
        leftover_grace: timedelta | float | None = None,
        local_root: str | os.PathLike[str] | None = None,
        persist_every_n_saves: int | None = None,
        replicas: int | None = None,
        local_keep: int | None = None,
        node: str | None = None,
        full_every_n_saves: int | None = None,
    ) -> None:
        tiers = tier_options(  # validates them (ConfigError)
            local_root,
            persist_every_n_saves=persist_every_n_saves,
            replicas=replicas,
            local_keep=local_keep,
            node=node,
        )
        if storage is None:
            if root is None:
                raise ConfigError("CheckpointEngine needs a root directory or a storage")
            storage = Storage(root, storage_options=storage_options)
        if when_busy not in WHEN_BUSY:
            raise ConfigError(f"when_busy must be one of {WHEN_BUSY}, got {when_busy!r}")
        if snapshot not in SNAPSHOT_MODES:
            raise ConfigError(f"snapshot must be one of {SNAPSHOT_MODES}, got {snapshot!r}")
        timeout = timedelta(seconds=check_seconds(timeout, "timeout"))
        grace = (
            2 * timeout
            if leftover_grace is None
            else timedelta(seconds=check_seconds(leftover_grace, "leftover_grace", zero=True))
        )
        config = SaveConfig(  # validates them (ConfigError)
            checksum,
            compression,
            timeout.total_seconds(),
            grace.total_seconds(),
            tuple(retention),
            full_every_n_saves=full_every_n_saves,
        )
        if tiers and (config.full_every_n_saves or 1) > 1:
            # the node-local tier's replicas, uploads and recovery copy a checkpoint's own
            # files only: a copy of an incremental one would miss what it refers to
            raise ConfigError(
                f"full_every_n_saves={config.full_every_n_saves} (incremental saves) is not "
                "supported with local_root (multi-tier) yet: leave full_every_n_saves unset"
            )
        if run_id is not None:
            check_run_name(run_id, "run_id")
        self.storage = storage
        self.async_save = async_save
        self.snapshot = snapshot
        self.when_busy = when_busy
        self._snapshot: LazySnapshot | None = None  # the lazy copy in flight
        self.snapshot_fallback: str | None = None  # why lazy snapshots were turned off
        coord = self.coordinator = coordinator or Coordinator.from_environment(
            timeout=timeout, process_group=process_group
        )
        self.catalog = Catalog(storage)
        self._run = RunState(coord.broadcast(Phase.INIT, lambda: run_id or uuid.uuid4().hex[:12]))
        self._placement = make_placement(storage, self.catalog, coord, config, self._run, **tiers)
        # the run's name, when given: loads consider only its checkpoints, and its manifests
        # say so (an unnamed job never continues a named run)
        self._named = self._run.run_id if run_id is not None else None
        named = {} if self._named is None else {RUN_NAMED: True}
        self._metadata = {**named, **self._placement.save_metadata}  # in every manifest
        self._replicas = ReplicationCheck()
        self._plan_cache: PlanCache | None = None  # this rank's, training thread only
        self._lane = SaveLane(coord, when_busy)
        self._closed = False

    # ------------------------------------------------------------------ properties

    @property
    def rank(self) -> int:
        """The rank of this process in the checkpoint group."""
        return self.coordinator.rank

    @property
    def world_size(self) -> int:
        """The number of ranks in the checkpoint group."""
        return self.coordinator.world_size

    @property
    def run_id(self) -> str:
        """The run id of this engine's saves, agreed by all ranks (a load may adopt the loaded
        checkpoint's run)."""
        return self._run.run_id

    @property
    def resumed_from(self) -> str | None:
        """The name of the checkpoint this engine last loaded, or ``None``."""
        return self._run.resumed_from

    @property
    def multi_tier(self) -> bool:
        """Whether this engine has a node-local tier (``local_root``)."""
        return self._placement.multi_tier

    @property
    def last_recovery(self) -> Recovery | None:
        """Multi-tier: what the last load did, tier by tier (``None`` without tiers)."""
        return self._placement.last_recovery

    @property
    def load_storage(self) -> Storage:
        """Where loads read checkpoints: the root, or with ``local_root`` the node-local root
        (recovery gathers the checkpoint there; ``dirpath`` may not hold it)."""
        return self._placement.target.storage

    @property
    def arena(self) -> HostArena:
        """The host buffer asynchronous saves stage into, reused across saves."""
        return self._placement.target.arena

    # ------------------------------------------------------------------ saving

    def save(
        self,
        state: Mapping[str, Any],
        *,
        step: int,
        epoch: int | None = None,
        metrics: Mapping[str, float] | None = None,
        metadata: Mapping[str, Any] | None = None,
        rank_state: Mapping[str, Any] | None = None,
        name: str | None = None,
        overwrite: bool = False,
        blocking: bool | None = None,
        persist: bool = False,
        guarded: Iterable[torch.Tensor] | None = None,
    ) -> SaveHandle | None:
        """Save ``state`` (identical keys on every rank) as the checkpoint of ``step``.

        ``state`` values may be tensors, DTensors, nested dicts/lists, ``Stateful`` objects or
        picklable objects; replicated entries are written once. An entry whose value differs
        between ranks is found (digests compared across ranks) and kept per rank
        (:mod:`~lightning_elastic.core.save.replicated`). ``rank_state`` is kept per rank
        (RNG states, data position): each rank gets its own back from :meth:`load`.
        ``metadata`` must be JSON-safe and lands in the manifest, as do ``metrics`` (used by
        ``KeepBestK``). Returns ``None`` when skipped because a save is in flight
        (``when_busy="skip"``), else a handle; with ``blocking`` (default: not ``async_save``)
        the handle is already committed. With ``local_root`` (multi-tier), ``persist=True``
        (the same on every rank) persists this save whatever ``persist_every_n_saves`` says.
        With ``snapshot="lazy"``, ``guarded`` are the tensors whose changes the caller guards
        with :meth:`wait_snapshot` (parameters and optimizer state: ``guarded_tensors``);
        only they are copied after ``save`` returns (default: every tensor).
        """
        self._check_open()
        called = time.monotonic()
        ready = self._lane.ready()
        self._note_abandoned()
        if not ready:
            return None
        request = checked_request(step, epoch, metrics, metadata, name, overwrite, self._metadata)
        persist = self._placement.decide(persist)
        target = self._placement.target
        with paused_gc():  # the training thread waits here: see core/gcpause.py
            state_dict, walk = state_to_save(self._replicas, self.coordinator, state, rank_state)
            planned = plan_save(target, self._run, state_dict, request, walk, self._plan_cache)
            self._plan_cache = planned.cache
            if target.increments is not None:  # unchanged tensors are referred to, not staged
                if request.name is not None and request.overwrite:
                    # full: it may replace the checkpoint whose files it would refer to (the
                    # commit removes them as strays); decided alike on every rank
                    target.increments.reset()
                planned.increment, staged = target.increments.preselect(
                    planned.plan.items, planned.planner
                )
                planned.plan = dataclasses.replace(planned.plan, items=staged)
            del walk  # it dies inside the pause: alive at its end, the collector scans it
            # (60,000 objects at 20,000 tensors: 7-17 ms of every save)
            blocking = (not self.async_save) if blocking is None else blocking
            lazy = self.snapshot == "lazy" and not blocking
            if lazy and self.snapshot_fallback is not None:
                lazy, planned.snapshot_mode = False, "fallback"
            stage_start = time.monotonic()
            rule = LazyRule(guarded) if lazy else None
            payload = stage_save(target, planned, copy=not blocking, lazy=rule)
            staging_s = time.monotonic() - stage_start
            self._snapshot = planned.snapshot

        def finish(blocked_s: float) -> SaveResult:  # the writer thread, or inline
            try:
                return self._placement.finish(planned, payload, blocked_s, staging_s, persist)
            finally:
                if planned.snapshot is not None:
                    planned.snapshot.end()  # no guard waits forever on a save that failed

        try:
            return self._lane.start(
                finish, name=planned.name, step=step, called=called, blocking=blocking
            )
        except BaseException:  # (a writer thread that could not start: no guard may wait
            if planned.snapshot is not None:  # for a copy that will never run)
                planned.snapshot.end()
                self._snapshot = None
            raise

    def wait(self) -> SaveResult | None:
        """Wait for the save in flight (and, multi-tier, the persist in flight); raise its
        error (once) if it failed. A save whose lazy snapshot saw a tensor change is not
        raised here (``None``; see :meth:`wait_snapshot`)."""
        result = self._lane.wait()
        self._note_abandoned()
        self._placement.wait()
        return result

    def wait_snapshot(self) -> float:
        """Block until the lazy snapshot in flight (if any) has copied its tensors, and return
        the seconds waited: call it before anything that changes a guarded tensor (an
        optimizer step, a scheduler's tensor, an in-place update). Cheap when nothing is in
        flight or the copy is done."""
        snapshot = self._snapshot
        if snapshot is None:
            return 0.0
        waited = snapshot.wait()
        self._snapshot = None
        return waited

    def _note_abandoned(self) -> None:
        """Training thread, after the save in flight ended: if its lazy snapshot saw a tensor
        change (not committed, on every rank), turn lazy snapshots off and warn, once."""
        self._snapshot = None if self._lane.idle() else self._snapshot
        exc = self._lane.take_abandoned()
        if exc is None or self.snapshot_fallback is not None:
            return
        self.snapshot_fallback = str(exc)
        warnings.warn(
            f"a lazy snapshot was given up: {exc}. That save was not committed; this "
            "engine's saves take blocking snapshots from now on (a tensor was changed in "
            "place outside the guarded optimizer step; see docs/guarantees.md)",
            SnapshotFallbackWarning,
            stacklevel=3,
        )

    def persist_latest(self) -> bool:
        """Multi-tier: persist the newest save now unless it is persisted already, and wait
        (collective; the end of a fit, a preemption). ``False`` when there was nothing to do
        (or no tiers)."""
        self._check_open()
        self.wait()
        return self._placement.persist_latest()

    def close(self) -> None:
        """Wait for the save in flight (raising its error) and release threads and buffers."""
        if self._closed:
            return
        self._closed = True
        try:
            self.wait()
        finally:
            self._lane.close()
            self._placement.close()
            self._placement.target.arena.release()

    def __enter__(self) -> CheckpointEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ loading

    def latest(self, *, verify: str = "full") -> CheckpointInfo | None:
        """The newest valid checkpoint (collective; corrupt ones are quarantined), or None.
        Multi-tier: the one a recovery would load, from any tier (verified when loaded)."""
        check_verify_mode(verify)
        return self._placement.newest(Filters(run_id=self._named), verify)

    def best(
        self, monitor: str, mode: str = "min", *, verify: str = "full"
    ) -> CheckpointInfo | None:
        """The valid checkpoint with the best ``monitor`` value recorded in its manifest
        (``mode``: ``"min"`` or ``"max"``; ties go to the newer), or ``None`` when none
        recorded it. Collective like :meth:`latest`: rank 0 ranks, every rank verifies, and a
        corrupt candidate is quarantined and the next best tried. Load it with
        ``load(checkpoint=info.name, verify="none")`` (it was just verified)."""
        check_verify_mode(verify)
        return select_best(
            self.storage, self.catalog, self.coordinator, monitor, mode, verify, run_id=self._named
        )

    def load(
        self,
        state: dict[str, Any] | None = None,
        *,
        checkpoint: str | None = None,
        verify: str = "full",
        strict: bool = True,
        adopt_run: bool = True,
        take_over: bool = False,
        skip_named_runs: bool | None = None,
        trusted: bool = False,
        per_rank_rules: Sequence[PerRankRule] = (),
        targets: Targets | None = None,
    ) -> LoadResult:
        """Load into ``state`` in place, at this world size (DCP reshards as needed); with
        ``state=None`` the whole checkpoint is returned as a new nested dict
        (``result.state``), its containers and key types as they were saved, and
        ``targets(path, shape, dtype)`` may give the tensor (e.g. a ``DTensor`` of this
        world's layout) a saved tensor is loaded into instead of a new full-size one.

        ``checkpoint`` names a directory under the root; by default the newest valid one is
        used, walking back past corrupt ones. With ``adopt_run`` this engine continues the
        checkpoint's run id, and the checkpoint is protected from retention.
        ``take_over=True`` takes the run's lease now (:meth:`take_over`): for a job that loads
        in order to continue writing the run; a reader leaves it (a lease is taken at the
        first save anyway). ``skip_named_runs`` (default: ``take_over``): an engine without
        an explicit ``run_id`` does not pick the newest checkpoint of a run that was named
        explicitly (an unnamed job never continues someone's named run).

        Objects (everything that is not a tensor) are unpickled with an allowlist and never run
        code from storage; a checkpoint holding other types raises
        :class:`~lightning_elastic.errors.UnsafeCheckpointError`. ``trusted=True`` lifts the
        allowlist: only for checkpoints whose origin you trust.

        Entries that were saved per rank (their values differed between ranks) come back as
        each rank's own value at the saved world size. At another world size,
        ``per_rank_rules`` (:class:`~lightning_elastic.core.load.per_rank.PerRankRule`) say
        what each rank gets; an entry none covers raises
        :class:`~lightning_elastic.errors.PerRankStateError` on every rank.
        """
        self._check_open()
        check_verify_mode(verify)
        self.wait()  # no save (nor persist) in flight
        skip = take_over if skip_named_runs is None else skip_named_runs
        filters = Filters.of(checkpoint, self._named, skip)
        request = LoadRequest(state, filters, verify, strict, trusted, per_rank_rules, targets)
        info, result = load_walk(self._placement, self.coordinator, request)
        if self._placement.target.increments is not None:
            self._placement.target.increments.reset()  # the next save is a full one
        adopt = info.run_id if adopt_run and info.run_id and self._named is None else None
        if self._run.loaded(info.name, adopt):  # lineage, retention keeps it, maybe its run
            log.info("resuming run %s from %s", info.run_id, info.location)
        if take_over:
            self.take_over()
        log.info("loaded checkpoint %s (step %s)", info.location, info.step)
        return result

    def adopt_run(self, run_id: str) -> None:
        """Write ``run_id`` from now on (not collective; every rank calls it with the same
        id): a job that joins a run another job writes (replica groups share one run). An
        engine given an explicit ``run_id`` keeps its own."""
        check_run_name(run_id, "run_id")
        if self._named is None and self._run.adopt(run_id):
            log.info("writing run %s from now on", run_id)

    def list(self) -> list[CheckpointInfo]:
        """All checkpoint directories under the root, oldest first (local, not collective)."""
        return self.catalog.scan()

    def take_over(self, *, renew: bool = False) -> None:
        """Take this job's lease on the run now (collective; rank 0 writes it), so a
        still-running older copy of the job cannot commit from here on (see
        :mod:`~lightning_elastic.core.dist.lease`). Call it once the job is sure to continue
        the run; the first save takes it otherwise. ``renew``: take a new generation even if
        this job holds one (a writer that hands the run back and forth, such as the leader of
        replica groups, becomes the newest writer again)."""
        self.coordinator.broadcast(
            Phase.LOAD, lambda: self._placement.take_over(renew=renew), error=CheckpointLoadError
        )
        if self._placement.target.increments is not None:
            # the next save is full: another writer of the run (a replica group that led
            # meanwhile) may have retired this one's last chain, which it would refer to
            self._placement.target.increments.reset()

    def check_writable(self) -> None:
        """Every rank writes and deletes a small probe file in the root, so a root that is a
        file, cannot be created or lacks credentials fails now, on every rank, with a
        :class:`ConfigError` naming each rank's error, rather than at the first save."""
        check_writable(self.coordinator, self._placement.roots, self.storage.display())

    # ------------------------------------------------------------------ internals

    def _check_open(self) -> None:
        if self._closed:
            raise ConfigError("this CheckpointEngine is closed")
