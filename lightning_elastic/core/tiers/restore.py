"""Recovery from the fastest tier: agree on a checkpoint, gather its files on every node, load.

Which rank calls what, in what order (every rank, together, from the training thread, with no
save or persist in flight; the load walk (:mod:`~lightning_elastic.core.load.walk`) calls
:func:`attempt` through the tiered placement, as often as its retry rule allows):

1. **Survey** (one all-gather): each node's lead scans its local root, keeping only
   checkpoints that belong to this persistent root (and run, when the run is named); rank 0
   adds the newest valid checkpoints of the persistent root
   (:mod:`~lightning_elastic.core.tiers.candidates`).
2. **Plan**: every rank merges the scans and calls
   :func:`~lightning_elastic.core.tiers.recovery.plan_recovery`: the same plan everywhere.
   Nothing recoverable anywhere: ``None`` (the walk raises :func:`not_found`'s error).
3. **Manifest** (one all-gather of the chosen manifest's text from whoever holds it).
4. **Verify and fetch** (:mod:`~lightning_elastic.core.tiers.gather`): with ``verify="full"``
   each lead hashes the copies its node holds; copies a node lacks come from a peer node or
   the persistent root, checked on arrival. A corrupt copy is deleted, or a corrupt persistent
   checkpoint quarantined: :class:`~lightning_elastic.core.load.walk.Retry` (the walk selects
   again). At the saved world size the metadata comes first, then each node gets only the
   files its ranks read (and would upload, and the replicas a save places on it).
5. Each other node's lead writes the manifest beside the files (last); the walk loads from
   every rank's node-local root (at any world size: DCP reshards), then :func:`finished`.

Every rank logs which tier its node used and the bytes by source, and gets a
:class:`Recovery` with the same.
"""

from __future__ import annotations

import functools
from collections.abc import Collection, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from lightning_elastic.core.forksafe import fork_safe_logger
from lightning_elastic.core.format.catalog import VALID, CheckpointInfo
from lightning_elastic.core.format.manifest import MANIFEST_FILE, Manifest
from lightning_elastic.core.load.load import Targets, files_to_read
from lightning_elastic.core.load.walk import Filters, LoadRequest, Retry, Selected
from lightning_elastic.core.tiers.candidates import (
    Choice,
    agree,
    drop_conflicting,
    manifest_text,
    recovery_error,
    survey,
)
from lightning_elastic.core.tiers.gather import gather, global_files, routes
from lightning_elastic.core.tiers.recovery import RecoveryPlan
from lightning_elastic.core.tiers.runtime import TierSet
from lightning_elastic.errors import CheckpointLoadError, CheckpointNotFoundError, Phase

__all__ = ["Recovery", "attempt", "choose", "drop", "finished", "not_found"]

log = fork_safe_logger(__name__)
_TIERS = ("none", "local", "peer", "persistent")  # slowest last


@dataclass(frozen=True)
class Recovery:
    """What one rank's recovery did. ``tier``: the slowest source its node used (``"local"``,
    ``"peer"``, ``"persistent"``); ``plan_tier`` the same for the whole job; ``bytes``: this
    node's bytes of the checkpoint by source."""

    checkpoint: str
    step: int | None
    tier: str
    plan_tier: str
    node: str
    bytes: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0
    skipped: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        """A plain dict (logs, journals)."""
        return asdict(self)


@dataclass(frozen=True)
class _Gathered:
    """What :func:`attempt` did, for :func:`finished`."""

    persisted: bool  # the persistent tier holds the checkpoint
    plans: tuple[RecoveryPlan, ...]  # whose fetches were made, in turn (the last: the plan)
    needed: Collection[str] | None  # the files this node's ranks read (None: every file)


def attempt(
    tiers: TierSet, request: LoadRequest, excluded: Collection[str]
) -> Selected | Retry | None:
    """Every rank, steps 1-5 of the module: the chosen checkpoint, readable in every node's
    local root; a :class:`Retry` after a corrupt copy or checkpoint; ``None``: nothing left."""
    coord = tiers.coordinator
    gone = frozenset(excluded)
    surveys = coord.all_gather(
        Phase.LOAD_SELECT, functools.partial(survey, tiers, request.filters, gone)
    )
    choice = agree(tiers, surveys, set(gone))
    tiers.run.raise_floor(c.order[1] for c in choice.candidates)
    name = choice.plan.checkpoint
    if name is None:
        return None
    text = manifest_text(tiers, choice, name)
    drop_conflicting(tiers, choice, name)
    manifest = Manifest.from_json(text, tiers.local.display(name))
    gathered = _gather_all(tiers, request, choice, manifest)
    if isinstance(gathered, Retry):
        return gathered
    return Selected(_commit_copy(tiers, name, text), tiers.local, detail=gathered)


def _gather_all(
    tiers: TierSet, request: LoadRequest, choice: Choice, manifest: Manifest
) -> _Gathered | Retry:
    """Step 4: every node's copy of ``manifest``'s checkpoint made complete (what its ranks
    read), or what to do first."""
    coord, name, verify = tiers.coordinator, manifest.name, request.verify
    plan = choice.plan
    held = choice.held.get(tiers.node, {})  # this node's copies (the lead's scan)
    needs: dict[int, set[str]] = {}
    done: list[RecoveryPlan] = []
    if manifest.world_size == coord.world_size:
        # the same world: each node gets the files its ranks read (and would upload), known
        # once the DCP metadata is there; at another world size every node gets every file
        # (a world-size change reads every saved rank's state)
        first = global_files(manifest)
        done.append(plan.narrowed({tiers.layout.lead(node): first for node in tiers.layout.names}))
        bad = gather(tiers, manifest, done[-1], held, verify, first)
        if bad is not None:
            return Retry(name, frozenset(bad))
        needs = _needs(tiers, manifest, request.state, request.strict, request.targets)
        plan = plan.narrowed({lead: files - first for lead, files in needs.items()})
    mine = needs.get(tiers.layout.lead(tiers.node))
    bad = gather(tiers, manifest, plan, held, verify, mine)
    if bad is not None:
        return Retry(name, frozenset(bad))
    return _Gathered(choice.winners[name].persisted, (*done, plan), mine)


def _needs(
    tiers: TierSet,
    manifest: Manifest,
    state: dict[str, Any] | None,
    strict: bool,
    targets: Targets | None,
) -> dict[int, set[str]]:
    """Every rank, at the saved world size, once each node holds the DCP metadata: the files
    each node needs, by its lead rank - what its ranks' loads read (:func:`files_to_read`),
    its own ranks' shards (also what they upload if this checkpoint is persisted from here:
    ``persist_checkpoint`` gives saved rank ``r``'s file to rank ``r % world``, here ``r``)
    and the replicas a save places on it (so a recovery leaves every shard on
    ``1 + replicas`` nodes, as the save did: losing another node before the next save still
    leaves a recoverable checkpoint), and the metadata. A node with a rank that cannot plan
    its load is left out (it gets every file)."""
    coord, name = tiers.coordinator, manifest.name
    info = CheckpointInfo(name, tiers.local.display(name), VALID, manifest)

    def mine() -> list[str] | None:
        files = files_to_read(tiers.local, coord, info, state, strict=strict, targets=targets)
        return None if files is None else sorted(f"{name}/{path}" for path in files)

    gathered = coord.all_gather(Phase.LOAD_SELECT, mine, error=CheckpointLoadError)
    layout = tiers.layout
    shards = {f.rank: f"{name}/{f.path}" for f in manifest.files if f.rank is not None}
    needs: dict[int, set[str]] = {}
    for node, ranks in layout.nodes:
        wanted = [gathered[r] for r in ranks]
        if all(w is not None for w in wanted):
            needs[layout.lead(node)] = {f for w in wanted if w for f in w}
    for node, ranks in layout.nodes:  # the copies a save would have left: replicas stay whole
        for holder in (node, *layout.replica_nodes(node, tiers.replicas)):
            lead = layout.lead(holder)
            if lead in needs:
                needs[lead] |= {shards[r] for r in ranks if r in shards}
    return {lead: files | global_files(manifest) for lead, files in needs.items()}


def _commit_copy(tiers: TierSet, name: str, text: str) -> CheckpointInfo:
    """Each other lead writes the manifest beside the gathered files (last); the node's copy,
    as its catalog reads it."""
    coord, local = tiers.coordinator, tiers.local

    def commit() -> None:
        if tiers.layout.is_lead(coord.rank) and not local.exists(f"{name}/{MANIFEST_FILE}"):
            local.write_bytes(f"{name}/{MANIFEST_FILE}", text.encode(), exclusive=True)

    coord.all_gather(Phase.LOAD, commit, error=CheckpointLoadError)
    catalog = tiers.target.catalog
    catalog.forget(name)
    info = catalog.info(name)
    if info.status != VALID:
        raise recovery_error(tiers, info.location, f"the node-local copy is {info.status.value}")
    return info


def finished(tiers: TierSet, selected: Selected, seconds: float) -> Recovery:
    """Every rank, after the walk loaded ``selected``: the record (logged), and the save side
    learns where the run resumed (:meth:`TierSet.resumed`)."""
    info, gathered = selected.info, selected.detail
    assert isinstance(gathered, _Gathered) and info.manifest is not None
    record = _record(tiers, info, gathered.plans, seconds, gathered.needed)
    tiers.resumed(info.manifest, persisted=gathered.persisted)
    return record


def drop(tiers: TierSet, info: CheckpointInfo, file: str) -> None:
    """Every rank: ``file`` of ``info`` was found corrupt while loading; each node's lead
    deletes its copy (a cache: a later recovery fetches a good one from another tier). Not
    reached today: recovery verifies the copies while gathering them (``Selected.fused`` is
    false), so a load never finds one corrupt."""
    coord = tiers.coordinator

    def delete() -> None:
        if tiers.layout.is_lead(coord.rank):
            tiers.local.delete(f"{info.name}/{file}")

    coord.all_gather(Phase.LOAD_QUARANTINE, delete, error=CheckpointLoadError)


def not_found(tiers: TierSet, filters: Filters) -> CheckpointNotFoundError:
    """The error of a recovery that found nothing to load, naming every place it looked."""
    where = (
        f"{tiers.persistent.storage.display()} or the node-local roots "
        f"({tiers.local.display()} on {len(tiers.layout.nodes)} node(s))"
    )
    if filters.checkpoint is not None:
        return CheckpointNotFoundError(
            f"no valid checkpoint {filters.checkpoint} in {where}; name one that "
            "`lightning-elastic ls DIR --local PATH` lists as valid"
        )
    return CheckpointNotFoundError(
        f"no valid checkpoint in {where}; start without resuming or point to a "
        "directory holding committed checkpoints"
    )


def choose(tiers: TierSet, filters: Filters) -> CheckpointInfo | None:
    """Every rank: the checkpoint a recovery would load now (survey and plan, nothing moved),
    as an info built from its manifest, or ``None``."""
    surveys = tiers.coordinator.all_gather(
        Phase.LOAD_SELECT, functools.partial(survey, tiers, filters, frozenset())
    )
    choice = agree(tiers, surveys, set())
    name = choice.plan.checkpoint
    if name is None:
        return None
    manifest = Manifest.from_json(manifest_text(tiers, choice, name), name)
    return CheckpointInfo(name, tiers.local.display(name), VALID, manifest)


def _record(
    tiers: TierSet,
    info: CheckpointInfo,
    plans: Sequence[RecoveryPlan],
    seconds: float,
    needed: Collection[str] | None,
) -> Recovery:
    """This rank's recovery record, logged: the fetches of ``plans`` (each made in turn; the
    last is the plan), and the bytes its node needed (``needed``: the files its ranks read;
    ``None``: the whole checkpoint)."""
    lead = tiers.layout.lead(tiers.node)
    plan = plans[-1]
    routed = [routes(p) for p in plans]
    manifest = info.manifest
    total = manifest.total_bytes if manifest is not None else 0
    if needed is not None and manifest is not None:
        total = sum(f.size for f in manifest.files if f"{info.name}/{f.path}" in needed)
    by_source = {"local": 0, "peer": 0, "persistent": 0}
    for f in (f for downloads, relays in routed for f in [*downloads, *relays]):
        if f.dst_rank == lead:
            by_source[f.source] += f.size
    by_source["local"] = max(0, total - by_source["peer"] - by_source["persistent"])
    tier = "local"
    if by_source["persistent"]:
        tier = "persistent"
    elif by_source["peer"]:
        tier = "peer"
    record = Recovery(
        info.name,
        info.step,
        tier,
        max((p.tier for p in plans), key=_TIERS.index),  # the slowest any node used
        tiers.node,
        by_source,
        seconds,
        dict(plan.skipped),
    )
    # a warning so every rank's line shows without logging configured (torchrun's workers):
    # which tier a restart read is what an operator looks for first
    log.warning(
        "rank %d on node %s recovered %s from %s: local %d B, peer %d B, persistent %d B (%.2f s)",
        tiers.coordinator.rank,
        tiers.node,
        info.name,
        tier,
        by_source["local"],
        by_source["peer"],
        by_source["persistent"],
        seconds,
    )
    return record
