"""Job epochs: every job that writes a multi-tier run draws a number above every earlier job's
on the same persistent root, and its commit sequences start at ``epoch << 32``.

Why: a node that was away while the job rolled back (or restarted elsewhere) comes back with
local copies whose commit sequences may be above the new branch's, since the new job could not
see them when it chose its first sequence. With an epoch in the high bits, every commit of a
later job is newer than every commit of an earlier one, whatever any node holds: "newest" stays
the last committed, across jobs, nodes and tiers.

Which rank calls what: rank 0 alone, once per engine, before its first save
(:meth:`~lightning_elastic.core.tiers.runtime.TierSet.decide`). The epoch is an empty object
``.epochs/<n>`` created exclusively (an ``If-None-Match`` put on object stores): two jobs
starting at the same moment get different numbers. A hidden folder: no listing of
checkpoints, and no retention, ever sees it.
"""

from __future__ import annotations

from lightning_elastic.core.storage.base import Storage
from lightning_elastic.errors import CheckpointExistsError, StorageError

__all__ = ["EPOCHS_DIR", "EPOCH_SHIFT", "claim_epoch"]

EPOCHS_DIR = ".epochs"
EPOCH_SHIFT = 32  # 4 billion commits per job; 2 million jobs below MAX_SEQUENCE (2**53)
_TRIES = 64


def claim_epoch(storage: Storage) -> int:
    """A new epoch of ``storage`` (the persistent root), above every one claimed before."""
    taken = [int(e.name) for e in storage.listdir(EPOCHS_DIR) if e.name.isdigit()]
    epoch = max(taken, default=0) + 1
    for _ in range(_TRIES):
        try:
            storage.write_bytes(f"{EPOCHS_DIR}/{epoch:012d}", b"", exclusive=True)
            return epoch
        except CheckpointExistsError:
            epoch += 1  # another job took it at the same moment
    raise StorageError("claim", storage.display(EPOCHS_DIR), f"no free epoch in {_TRIES} tries")
