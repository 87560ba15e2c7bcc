"""Multi-tier checkpoints (docs/tiers.md): a node-local tier with its own commit, replicas of
each rank's shard on other nodes, a persistent tier written every k-th save, and recovery that
reads each file from the fastest tier holding it (local, then a peer, then persistent storage).

* :mod:`~lightning_elastic.core.tiers.layout` - which ranks run on which node; the replica ring;
* :mod:`~lightning_elastic.core.tiers.runtime` - the save side (:class:`TierSet`): local commit,
  replicas, the persist lane;
* :mod:`~lightning_elastic.core.tiers.persist` - persisting a local checkpoint (same commit
  protocol as any save);
* :mod:`~lightning_elastic.core.tiers.restore` - recovery at start (:func:`recover`);
* :mod:`~lightning_elastic.core.tiers.transfer` - moving files between ranks (gloo p2p);
* :mod:`~lightning_elastic.core.tiers.inventory` - what a node-local root holds;
* :mod:`~lightning_elastic.core.tiers.recovery` - the pure recovery plan.
"""

from lightning_elastic.core.tiers.inventory import (
    NodeScan,
    candidate_conflicts,
    holdings,
    merge_candidates,
    scan_node,
)
from lightning_elastic.core.tiers.layout import NodeLayout, node_name
from lightning_elastic.core.tiers.restore import Recovery
from lightning_elastic.core.tiers.transfer import (
    Transfer,
    TransferError,
    TransferFailure,
    TransferIntegrityError,
    TransferStats,
    execute_transfers,
)

__all__ = [
    "NodeLayout",
    "NodeScan",
    "Recovery",
    "Transfer",
    "TransferError",
    "TransferFailure",
    "TransferIntegrityError",
    "TransferStats",
    "candidate_conflicts",
    "execute_transfers",
    "holdings",
    "merge_candidates",
    "node_name",
    "scan_node",
]
