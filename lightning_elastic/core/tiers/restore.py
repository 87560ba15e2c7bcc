"""Recovery from the fastest tier: agree on a checkpoint, gather its files on every node, load.

Which rank calls what, in what order (every rank calls :func:`recover` together from the
training thread, with no save or persist in flight):

1. **Survey** (one all-gather): each node's lead scans its local root
   (:func:`~lightning_elastic.core.tiers.inventory.scan_node`), keeping only checkpoints that
   belong to this persistent root (and run, when the run is named); rank 0 adds the newest
   valid checkpoint of the persistent root.
2. **Plan**: every rank merges the scans and calls
   :func:`~lightning_elastic.core.tiers.recovery.plan_recovery`: the same plan everywhere.
   Nothing recoverable anywhere is :class:`CheckpointNotFoundError`, as without tiers.
3. **Manifest** (one all-gather of the chosen manifest's text from whoever holds it).
4. **Verify** (``verify="full"``): each lead hashes the copies its node holds; a corrupt copy
   is deleted (a copy: the checkpoint lives on in other tiers) and recovery starts over at 1.
5. **Fetch**: copies a node lacks come from a peer node (point-to-point on the tier group,
   checked at the receiver) or, when no running node holds them, from the persistent root
   (checked against the manifest while reading). A source found corrupt is deleted (local) or
   the persistent checkpoint quarantined, and recovery starts over at 1.
6. Each other node's lead writes the manifest beside the files (last); every rank loads from
   its node's local root (at any world size: DCP reshards).

Every rank logs which tier its node used and the bytes by source, and gets a
:class:`Recovery` with the same.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Collection, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from lightning_elastic.core.forksafe import fork_safe_logger
from lightning_elastic.core.format.catalog import VALID, CheckpointInfo
from lightning_elastic.core.format.manifest import MANIFEST_FILE, FileRecord, Manifest
from lightning_elastic.core.load.load import LoadResult, Targets, files_to_read, load_checkpoint
from lightning_elastic.core.load.per_rank import PerRankRule
from lightning_elastic.core.load.select import RUN_NAMED
from lightning_elastic.core.storage.base import Storage
from lightning_elastic.core.tiers.inventory import NodeScan, adoptable, holdings, scan_node
from lightning_elastic.core.tiers.recovery import (
    CheckpointCandidate,
    Fetch,
    RecoveryPlan,
    plan_recovery,
)
from lightning_elastic.core.tiers.runtime import TIER_ROOT_KEY, TierSet
from lightning_elastic.core.tiers.transfer import Transfer, TransferError, execute_transfers
from lightning_elastic.errors import (
    CheckpointLoadError,
    CheckpointNotFoundError,
    ConfigError,
    IntegrityError,
    Phase,
    RankFailure,
)

__all__ = ["Filters", "Recovery", "choose", "recover"]

log = fork_safe_logger(__name__)
_ATTEMPTS = 6  # each retry follows a deleted corrupt copy or a quarantined checkpoint
_PERSISTENT_CANDIDATES = 3
_CHUNK = 16 * 2**20
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
class _Survey:
    node: str
    scan: NodeScan | None  # leads only
    persistent: tuple[CheckpointCandidate, ...] = ()  # rank 0 only: the newest few, newest first
    occupied: tuple[CheckpointCandidate, ...] = ()  # leads: local ones recovery may not use


@dataclass(frozen=True)
class Filters:
    """Which checkpoints recovery may choose."""

    checkpoint: str | None = None  # only this one
    run_id: str | None = None  # only this run's
    skip_named: bool = False  # not a named run's (an unnamed job never continues one)


def recover(
    tiers: TierSet,
    state: dict[str, Any] | None,
    *,
    filters: Filters,
    verify: str,
    strict: bool,
    trusted: bool,
    per_rank_rules: Sequence[PerRankRule],
    targets: Targets | None,
) -> tuple[CheckpointInfo, LoadResult, Recovery]:
    """Every rank: the module's steps; the loaded checkpoint, the load's result and the
    recovery record of this rank."""
    start = time.monotonic()
    coord = tiers.coordinator
    excluded: set[str] = set()
    for _ in range(_ATTEMPTS):
        surveys = coord.all_gather(
            Phase.LOAD_SELECT, functools.partial(_survey, tiers, filters, frozenset(excluded))
        )
        choice = _plan(tiers, surveys, excluded)
        plan = choice.plan
        tiers.run.raise_floor(c.order[1] for c in choice.candidates)
        if plan.checkpoint is None:
            where = (
                f"{tiers.persistent.storage.display()} or the node-local roots "
                f"({tiers.local.display()} on {len(tiers.layout.nodes)} node(s))"
            )
            if filters.checkpoint is not None:
                raise CheckpointNotFoundError(
                    f"no valid checkpoint {filters.checkpoint} in {where}; name one that "
                    "`lightning-elastic ls DIR --local PATH` lists as valid"
                )
            raise CheckpointNotFoundError(
                f"no valid checkpoint in {where}; start without resuming or point to a "
                "directory holding committed checkpoints"
            )
        name = plan.checkpoint
        text = _manifest_text(tiers, choice, name)
        _drop_conflicting(tiers, choice, name)
        manifest = Manifest.from_json(text, tiers.local.display(name))
        held = choice.held.get(tiers.node, {})  # this node's copies (the lead's scan)
        needs: dict[int, set[str]] = {}
        done: list[RecoveryPlan] = []  # plans whose fetches were made (for the record)
        if manifest.world_size == coord.world_size:
            # the same world: each node gets the files its ranks read (and would upload),
            # known once the DCP metadata is there; at another world size every node gets
            # every file (a world-size change reads every saved rank's state)
            first = _global_files(manifest)
            leads = {tiers.layout.lead(node): first for node in tiers.layout.names}
            done.append(plan.narrowed(leads))
            bad = _gather(tiers, manifest, done[-1], held, verify, first)
            if bad is not None:
                excluded |= bad
                continue
            needs = _needs(tiers, manifest, state, strict, targets)
            plan = plan.narrowed({lead: files - first for lead, files in needs.items()})
        mine = needs.get(tiers.layout.lead(tiers.node))
        bad = _gather(tiers, manifest, plan, held, verify, mine)
        if bad is not None:
            excluded |= bad
            continue
        info, result = _load(tiers, state, name, text, strict, trusted, per_rank_rules, targets)
        record = _record(tiers, info, [*done, plan], time.monotonic() - start, mine)
        assert info.manifest is not None
        tiers.resumed(info.manifest, persisted=choice.winners[name].persisted)
        return info, result, record
    raise _error(
        tiers,
        tiers.persistent.storage.display(),
        f"recovery gave up after {_ATTEMPTS} attempts (corrupt copies kept turning up); "
        "inspect the node-local roots with `lightning-elastic ls DIR --local PATH`",
    )


def _gather(
    tiers: TierSet,
    manifest: Manifest,
    plan: RecoveryPlan,
    held: Mapping[str, Mapping[str, int]],
    verify: str,
    files: Collection[str] | None,
) -> set[str] | None:
    """Verify the node's copies among ``files`` (``None``: all) with ``verify="full"``, then
    make the plan's fetches. ``None`` when done, else what to exclude from the next attempt
    (an empty set: a corrupt copy was deleted, the nodes hold less now)."""
    if verify == "full" and _drop_corrupt(tiers, manifest, plan, held, files):
        return set()
    return _fetch(tiers, manifest, plan)


def _global_files(manifest: Manifest) -> set[str]:
    """The files of no rank (the DCP metadata): every node needs them."""
    return {f"{manifest.name}/{f.path}" for f in manifest.files if f.rank is None}


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
    return {lead: files | _global_files(manifest) for lead, files in needs.items()}


def _error(tiers: TierSet, what: str, message: str) -> CheckpointLoadError:
    """The error every rank raises (each with the same message) for a failed recovery."""
    failure = RankFailure(tiers.coordinator.rank, Phase.LOAD, "RecoveryError", message)
    return CheckpointLoadError(what, [failure])


def choose(tiers: TierSet, filters: Filters) -> CheckpointInfo | None:
    """Every rank: the checkpoint a recovery would load now (survey and plan, nothing moved),
    as an info built from its manifest, or ``None``."""
    surveys = tiers.coordinator.all_gather(
        Phase.LOAD_SELECT, functools.partial(_survey, tiers, filters, frozenset())
    )
    choice = _plan(tiers, surveys, set())
    name = choice.plan.checkpoint
    if name is None:
        return None
    manifest = Manifest.from_json(_manifest_text(tiers, choice, name), name)
    return CheckpointInfo(name, tiers.local.display(name), VALID, manifest)


def _drop_conflicting(tiers: TierSet, choice: _Choice, name: str) -> None:
    """A node whose copy of ``name`` is another (older) checkpoint gives that copy up: its
    manifest goes first, then the chosen one's files and manifest arrive like on a node that
    had none. A node-local copy is a cache; the other checkpoint lives on where it was."""
    lead = tiers.layout.is_lead(tiers.coordinator.rank)
    if name in choice.conflicted.get(tiers.node, ()) and lead:
        log.warning(
            "dropping %s on node %s: it is another checkpoint than the newer %s being recovered",
            tiers.local.display(name),
            tiers.node,
            name,
        )
        tiers.local.delete(f"{name}/{MANIFEST_FILE}")
        tiers.target.catalog.forget(name)


def _survey(tiers: TierSet, filters: Filters, excluded: frozenset[str]) -> _Survey:
    rank = tiers.coordinator.rank
    scan = None
    occupied: tuple[CheckpointCandidate, ...] = ()
    if tiers.layout.is_lead(rank):
        whole = scan_node(tiers.local)
        scan = _filtered(whole, tiers, filters, excluded)
        kept = {c.name for c in scan.candidates} | excluded
        occupied = tuple(c for c in whole.candidates if c.name not in kept)
    persistent: tuple[CheckpointCandidate, ...] = ()
    if rank == 0:
        persistent = _persistent_newest(tiers, filters, excluded)
    return _Survey(tiers.node, scan, persistent, occupied)


def _eligible(manifest: Manifest, tiers: TierSet, filters: Filters, local: bool) -> bool:
    meta = manifest.metadata
    if local and meta.get(TIER_ROOT_KEY) != tiers.persistent.storage.display():
        return False  # another job's, or this local root used with another persistent root
    if filters.checkpoint is not None and manifest.name != filters.checkpoint:
        return False
    if filters.run_id is not None and manifest.run_id != filters.run_id:
        return False
    return not (filters.skip_named and meta.get(RUN_NAMED))


def _filtered(
    scan: NodeScan, tiers: TierSet, filters: Filters, excluded: frozenset[str]
) -> NodeScan:
    keep = []
    for cand in scan.candidates:
        if cand.name in excluded:
            continue
        try:
            info = tiers.target.catalog.info(cand.name)
        except Exception:
            continue
        if info.manifest is not None and _eligible(info.manifest, tiers, filters, local=True):
            keep.append(cand)
    names = {c.name for c in keep}
    held = {n: files for n, files in scan.checkpoints.items() if n in names}
    return NodeScan(held, tuple(keep), scan.uncommitted)


def _persistent_newest(
    tiers: TierSet, filters: Filters, excluded: frozenset[str]
) -> tuple[CheckpointCandidate, ...]:
    """Rank 0: the newest valid checkpoints of the persistent root recovery may choose (a few:
    the newest may lose to a newer node-local checkpoint of the same name)."""
    found: list[CheckpointCandidate] = []
    for info in reversed(tiers.persistent.catalog.scan()):
        m = info.manifest
        if info.status != VALID or m is None or info.name in excluded:
            continue
        if _eligible(m, tiers, filters, local=False):
            files = {f"{info.name}/{f.path}": f.size for f in m.files}
            found.append(CheckpointCandidate(info.name, info.sort_key(), files, persisted=True))
            if len(found) == _PERSISTENT_CANDIDATES:
                break
    return tuple(found)


@dataclass(frozen=True)
class _Choice:
    """The agreed plan, and the nodes whose local copy of a name is another checkpoint."""

    plan: RecoveryPlan
    candidates: tuple[CheckpointCandidate, ...]  # every variant seen (for the sequence floor)
    winners: dict[str, CheckpointCandidate]
    conflicted: dict[str, frozenset[str]]  # node -> names its copy of which lost
    held: dict[str, dict[str, dict[str, int]]]  # node -> name -> the files it holds (path: size)


def _plan(tiers: TierSet, surveys: Sequence[_Survey], excluded: set[str]) -> _Choice:
    """Every rank, same inputs: one checkpoint per name (two different ones under one name -
    a rollback's new branch beside an old copy, a hand-edited manifest - go by commit order,
    the newer wins, and the copies of the other count as not held), then the plan."""
    variants: dict[str, list[CheckpointCandidate]] = {}
    seen: list[CheckpointCandidate] = []
    for s in surveys:
        for c in [*(s.scan.candidates if s.scan is not None else ()), *s.persistent]:
            if c.name not in excluded:
                variants.setdefault(c.name, []).append(c)
                seen.append(c)
    # a persisted checkpoint wins its name over node-only copies (a copy left on a node that
    # was away while the job rolled back must not replace what the job committed since)
    winners = {n: max(vs, key=lambda c: (c.persisted, c.order)) for n, vs in variants.items()}
    merged = []
    for name, win in winners.items():
        persisted = any(c.persisted and _same(c, win) for c in variants[name])
        merged.append(replace(win, persisted=persisted))
    conflicted: dict[str, frozenset[str]] = {}
    node_held: dict[str, dict[str, dict[str, int]]] = {}
    nodes = []
    for s in surveys:
        if s.scan is None:
            continue
        lost = frozenset(
            c.name for c in s.scan.candidates if c.name in winners and not _same(c, winners[c.name])
        )
        conflicted[s.node] = lost
        held = {n: dict(files) for n, files in s.scan.checkpoints.items() if n not in lost}
        for n in s.scan.uncommitted:  # the manifest of n did not reach the node
            if n in winners and n not in held:
                held[n] = adoptable(s.scan, n, winners[n].files)
        node_held[s.node] = held
        nodes.append(holdings(NodeScan(held), node=s.node, ranks=tiers.layout.ranks_of(s.node)))
        if lost and tiers.coordinator.is_coordinator:
            log.warning(
                "node %s holds other checkpoints under the names %s than the newer ones of "
                "the same names elsewhere: its copies count as not held",
                s.node,
                sorted(lost),
            )
    plan = plan_recovery(merged, nodes, persistent_newest=None)
    _refuse_occupied(tiers, surveys, winners.get(plan.checkpoint or ""))
    if tiers.coordinator.is_coordinator:
        for skipped, why in plan.skipped.items():
            log.warning("not recovering from %s: %s", skipped, why)
    return _Choice(plan, tuple(seen), winners, conflicted, node_held)


def _refuse_occupied(
    tiers: TierSet, surveys: Sequence[_Survey], chosen: CheckpointCandidate | None
) -> None:
    """Every rank, same inputs: refuse to recover ``chosen`` when a node's local root holds
    another checkpoint of its name that recovery may not use (another job's: its manifest
    names another persistent root, or another run's). Its files would go beside that
    checkpoint's, and the node's manifest would be the other one. Nothing is deleted: both
    checkpoints stay. (A copy of the same checkpoint, e.g. after the job's directories were
    moved, is no obstacle.)"""
    if chosen is None:
        return
    name = chosen.name
    nodes = [s.node for s in surveys for c in s.occupied if c.name == name and not _same(c, chosen)]
    if nodes:
        raise ConfigError(
            f"cannot recover {name}: the node-local root {tiers.local.display()} on node(s) "
            f"{', '.join(map(repr, nodes))} holds another checkpoint named {name} (another "
            f"job's or run's, not of {tiers.persistent.storage.display()}). Give each job its "
            "own local_dirpath, or move that folder out of the local root"
        )


def _same(a: CheckpointCandidate, b: CheckpointCandidate) -> bool:
    return tuple(a.order) == tuple(b.order) and dict(a.files) == dict(b.files)


def _manifest_text(tiers: TierSet, choice: _Choice, name: str) -> str:
    """The chosen checkpoint's manifest, from a node (or the persistent root) holding that
    checkpoint under its name, not another one."""
    winner = choice.winners[name]

    def mine() -> list[str]:
        rank, texts = tiers.coordinator.rank, []
        lost = choice.conflicted.get(tiers.node, frozenset())
        if tiers.layout.is_lead(rank) and name not in lost:
            with contextlib.suppress(Exception):
                texts.append(tiers.local.read_bytes(f"{name}/{MANIFEST_FILE}").decode())
        if rank == 0:
            with contextlib.suppress(Exception):
                p = tiers.persistent.storage
                texts.append(p.read_bytes(f"{name}/{MANIFEST_FILE}").decode())
        return texts

    gathered = tiers.coordinator.all_gather(Phase.LOAD_SELECT, mine, error=CheckpointLoadError)
    for text in (t for texts in gathered for t in texts):
        try:
            m = Manifest.from_json(text, name)
        except Exception:
            continue
        files = {f"{name}/{f.path}": f.size for f in m.files}
        if (m.sequence, m.created_unix) == tuple(winner.order[1:3]) and files == winner.files:
            return text
    raise _error(tiers, name, "no tier holds its manifest any more (it vanished during recovery)")


def _my_fetches(tiers: TierSet, plan: RecoveryPlan) -> list[Any]:
    return [f for f in plan.fetches if f.dst_rank == tiers.coordinator.rank]


def _drop_corrupt(
    tiers: TierSet,
    manifest: Manifest,
    plan: RecoveryPlan,
    held: Mapping[str, Mapping[str, int]],
    files: Collection[str] | None = None,
) -> bool:
    """Each lead hashes its node's copies of the chosen checkpoint (``held``: name -> files,
    among ``files``: those its ranks read; ``None``: all); corrupt ones are deleted. ``True``
    (everywhere) when some node had one."""
    rank, name = tiers.coordinator.rank, manifest.name

    def check() -> list[str]:
        if not tiers.layout.is_lead(rank):
            return []
        # a copy this node sends to another is hashed by the sending itself (a corrupt one
        # fails the transfer at the source): hashing it here too would read it twice
        sent = {f.file for f in plan.fetches if f.src_rank == rank}
        bad = []
        for record in manifest.files:
            rel = f"{name}/{record.path}"
            if rel not in held.get(name, {}) or rel in sent:
                continue
            if files is not None and rel not in files:
                continue  # not read here: checked where it is read (or sent)
            got = tiers.local.hash_file(rel, manifest.checksum_algorithm)
            if got.checksum != record.checksum:
                log.warning(
                    "the node-local copy %s is corrupt (checksum %s, the manifest says %s): "
                    "deleting it; it is fetched from another tier",
                    tiers.local.display(rel),
                    got.checksum,
                    record.checksum,
                )
                tiers.local.delete(rel)
                bad.append(rel)
        return bad

    found = tiers.coordinator.all_gather(Phase.LOAD_VERIFY, check, error=CheckpointLoadError)
    return any(found)


def _routes(plan: RecoveryPlan) -> tuple[list[Fetch], list[Fetch]]:
    """The downloads and the node-to-node copies of ``plan``, same on every rank. A file no
    node holds is downloaded from the persistent tier by ONE of the nodes that need it (the
    one with the fewest bytes to download so far, largest files first), which then passes it
    on: every node downloads a share, not the whole checkpoint (N nodes, N copies of egress)."""
    remote: dict[str, list[Fetch]] = {}
    relays = [f for f in plan.fetches if f.src_rank is not None]
    for f in plan.fetches:
        if f.src_rank is None:
            remote.setdefault(f.file, []).append(f)
    assigned: dict[int, int] = {}
    downloads: list[Fetch] = []
    for file in sorted(remote, key=lambda p: (-remote[p][0].size, p)):
        size = remote[file][0].size
        dsts = sorted(f.dst_rank for f in remote[file])
        who = min(dsts, key=lambda r: (assigned.get(r, 0), r))
        assigned[who] = assigned.get(who, 0) + size
        downloads.append(Fetch(file, size, who, None))
        relays += [Fetch(file, size, d, who) for d in dsts if d != who]
    return downloads, relays


def _fetch(tiers: TierSet, manifest: Manifest, plan: RecoveryPlan) -> set[str] | None:
    """Make every node's copy complete: downloads first (each rank its share), then the
    node-to-node copies (the relays of the downloads among them). ``None`` when done, else
    what to exclude from the next attempt: the checkpoint when its persistent copy is corrupt
    (quarantined there), nothing when a corrupt local source was deleted (fewer copies)."""
    coord, rank = tiers.coordinator, tiers.coordinator.rank
    records = {f"{manifest.name}/{f.path}": f for f in manifest.files}
    alg = manifest.checksum_algorithm
    for f in _my_fetches(tiers, plan):  # a wrong-size copy is not held: make room
        tiers.local.delete(f.file)
    downloads, relays = _routes(plan)
    transfers = [
        Transfer(f.src_rank, f.dst_rank, f.file, f.size, records[f.file].checksum, alg)
        for f in relays
        if f.src_rank is not None
    ]

    def fetch() -> dict[str, Any]:
        outcome: dict[str, Any] = {"retry": False, "persistent_corrupt": None}
        for f in downloads:
            if f.dst_rank == rank:
                try:
                    _download(tiers.persistent.storage, tiers.local, f.file, records[f.file], alg)
                except IntegrityError as exc:
                    outcome["persistent_corrupt"] = [f.file, exc.reason]
        if transfers and tiers.group is not None:
            try:
                execute_transfers(
                    transfers,
                    rank=rank,
                    group=tiers.group,
                    storage=tiers.local,
                    timeout=tiers.timeout,
                )
            except TransferError as exc:
                for failure in exc.failures:
                    if failure.kind in ("communication", "write"):
                        raise
                    t = failure.transfer  # "source" / "integrity": plan again
                    if failure.kind == "integrity" and t.src == rank:
                        tiers.local.delete(t.path)  # our copy is the corrupt one
                    outcome["retry"] = True
        return outcome

    outcomes = coord.all_gather(Phase.LOAD, fetch, error=CheckpointLoadError)
    corrupt = [o["persistent_corrupt"] for o in outcomes if o["persistent_corrupt"]]
    if corrupt and rank == 0:
        file, reason = corrupt[0]
        try:
            tiers.persistent.catalog.quarantine(manifest.name, file, reason)
        except Exception as exc:
            log.warning("could not quarantine %s: %r", manifest.name, exc)
    if corrupt:
        return {manifest.name}
    if any(o["retry"] for o in outcomes):
        return set()  # a corrupt source was deleted: the next attempt sees fewer copies
    return None


def _load(
    tiers: TierSet,
    state: dict[str, Any] | None,
    name: str,
    text: str,
    strict: bool,
    trusted: bool,
    per_rank_rules: Sequence[PerRankRule],
    targets: Targets | None,
) -> tuple[CheckpointInfo, LoadResult]:
    """Each other lead writes the manifest beside the files; every rank loads its node's copy."""
    coord = tiers.coordinator

    def commit() -> None:
        if tiers.layout.is_lead(coord.rank) and not tiers.local.exists(f"{name}/{MANIFEST_FILE}"):
            tiers.local.write_bytes(f"{name}/{MANIFEST_FILE}", text.encode(), exclusive=True)

    coord.all_gather(Phase.LOAD, commit, error=CheckpointLoadError)
    tiers.target.catalog.forget(name)
    info = tiers.target.catalog.info(name)
    if info.status != VALID:
        raise _error(tiers, info.location, f"the node-local copy is {info.status.value}")
    result = load_checkpoint(
        tiers.local,
        coord,
        info,
        state,
        strict=strict,
        trusted=trusted,
        per_rank_rules=per_rank_rules,
        targets=targets,
    )
    return info, result


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
    routes = [_routes(p) for p in plans]
    manifest = info.manifest
    total = manifest.total_bytes if manifest is not None else 0
    if needed is not None and manifest is not None:
        total = sum(f.size for f in manifest.files if f"{info.name}/{f.path}" in needed)
    by_source = {"local": 0, "peer": 0, "persistent": 0}
    for f in (f for downloads, relays in routes for f in [*downloads, *relays]):
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


def _download(src: Storage, dst: Storage, rel: str, record: FileRecord, alg: str) -> None:
    size, checksum = record.size, record.checksum

    def chunks() -> Iterator[bytes]:
        for start in range(0, size, _CHUNK):
            yield src.read_bytes(rel, start, min(_CHUNK, size - start))

    written = dst.write_stream(rel, chunks, checksum=alg, size=size)
    if written.size != size or written.checksum != checksum:
        dst.delete(rel)
        raise IntegrityError(
            rel.split("/", 1)[0],
            rel,
            f"the persistent copy has checksum {written.checksum}, the manifest says {checksum}",
        )
