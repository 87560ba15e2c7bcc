"""Which ranks run on which node, and where each node's replicas go.

Which rank calls what: every rank calls :meth:`NodeLayout.gather` together (one all-gather of
the node ids on the checkpoint group, at engine construction); the result is the same on every
rank. Then :func:`check_node_local` (two all-gathers: every node's lead writes a probe file
into its local root, every rank looks for its own node's and the others'). The rest is pure.

**Node ids** come from ``$LIGHTNING_ELASTIC_NODE`` when set (several "nodes" on one machine in
tests, or a scheduler's node id), else the host name. Nodes are ordered by their lowest rank,
so the order (and the replica ring built on it) is the same on every rank.

**Replica ring.** Node ``i`` (in that order) replicates its ranks' shards to nodes
``i+1 .. i+replicas`` (mod the node count), i.e. to ``replicas`` *other* nodes: a node that is
lost leaves every one of its shards on ``replicas`` surviving nodes. ``replicas`` is capped at
``nodes - 1`` (one node has nowhere to replicate to).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import socket
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

from lightning_elastic.core.dist.coordinator import Coordinator
from lightning_elastic.core.options import check_node_id
from lightning_elastic.core.storage.base import Storage
from lightning_elastic.errors import ConfigError, DistributedFailure, Phase, StorageError

__all__ = ["NODE_ENV", "NodeLayout", "check_apart", "check_node_local", "node_name"]

NODE_ENV = "LIGHTNING_ELASTIC_NODE"


def node_name() -> str:
    """This process's node: ``$LIGHTNING_ELASTIC_NODE`` when set, else the host name."""
    return os.environ.get(NODE_ENV) or socket.gethostname()


@dataclass(frozen=True)
class NodeLayout:
    """The nodes of the job, each with its ranks, ordered by lowest rank.

    Args:
        nodes: ``(node id, ranks)`` pairs; ranks are checkpoint-group ranks.
    """

    nodes: tuple[tuple[str, tuple[int, ...]], ...]

    def __post_init__(self) -> None:
        seen: set[int] = set()
        for node, ranks in self.nodes:
            if not ranks or seen & set(ranks):
                raise ConfigError(f"invalid node layout: node {node!r} has ranks {ranks}")
            seen |= set(ranks)

    @classmethod
    def of(cls, node_of_rank: Sequence[str]) -> NodeLayout:
        """The layout where rank ``r`` runs on ``node_of_rank[r]``."""
        by_node: dict[str, list[int]] = {}
        for rank, node in enumerate(node_of_rank):
            if not isinstance(node, str) or not node:
                raise ConfigError(f"rank {rank} reported an invalid node id {node!r}")
            by_node.setdefault(node, []).append(rank)
        pairs = sorted(((n, tuple(r)) for n, r in by_node.items()), key=lambda p: p[1][0])
        return cls(tuple(pairs))

    @classmethod
    def gather(cls, coord: Coordinator, node: str) -> NodeLayout:
        """Every rank, together: the layout of the job, from each rank's node id."""
        ids = coord.all_gather(Phase.INIT, lambda: node)  # then checked alike on every rank
        for rank, rank_node in enumerate(ids):
            check_node_id(rank_node, f"the node id of rank {rank} (node= or ${NODE_ENV})")
        return cls.of(ids)

    @property
    def names(self) -> tuple[str, ...]:
        """The node ids, in ring order."""
        return tuple(n for n, _ in self.nodes)

    def ranks_of(self, node: str) -> tuple[int, ...]:
        """The ranks running on ``node``."""
        for name, ranks in self.nodes:
            if name == node:
                return ranks
        raise KeyError(node)

    def node_of(self, rank: int) -> str:
        """The node ``rank`` runs on."""
        for name, ranks in self.nodes:
            if rank in ranks:
                return name
        raise KeyError(rank)

    def lead(self, node: str) -> int:
        """The rank that writes the node's manifest and receives its replicas: its lowest."""
        return self.ranks_of(node)[0]

    def is_lead(self, rank: int) -> bool:
        """Whether ``rank`` is its node's lead."""
        return self.lead(self.node_of(rank)) == rank

    def replica_nodes(self, node: str, replicas: int) -> tuple[str, ...]:
        """The nodes holding replicas of ``node``'s shards (the module's ring)."""
        names = self.names
        i = names.index(node)
        count = min(max(replicas, 0), len(names) - 1)
        return tuple(names[(i + k) % len(names)] for k in range(1, count + 1))


def check_apart(local: Storage, persistent: Storage) -> None:
    """The node-local root is neither the persistent root (however spelled) nor inside it,
    nor holds it (``ConfigError``)."""
    if _overlap(local, persistent):
        raise ConfigError(
            f"the node-local root {local.display()} and the persistent root "
            f"{persistent.display()} are the same directory or one holds the other: give "
            "local_dirpath a node-local directory of its own (/dev/shm/..., a local disk)"
        )


def _overlap(a: Storage, b: Storage) -> bool:
    """Whether two roots are one directory (however spelled) or one lies inside the other."""
    if a.is_local != b.is_local or (
        not a.is_local and a.url.split("://")[0] != b.url.split("://")[0]
    ):
        return False
    pa, pb = (os.path.realpath(s.root) if s.is_local else s.root.rstrip("/") for s in (a, b))
    return pa == pb or pa.startswith(pb.rstrip("/") + "/") or pb.startswith(pa.rstrip("/") + "/")


def check_node_local(coord: Coordinator, layout: NodeLayout, node: str, local: Storage) -> None:
    """Every rank, together (engine construction): every rank of a node must see the node's
    local root, or its shards would pile up where no manifest and no retention ever reach (two
    hosts with one node id: a copied ``$LIGHTNING_ELASTIC_NODE``, identical host names); and
    no rank may see another node's, or replicas would land in the directory they protect."""
    lead = layout.lead(node)
    tag = hashlib.sha1(node.encode()).hexdigest()[:12]  # any id makes a file name
    probe = f".tier-probe-{tag}-{uuid.uuid4().hex[:12]}"

    def write() -> str | None:
        if coord.rank != lead:
            return None
        try:
            local.write_bytes(probe, b"", durable=False)
        except StorageError as exc:
            raise ConfigError(
                f"the node-local root (local_dirpath) {local.display()} of node "
                f"{node!r} cannot be written: {exc}. Give a directory every rank of "
                "the node can create and write (/dev/shm/..., a local disk)"
            ) from exc
        return probe

    probes = coord.all_gather(Phase.INIT, write, error=DistributedFailure)
    mine = probes[lead]
    assert mine is not None
    others = [p for r, p in enumerate(probes) if p is not None and r != lead]

    def look() -> tuple[bool, bool]:
        return local.exists(mine), any(local.exists(p) for p in others)

    seen = coord.all_gather(Phase.INIT, look, error=DistributedFailure)
    if coord.rank == lead:
        with contextlib.suppress(Exception):
            local.delete(mine)
    blind = [r for r, (ok, _) in enumerate(seen) if not ok]
    if blind:
        raise ConfigError(
            f"rank(s) {blind} report the node id of other ranks but do not see their "
            f"node-local root ({local.display()}): give every host its own node id "
            f"(${NODE_ENV} or distinct host names)"
        )
    shared = [r for r, (_, other) in enumerate(seen) if other]
    if shared:
        raise ConfigError(
            f"rank(s) {shared} see the local root of another node in {local.display()}: "
            "local_dirpath must be node-local (/dev/shm, a local disk), not a shared file "
            "system, or replicas would land in the directory they protect"
        )
