"""The types a save passes between its phases, and what it is given to run them.

* :class:`SaveConfig` - how the engine saves (frozen: options fixed at construction);
* :class:`SaveTarget` - where and with whom a save commits: the root (multi-tier: the
  node-local one) and its catalog, the coordinator, the commit channel, the host arena and
  the config (frozen: the collaborators never change for one engine);
* :class:`RunState` - what the run has become (mutable, with one owner and a lock): its id,
  its lineage, rank 0's lease, the checkpoints retention must keep, the commit sequence floor;
* :class:`SaveRequest` (what was asked), :class:`PlannedSave` (the agreed plan) and
  :class:`SaveResult` (what a rank gets back).

Kept apart from the phases themselves so that plan, pipeline and commit can all import them
without importing each other. A load takes none of them except the run state's owner, the
engine, which updates the lineage after it.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from lightning_elastic.core.storage.checksum import DEFAULT_ALGORITHM, new_hasher
from lightning_elastic.errors import ConfigError

if TYPE_CHECKING:
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.metadata import Metadata
    from torch.distributed.checkpoint.planner import SavePlan

    from lightning_elastic.core.dist.channel import CommitChannel
    from lightning_elastic.core.dist.coordinator import Coordinator
    from lightning_elastic.core.dist.lease import Lease
    from lightning_elastic.core.format.catalog import Catalog
    from lightning_elastic.core.format.manifest import Manifest
    from lightning_elastic.core.format.skeleton import Skeleton
    from lightning_elastic.core.policy.retention import RetentionPolicy
    from lightning_elastic.core.save.incremental import Increments, Preselected
    from lightning_elastic.core.save.plan import PlanCache
    from lightning_elastic.core.save.snapshot import LazySnapshot
    from lightning_elastic.core.save.stage import HostArena
    from lightning_elastic.core.storage.base import Storage

__all__ = [
    "PlannedSave",
    "RunState",
    "SaveConfig",
    "SaveRequest",
    "SaveResult",
    "SaveTarget",
]


@dataclass(frozen=True)
class SaveConfig:
    """How saves are written and cleaned up, fixed for an engine's life; validated here
    (``ConfigError`` naming the engine's option)."""

    checksum: str = DEFAULT_ALGORITHM
    compression: str | None = None
    timeout_s: float = 600.0
    leftover_grace_s: float = 1200.0  # age after which anyone's leftovers are garbage
    retention: tuple[RetentionPolicy, ...] = ()  # applied to the target's root after a commit
    # rank 0 writes the small replicated items (save/plan.py small_replicated_to_lowest):
    # multi-tier, so a node's ranks read two files of a sharded state, not every file
    small_replicated_to_lowest: bool = False
    # incremental saves (core/save/incremental.py): every n-th save is full, the others
    # refer to the unchanged tensors of the previous ones (None or 1: every save is full)
    full_every_n_saves: int | None = None

    def __post_init__(self) -> None:
        # save.write imports torch; importing it here, not at the top, keeps this module
        # (lightning_elastic.SaveResult's) light
        from lightning_elastic.core.save.write import check_compression

        if self.timeout_s <= 0:
            raise ConfigError(f"timeout must be positive, got {timedelta(seconds=self.timeout_s)}")
        if self.leftover_grace_s < 0:
            grace = timedelta(seconds=self.leftover_grace_s)
            raise ConfigError(f"leftover_grace must be >= 0, got {grace}")
        check_compression(self.compression)
        new_hasher(self.checksum)  # validates the name
        if self.full_every_n_saves is not None:
            from lightning_elastic.core.options import check_count

            object.__setattr__(
                self,
                "full_every_n_saves",
                check_count(self.full_every_n_saves, "full_every_n_saves"),
            )


@dataclass(frozen=True)
class SaveTarget:
    """Where and with whom the saves of one engine commit (see the module docstring)."""

    storage: Storage
    catalog: Catalog  # of ``storage``
    coordinator: Coordinator
    channel: CommitChannel
    arena: HostArena
    config: SaveConfig
    increments: Increments | None = None  # this rank's base for incremental saves


class RunState:
    """What one engine's run has become, as opposed to how it was configured: the run id (a
    load may adopt the loaded checkpoint's), the lineage (the checkpoint resumed from, the
    parent of the next save), rank 0's lease, the checkpoints retention must keep, and the
    commit sequence floor and the names other tiers hold (multi-tier).

    Owner and threads: the engine owns it. The training thread changes it between saves (a
    load's lineage, ``take_over``'s lease, a multi-tier save's decision); the writer thread of
    the one save in flight reads it for the commit and, after the commit, moves the lineage on
    (:meth:`committed`) and, multi-tier, raises the floor and protects the checkpoint it hands
    to the persister; the persister thread only gets a frozen copy (:attr:`protected`). Every
    change holds the lock, so the training thread may release a protection while the writer
    retains.
    """

    def __init__(self, run_id: str) -> None:
        self._lock = threading.Lock()
        self._run_id = run_id
        self._resumed_from: str | None = None
        self._parent: str | None = None
        self._protected: set[str] = set()
        self._floor = 0
        self._reserved: frozenset[str] = frozenset()
        self.lease: Lease | None = None  # rank 0: this job's claim to write the run

    @property
    def run_id(self) -> str:
        """The run this engine's saves belong to."""
        return self._run_id

    @property
    def resumed_from(self) -> str | None:
        """The checkpoint the engine last loaded."""
        return self._resumed_from

    @property
    def parent(self) -> str | None:
        """The checkpoint the next save continues (lineage)."""
        return self._parent

    @property
    def protected(self) -> frozenset[str]:
        """The checkpoints retention must keep now (a copy)."""
        with self._lock:
            return frozenset(self._protected)

    @property
    def sequence_floor(self) -> int:
        """Commits draw sequences above it (multi-tier: every tier's newest)."""
        return self._floor

    @property
    def reserved_names(self) -> frozenset[str]:
        """Names rank 0 never claims (multi-tier: held on another node or the persistent root)."""
        return self._reserved

    def loaded(self, name: str, adopt: str | None = None) -> bool:
        """A load of ``name``: the next save continues it, and retention keeps it; with
        ``adopt``, the engine continues that run from now on. Whether the run changed."""
        with self._lock:
            self._resumed_from = self._parent = name
            self._protected.add(name)
            changed = adopt is not None and adopt != self._run_id
            if adopt is not None:
                self._run_id = adopt
            return changed

    def adopt(self, run_id: str) -> bool:
        """Continue ``run_id`` from now on (a job joining a run another job writes); whether
        the run changed."""
        with self._lock:
            changed = run_id != self._run_id
            self._run_id = run_id
            return changed

    def committed(self, name: str) -> None:
        """A save of ``name`` committed: the next one continues it."""
        with self._lock:
            self._parent = name

    def protect(self, name: str) -> None:
        """Keep ``name`` from retention until :meth:`release`."""
        with self._lock:
            self._protected.add(name)

    def release(self, name: str) -> None:
        """Let retention delete ``name`` again."""
        with self._lock:
            self._protected.discard(name)

    def raise_floor(self, sequences: Iterable[int]) -> None:
        """Draw the next commit sequences above every one of ``sequences`` as well."""
        with self._lock:
            self._floor = max([self._floor, *sequences])

    def reserve(self, names: Iterable[str]) -> None:
        """Never claim these names (they hold a checkpoint on another tier)."""
        with self._lock:
            self._reserved = self._reserved | frozenset(names)


@dataclass(frozen=True)
class SaveRequest:
    """One save as the caller asked for it (validated by the engine)."""

    step: int
    epoch: int | None = None
    metrics: Mapping[str, float] = field(default_factory=dict)
    metadata: Mapping[str, Any] = field(default_factory=dict)
    name: str | None = None
    overwrite: bool = False


@dataclass
class PlannedSave:
    """The plan every rank agreed on: directory name, save id, this rank's write items, and
    the plan cache the next save starts from."""

    request: SaveRequest
    name: str
    save_id: str
    plan: SavePlan
    planner: DefaultSavePlanner
    dcp_metadata: Metadata | None  # rank 0 only
    skeleton: Skeleton  # rank 0 only: the shape of all ranks' states
    started: float
    deadline: float
    cached: bool = False
    cache: PlanCache | None = None  # for the next plan_save of this rank
    # rank 0 only: the save replaces the committed checkpoint of its name (overwrite), whose
    # manifest its own replaces at the commit
    replaces: bool = False
    # a lazy snapshot: the staging copy the writer thread makes before writing
    snapshot: LazySnapshot | None = None
    snapshot_mode: str = "blocking"  # what SaveResult.snapshot says without a lazy snapshot
    # incremental saves: what the save point decided (core/save/incremental.py)
    increment: Preselected | None = None


@dataclass(frozen=True)
class SaveResult:
    """A committed save, as seen by one rank."""

    name: str
    location: str
    step: int
    bytes_written: int  # by this rank
    blocked_s: float  # time the caller was blocked on this rank (with the snapshot's waits)
    staging_s: float  # the whole staging copy, a lazy snapshot's included
    writing_s: float
    total_s: float  # from the save call to the commit being known on this rank
    manifest: Manifest | None = None  # rank 0 only
    # "lazy": the copy overlapped training; "blocking": made before the save returned
    # ("fallback": blocking because an earlier lazy snapshot saw a tensor change)
    snapshot: str = "blocking"
    snapshot_wait_s: float = 0.0  # the part of blocked_s spent waiting for a lazy copy
