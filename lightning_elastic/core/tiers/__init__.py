"""Multi-tier checkpoints (docs/tiers.md): a node-local tier with its own commit, replicas of
each rank's shard on other nodes, a persistent tier written every k-th save, and recovery that
reads each file from the fastest tier holding it (local, then a peer, then persistent storage).

* :mod:`~lightning_elastic.core.tiers.layout` - which ranks run on which node; the replica ring;
* :mod:`~lightning_elastic.core.tiers.runtime` - the save side (:class:`TierSet`): local commit,
  replicas, the persist lane;
* :mod:`~lightning_elastic.core.tiers.persist` - persisting a local checkpoint (same commit
  protocol as any save);
* :mod:`~lightning_elastic.core.tiers.restore` - one recovery attempt at start, for the load
  walk (:func:`~lightning_elastic.core.tiers.restore.attempt`);
* :mod:`~lightning_elastic.core.tiers.candidates` - which checkpoint a recovery takes (survey,
  agreement);
* :mod:`~lightning_elastic.core.tiers.gather` - every node's copy made complete (verify, fetch);
* :mod:`~lightning_elastic.core.tiers.transfer` - moving files between ranks (gloo p2p);
* :mod:`~lightning_elastic.core.tiers.inventory` - what a node-local root holds;
* :mod:`~lightning_elastic.core.tiers.survey` - which tiers hold each checkpoint (for tools);
* :mod:`~lightning_elastic.core.tiers.recovery` - the pure recovery plan.

The names below are re-exported lazily (PEP 562), as in the top-level package: the
manifest-only modules (inventory, survey, recovery) serve ``lightning-elastic ls``,
which must not import torch, and the transfer and restore modules do.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# public name -> module that defines it
_EXPORTS = {
    "NodeScan": "lightning_elastic.core.tiers.inventory",
    "candidate_conflicts": "lightning_elastic.core.tiers.inventory",
    "holdings": "lightning_elastic.core.tiers.inventory",
    "merge_candidates": "lightning_elastic.core.tiers.inventory",
    "scan_node": "lightning_elastic.core.tiers.inventory",
    "NodeLayout": "lightning_elastic.core.tiers.layout",
    "node_name": "lightning_elastic.core.tiers.layout",
    "Recovery": "lightning_elastic.core.tiers.restore",
    "Transfer": "lightning_elastic.core.tiers.transfer",
    "TransferError": "lightning_elastic.core.tiers.transfer",
    "TransferFailure": "lightning_elastic.core.tiers.transfer",
    "TransferIntegrityError": "lightning_elastic.core.tiers.transfer",
    "TransferStats": "lightning_elastic.core.tiers.transfer",
    "execute_transfers": "lightning_elastic.core.tiers.transfer",
}

# a literal, not sorted(_EXPORTS): linters read it to see the TYPE_CHECKING imports used
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

if TYPE_CHECKING:  # for type checkers and IDEs; at run time __getattr__ imports on demand
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


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # cache: later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return __all__
