"""Which ranks run on which node, and where each node's replicas go.

Which rank calls what: every rank calls :meth:`NodeLayout.gather` together (one all-gather of
the node ids on the checkpoint group, at engine construction); the result is the same on every
rank. The rest is pure.

**Node ids** come from ``$LIGHTNING_ELASTIC_NODE`` when set (several "nodes" on one machine in
tests, or a scheduler's node id), else the host name. Nodes are ordered by their lowest rank,
so the order (and the replica ring built on it) is the same on every rank.

**Replica ring.** Node ``i`` (in that order) replicates its ranks' shards to nodes
``i+1 .. i+replicas`` (mod the node count), i.e. to ``replicas`` *other* nodes: a node that is
lost leaves every one of its shards on ``replicas`` surviving nodes. ``replicas`` is capped at
``nodes - 1`` (one node has nowhere to replicate to).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Sequence
from dataclasses import dataclass

from lightning_elastic.core.dist.coordinator import Coordinator
from lightning_elastic.core.options import check_node_id
from lightning_elastic.errors import ConfigError, Phase

__all__ = ["NODE_ENV", "NodeLayout", "node_name"]

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
