"""Which checkpoint a multi-tier recovery takes: every node's survey of its local root and the
persistent root's newest, one checkpoint per name, the plan every rank agrees on.

Which rank calls what (every rank together, from the training thread, for
:mod:`~lightning_elastic.core.tiers.restore`): each rank runs :func:`survey` inside one
all-gather (a node's lead scans its local root, keeping only checkpoints of this persistent
root and of the filters' run; rank 0 adds the newest few of the persistent root); then every
rank calls :func:`agree` on the same surveys and gets the same :class:`Choice`;
:func:`manifest_text` gathers the chosen manifest from whoever holds it (one all-gather) and
:func:`drop_conflicting` makes a node whose copy of the name is another checkpoint give it up.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass, replace

from lightning_elastic.core.forksafe import fork_safe_logger
from lightning_elastic.core.format.catalog import VALID
from lightning_elastic.core.format.manifest import MANIFEST_FILE, Manifest
from lightning_elastic.core.load.select import RUN_NAMED
from lightning_elastic.core.load.walk import Filters
from lightning_elastic.core.tiers.inventory import NodeScan, adoptable, holdings, scan_node
from lightning_elastic.core.tiers.recovery import CheckpointCandidate, RecoveryPlan, plan_recovery
from lightning_elastic.core.tiers.runtime import TIER_ROOT_KEY, TierSet
from lightning_elastic.errors import CheckpointLoadError, ConfigError, Phase, RankFailure

__all__ = [
    "Choice",
    "Survey",
    "agree",
    "drop_conflicting",
    "manifest_text",
    "recovery_error",
    "survey",
]

log = fork_safe_logger(__name__)
_PERSISTENT_CANDIDATES = 3


@dataclass(frozen=True)
class Survey:
    """One rank's part of the survey (:func:`survey`)."""

    node: str
    scan: NodeScan | None  # leads only
    persistent: tuple[CheckpointCandidate, ...] = ()  # rank 0 only: the newest few, newest first
    occupied: tuple[CheckpointCandidate, ...] = ()  # leads: local ones recovery may not use


def survey(tiers: TierSet, filters: Filters, excluded: frozenset[str]) -> Survey:
    """This rank's part of the survey (inside an all-gather): a node's lead scans its local
    root for the checkpoints recovery may use (and notes those it may not: ``occupied``);
    rank 0 adds the persistent root's newest."""
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
    return Survey(tiers.node, scan, persistent, occupied)


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
class Choice:
    """The agreed plan, and the nodes whose local copy of a name is another checkpoint."""

    plan: RecoveryPlan
    candidates: tuple[CheckpointCandidate, ...]  # every variant seen (for the sequence floor)
    winners: dict[str, CheckpointCandidate]
    conflicted: dict[str, frozenset[str]]  # node -> names its copy of which lost
    held: dict[str, dict[str, dict[str, int]]]  # node -> name -> the files it holds (path: size)


def agree(tiers: TierSet, surveys: Sequence[Survey], excluded: set[str]) -> Choice:
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
    return Choice(plan, tuple(seen), winners, conflicted, node_held)


def _refuse_occupied(
    tiers: TierSet, surveys: Sequence[Survey], chosen: CheckpointCandidate | None
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


def manifest_text(tiers: TierSet, choice: Choice, name: str) -> str:
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
    raise recovery_error(
        tiers, name, "no tier holds its manifest any more (it vanished during recovery)"
    )


def drop_conflicting(tiers: TierSet, choice: Choice, name: str) -> None:
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


def recovery_error(tiers: TierSet, what: str, message: str) -> CheckpointLoadError:
    """The error every rank raises (each with the same message) for a failed recovery."""
    failure = RankFailure(tiers.coordinator.rank, Phase.LOAD, "RecoveryError", message)
    return CheckpointLoadError(what, [failure])
