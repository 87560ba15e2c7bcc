"""The seam between the engine and where its checkpoints live: the :class:`Placement` protocol.

Which rank calls what, in what order (the engine does; every rank, same order):

* construction (collective; :func:`~lightning_elastic.core.placement.make_placement`);
* :meth:`Placement.decide` on the training thread at every save, before planning: whether the
  save is persisted beyond where it commits (tiers: every k-th, or forced);
* the save is planned and staged into :attr:`Placement.target`, then
  :meth:`Placement.finish` runs in the background writer (or inline): write, commit, and
  whatever the placement adds (tiers: replicas, the persist handed to its own thread);
* :meth:`Placement.wait`, :meth:`Placement.persist_latest`, :meth:`Placement.close` on the
  training thread with no save in flight;
* :meth:`Placement.take_over`: rank 0 only, inside the engine's broadcast;
* loads go through the load walk (:mod:`~lightning_elastic.core.load.walk`): the placement
  selects and makes readable (:meth:`~lightning_elastic.core.load.walk.Candidates.select`),
  drops what a load found corrupt, and records what a load did; :meth:`Placement.newest`
  answers ``latest()``. All on the training thread, every rank together.
"""

from __future__ import annotations

import os
import socket
import uuid
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import torch

from lightning_elastic.core.dist.channel import CommitChannel
from lightning_elastic.core.dist.coordinator import Coordinator
from lightning_elastic.core.dist.lease import take_lease
from lightning_elastic.core.format.catalog import Catalog, CheckpointInfo
from lightning_elastic.core.load.walk import Candidates, Filters
from lightning_elastic.core.save.incremental import Increments
from lightning_elastic.core.save.request import (
    PlannedSave,
    RunState,
    SaveConfig,
    SaveResult,
    SaveTarget,
)
from lightning_elastic.core.save.stage import HostArena, Payload
from lightning_elastic.core.storage.base import Storage
from lightning_elastic.errors import ConfigError, Phase

if TYPE_CHECKING:
    from lightning_elastic.core.tiers.restore import Recovery

__all__ = ["Placement", "check_writable", "lease_target", "save_target"]


class Placement(Candidates, Protocol):
    """Where one engine's checkpoints live: one root, or tiers (node-local, peers, persistent).
    See the module docstring for who calls what."""

    @property
    def target(self) -> SaveTarget:
        """Where saves commit first, with whom (loads read there too)."""
        ...

    @property
    def roots(self) -> tuple[Storage, ...]:
        """Every root this rank writes (``check_writable`` probes them)."""
        ...

    @property
    def multi_tier(self) -> bool:
        """Whether saves also live on other tiers than the one they commit to."""
        ...

    @property
    def save_metadata(self) -> Mapping[str, Any]:
        """Manifest metadata every save carries (tiers: the persistent root it belongs to)."""
        ...

    @property
    def last_recovery(self) -> Recovery | None:
        """What the last load did, tier by tier (``None``: one root, or no load yet)."""
        ...

    def decide(self, force: bool) -> bool:
        """Every rank, before planning a save: whether it is persisted beyond its commit
        (``force``: the caller asks for it). May raise an earlier background failure."""
        ...

    def finish(
        self,
        planned: PlannedSave,
        payload: Payload,
        blocked_s: float,
        staging_s: float,
        persist: bool,
    ) -> SaveResult:
        """Every rank, the writer thread: write, commit, and what the placement adds."""
        ...

    def take_over(self, *, renew: bool = False) -> None:
        """Rank 0: take this job's lease on the run wherever it commits (``renew``: a new
        generation even if this job holds one)."""
        ...

    def newest(self, filters: Filters, verify: str) -> CheckpointInfo | None:
        """Every rank: the checkpoint a load would choose now (nothing is moved)."""
        ...

    def persist_latest(self) -> bool:
        """Every rank, no save in flight: persist the newest save now unless it is, and wait.
        ``False`` when there was nothing to do."""
        ...

    def wait(self) -> None:
        """Every rank: wait for the placement's own background work; raise its failure."""
        ...

    def close(self) -> None:
        """Every rank, after :meth:`wait`: release threads, groups and spare files."""
        ...


def save_target(
    storage: Storage, catalog: Catalog, coordinator: Coordinator, config: SaveConfig
) -> SaveTarget:
    """The target of saves committed in ``storage``: its commit channel in the coordinator's
    namespace, and a host arena (pinned when CUDA is there)."""
    channel = CommitChannel(
        coordinator.store,
        rank=coordinator.rank,
        world_size=coordinator.world_size,
        namespace=coordinator.key("commit"),
        timeout_s=config.timeout_s,
    )
    arena = HostArena(pin_memory=torch.cuda.is_available())
    n = config.full_every_n_saves
    increments = Increments(n) if n is not None and n > 1 else None
    return SaveTarget(storage, catalog, coordinator, channel, arena, config, increments)


def lease_target(target: SaveTarget, run: RunState, *, renew: bool = False) -> None:
    """Rank 0: take ``run``'s lease in the target's root unless this job holds it already (or
    anew with ``renew``)."""
    if renew or run.lease is None or run.lease.run_id != run.run_id:
        run.lease = take_lease(target.storage, run.run_id)


def check_writable(coordinator: Coordinator, roots: Sequence[Storage], shown: str) -> None:
    """Every rank writes and deletes a small probe file in each of ``roots``; any rank's
    failure raises :class:`ConfigError` on every rank, naming each rank's error (``shown``:
    the root as the user gave it)."""

    def probe() -> str | None:
        rel = f".probe-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        for root in roots:
            try:
                root.write_bytes(rel, b"", durable=False)
                root.delete(rel)
            except Exception as exc:
                return f"{root.display()}: {type(exc).__name__}: {exc}"
        return None

    errors = coordinator.all_gather(Phase.INIT, probe)
    failed = [f"rank {rank}: {error}" for rank, error in enumerate(errors) if error]
    if failed:
        raise ConfigError(
            f"cannot write checkpoints to {shown} ("
            + "; ".join(failed)
            + "): check that the path is a directory this user can create and write, and "
            "the storage options (credentials, endpoint_url)"
        )
