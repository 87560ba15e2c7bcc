"""One root: every save commits in it, where it persists, and every load reads it there.

Which rank calls what: as :mod:`~lightning_elastic.core.placement.base` says; nothing runs
in the background beyond the engine's writer, so :meth:`SingleRoot.wait` and
:meth:`SingleRoot.close` have nothing to do.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from lightning_elastic.core.format.catalog import CheckpointInfo
from lightning_elastic.core.load.select import quarantine, select_checkpoint
from lightning_elastic.core.load.walk import Filters, LoadRequest, Retry, Selected
from lightning_elastic.core.placement.base import lease_target
from lightning_elastic.core.save.pipeline import finish_save
from lightning_elastic.core.save.request import PlannedSave, RunState, SaveResult, SaveTarget
from lightning_elastic.core.save.stage import Payload
from lightning_elastic.core.storage.base import Storage
from lightning_elastic.errors import CheckpointNotFoundError

if TYPE_CHECKING:
    from lightning_elastic.core.tiers.restore import Recovery

__all__ = ["SingleRoot"]


class SingleRoot:
    """The :class:`~lightning_elastic.core.placement.base.Placement` of an engine without
    tiers: ``target``'s root is where saves commit and persist and loads read."""

    multi_tier = False
    last_recovery: Recovery | None = None
    save_metadata: Mapping[str, Any] = MappingProxyType({})

    def __init__(self, target: SaveTarget, run: RunState) -> None:
        self.target = target
        self.roots: tuple[Storage, ...] = (target.storage,)
        self._run = run

    # ------------------------------------------------------------------ saving

    def decide(self, force: bool) -> bool:
        """Nothing beyond the commit: the root is the persistent storage."""
        return False

    def finish(
        self,
        planned: PlannedSave,
        payload: Payload,
        blocked_s: float,
        staging_s: float,
        persist: bool,
    ) -> SaveResult:
        """Write, commit, then (rank 0) housekeeping and retention in the root."""
        return finish_save(self.target, self._run, planned, payload, blocked_s, staging_s)

    def take_over(self, *, renew: bool = False) -> None:
        """Rank 0: the run's lease in the root."""
        lease_target(self.target, self._run, renew=renew)

    def persist_latest(self) -> bool:
        """Nothing to do: every committed save is persisted."""
        return False

    def wait(self) -> None:
        """Nothing runs beyond the engine's writer."""

    def close(self) -> None:
        """Nothing to release."""

    # ------------------------------------------------------------------ loading

    def newest(self, filters: Filters, verify: str) -> CheckpointInfo | None:
        """The newest valid checkpoint, verified with ``verify`` (corrupt ones quarantined)."""
        t = self.target
        return select_checkpoint(
            t.storage, t.catalog, t.coordinator, None, verify, run_id=filters.run_id
        )

    def select(self, request: LoadRequest, excluded: Collection[str]) -> Selected | Retry | None:
        """The newest valid checkpoint the filters allow (the named one, or an error), walking
        back past corrupt ones, which are quarantined. With ``verify="full"`` the shard files'
        checksums are left to the load when it can check them (``LoadRequest.fusable``)."""
        t, f = self.target, request.filters
        start, fused = time.monotonic(), request.fusable
        info = select_checkpoint(
            t.storage,
            t.catalog,
            t.coordinator,
            f.checkpoint,
            request.verify,
            run_id=f.run_id,
            skip_named=f.skip_named,
            fused=fused,
            exclude=excluded,
        )
        if info is None:
            return None
        return Selected(info, t.storage, time.monotonic() - start, fused)

    def drop(self, info: CheckpointInfo, file: str, reason: str) -> None:
        """Quarantine ``info`` (rank 0 writes the record; a warning on every rank)."""
        t = self.target
        quarantine(t.catalog, t.coordinator, info, file, reason)

    def not_found(self, filters: Filters) -> CheckpointNotFoundError:
        """Nothing valid (of the run, when named) in the root."""
        only = "" if filters.run_id is None else f" of run {filters.run_id!r}"
        return CheckpointNotFoundError(
            f"no valid checkpoint{only} in {self.target.storage.display()}; start without "
            "resuming or point to a directory holding committed checkpoints"
        )

    def loaded(self, selected: Selected, seconds: float) -> None:
        """Nothing to record beyond the load's result."""
