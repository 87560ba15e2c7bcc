"""Tiers: every save commits on the node-local tier, is replicated to peer nodes and persisted
to the root every k-th save; a load recovers from the fastest tier holding the newest
checkpoint (docs/tiers.md).

Which rank calls what: as :mod:`~lightning_elastic.core.placement.base` says. The save side is
:class:`~lightning_elastic.core.tiers.runtime.TierSet` (local commit, replicas, the persist
lane and its thread); the load side is :mod:`~lightning_elastic.core.tiers.restore` (survey,
plan, gather), driven by the load walk. This module only maps the one onto the other.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Collection, Mapping
from types import MappingProxyType
from typing import Any

from lightning_elastic.core.dist.coordinator import Coordinator
from lightning_elastic.core.dist.lease import take_lease
from lightning_elastic.core.format.catalog import Catalog, CheckpointInfo
from lightning_elastic.core.load.walk import Filters, LoadRequest, Retry, Selected
from lightning_elastic.core.options import (
    DEFAULT_LOCAL_KEEP,
    DEFAULT_PERSIST_EVERY_N_SAVES,
    DEFAULT_REPLICAS,
)
from lightning_elastic.core.placement.base import lease_target, save_target
from lightning_elastic.core.policy.retention import KeepLastN
from lightning_elastic.core.save.request import PlannedSave, RunState, SaveConfig, SaveResult
from lightning_elastic.core.save.stage import Payload
from lightning_elastic.core.storage.base import Storage
from lightning_elastic.core.tiers import restore
from lightning_elastic.core.tiers.runtime import TIER_ROOT_KEY, TierSet
from lightning_elastic.errors import CheckpointNotFoundError

__all__ = ["Tiered"]


class Tiered:
    """The :class:`~lightning_elastic.core.placement.base.Placement` of an engine with a
    node-local root. ``root``: the persistent root (``config.retention`` applies there);
    saves commit in ``local_root``, keeping ``local_keep`` checkpoints (default
    :data:`~lightning_elastic.core.options.DEFAULT_LOCAL_KEEP`)."""

    multi_tier = True

    def __init__(
        self,
        root: Storage,
        coordinator: Coordinator,
        config: SaveConfig,
        run: RunState,
        *,
        local_root: str | os.PathLike[str],
        persist_every_n_saves: int | None = None,
        replicas: int | None = None,
        local_keep: int | None = None,
        node: str | None = None,
    ) -> None:
        local = Storage(local_root)
        local_config = dataclasses.replace(
            config,
            retention=(KeepLastN(DEFAULT_LOCAL_KEEP if local_keep is None else local_keep),),
            small_replicated_to_lowest=True,
        )
        self.target = save_target(local, Catalog(local), coordinator, local_config)
        self.tiers = TierSet(
            self.target,
            run,
            persistent=root,
            persist_every_n_saves=(
                DEFAULT_PERSIST_EVERY_N_SAVES
                if persist_every_n_saves is None
                else persist_every_n_saves
            ),
            replicas=DEFAULT_REPLICAS if replicas is None else replicas,
            retention=config.retention,
            node=node,
        )
        self.roots: tuple[Storage, ...] = (root, local)
        self.save_metadata: Mapping[str, Any] = MappingProxyType({TIER_ROOT_KEY: root.display()})
        self.last_recovery: restore.Recovery | None = None
        self._run = run

    # ------------------------------------------------------------------ saving

    def decide(self, force: bool) -> bool:
        """Persist every k-th save, or this one when forced (a persist still running defers
        it); see :meth:`TierSet.decide`."""
        return self.tiers.decide(force)

    def finish(
        self,
        planned: PlannedSave,
        payload: Payload,
        blocked_s: float,
        staging_s: float,
        persist: bool,
    ) -> SaveResult:
        """Local commit, replicas, then the persist handed to the persister thread."""
        return self.tiers.finish(planned, payload, blocked_s, staging_s, persist)

    def take_over(self, *, renew: bool = False) -> None:
        """Rank 0: the run's lease in the node-local root and in the persistent one."""
        lease_target(self.target, self._run, renew=renew)
        if renew or (persistent := self.tiers.persistent).lease is None:
            persistent = self.tiers.persistent
            persistent.lease = take_lease(persistent.storage, self._run.run_id)

    def persist_latest(self) -> bool:
        """Persist the newest local save unless it is, and wait for it."""
        return self.tiers.persist_latest()

    def wait(self) -> None:
        """Wait for the persist in flight; raise the newest persist's failure (once)."""
        self.tiers.wait()

    def close(self) -> None:
        """The persister thread, the tier group, the node's spare files."""
        self.tiers.close()

    # ------------------------------------------------------------------ loading

    def newest(self, filters: Filters, verify: str) -> CheckpointInfo | None:
        """The checkpoint a recovery would load, from any tier (verified when loaded)."""
        return restore.choose(self.tiers, filters)

    def select(self, request: LoadRequest, excluded: Collection[str]) -> Selected | Retry | None:
        """Survey, plan and gather the newest checkpoint into every node's local root."""
        return restore.attempt(self.tiers, request, excluded)

    def drop(self, info: CheckpointInfo, file: str, reason: str) -> None:
        """Every node's copy of ``file`` goes (a cache; other tiers hold it)."""
        restore.drop(self.tiers, info, file)

    def not_found(self, filters: Filters) -> CheckpointNotFoundError:
        """Nothing recoverable on any tier."""
        return restore.not_found(self.tiers, filters)

    def loaded(self, selected: Selected, seconds: float) -> None:
        """Keep the recovery record (:attr:`last_recovery`); the save side learns where the
        run resumed."""
        self.last_recovery = restore.finished(self.tiers, selected, seconds)
