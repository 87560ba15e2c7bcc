"""The checkpoint engine: stage -> write (DCP planning) -> commit, one save in flight.

Which rank calls what: construct, :meth:`CheckpointEngine.save`, :meth:`~CheckpointEngine.load`,
:meth:`~CheckpointEngine.wait` and :meth:`~CheckpointEngine.close` are called by every rank of
the group, in the same order, from the training thread. ``save`` returns as soon as this
rank's bytes are staged (async) or after the commit (sync); the write and the commit run in
one background thread per rank. A failure anywhere surfaces on every rank as the same typed
error at the next ``save``/``wait``/``close`` (or from the handle's ``result()``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.stateful import Stateful

from lightning_elastic.core.dist.channel import CommitChannel
from lightning_elastic.core.dist.coordinator import Coordinator
from lightning_elastic.core.dist.lease import take_lease
from lightning_elastic.core.format.catalog import Catalog, CheckpointInfo
from lightning_elastic.core.format.integrity import check_verify_mode
from lightning_elastic.core.format.manifest import check_json_safe, is_plain_name
from lightning_elastic.core.gcpause import paused_gc
from lightning_elastic.core.load.load import (
    RANK_LOCAL_KEY,
    CorruptWhileLoading,
    LoadResult,
    Targets,
    load_checkpoint,
)
from lightning_elastic.core.load.per_rank import PerRankRule
from lightning_elastic.core.load.select import RUN_NAMED, quarantine, select_checkpoint
from lightning_elastic.core.options import check_run_name, tier_options
from lightning_elastic.core.policy.retention import KeepBestK, KeepLastN, RetentionPolicy
from lightning_elastic.core.save.pipeline import finish_save, stage_save
from lightning_elastic.core.save.plan import PlanCache, plan_save
from lightning_elastic.core.save.replicated import (
    PER_RANK_KEY,
    PER_RANK_VALUES_KEY,
    ReplicationCheck,
    encode_paths,
)
from lightning_elastic.core.save.request import (
    PlannedSave,
    RunState,
    SaveConfig,
    SaveRequest,
    SaveResult,
    SaveTarget,
)
from lightning_elastic.core.save.stage import HostArena, Payload
from lightning_elastic.core.save.write import check_compression
from lightning_elastic.core.storage.base import Storage
from lightning_elastic.core.storage.checksum import DEFAULT_ALGORITHM, new_hasher
from lightning_elastic.core.tiers.restore import Filters, Recovery, choose, recover
from lightning_elastic.core.tiers.runtime import TIER_ROOT_KEY, TierSet
from lightning_elastic.errors import (
    CheckpointLoadError,
    CheckpointNotFoundError,
    CheckpointSaveError,
    ConfigError,
    IntegrityError,
    Phase,
)

__all__ = ["WHEN_BUSY", "CheckpointEngine", "SaveHandle"]

log = logging.getLogger(__name__)
WHEN_BUSY = ("wait", "skip")


class SaveHandle:
    """A save that was started; :meth:`result` waits for its commit (or raises its error)."""

    def __init__(self, future: Future[SaveResult], name: str, step: int, blocked_s: float) -> None:
        self._future = future
        self.name = name
        self.step = step
        self.blocked_s = blocked_s
        self.error_seen = False  # the caller already got the error from result()

    def done(self) -> bool:
        """Whether the save has finished, committed or failed (no waiting)."""
        return self._future.done()

    def succeeded(self) -> bool:
        """Finished and committed (no waiting)."""
        return self._future.done() and self._future.exception() is None

    def result(self, timeout: float | None = None) -> SaveResult:
        """Wait (at most ``timeout`` seconds, ``None``: no limit) for the commit and return its
        result, or raise the save's error."""
        try:
            return self._future.result(timeout)
        except Exception:
            if self._future.done():
                self.error_seen = True
            raise

    def __repr__(self) -> str:
        state = "done" if self.done() else "in flight"
        return f"SaveHandle({self.name!r}, step={self.step}, {state})"


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
        when_busy: a save requested while another is in flight ``"wait"``s for it, or is
            ``"skip"``ped (decided by all ranks together, so all skip or none).
        compression: ``None`` or ``"zstd"`` (one frame per item, DCP's ``stream.zstd`` format).
        checksum: algorithm for the manifest's checksums (``"xxh3_64"``, ``"crc32"``, ...).
        retention: policies (``KeepLastN`` ...) applied by rank 0 after each durable commit.
        timeout: how long ranks wait for each other in a save or load before raising
            :class:`~lightning_elastic.errors.CheckpointTimeoutError`.
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
        when_busy: str = "wait",
        compression: str | None = None,
        checksum: str = DEFAULT_ALGORITHM,
        retention: Sequence[RetentionPolicy] = (),
        timeout: timedelta = timedelta(minutes=10),
        leftover_grace: timedelta | None = None,
        local_root: str | os.PathLike[str] | None = None,
        persist_every_n_saves: int | None = None,
        replicas: int | None = None,
        local_keep: int | None = None,
        node: str | None = None,
    ) -> None:
        tier_options(  # validates them (ConfigError)
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
        if timeout.total_seconds() <= 0:
            raise ConfigError(f"timeout must be positive, got {timeout}")
        grace = 2 * timeout if leftover_grace is None else leftover_grace
        if grace.total_seconds() < 0:
            raise ConfigError(f"leftover_grace must be >= 0, got {leftover_grace}")
        check_compression(compression)
        new_hasher(checksum)  # validates the name
        if run_id is not None:
            check_run_name(run_id, "run_id")
        self.storage = storage
        self.async_save = async_save
        self.when_busy = when_busy
        self.coordinator = coordinator or Coordinator.from_environment(
            timeout=timeout, process_group=process_group
        )
        coord = self.coordinator
        agreed_run_id = coord.broadcast(Phase.INIT, lambda: run_id or uuid.uuid4().hex[:12])
        self.catalog = Catalog(storage)
        self._run = RunState(agreed_run_id)
        config = SaveConfig(
            checksum=checksum,
            compression=compression,
            timeout_s=timeout.total_seconds(),
            leftover_grace_s=grace.total_seconds(),
            retention=tuple(retention),
        )
        written, catalog = storage, self.catalog
        if local_root is not None:
            written = Storage(local_root)
            catalog = Catalog(written)
            config = dataclasses.replace(
                config,
                retention=(KeepLastN(2 if local_keep is None else local_keep),),
                small_replicated_to_lowest=True,
            )
        self._target = SaveTarget(
            storage=written,
            catalog=catalog,
            coordinator=coord,
            channel=CommitChannel(
                coord.store,
                rank=coord.rank,
                world_size=coord.world_size,
                namespace=coord.key("commit"),
                timeout_s=timeout.total_seconds(),
            ),
            arena=HostArena(pin_memory=torch.cuda.is_available()),
            config=config,
        )
        self._tiers: TierSet | None = None
        if local_root is not None:
            self._tiers = TierSet(
                self._target,
                self._run,
                persistent=storage,
                persist_every_n_saves=1 if persist_every_n_saves is None else persist_every_n_saves,
                replicas=1 if replicas is None else replicas,
                retention=tuple(retention),
                node=node,
            )
        self._plan_cache: PlanCache | None = None
        self.last_recovery: Recovery | None = None  # multi-tier: what the last load did
        self._explicit_run = run_id is not None
        self._replicas = ReplicationCheck()
        self._executor: ThreadPoolExecutor | None = None
        self._inflight: SaveHandle | None = None
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
        return self._tiers is not None

    @property
    def load_storage(self) -> Storage:
        """Where loads read checkpoints: the root, or with ``local_root`` the node-local root
        (recovery gathers the checkpoint there from the fastest tier; ``dirpath`` may not
        hold it)."""
        return self._target.storage

    @property
    def arena(self) -> HostArena:
        """The host buffer asynchronous saves stage into, reused across saves."""
        return self._target.arena

    def check_writable(self) -> None:
        """Every rank writes and deletes a small probe file in the root, so a root that is a
        file, cannot be created or lacks credentials fails now, on every rank, with a
        :class:`ConfigError` naming each rank's error, rather than at the first save."""

        roots = [self.storage] if self._tiers is None else [self.storage, self._target.storage]

        def probe() -> str | None:
            rel = f".probe-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
            for root in roots:
                try:
                    root.write_bytes(rel, b"", durable=False)
                    root.delete(rel)
                except Exception as exc:
                    return f"{root.display()}: {type(exc).__name__}: {exc}"
            return None

        errors = self.coordinator.all_gather(Phase.INIT, probe)
        failed = [f"rank {rank}: {error}" for rank, error in enumerate(errors) if error]
        if failed:
            raise ConfigError(
                f"cannot write checkpoints to {self.storage.display()} ("
                + "; ".join(failed)
                + "): check that the path is a directory this user can create and write, and "
                "the storage options (credentials, endpoint_url)"
            )

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
        """
        self._check_open()
        called = time.monotonic()
        if not self._ready_for_new_save():
            return None
        request = self._request(step, epoch, metrics, metadata, name, overwrite)
        to_persist = self._tiers is not None and self._tiers.decide(persist)
        state_dict = _to_state_dict(state)
        for reserved in (RANK_LOCAL_KEY, PER_RANK_KEY):
            if reserved in state_dict:
                raise ConfigError(f"the state key {reserved!r} is reserved")
        local = None if rank_state is None else _to_state_dict(rank_state)
        if local is not None and PER_RANK_VALUES_KEY in local:
            raise ConfigError(f"the rank_state key {PER_RANK_VALUES_KEY!r} is reserved")
        with paused_gc():  # the training thread waits here: see core/gcpause.py
            split = self._replicas.split(self.coordinator, state_dict)
            state_dict = split.state
            if split.per_rank:
                state_dict[PER_RANK_KEY] = encode_paths(split.per_rank)
            if split.values:
                local = {**(local or {}), PER_RANK_VALUES_KEY: split.values}
            if local is not None:
                state_dict[RANK_LOCAL_KEY] = {str(self.rank): local}
            planned = plan_save(
                self._target, self._run, state_dict, request, split.walk, self._plan_cache
            )
            self._plan_cache = planned.cache
            del split  # its walk dies inside the pause: alive at its end, the collector
            # scans it (60,000 objects at 20,000 tensors: 7-17 ms of every save)
            is_blocking = (not self.async_save) if blocking is None else blocking
            stage_start = time.monotonic()
            payload = stage_save(self._target, planned, copy=not is_blocking)
            staging_s = time.monotonic() - stage_start
        future: Future[SaveResult]
        if is_blocking:
            future = Future()
            try:
                blocked = time.monotonic() - called
                future.set_result(self._finish(planned, payload, blocked, staging_s, to_persist))
            except BaseException as exc:
                future.set_exception(exc)
                raise
            return SaveHandle(future, planned.name, step, time.monotonic() - called)
        blocked_s = time.monotonic() - called
        future = self._writer().submit(
            self._finish, planned, payload, blocked_s, staging_s, to_persist
        )
        self._inflight = SaveHandle(future, planned.name, step, blocked_s)
        return self._inflight

    def wait(self) -> SaveResult | None:
        """Wait for the save in flight (and, multi-tier, the persist in flight); raise its
        error (once) if it failed."""
        handle, self._inflight = self._inflight, None
        result = None
        if handle is not None and not (handle.error_seen and handle.done()):
            result = handle.result()
        if self._tiers is not None:
            self._tiers.wait()
        return result

    def persist_latest(self) -> bool:
        """Multi-tier: persist the newest save now unless it is persisted already, and wait
        (collective; the end of a fit, a preemption). ``False`` when there was nothing to do
        (or no tiers)."""
        self._check_open()
        self.wait()
        return self._tiers is not None and self._tiers.persist_latest()

    def _finish(
        self,
        planned: PlannedSave,
        payload: Payload,
        blocked_s: float,
        staging_s: float,
        persist: bool,
    ) -> SaveResult:
        """The background part of a save: write and commit (and, multi-tier, replicate and
        hand the persist over)."""
        if self._tiers is None:
            return finish_save(self._target, self._run, planned, payload, blocked_s, staging_s)
        return self._tiers.finish(planned, payload, blocked_s, staging_s, persist)

    def close(self) -> None:
        """Wait for the save in flight (raising its error) and release threads and buffers."""
        if self._closed:
            return
        self._closed = True
        try:
            self.wait()
        finally:
            if self._executor is not None:
                self._executor.shutdown(wait=True)
                self._executor = None
            if self._tiers is not None:
                self._tiers.close()
            self._target.arena.release()

    def __enter__(self) -> CheckpointEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ loading

    def latest(self, *, verify: str = "full") -> CheckpointInfo | None:
        """The newest valid checkpoint (collective; corrupt ones are quarantined), or None.
        Multi-tier: the one a recovery would load, from any tier (verified when loaded)."""
        check_verify_mode(verify)
        if self._tiers is not None:
            filters = Filters(run_id=self._run_filter())
            return choose(self._tiers, filters)
        return select_checkpoint(
            self.storage, self.catalog, self.coordinator, None, verify, run_id=self._run_filter()
        )

    def best(
        self, monitor: str, mode: str = "min", *, verify: str = "full"
    ) -> CheckpointInfo | None:
        """The valid checkpoint with the best ``monitor`` value recorded in its manifest
        (``mode``: ``"min"`` or ``"max"``; ties go to the newer), or ``None`` when none
        recorded it. Collective like :meth:`latest`: rank 0 ranks, every rank verifies, and a
        corrupt candidate is quarantined and the next best tried. Load it with
        ``load(checkpoint=info.name, verify="none")`` (it was just verified)."""
        check_verify_mode(verify)
        if not monitor or not isinstance(monitor, str):
            raise ConfigError(f"best() needs the name of a recorded metric, got {monitor!r}")
        ranking = KeepBestK(1, monitor, mode)  # validates mode (ConfigError)
        return select_checkpoint(
            self.storage,
            self.catalog,
            self.coordinator,
            None,
            verify,
            run_id=self._run_filter(),
            order=ranking.ranked,
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
        if self._inflight is not None or self._tiers is not None:
            self.wait()
        if self._tiers is not None:
            return self._recover(
                state,
                checkpoint=checkpoint,
                verify=verify,
                strict=strict,
                adopt_run=adopt_run,
                take_over=take_over,
                skip_named=checkpoint is None
                and not self._explicit_run
                and (take_over if skip_named_runs is None else skip_named_runs),
                trusted=trusted,
                per_rank_rules=per_rank_rules,
                targets=targets,
            )
        # verify="full" checks the shard files' checksums while loading them (one pass over
        # the bytes; load_checkpoint's ``fused``); a corrupt one found then is quarantined and
        # the walk goes on, as when selection finds it. What the corrupt one wrote in place
        # must all be written again by the one loaded instead, or the load says so.
        fused = verify == "full" and not trusted and (state is None or strict)
        in_place = state is not None or targets is not None
        corrupt: dict[str, CorruptWhileLoading] = {}  # by checkpoint name
        touched: set[tuple[Any, ...]] = set()  # the targets corrupt attempts loaded into
        while True:
            start = time.monotonic()
            info = select_checkpoint(
                self.storage,
                self.catalog,
                self.coordinator,
                checkpoint,
                verify,
                run_id=None if checkpoint is not None else self._run_filter(),
                skip_named=checkpoint is None
                and not self._explicit_run
                and (take_over if skip_named_runs is None else skip_named_runs),
                fused=fused,
                exclude=corrupt.keys(),
            )
            if info is None:
                only = f" of run {self.run_id!r}" if self._explicit_run else ""
                if corrupt and in_place:
                    raise _partly(corrupt, f"no older valid checkpoint{only} is left")
                raise CheckpointNotFoundError(
                    f"no valid checkpoint{only} in {self.storage.display()}; start without "
                    "resuming or point to a directory holding committed checkpoints"
                )
            handed: set[tuple[Any, ...]] = set()
            try:
                result = load_checkpoint(
                    self.storage,
                    self.coordinator,
                    info,
                    state,
                    strict=strict,
                    verify_s=time.monotonic() - start,
                    trusted=trusted,
                    per_rank_rules=per_rank_rules,
                    targets=_recording(targets, handed),
                    fused=fused,
                )
            except CorruptWhileLoading as exc:
                if checkpoint is not None:  # the named one: an IntegrityError, as from selection
                    if in_place:
                        raise _partly({info.name: exc}) from None
                    raise
                quarantine(self.catalog, self.coordinator, info, exc.file, exc.reason)
                corrupt[info.name] = exc
                touched |= handed
                continue
            except Exception as exc:
                if corrupt and in_place:
                    why = f"loading {info.location} instead failed ({type(exc).__name__}: {exc})"
                    raise _partly(corrupt, why) from exc
                raise
            stale = touched - handed
            if stale:
                shown = ", ".join(".".join(map(str, p)) for p in sorted(stale, key=str)[:3])
                raise _partly(corrupt, f"{info.location}, loaded instead, does not hold {shown}")
            break
        return self._loaded(info, result, adopt_run, take_over)

    def _recover(
        self,
        state: dict[str, Any] | None,
        *,
        checkpoint: str | None,
        verify: str,
        strict: bool,
        adopt_run: bool,
        take_over: bool,
        skip_named: bool,
        trusted: bool,
        per_rank_rules: Sequence[PerRankRule],
        targets: Targets | None,
    ) -> LoadResult:
        """Multi-tier :meth:`load`: from the fastest tier (:mod:`~lightning_elastic.core.tiers.
        restore`)."""
        assert self._tiers is not None
        filters = Filters(
            checkpoint=checkpoint,
            run_id=None if checkpoint is not None else self._run_filter(),
            skip_named=skip_named,
        )
        info, result, self.last_recovery = recover(
            self._tiers,
            state,
            filters=filters,
            verify=verify,
            strict=strict,
            trusted=trusted,
            per_rank_rules=per_rank_rules,
            targets=targets,
        )
        return self._loaded(info, result, adopt_run, take_over)

    def _loaded(
        self, info: CheckpointInfo, result: LoadResult, adopt_run: bool, take_over: bool
    ) -> LoadResult:
        """After a successful load: lineage, protection, the run id, the lease."""
        self._run.loaded(info.name)
        if adopt_run and info.run_id and not self._explicit_run:
            if info.run_id != self._run.run_id:
                log.info("resuming run %s from %s", info.run_id, info.location)
            self._run.adopt(info.run_id)
        if take_over:
            self.take_over()
        log.info("loaded checkpoint %s (step %s)", info.location, info.step)
        return result

    def list(self) -> list[CheckpointInfo]:
        """All checkpoint directories under the root, oldest first (local, not collective)."""
        return self.catalog.scan()

    # ------------------------------------------------------------------ internals

    def _run_filter(self) -> str | None:
        return self.run_id if self._explicit_run else None

    def take_over(self) -> None:
        """Take this job's lease on the run now (collective; rank 0 writes it), so a
        still-running older copy of the job cannot commit from here on (see
        :mod:`~lightning_elastic.core.dist.lease`). Call it once the job is sure to continue
        the run; the first save takes it otherwise."""
        run, target = self._run, self._target

        tiers = self._tiers

        def take() -> None:
            if run.lease is None or run.lease.run_id != run.run_id:
                run.lease = take_lease(target.storage, run.run_id)
            if tiers is not None and (p := tiers.persistent).lease is None:
                p.lease = take_lease(p.storage, run.run_id)

        self.coordinator.broadcast(Phase.LOAD, take, error=CheckpointLoadError)

    def _ready_for_new_save(self) -> bool:
        handle = self._inflight
        if handle is None:
            return True
        if self.when_busy == "skip" and not self.coordinator.all(
            handle.done(), Phase.SAVE_BUSY, error=CheckpointSaveError
        ):
            log.info("skipping a save: %r is still in flight on some rank", handle)
            return False
        self._inflight = None
        if not handle.error_seen:
            handle.result()  # raises the previous save's error, on every rank
        return True

    def _request(
        self,
        step: int,
        epoch: int | None,
        metrics: Mapping[str, float] | None,
        metadata: Mapping[str, Any] | None,
        name: str | None,
        overwrite: bool,
    ) -> SaveRequest:
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ConfigError(f"step must be a non-negative integer, got {step!r}")
        if name is not None and not is_plain_name(name.strip("/")):
            raise ConfigError(f"name must be a plain directory name below the root, got {name!r}")
        try:
            check_json_safe(metadata or {}, "metadata")
            clean_metrics = {str(k): float(v) for k, v in (metrics or {}).items()}
            check_json_safe(clean_metrics, "metrics")
        except (TypeError, ValueError) as exc:
            raise ConfigError(str(exc)) from exc
        meta = dict(metadata or {})
        if self._explicit_run:
            meta[RUN_NAMED] = True
        if self._tiers is not None:
            meta[TIER_ROOT_KEY] = self.storage.display()
        return SaveRequest(step, epoch, clean_metrics, meta, name, overwrite)

    def _writer(self) -> ThreadPoolExecutor:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(
                1, thread_name_prefix="lightning-elastic-writer", initializer=_background_priority
            )
        return self._executor

    def _check_open(self) -> None:
        if self._closed:
            raise ConfigError("this CheckpointEngine is closed")


def _background_priority() -> None:
    """Lower the writer thread's CPU priority (Linux applies nice per thread): when training
    and writing compete for few cores, training should win; idle cores still write at full
    speed."""
    with contextlib.suppress(AttributeError, OSError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)


def _to_state_dict(state: Mapping[str, Any]) -> dict[str, Any]:
    """A shallow copy with every ``Stateful`` value replaced by its ``state_dict()``."""
    return {k: v.state_dict() if isinstance(v, Stateful) else v for k, v in state.items()}


def _recording(targets: Targets | None, handed: set[tuple[Any, ...]]) -> Targets | None:
    """``targets``, noting the path of every tensor it hands out in ``handed``."""
    if targets is None:
        return None
    give = targets

    def recorded(path: tuple[Any, ...], shape: torch.Size, dtype: torch.dtype) -> Any:
        tensor = give(path, shape, dtype)
        if tensor is not None:
            handed.add(tuple(path))
        return tensor

    return recorded


def _partly(corrupt: Mapping[str, CorruptWhileLoading], why: str = "") -> IntegrityError:
    """The error of a load that found a checkpoint corrupt only after reading part of it into
    the caller's state or targets, and could not overwrite all of that from another one."""
    last = list(corrupt.values())[-1]
    return IntegrityError(
        last.checkpoint,
        last.file,
        f"{last.reason}; found while loading it{', and ' + why if why else ''}: what was "
        "loaded in place (the state or targets passed in) is partly that corrupt "
        "checkpoint's. Start from a fresh state (a restarted job finds the corrupt "
        "checkpoint quarantined)",
    )
