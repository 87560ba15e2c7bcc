"""Two-phase commit of one save, coordinated through the c10d store.

Protocol for save ``S`` (every rank runs it in its background writer, after its own write):

1. every rank ``report(S, report)``: ``ok`` with its file's size/checksum and DCP write
   results, or its failure (phase and message);
2. rank 0 ``collect(S)`` waits for all reports until the deadline; missing ranks are named;
3. rank 0 writes ``dcp_metadata.json`` then ``manifest.json`` (exclusive create), only if
   every report is ``ok``; then ``publish(S, decision)``;
4. ranks != 0 ``await_decision(S)`` until the deadline plus a grace period, so rank 0's
   verdict (which names the guilty rank) normally arrives first;
5. every rank ``ack(S)``; the last one removes the keys.

The store is used instead of gloo collectives because it is safe from a background thread
while the training thread runs its own collectives, and because a wait on a key can name the
rank that never wrote it.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from torch.distributed.distributed_c10d import Store

from lightning_elastic.errors import (
    CheckpointSaveError,
    Phase,
    RankFailure,
    SaveTimeoutError,
    SnapshotChangedError,
    StaleWriterError,
)

__all__ = ["POSTED", "CommitChannel", "CommitDecision"]

#: what rank 0 may post beside its decision (multi-tier saves: the manifest every node
#: writes, and whether a persist goes ahead)
POSTED = ("manifest", "go")


@dataclass(frozen=True)
class CommitDecision:
    """Rank 0's verdict on one save."""

    committed: bool
    failures: tuple[RankFailure, ...] = ()
    missing: tuple[int, ...] = ()
    timeout_s: float = 0.0

    def to_json(self) -> str:
        """The decision as the JSON text published through the store."""
        return json.dumps(
            {
                "committed": self.committed,
                "failures": [f.to_json() for f in self.failures],
                "missing": list(self.missing),
                "timeout_s": self.timeout_s,
            }
        )

    @classmethod
    def from_json(cls, raw: str | bytes) -> CommitDecision:
        """The decision :meth:`to_json` wrote."""
        data = json.loads(raw)
        return cls(
            committed=bool(data["committed"]),
            failures=tuple(RankFailure.from_json(f) for f in data["failures"]),
            missing=tuple(int(r) for r in data["missing"]),
            timeout_s=float(data["timeout_s"]),
        )

    def error(self, checkpoint: str) -> CheckpointSaveError:
        """The error every rank raises for a refused save."""
        if any(f.error_type == StaleWriterError.__name__ for f in self.failures):
            return StaleWriterError(checkpoint, self.failures)
        changed = SnapshotChangedError.__name__
        if self.failures and not self.missing and all(
            f.error_type == changed for f in self.failures
        ):
            return SnapshotChangedError(checkpoint, self.failures)
        if self.missing:
            return SaveTimeoutError(
                checkpoint, Phase.COMMIT, self.missing, self.timeout_s, self.failures
            )
        return CheckpointSaveError(checkpoint, self.failures)


class CommitChannel:
    """Reports and decisions of saves, exchanged through ``store`` under ``namespace``."""

    def __init__(
        self,
        store: Store,
        *,
        rank: int,
        world_size: int,
        namespace: str,
        timeout_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        # A client of its own: a store client serializes its operations, and this channel
        # waits from the background writer while the training thread uses the store too.
        self.store = store.clone()  # type: ignore[attr-defined]
        self.rank = rank
        self.world_size = world_size
        self.namespace = namespace
        self.timeout_s = timeout_s  # only for messages; deadlines are passed per call
        self.clock = clock

    def _key(self, save_id: str, *parts: object) -> str:
        return "/".join([self.namespace, "save", save_id, *(str(p) for p in parts)])

    def report(self, save_id: str, report: Mapping[str, Any]) -> None:
        """Post this rank's report for ``save_id`` (JSON-serializable) for rank 0 to collect."""
        self.store.set(self._key(save_id, "report", self.rank), json.dumps(report))

    def collect(self, save_id: str, deadline: float, checkpoint: str) -> dict[int, dict[str, Any]]:
        """Rank 0: every rank's report, or :class:`SaveTimeoutError` naming the missing."""
        keys = [self._key(save_id, "report", r) for r in range(self.world_size)]
        self._wait(keys, deadline, save_id, checkpoint)
        raw = self.store.multi_get(keys)
        return {r: json.loads(value) for r, value in enumerate(raw)}

    def _wait(self, keys: list[str], deadline: float, save_id: str, checkpoint: str) -> None:
        """Block until every key exists (the store wakes us up) or the deadline passes; then
        name the ranks whose report is missing."""
        remaining = deadline - self.clock()
        if remaining > 0:
            try:
                self.store.wait(keys, timedelta(seconds=remaining))
                return
            except Exception:  # the store's timeout (or a dead store): report who is missing
                pass
        if self.store.check(keys):
            return
        missing = self.missing_reports(save_id) or [0]
        raise SaveTimeoutError(checkpoint, Phase.COMMIT, missing, self.timeout_s)

    def missing_reports(self, save_id: str) -> list[int]:
        """The ranks whose report for ``save_id`` is not in the store yet (no waiting)."""
        return [
            r
            for r in range(self.world_size)
            if not self.store.check([self._key(save_id, "report", r)])
        ]

    def publish(self, save_id: str, decision: CommitDecision) -> None:
        """Rank 0: post the decision on ``save_id`` for the other ranks to await."""
        self.store.set(self._key(save_id, "decision"), decision.to_json())

    def await_decision(self, save_id: str, deadline: float, checkpoint: str) -> CommitDecision:
        """Ranks != 0: rank 0's decision, or a timeout naming the ranks that never reported
        (rank 0 included when it is the one that went silent)."""
        key = self._key(save_id, "decision")
        self._wait([key], deadline, save_id, checkpoint)
        return CommitDecision.from_json(self.store.get(key))

    def post(self, save_id: str, part: str, text: str) -> None:
        """Rank 0: post ``text`` as ``part`` of ``save_id`` (one of :data:`POSTED`) for the
        other ranks to :meth:`fetch`."""
        if part not in POSTED:
            raise ValueError(f"unknown part {part!r}")
        self.store.set(self._key(save_id, part), text)

    def fetch(self, save_id: str, part: str, deadline: float, checkpoint: str) -> str:
        """Ranks != 0: what rank 0 posted as ``part``, or a timeout naming the silent ranks."""
        key = self._key(save_id, part)
        self._wait([key], deadline, save_id, checkpoint)
        raw = self.store.get(key)
        return raw.decode() if isinstance(raw, bytes) else str(raw)

    def ack(self, save_id: str) -> None:
        """Called by every rank once it is done with ``save_id``; the last one cleans up."""
        done = self.store.add(self._key(save_id, "acks"), 1)
        if done >= self.world_size:
            keys = [self._key(save_id, "report", r) for r in range(self.world_size)]
            keys += [self._key(save_id, name) for name in ("decision", *POSTED, "acks")]
            for key in keys:
                try:
                    self.store.delete_key(key)
                except Exception:  # best effort: a store without deletes just keeps them
                    break
