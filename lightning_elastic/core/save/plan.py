"""The plan phase of a save: which rank writes which item, and where.

DCP's ``DefaultSavePlanner`` builds each rank's local plan; a global plan deduplicates
replicated items (each is written by exactly one rank, balancing bytes; multi-tier, the
small ones by rank 0: :func:`small_replicated_to_lowest`). Exchanging plans is
two object collectives, 5-20 ms per save on gloo here, although between two saves of a
training run the plans almost never change. So (every rank, together):

1. each rank walks its state (:mod:`~lightning_elastic.core.save.walk`; the replica check's
   walk of the same save is reused for every top-level value it walked) and reuses its cached
   local plan when the skeleton and every leaf's plan-relevant properties are the cached ones;
   otherwise it builds its local plan and compares it with the cached one;
2. rank 0 picks the directory name and a save id and writes the staging record, so the save
   is attributable before any rank writes a byte;
3. one all-reduce of four integers carries "did any rank's plan change (or fail)?" together
   with rank 0's name attempt and save id;
4. unchanged everywhere: every rank reuses its cached final plan (rank 0 its cached DCP
   metadata). Otherwise the full gather/plan/scatter runs, which also carries any rank's
   error to every rank, and refreshes the caches.
"""

from __future__ import annotations

import secrets
import time
from collections import defaultdict
from collections.abc import Collection, Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan

from lightning_elastic.core._compat import save_planner_state, set_up_save_planner
from lightning_elastic.core.dist.lease import take_lease
from lightning_elastic.core.format.catalog import checkpoint_name, holds_checkpoint_files
from lightning_elastic.core.format.manifest import (
    MANIFEST_FILE,
    QUARANTINE_FILE,
    STAGING_FILE,
    StagingRecord,
)
from lightning_elastic.core.format.skeleton import Skeleton, merge
from lightning_elastic.core.save.request import PlannedSave
from lightning_elastic.core.save.walk import StateWalk, walk_state
from lightning_elastic.errors import (
    CheckpointExistsError,
    CheckpointSaveError,
    Phase,
    StorageNotFoundError,
)

__all__ = [
    "SMALL_REPLICATED_BUDGET",
    "SMALL_REPLICATED_BYTES",
    "PlanCache",
    "plan_save",
    "small_replicated_to_lowest",
]

if TYPE_CHECKING:
    from lightning_elastic.core.save.request import RunState, SaveRequest, SaveTarget
    from lightning_elastic.core.storage.base import Storage


@dataclass
class PlanCache:
    """The last successful plan of this rank (and, on rank 0, its DCP metadata and the
    merged skeleton of every rank's state), with what its local plan was made from: DCP's
    flattening of the state (FQN -> path of str keys), the FQN of every leaf in the walk's
    order, and every leaf's plan-relevant properties."""

    local: SavePlan
    skeleton: Skeleton
    final: SavePlan
    metadata: Metadata | None
    merged_skeleton: Skeleton
    mappings: dict[str, tuple[Any, ...]] | None = None  # DCP's: FQN -> path of str keys
    leaves: list[Any] | None = None  # leaf_properties of every leaf, in the walk's order
    fqns: list[str] | None = None  # the FQN of every leaf, in the walk's order


def plan_save(
    target: SaveTarget,
    run: RunState,
    state_dict: dict[str, Any],
    request: SaveRequest,
    walked: StateWalk | None = None,
    cache: PlanCache | None = None,
) -> PlannedSave:
    """Every rank, together: the plan of this save of ``state_dict`` into ``target``, rank 0
    having claimed its directory (and taken ``run``'s lease; see the module docstring).
    ``walked``: this save's replica check's walk, whose branches are reused where
    ``state_dict`` holds the same objects. ``cache``: the previous plan's
    (:attr:`PlannedSave.cache`; this rank's, kept by the caller). A failure on any rank is
    raised on every rank."""
    coord = target.coordinator
    planner = DefaultSavePlanner()
    started = time.monotonic()
    what = f"checkpoint of step {request.step}"

    local: SavePlan | None = None
    local_error: Exception | None = None
    shape: Skeleton = None
    leaves: list[Any] | None = None
    fqns: list[str] | None = None
    try:
        walk = walk_state(state_dict, reuse=walked)
        shape = walk.skeleton()
        local = _reuse_local_plan(planner, walk, shape, cache, coord.is_coordinator)
        if local is None:
            planner.set_up_planner(state_dict, None, coord.is_coordinator)
            local = planner.create_local_plan()
            leaves = walk.props()
            fqns = _fqns(walk, save_planner_state(planner))
        elif cache is not None:
            leaves, fqns = cache.leaves, cache.fqns
    except Exception as exc:  # re-raised on every rank by the full exchange below
        local_error = exc
    unchanged = (
        local is not None
        and cache is not None
        and shape == cache.skeleton
        and (local is cache.local or _same(local, cache.local))
    )

    attempt, save_int, name_error, replaces = 0, 0, None, False
    if coord.is_coordinator:
        try:
            if run.lease is None or run.lease.run_id != run.run_id:
                run.lease = take_lease(target.storage, run.run_id)
            save_int = secrets.randbits(63)
            record = StagingRecord(run.run_id, f"{save_int:016x}", request.step, time.time())
            attempt, replaces = _claim(target, run.reserved_names, request, record)
        except Exception as exc:
            name_error = exc
    changed, attempt, save_int = coord.max_ints(
        [0 if unchanged and name_error is None else 1, attempt, save_int],
        Phase.SAVE_PLAN,
        error=CheckpointSaveError,
    )
    name, save_id = _name(request, attempt), f"{save_int:016x}"

    if not changed and cache is not None:
        final, metadata, merged = cache.final, cache.metadata, cache.merged_skeleton
    else:
        kept: dict[str, Any] = {}

        def local_fn() -> tuple[SavePlan, Skeleton]:
            if local_error is not None:
                raise local_error
            assert local is not None
            return local, shape

        def global_fn(locals_: list[tuple[SavePlan, Skeleton]]) -> list[SavePlan]:
            if name_error is not None:
                raise name_error
            plans = [p for p, _ in locals_]
            if target.config.small_replicated_to_lowest:
                plans = small_replicated_to_lowest(plans)
            plans, kept["metadata"] = planner.create_global_plan(plans)
            merged_shape: Skeleton = None
            for _, rank_shape in locals_:
                merged_shape = merge(merged_shape, rank_shape)
            kept["skeleton"] = merged_shape
            return plans

        final = coord.gather_scatter(
            Phase.SAVE_PLAN, local_fn, global_fn, what=what, error=CheckpointSaveError
        )
        metadata, merged = kept.get("metadata"), kept.get("skeleton")
        assert local is not None
        cache = PlanCache(
            local, shape, final, metadata, merged, dict(planner.mappings), leaves, fqns
        )
    return PlannedSave(
        request=request,
        name=name,
        save_id=save_id,
        plan=planner.finish_plan(final),
        planner=planner,
        dcp_metadata=metadata,
        skeleton=merged,
        started=started,
        deadline=started + target.config.timeout_s,
        cached=not changed,
        cache=cache,
        replaces=replaces,
    )


def _reuse_local_plan(
    planner: DefaultSavePlanner,
    walk: StateWalk,
    shape: Skeleton,
    cache: PlanCache | None,
    is_coordinator: bool,
) -> SavePlan | None:
    """The cached local plan, with ``planner`` set up as ``set_up_planner`` would have, when
    the state has the cached skeleton (the same paths, hence DCP's same FQNs, in the same
    order) and every leaf the same plan-relevant properties: DCP's flattening and planning
    cost ~40 us a tensor (0.8 s of every save of 20,000 tensors) and give the same plan.
    The leaves come from the walk (in DCP's order), never from looking the cached paths up
    again: a ``Counter`` or a ``defaultdict`` answers a made-up value for a key it lacks.
    ``None``: plan anew."""
    if (
        cache is None
        or cache.mappings is None
        or cache.fqns is None
        or cache.leaves is None
        or shape != cache.skeleton
    ):
        return None
    leaves = walk.leaves()
    if len(leaves) != len(cache.fqns) or walk.props() != cache.leaves:
        return None
    flat = dict(zip(cache.fqns, leaves, strict=True))
    set_up_save_planner(planner, flat, dict(cache.mappings), is_coordinator, cache.local)
    return cache.local


def _fqns(walk: StateWalk, flat: Mapping[str, Any] | None) -> list[str] | None:
    """DCP's FQN of every leaf of the walk, in its order, when DCP's flattened state ``flat``
    holds exactly these leaves under them; ``None`` (never reuse this plan) otherwise, e.g.
    when two paths give one FQN or DCP replaced a leaf (a ShardedTensor)."""
    if flat is None:
        return None
    fqns = [".".join(map(str, path)) for path in walk.paths()]
    leaves = walk.leaves()
    if len(flat) != len(fqns) or any(
        flat.get(fqn, _MISSING) is not leaf for fqn, leaf in zip(fqns, leaves, strict=True)
    ):
        return None
    return fqns


_MISSING = object()


def _same(a: SavePlan, b: SavePlan) -> bool:
    return a.items == b.items and a.planner_data == b.planner_data


def _name(request: SaveRequest, attempt: int) -> str:
    if request.name is not None:
        return request.name.strip("/")
    return checkpoint_name(request.step, attempt)


def _refuse_foreign(storage: Storage, name: str) -> None:
    """A named save into a directory that holds something, none of it ours (a user's folder
    of that name, another tool's checkpoint), would have its commit's cleanup delete all of
    it: refused, naming what is there."""
    entries = storage.listdir(name)
    if entries and not holds_checkpoint_files(e.name for e in entries if not e.is_dir):
        shown = ", ".join(e.name for e in entries[:3]) + (", ..." if len(entries) > 3 else "")
        raise CheckpointExistsError(
            f"{storage.display(name)} is a directory that is not a checkpoint of ours (it holds "
            f"{shown}); a save under that name would delete its contents: move it away or "
            "choose another name"
        )


def _claim(
    target: SaveTarget, reserved: Collection[str], request: SaveRequest, record: StagingRecord
) -> tuple[int, bool]:
    """Rank 0: claim the save's directory by creating its staging record exclusively (and
    durably), so no two saves - of this job, a stale copy of it, or another run sharing the
    root - ever write into one directory. Returns 0 for the plain name, n for ``-n``: a
    directory that holds a checkpoint (committed, quarantined, or an abandoned branch's) or
    another save's claim is never written again; and whether the save replaces a committed
    checkpoint (an explicit name with ``overwrite``).

    A replaced checkpoint stays committed until the new manifest replaces its own
    (:meth:`Storage.replace_bytes`): its files and the new save's have save-unique names, so
    both live in the directory meanwhile, and a crash leaves the old checkpoint or the new
    one, never neither (the new one's files, or the old one's after the commit, are strays
    that the commit's cleanup removes). A quarantined one is uncommitted first: there is
    nothing worth keeping, and its quarantine record would condemn the new manifest too."""
    storage = target.storage
    body = record.to_json().encode()
    if request.name is not None:
        name = request.name.strip("/")
        replaces = False
        _refuse_foreign(storage, name)
        if storage.exists(f"{name}/{MANIFEST_FILE}"):
            if not request.overwrite:
                raise CheckpointExistsError(
                    f"{storage.display(name)} already holds a committed checkpoint; "
                    "pass overwrite=True to replace it or choose another name"
                )
            replaces = not storage.exists(f"{name}/{QUARANTINE_FILE}")
            # as delete_checkpoint: an incremental checkpoint reads from its files, which the
            # replacement's commit would remove (the referrer would be corrupt)
            referrers = sorted(
                i.name
                for i in target.catalog.scan()
                if i.manifest is not None
                and i.name != name
                and name in i.manifest.referenced_checkpoints
            )
            if referrers:
                raise CheckpointExistsError(
                    f"{storage.display(name)} cannot be replaced: {', '.join(referrers)} "
                    "refer(s) to its files (incremental checkpoints); choose another name"
                )
            if not replaces:
                storage.delete(f"{name}/{MANIFEST_FILE}")  # uncommit first, then replace
                storage.delete(f"{name}/{QUARANTINE_FILE}")
            target.catalog.forget(name)
        if request.overwrite:
            storage.delete(f"{name}/{STAGING_FILE}")  # the replaced save's (or a crashed) claim
        storage.write_bytes(f"{name}/{STAGING_FILE}", body, exclusive=True)
        return 0, replaces
    for attempt in range(1000):
        name = checkpoint_name(request.step, attempt)
        if name in reserved:
            continue  # multi-tier: the name is taken on another node or the persistent root
        if storage.exists(f"{name}/{MANIFEST_FILE}") or storage.exists(f"{name}/{QUARANTINE_FILE}"):
            continue
        try:
            _write_claim(storage, name, body)
        except CheckpointExistsError:
            continue  # another save holds it (in flight, or crashed and not yet collected)
        if not _claimed_alone(storage, name):
            storage.delete(f"{name}/{STAGING_FILE}")  # give it back untouched
            continue
        return attempt, False
    raise CheckpointExistsError(f"too many checkpoints of step {request.step}")


def _write_claim(storage: Storage, name: str, body: bytes, tries: int = 3) -> None:
    """Create ``name``'s claim exclusively. A free name may be one whose checkpoint another
    run's retention is deleting right now: its last step removes the (then empty) directory,
    which can fall between our creating the directory and our writing into it. The claim is
    then written again (the name is still free); a directory that keeps vanishing is taken as
    taken (:class:`CheckpointExistsError`)."""
    for _ in range(tries):
        try:
            storage.write_bytes(f"{name}/{STAGING_FILE}", body, exclusive=True)
            return
        except StorageNotFoundError:
            continue
    raise CheckpointExistsError(f"{storage.display(name)} vanished {tries} times while claimed")


def _claimed_alone(storage: Storage, name: str) -> bool:
    """Our claim is in ``name`` and no other save's file is. Between the check above and the
    claim, another save may have committed there and released its claim, or retention may
    be deleting a checkpoint there (manifest already gone): writing into either would mix
    two saves in one directory.

    Another save claiming the name at the same moment is no such file: on a local disk its
    claim is a temporary ``_staging.json.tmp-*`` linked to ``_staging.json``, and its link
    fails now that ours is there. Such a file written within :data:`_CLAIM_RACE_S` of ours is
    that; an older one is what a claim that crashed left, and keeps the name taken until
    garbage collection removes the directory (claiming it now could race that removal)."""
    entries = {e.name: e for e in storage.listdir(name)}
    ours = entries.get(STAGING_FILE)
    if ours is None:
        return False
    since = None if ours.mtime is None else ours.mtime - _CLAIM_RACE_S
    others = {
        n
        for n, e in entries.items()
        if n != STAGING_FILE
        and not (
            n.startswith(f"{STAGING_FILE}.tmp-")
            and since is not None
            and e.mtime is not None
            and e.mtime >= since
        )
    }
    return not holds_checkpoint_files(others)


#: how much earlier than our claim another save's claim may have started writing and still
#: be racing ours (a claim is a few hundred bytes and one fsync: milliseconds)
_CLAIM_RACE_S = 10.0


#: replicated items below this size are written by the lowest rank holding them, up to
#: ``SMALL_REPLICATED_BUDGET`` bytes in all (the rest is balanced, as DCP balances)
SMALL_REPLICATED_BYTES = 1 << 20
SMALL_REPLICATED_BUDGET = 64 << 20


def small_replicated_to_lowest(plans: list[SavePlan]) -> list[SavePlan]:
    """Rank 0 (the coordinator's global plan): keep each small replicated item (one in
    several ranks' plans: below ``SMALL_REPLICATED_BYTES``, or an object) only in the lowest
    of those ranks' plans, up to ``SMALL_REPLICATED_BUDGET`` bytes in all (in plan order);
    DCP's deduplication then balances the rest across ranks.

    A rank that loads its own shards thus reads its own file and the lowest rank's (the small
    replicated rest: optimizer steps, norms, buffers, loop state), not a sliver of every
    rank's file; multi-tier recovery fetches a node the files its ranks read, so with a
    sharded state a node needs two files, not all (core/tiers/restore.py). The budget bounds
    what rank 0 writes beyond its share (a replicated model of many small tensors)."""
    holders: dict[Any, list[int]] = defaultdict(list)
    sizes: dict[Any, int] = {}
    for rank, plan in enumerate(plans):
        for item in plan.items:
            holders[item.index].append(rank)
            sizes[item.index] = item.tensor_storage_size() or 0
    small: set[Any] = set()
    budget = SMALL_REPLICATED_BUDGET
    for index, ranks in holders.items():  # plan order: the same on every run
        size = sizes[index]
        if len(ranks) > 1 and size < SMALL_REPLICATED_BYTES and size <= budget:
            small.add(index)
            budget -= size
    out = []
    for rank, plan in enumerate(plans):
        items = [
            item
            for item in plan.items
            if item.index not in small or rank == min(holders[item.index])
        ]
        out.append(plan if len(items) == len(plan.items) else replace(plan, items=items))
    return out
