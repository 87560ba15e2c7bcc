"""The types one save passes between its phases: what was asked (:class:`SaveRequest`), what
the engine lends every save (:class:`SaveContext`), the agreed plan (:class:`PlannedSave`)
and what a rank gets back (:class:`SaveResult`).

Kept apart from the phases themselves so that plan, pipeline and commit can all import them
without importing each other.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

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
    from lightning_elastic.core.save.plan import PlanCache
    from lightning_elastic.core.save.stage import HostArena
    from lightning_elastic.core.storage.base import Storage

__all__ = ["PlannedSave", "SaveContext", "SaveRequest", "SaveResult"]


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
    arena: HostArena
    retention: Sequence[RetentionPolicy] = ()
    protected: set[str] = field(default_factory=set)
    resumed_from: str | None = None
    plan_cache: PlanCache | None = None
    lease: Lease | None = None  # rank 0: this job's claim to write the run
    parent: str | None = None  # the checkpoint the next save continues (lineage)
    leftover_grace_s: float = 1200.0  # age after which anyone's leftovers are garbage
    sequence_floor: int = 0  # commits draw sequences above it (multi-tier: every tier's newest)
    reserved_names: set[str] = field(default_factory=set)  # rank 0 never claims these (tiers)
    # rank 0 writes the small replicated items (save/plan.py small_replicated_to_lowest):
    # multi-tier, so a node's ranks read two files of a sharded state, not every file
    small_replicated_to_lowest: bool = False


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
    """The plan every rank agreed on: directory name, save id, this rank's write items."""

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
