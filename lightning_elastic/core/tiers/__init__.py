"""Multi-tier checkpoints (issue #11), built up in steps: a node-local tier with its own
commit, peer replication of each rank's shard to ranks on other nodes, and recovery that reads
each shard from the fastest tier that holds it (local, then a peer, then persistent storage).

Today it holds the building block the others use: moving checkpoint files between ranks
(:mod:`~lightning_elastic.core.tiers.transfer`).
"""

from lightning_elastic.core.tiers.transfer import (
    Transfer,
    TransferError,
    TransferFailure,
    TransferIntegrityError,
    TransferStats,
    execute_transfers,
)

__all__ = [
    "Transfer",
    "TransferError",
    "TransferFailure",
    "TransferIntegrityError",
    "TransferStats",
    "execute_transfers",
]
