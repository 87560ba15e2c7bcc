"""Multi-tier checkpoints (issue #11), built up in steps: a node-local tier with its own
commit, peer replication of each rank's shard to ranks on other nodes, and recovery that reads
each shard from the fastest tier that holds it (local, then a peer, then persistent storage).

Today it holds the building blocks of recovery: moving checkpoint files between ranks
(:mod:`~lightning_elastic.core.tiers.transfer`), scanning a node-local root
(:mod:`~lightning_elastic.core.tiers.inventory`) and planning which tier each file comes from
(:mod:`~lightning_elastic.core.tiers.recovery`).
"""

from lightning_elastic.core.tiers.inventory import (
    NodeScan,
    candidate_conflicts,
    holdings,
    merge_candidates,
    scan_node,
)
from lightning_elastic.core.tiers.transfer import (
    Transfer,
    TransferError,
    TransferFailure,
    TransferIntegrityError,
    TransferStats,
    execute_transfers,
)

__all__ = [
    "NodeScan",
    "Transfer",
    "TransferError",
    "TransferFailure",
    "TransferIntegrityError",
    "TransferStats",
    "candidate_conflicts",
    "execute_transfers",
    "holdings",
    "merge_candidates",
    "scan_node",
]
