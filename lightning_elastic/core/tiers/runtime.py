"""The save side of multi-tier checkpoints: one engine's node-local tier, replicas on other
nodes, and the persistent root it persists every k-th save to.

Which rank calls what, in what order (the engine does, through the tiered placement
:class:`~lightning_elastic.core.placement.tiered.Tiered`; every rank, same order):

* construction (collective): the node layout is gathered
  (:class:`~lightning_elastic.core.tiers.layout.NodeLayout`) and a dedicated gloo group is
  created for the replica transfers: never the training group, and not the checkpoint group
  either (the training thread runs the per-step agreement on that one while replicas move);
* :meth:`TierSet.decide` on the training thread at every save, before planning: whether this
  save is persisted (every ``persist_every_n_saves``-th, or forced: the last save, a signal),
  agreed with one all-reduce that also says whether every rank's previous persist finished
  (a persist still running defers the next one to the following save); a finished persist's
  failure is raised here, on every rank;
* :meth:`TierSet.finish` in the background writer, in place of the plain ``finish_save``: the
  local two-phase commit (rank 0 commits into its node's local root), then the manifest is
  handed to every rank through the store, each rank's shard is sent to its replica nodes and
  the DCP metadata to every node (point-to-point on the tier group, checksums checked at the
  receiver), each other node's lead writes the manifest into its local root (last, with
  exclusive create), and every node's lead applies the local retention there (rank 0 too:
  only now, so its deletes delay no rank's copies); then, when decided, the persist
  is handed to the persister thread (:mod:`~lightning_elastic.core.tiers.persist`).

A replica that could not be sent (a peer died) is logged and counted, not raised: the save is
committed on the local tier, and the node that lacks the replica fetches it at recovery if it
still can. A node's local root thus holds, per checkpoint, the manifest, its own ranks' shards
and the replicas it received; a missing file there is normal (never "corrupt").
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import timedelta

import torch.distributed as dist

from lightning_elastic.core.dist.channel import CommitChannel
from lightning_elastic.core.forksafe import fork_safe_logger
from lightning_elastic.core.format.catalog import Catalog
from lightning_elastic.core.format.manifest import MANIFEST_FILE, Manifest
from lightning_elastic.core.options import check_count
from lightning_elastic.core.policy.housekeeping import apply_retention
from lightning_elastic.core.policy.retention import RetentionPolicy
from lightning_elastic.core.save.pipeline import finish_save, housekeep
from lightning_elastic.core.save.request import PlannedSave, RunState, SaveResult, SaveTarget
from lightning_elastic.core.save.stage import Payload
from lightning_elastic.core.storage.base import Storage
from lightning_elastic.core.storage.local import LocalStorage
from lightning_elastic.core.tiers.epoch import EPOCH_SHIFT, claim_epoch
from lightning_elastic.core.tiers.layout import (
    NodeLayout,
    check_apart,
    check_node_local,
    node_name,
)
from lightning_elastic.core.tiers.persist import PersistentTier, persist_checkpoint
from lightning_elastic.core.tiers.transfer import Transfer, TransferError, execute_transfers
from lightning_elastic.errors import (
    CheckpointExistsError,
    ConfigError,
    ManifestNotReceivedError,
    Phase,
    SaveTimeoutError,
    StorageError,
)

__all__ = ["TIER_ROOT_KEY", "TierSet"]

log = fork_safe_logger(__name__)  # also logs from the writer thread

#: manifest metadata: the persistent root a node-local checkpoint belongs to (a local root
#: reused by another job, or by this job with another persistent root, is not recovered from)
TIER_ROOT_KEY = "tier_persistent_root"


class TierSet:
    """The tiers of one engine (see the module docstring)."""

    def __init__(
        self,
        target: SaveTarget,
        run: RunState,
        *,
        persistent: Storage,
        persist_every_n_saves: int = 1,
        replicas: int = 1,
        retention: Sequence[RetentionPolicy] = (),
        node: str | None = None,
    ) -> None:
        """``target``: where saves commit first (its storage is the node-local root, its
        retention the local one); ``run``: the engine's run state; ``persistent``: the
        persistent root, with its own ``retention``."""
        self.every = check_count(persist_every_n_saves, "persist_every_n_saves")
        self.replicas = check_count(replicas, "replicas", minimum=0)
        local = target.storage
        check_apart(local, persistent)
        coord = self.coordinator = target.coordinator
        self.target, self.run = target, run
        self.local = local
        # deleted checkpoints' large files are kept for the next save to overwrite (no new
        # pages to fault in); the node's lead sizes the pool after each save (_size_spares)
        self.spares = local.keep_spares() if isinstance(local, LocalStorage) else None
        timeout = self.timeout = timedelta(seconds=target.config.timeout_s)
        self.node = node or node_name()
        self.layout = NodeLayout.gather(coord, self.node)
        check_node_local(coord, self.layout, self.node, local)
        self.group: dist.ProcessGroup | None = None
        if coord.distributed:
            if dist.get_world_size() != coord.world_size:
                raise ConfigError(
                    "multi-tier checkpoints need the checkpoint group to span the whole job "
                    f"({coord.world_size} of {dist.get_world_size()} ranks)"
                )
            self.group = dist.new_group(backend="gloo", timeout=timeout)

        def channel(name: str) -> CommitChannel:
            return CommitChannel(
                coord.store,
                rank=coord.rank,
                world_size=coord.world_size,
                namespace=coord.key(name),
                timeout_s=timeout.total_seconds(),
            )

        self.persistent = PersistentTier(
            persistent,
            Catalog(persistent),
            channel("persist"),
            tuple(retention),
            grace_s=target.config.leftover_grace_s,
        )
        self._manifests = channel("tier")
        self._since_persist = 0
        self._persisting: Future[bool] | None = None
        self._persisting_name: str | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._names_known = False
        self._latest: Manifest | None = None  # the newest local commit
        self._persisted_name: str | None = None  # the newest persisted one
        self._persist_error: Exception | None = None  # of the newest persist attempt
        self._group_broken = False  # a transfer timed out: the group needs replacing
        self.replica_failures = 0
        self.persist_failures = 0

    # ------------------------------------------------------------------ training thread

    def decide(self, force: bool) -> bool:
        """Every rank, before planning a save: whether it is persisted (module docstring).
        Never raises a failed persist's error: the local save goes ahead and the next save
        persists again (the error is logged on every rank and raised by :meth:`wait`)."""
        if not self._names_known:
            self._reserve_names()
        running = self._persisting
        busy, broken = self.coordinator.max_ints(
            [0 if running is None or running.done() else 1, 1 if self._group_broken else 0],
            Phase.SAVE_DECIDE,
        )
        if broken:
            self._rebuild_group()
        idle = not busy
        if running is not None and (idle or force):
            self._finished()  # waits when forced
            idle = True
        persist = idle and (force or self._since_persist + 1 >= self.every)
        self._since_persist = 0 if persist else self._since_persist + 1
        return persist

    def _reserve_names(self) -> None:
        """Every rank, before the first save: rank 0 learns every directory name of every
        node's local root and of the persistent root, and never claims one of them (it claims
        in its own root only): one name is one checkpoint on every tier, also after a
        rollback whose new branch reaches steps an old copy still holds. The newest commit
        sequence of every node joins the floor, and so does a new job epoch: this job's saves
        are newer than any earlier job's copies on any node, present or not."""

        def names() -> tuple[list[str], int]:
            found: list[str] = []
            newest = 0  # commits draw sequences above every node's too (one commit order)
            if self.layout.is_lead(self.coordinator.rank):
                found += [e.name for e in self.local.listdir() if e.is_dir]
                scan = self.target.catalog.scan()
                newest = max([i.sequence for i in scan if i.manifest], default=0)
            if self.coordinator.is_coordinator:
                found += [e.name for e in self.persistent.storage.listdir() if e.is_dir]
                # this job's commits are newer than any earlier job's, on any node, even one
                # that is away now (tiers/epoch.py)
                newest = max(newest, claim_epoch(self.persistent.storage) << EPOCH_SHIFT)
            return found, newest

        gathered = self.coordinator.all_gather(Phase.SAVE_DECIDE, names)
        self.run.reserve(n for got, _ in gathered for n in got)
        self.run.raise_floor(newest for _, newest in gathered)
        self._names_known = True

    def resumed(self, manifest: Manifest, *, persisted: bool) -> None:
        """After a recovery (every rank): a run resumed from a checkpoint the persistent tier
        does not hold persists its first save (restarts that come more often than
        ``persist_every_n_saves`` saves cannot keep the persistent tier from moving on), and
        :meth:`persist_latest` persists the recovered checkpoint itself."""
        self._since_persist = 0 if persisted else self.every - 1
        self._latest = manifest
        self._persisted_name = manifest.name if persisted else None

    def persist_latest(self) -> bool:
        """Every rank, training thread, no save in flight: persist the newest local save now
        unless it is persisted already, and wait for it, raising its error. For the end of a
        fit and a preemption signal when the newest step was saved by the schedule already."""
        if self._persisting is not None:
            self._finished()
        latest = self._latest
        if latest is None or latest.name == self._persisted_name:
            self.wait()  # the newest attempt's error, if it failed
            return False
        self._persist_error = None  # an earlier failure is retried now, by the newest save
        self._submit(latest)
        self.wait()
        return True

    def wait(self) -> None:
        """Wait for the persist in flight (every rank); raise the error of the newest persist
        attempt when it failed (once)."""
        if self._persisting is not None:
            self._finished()
        error, self._persist_error = self._persist_error, None
        if error is not None:
            raise error

    def _rebuild_group(self) -> None:
        """Every rank, training thread: a replica transfer timed out somewhere, which leaves a
        gloo group unusable; replace it (collective, like at construction)."""
        log.warning("replacing the replica group after a failed transfer")
        if self.group is not None:
            with contextlib.suppress(Exception):
                dist.destroy_process_group(self.group)
            self.group = dist.new_group(backend="gloo", timeout=self.timeout)
        self._group_broken = False

    def close(self) -> None:
        """Release the persister thread and the tier group (after :meth:`wait`); a node's
        lead deletes the node's spare files."""
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
        if self.spares is not None and self.layout.is_lead(self.coordinator.rank):
            self.spares.limit = 0
            self.spares.clear()
        if self.group is not None and dist.is_initialized():
            with contextlib.suppress(Exception):
                dist.destroy_process_group(self.group)
        self.group = None

    def _finished(self) -> None:
        """Collect the persist in flight (waiting for it). A failure is logged and kept for
        :meth:`wait`; the next save persists again."""
        future, name = self._persisting, self._persisting_name
        self._persisting = self._persisting_name = None
        if future is not None:
            with contextlib.suppress(Exception):
                future.exception()  # done: the upload no longer reads the local copy
        if name is not None and name != self.run.resumed_from:
            self.run.release(name)  # local retention may delete it from now on
            self._trim()
        if future is None:
            return
        try:
            done = future.result()
        except Exception as exc:
            self.persist_failures += 1
            self._persist_error = exc
            self._since_persist = self.every  # retry with the next save
            log.error("persisting %s failed; the next save persists again: %s", name, exc)
            return
        self._persist_error = None
        if done:
            self._persisted_name = name
        else:
            self._since_persist = self.every  # skipped there: persist the next save

    def _trim(self) -> None:
        """A node's lead, no save in flight: apply the local retention now that an upload no
        longer protects its checkpoint (otherwise only the next commit would, and a job that
        ends keeps one checkpoint more than ``local_keep`` on each node)."""
        if not self.layout.is_lead(self.coordinator.rank):
            return
        target = self.target
        try:
            apply_retention(
                target.storage,
                target.catalog,
                run_id=self.run.run_id,
                retention=target.config.retention,
                protected=self.run.protected,
            )
        except Exception as exc:
            log.warning("local retention on node %s failed: %r", self.node, exc)

    # ------------------------------------------------------------------ background writer

    def finish(
        self,
        planned: PlannedSave,
        payload: Payload,
        blocked_s: float,
        staging_s: float,
        persist: bool,
    ) -> SaveResult:
        """The background part of a tiered save (module docstring)."""
        target, run = self.target, self.run
        result = finish_save(
            target, run, planned, payload, blocked_s, staging_s, housekeeping=False
        )
        manifest, text = self._share_manifest(planned, result)
        run.raise_floor([manifest.sequence])
        if self._replicate(manifest, text, payload):  # this node's lead: its copy is
            self._size_spares(manifest)  # committed; rank 0 retains only now, so its
            housekeep(target, run, manifest)  # deletes (~0.1 s a GB) delay nobody's copies
        self._latest = manifest
        if persist:
            self._submit(manifest)
        return result

    def _submit(self, manifest: Manifest) -> None:
        """Hand the persist of ``manifest`` to the persister thread."""
        self.run.protect(manifest.name)  # kept locally until it is uploaded
        self._persisting_name = manifest.name
        self._persisting = self._persister().submit(
            persist_checkpoint,
            self.persistent,
            local=self.local,
            manifest=manifest,
            rank=self.coordinator.rank,
            timeout_s=self.timeout.total_seconds(),
            protected=self.run.protected,
        )

    def _share_manifest(self, planned: PlannedSave, result: SaveResult) -> tuple[Manifest, str]:
        """Every rank gets the committed manifest and its text (rank 0 posts it through the
        store)."""
        ch, save_id = self._manifests, planned.save_id
        what = self.local.display(planned.name)
        try:
            if self.coordinator.is_coordinator:
                assert result.manifest is not None
                text = result.manifest.to_json()
                ch.post(save_id, "manifest", text)
            else:
                deadline = planned.deadline + self.timeout.total_seconds()
                try:
                    text = ch.fetch(save_id, "manifest", deadline, what)
                except SaveTimeoutError as exc:  # rank 0 committed (its decision came), then
                    raise ManifestNotReceivedError(  # went silent: not "not committed"
                        what, Phase.COMMIT, [0], exc.timeout_s
                    ) from exc
        finally:
            ch.ack(save_id)
        return result.manifest or Manifest.from_json(text, what), text

    def _replicate(self, manifest: Manifest, text: str, payload: Payload) -> bool:
        """Replicas and the DCP metadata to the other nodes; then each other node's lead
        commits its copy (manifest last). Whether this rank is a node's lead whose root now
        holds the committed copy (rank 0: its own commit), to retain there. A rank's
        own shard is sent from its staged payload (still intact: the next save stages only
        after this one finished), not read back from the file it was written to; the
        receiver checks it against the manifest's checksum all the same."""
        rank, local = self.coordinator.rank, self.local
        transfers = self.transfers(manifest)
        sources = {}
        if self.target.config.compression is None:  # else the file's bytes are not the payload's
            image = payload.image

            def chunks() -> Iterable[memoryview]:
                return payload.chunks() if image is None else (image,)

            sources = {
                f"{manifest.name}/{f.path}": chunks
                for f in manifest.files
                if f.rank == rank and f.size == payload.size
            }
        if transfers and self.group is not None:
            try:
                execute_transfers(
                    transfers,
                    rank=rank,
                    group=self.group,
                    storage=local,
                    timeout=self.timeout,
                    sources=sources,
                )
            except TransferError as exc:
                self.replica_failures += 1
                if any(f.kind == "communication" for f in exc.failures):
                    self._group_broken = True  # replaced at the next save (all ranks agree)
                log.warning("replicas of %s are incomplete: %s", manifest.name, exc)
        if rank == 0 or not self.layout.is_lead(rank):
            return rank == 0  # rank 0 committed into its node's root itself
        try:
            body = text.encode()
            local.write_bytes(f"{manifest.name}/{MANIFEST_FILE}", body, exclusive=True)
        except CheckpointExistsError:
            log.warning(
                "%s already holds a manifest: this node keeps no copy of the save",
                local.display(manifest.name),
            )
            return False
        except Exception:
            log.warning("could not commit %s on node %s", manifest.name, self.node, exc_info=True)
            return False
        return True

    def _size_spares(self, manifest: Manifest) -> None:
        """Let the node's spare pool keep about what this save wrote on the node (its ranks'
        shards and the replicas it received): what the next save will write here."""
        if self.spares is None:
            return
        try:
            entries = self.local.listdir(manifest.name)
        except StorageError:
            return
        self.spares.limit = sum(e.size for e in entries if not e.is_dir and not e.is_link)
        self.spares.trim()

    def transfers(self, manifest: Manifest) -> list[Transfer]:
        """The copies one save makes: each rank's shard to the leads of its replica nodes,
        the DCP metadata (rank 0's) to every other node's lead. Same list on every rank."""
        layout, name = self.layout, manifest.name
        alg = manifest.checksum_algorithm
        shards = {f.rank: f for f in manifest.files if f.rank is not None}
        out: list[Transfer] = []
        for node, ranks in layout.nodes:
            for dst in layout.replica_nodes(node, self.replicas):
                for r in ranks:
                    f = shards.get(r)
                    if f is not None:
                        path = f"{name}/{f.path}"
                        out.append(Transfer(r, layout.lead(dst), path, f.size, f.checksum, alg))
        home = layout.node_of(0)
        for f in manifest.files:
            if f.rank is None:
                for node in layout.names:
                    if node != home:
                        path = f"{name}/{f.path}"
                        out.append(Transfer(0, layout.lead(node), path, f.size, f.checksum, alg))
        return out

    def _persister(self) -> ThreadPoolExecutor:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="lightning-elastic-persist")
        return self._executor
