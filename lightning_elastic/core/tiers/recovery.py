"""Recovery from the fastest tier: which checkpoint to load, and how each node gets its files.

Pure planning (no torch, no I/O). Who calls what, in which order:

1. Every rank scans its node's local root; the nodes' :class:`NodeHoldings` (one per node,
   files whose size was verified against the manifest) and the candidates are all-gathered.
2. **Every rank** calls :func:`plan_recovery` with the same gathered inputs and gets the same
   :class:`RecoveryPlan` (deterministic: inputs are sorted, no dict or set order leaks out).
3. For each :class:`Fetch`, ``src_rank`` sends the file to ``dst_rank`` (its node's receiving
   rank), or ``dst_rank`` reads it from the persistent tier when ``src_rank`` is ``None``. Then
   every rank loads the chosen checkpoint from its node's local root.

Rules:

1. **Choice.** Candidates are considered newest first by ``order`` (commit order on one scale
   across tiers, as :meth:`CheckpointInfo.sort_key`, never the step; ties by name). A candidate is
   *recoverable from the nodes* when each of its files is present, with the manifest's size, on at
   least one node. The first candidate that is recoverable from the nodes or persisted is chosen,
   i.e. the newer of the newest recoverable-from-nodes candidate and ``persistent_newest`` (which
   is merged into the candidates as persisted; a candidate flagged ``persisted`` counts as well).
   When they are the same checkpoint and the nodes hold all of it, the nodes win (faster). Every
   newer candidate passed over is named in :attr:`RecoveryPlan.skipped` with the reason.
2. **Fetches** (``need="all"``: a load at any world size may read any shard, so every node needs
   every file; :meth:`RecoveryPlan.narrowed` keeps the fetches of the files a node's ranks
   read, once they are known). A file a node lacks is
   fetched by that node's receiving rank (its lowest) from the holding node with the fewest bytes
   assigned as a source so far (ties: node id order), sending from that node's lowest rank. Files
   are assigned largest first so the greedy split stays balanced. A file no node holds (only when
   the chosen checkpoint is persisted) is read from the persistent tier by every node that needs
   it: object stores serve parallel readers at full rate, and a two-hop chain would order fetches.
   When the persisted checkpoint is chosen, files a node holds need no fetch, and files another
   node holds come from that node: **peers are preferred over remote reads** (a node-to-node copy
   is faster than an object-store read and costs no egress).
3. **Tier**: ``"local"`` when no fetch is needed, ``"peer"`` when every fetch has a ``src_rank``,
   ``"persistent"`` when any file comes from remote; ``"none"`` with ``checkpoint=None`` when
   nothing is recoverable (a fresh start).
4. **Nodes**: a node appears in the holdings only if it runs ranks now. A node that left holds
   files nobody can reach, so an entry without ranks is refused rather than used as a source.
5. **Validation**: a copy whose size differs from the manifest's (a truncated file) does not count
   as held. A duplicate node id, a rank on two nodes, a duplicate candidate name, orders that do
   not compare, or ``persistent_newest`` disagreeing with the candidate of the same name raises
   :class:`~lightning_elastic.errors.ConfigError`.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from lightning_elastic.core.options import check_choice
from lightning_elastic.errors import ConfigError

__all__ = [
    "CheckpointCandidate",
    "Fetch",
    "NodeHoldings",
    "RecoveryPlan",
    "plan_recovery",
]

NEEDS = ("all",)
TIERS = ("local", "peer", "persistent", "none")


@dataclass(frozen=True)
class NodeHoldings:
    """What one node running ranks now holds in its local root.

    Args:
        node: The node id (hostname or ``NODE_RANK``).
        ranks: The ranks running on this node in the new world; at least one (rule 4).
        checkpoints: Checkpoint name -> {file path: verified size} of the files present.
    """

    node: str
    ranks: tuple[int, ...]
    checkpoints: Mapping[str, Mapping[str, int]]

    def __post_init__(self) -> None:
        if not self.ranks:
            raise ConfigError(
                f"node {self.node!r} runs no ranks: only nodes running ranks now can serve their "
                "files, so a node that left must not appear in the holdings"
            )
        if any(isinstance(r, bool) or not isinstance(r, int) or r < 0 for r in self.ranks):
            raise ConfigError(f"node {self.node!r}: ranks must be integers >= 0, got {self.ranks}")
        if len(set(self.ranks)) != len(self.ranks):
            raise ConfigError(f"node {self.node!r} lists a rank twice: {self.ranks}")

    def holds(self, checkpoint: str, path: str, size: int) -> bool:
        """Whether this node has ``path`` of ``checkpoint`` with the manifest's ``size``."""
        return self.checkpoints.get(checkpoint, {}).get(path) == size

    @property
    def lead_rank(self) -> int:
        """The rank that receives (and sends) this node's files: its lowest."""
        return min(self.ranks)


@dataclass(frozen=True)
class CheckpointCandidate:
    """A committed checkpoint some tier knows of.

    Args:
        name: The checkpoint's (save-unique) name.
        order: Its place in commit order, comparable across candidates (newest is greatest).
        files: Every file of the checkpoint, path -> size, from its manifest.
        persisted: Whether it is also committed and valid on the persistent tier.
    """

    name: str
    order: tuple[Any, ...]
    files: Mapping[str, int]
    persisted: bool = False


@dataclass(frozen=True)
class Fetch:
    """One node getting one file: ``dst_rank`` receives ``file`` from ``src_rank``, or reads it
    from the persistent tier when ``src_rank`` is ``None``."""

    file: str
    size: int
    dst_rank: int
    src_rank: int | None

    @property
    def source(self) -> str:
        """``"peer"`` or ``"persistent"``."""
        return "persistent" if self.src_rank is None else "peer"


@dataclass(frozen=True)
class RecoveryPlan:
    """The agreed recovery: the checkpoint to load, the slowest tier used, and the copies to make.

    Args:
        checkpoint: The checkpoint to load, or ``None`` for a fresh start.
        tier: ``"local"``, ``"peer"``, ``"persistent"`` or ``"none"`` (module rule 3).
        fetches: The copies to make, ordered by (``dst_rank``, ``file``).
        local_bytes: Bytes the nodes already hold of the chosen checkpoint (summed over nodes).
        skipped: Newer candidates passed over, name -> reason, newest first.
    """

    checkpoint: str | None
    tier: str
    fetches: tuple[Fetch, ...] = ()
    local_bytes: int = 0
    skipped: Mapping[str, str] = field(default_factory=dict)

    def narrowed(self, needs: Mapping[int, Collection[str]]) -> RecoveryPlan:
        """The plan with only the fetches of files their node needs: ``needs`` maps a node's
        receiving rank to the files its ranks read (a node not in it keeps every fetch)."""
        fetches = tuple(
            f for f in self.fetches if f.dst_rank not in needs or f.file in needs[f.dst_rank]
        )
        return replace(self, fetches=fetches, tier=_tier(fetches))

    def bytes_by_source(self) -> dict[str, int]:
        """Bytes each source provides: ``"local"`` (already on the node), ``"peer"`` and
        ``"persistent"``."""
        out = {"local": self.local_bytes, "peer": 0, "persistent": 0}
        for f in self.fetches:
            out[f.source] += f.size
        return out


def plan_recovery(
    candidates: Sequence[CheckpointCandidate],
    holdings: Sequence[NodeHoldings],
    *,
    persistent_newest: CheckpointCandidate | None,
    need: str = "all",
) -> RecoveryPlan:
    """The recovery every rank agrees on (the module docstring states the rules).

    Args:
        candidates: Checkpoints known to any node's local tier (and, optionally, others).
        holdings: One entry per node running ranks now.
        persistent_newest: The newest valid checkpoint on the persistent tier, if any.
        need: Which files each node needs; only ``"all"`` for now.

    Raises:
        ConfigError: on inconsistent inputs (module rule 5) or an unknown ``need``.
    """
    check_choice(need, "need", NEEDS)
    nodes = _checked_nodes(holdings)
    skipped: dict[str, str] = {}
    for cand in _merged(candidates, persistent_newest):
        missing = [p for p in sorted(cand.files) if not _held_anywhere(cand, p, nodes)]
        if not missing or cand.persisted:
            fetches, local = _assign(cand, nodes)
            tier = _tier(fetches)
            return RecoveryPlan(cand.name, tier, fetches, local, skipped)
        skipped[cand.name] = _why_skipped(cand, missing, nodes)
    return RecoveryPlan(None, "none", (), 0, skipped)


def _checked_nodes(holdings: Sequence[NodeHoldings]) -> list[NodeHoldings]:
    """The holdings sorted by node id; duplicate nodes or ranks are refused."""
    nodes = sorted(holdings, key=lambda h: h.node)
    if not nodes:
        raise ConfigError("holdings must name at least one node (the nodes running ranks now)")
    owner: dict[int, str] = {}
    for i, h in enumerate(nodes):
        if i and nodes[i - 1].node == h.node:
            raise ConfigError(f"node {h.node!r} appears twice in the holdings")
        for r in h.ranks:
            if r in owner:
                raise ConfigError(f"rank {r} is listed on two nodes: {owner[r]!r} and {h.node!r}")
            owner[r] = h.node
    return nodes


def _merged(
    candidates: Sequence[CheckpointCandidate], persistent_newest: CheckpointCandidate | None
) -> list[CheckpointCandidate]:
    """The candidates with ``persistent_newest`` folded in as persisted, newest first."""
    by_name: dict[str, CheckpointCandidate] = {}
    for c in candidates:
        if c.name in by_name:
            raise ConfigError(f"checkpoint {c.name!r} is listed twice among the candidates")
        by_name[c.name] = c
    p = persistent_newest
    if p is not None:
        same = by_name.get(p.name)
        if same is not None and (same.order != p.order or dict(same.files) != dict(p.files)):
            raise ConfigError(
                f"checkpoint {p.name!r} differs between the nodes and the persistent tier "
                f"(order {same.order} vs {p.order}, {len(same.files)} vs {len(p.files)} files): "
                "orders must be on one scale and a name names one checkpoint"
            )
        by_name[p.name] = replace(same if same is not None else p, persisted=True)
    try:
        return sorted(by_name.values(), key=lambda c: (c.order, c.name), reverse=True)
    except TypeError as e:  # e.g. a catalog's sort_key beside a bare sequence number
        orders = sorted(f"{c.name}: {c.order!r}" for c in by_name.values())
        raise ConfigError(f"candidate orders are not comparable ({e}): {orders}") from e


def _held_anywhere(cand: CheckpointCandidate, path: str, nodes: Sequence[NodeHoldings]) -> bool:
    return any(n.holds(cand.name, path, cand.files[path]) for n in nodes)


def _why_skipped(
    cand: CheckpointCandidate, missing: Sequence[str], nodes: Sequence[NodeHoldings]
) -> str:
    """The reason a newer candidate is not recovered, naming what is missing."""
    wrong = sorted(
        f"{path!r} on {n.node!r}"
        for path in missing
        for n in nodes
        if path in n.checkpoints.get(cand.name, {})
    )
    reason = (
        f"incomplete on the nodes and not on the persistent tier: {len(missing)} of "
        f"{len(cand.files)} file(s) held by no node with the manifest's size (first: "
        f"{missing[0]!r})"
    )
    if wrong:
        reason += f"; wrong-size copies (truncated?): {', '.join(wrong)}"
    return reason


def _assign(
    cand: CheckpointCandidate, nodes: Sequence[NodeHoldings]
) -> tuple[tuple[Fetch, ...], int]:
    """The fetches each node needs for ``cand`` and the bytes the nodes already hold.

    Files go largest first, each to the holder with the fewest bytes sent so far (greedy longest
    processing time first), so no holder serves much more than its share."""
    sent = {n.node: 0 for n in nodes}
    fetches: list[Fetch] = []
    local = 0
    for path in sorted(cand.files, key=lambda p: (-cand.files[p], p)):
        size = cand.files[path]
        holders = [n for n in nodes if n.holds(cand.name, path, size)]
        holder_ids = [h.node for h in holders]
        for node in nodes:
            if node.node in holder_ids:
                local += size
            elif holders:
                src = min(holders, key=lambda h: (sent[h.node], h.node))
                sent[src.node] += size
                fetches.append(Fetch(path, size, node.lead_rank, src.lead_rank))
            else:
                fetches.append(Fetch(path, size, node.lead_rank, None))
    fetches.sort(key=lambda f: (f.dst_rank, f.file))
    return tuple(fetches), local


def _tier(fetches: Sequence[Fetch]) -> str:
    """Module rule 3: the slowest source any fetch uses."""
    if not fetches:
        return "local"
    return "persistent" if any(f.src_rank is None for f in fetches) else "peer"
