"""Decisions agreed by all ranks, on a dedicated gloo process group with a timeout.

Protocol: every collective here is called by all ranks of the group, in the same order, from
the thread that drives training (never from the background writer, which talks through the
store; see :mod:`lightning_elastic.core.dist.channel`). Each method runs a local function on
every rank and never lets one rank's exception desynchronize the others: failures travel with
the collective and are raised on every rank together (as DCP does), as the failing rank's own
typed error when there is one kind, or as the caller's ``error`` class naming every rank.

A collective that does not complete because a rank died or never arrived raises the timeout
class of the operation (:class:`~lightning_elastic.errors.SaveTimeoutError`,
:class:`~lightning_elastic.errors.LoadTimeoutError`) naming the ranks that did not arrive,
found through arrival keys in the store. Any other exception inside the collective is reported
as that rank's own failure.
"""

from __future__ import annotations

import contextlib
import logging
import pickle
import uuid
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import Store

from lightning_elastic.core._compat import process_group_store
from lightning_elastic.errors import (
    DistributedFailure,
    ElasticCheckpointError,
    Phase,
    RankFailure,
    timeout_error_for,
)

__all__ = ["Coordinator"]

log = logging.getLogger(__name__)
T = TypeVar("T")
R = TypeVar("R")
_STORE_PREFIX = "lightning_elastic"


class _Failed:
    """A rank's exception in transit (the exception itself when picklable)."""

    def __init__(self, rank: int, phase: Phase, exc: BaseException) -> None:
        self.failure = RankFailure.from_exception(rank, phase, exc)
        try:
            self.blob: bytes | None = pickle.dumps(exc)
        except Exception:
            self.blob = None

    def exception(self) -> BaseException | None:
        if self.blob is None:
            return None
        try:
            exc = pickle.loads(self.blob)
        except Exception:
            return None
        return exc if isinstance(exc, BaseException) else None


def _hash_store() -> Store:
    return dist.HashStore()  # type: ignore[attr-defined]  # public, not re-exported in stubs


class Coordinator:
    """Rank identity plus the few collectives checkpointing needs.

    Build it with :meth:`from_environment` (all ranks, collectively) or
    :meth:`single_process`. ``store`` is a c10d store shared by the group's ranks; it carries
    arrival keys here and the commit reports in :mod:`~lightning_elastic.core.dist.channel`.
    """

    def __init__(
        self,
        *,
        rank: int,
        world_size: int,
        group: dist.ProcessGroup | None,
        store: Store,
        timeout: timedelta,
        namespace: str = "",
    ) -> None:
        self.rank = rank
        self.world_size = world_size
        self.group = group
        self.store = store
        self.timeout = timeout
        self.namespace = namespace or f"{_STORE_PREFIX}/{uuid.uuid4().hex[:12]}"
        self._seq = 0
        self._owns_group = False
        self._coordinator_global = dist.get_global_rank(group, 0) if group is not None else 0

    @classmethod
    def single_process(cls, timeout: timedelta = timedelta(minutes=10)) -> Coordinator:
        """A coordinator for a job of one process: rank 0 of 1, no group, a private in-memory store."""
        return cls(rank=0, world_size=1, group=None, store=_hash_store(), timeout=timeout)

    @classmethod
    def from_environment(
        cls,
        *,
        timeout: timedelta = timedelta(minutes=10),
        process_group: dist.ProcessGroup | None = None,
    ) -> Coordinator:
        """The coordinator for the current job.

        Without ``torch.distributed`` initialized this is a single process. Otherwise all
        ranks must call it together: it creates a dedicated gloo group (checkpoint traffic
        never shares the group training uses) unless ``process_group`` is given.
        """
        if not (dist.is_available() and dist.is_initialized()):
            return cls.single_process(timeout)
        group = process_group or dist.new_group(backend="gloo", timeout=timeout)
        # One namespace per coordinator instance, chosen by rank 0, so restarts and several
        # engines in one job never read each other's keys.
        box: list[Any] = [uuid.uuid4().hex[:12] if dist.get_rank(group) == 0 else None]
        dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
        coordinator = cls(
            rank=dist.get_rank(group),
            world_size=dist.get_world_size(group),
            group=group,
            store=process_group_store(group),
            timeout=timeout,
            namespace=f"{_STORE_PREFIX}/{box[0]}",
        )
        coordinator._owns_group = process_group is None
        return coordinator

    def close(self) -> None:
        """Destroy the gloo group this coordinator created (not one it was given)."""
        if self._owns_group and self.group is not None and dist.is_initialized():
            with contextlib.suppress(Exception):
                dist.destroy_process_group(self.group)
        self.group = None

    @property
    def is_coordinator(self) -> bool:
        """Whether this is rank 0, the rank that decides and commits."""
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        """Whether there are other ranks to talk to (a group and a world size above 1)."""
        return self.group is not None and self.world_size > 1

    def key(self, *parts: object) -> str:
        """A store key in this coordinator's namespace: ``namespace/part/part/...``."""
        return "/".join([self.namespace, *(str(p) for p in parts)])

    # ------------------------------------------------------------------ collectives

    def gather_scatter(
        self,
        phase: Phase,
        local_fn: Callable[[], T],
        global_fn: Callable[[list[T]], Sequence[R]],
        *,
        what: str = "checkpoint",
        error: type[DistributedFailure] = DistributedFailure,
    ) -> R:
        """Run ``local_fn`` everywhere, ``global_fn`` on rank 0 over all results, and hand
        rank ``i`` the ``i``-th element of its output."""
        local = self._run(phase, local_fn)
        if not self.distributed:
            gathered: list[Any] = [local]
        else:
            gathered = [None] * self.world_size if self.is_coordinator else []
            self._collective(
                phase,
                what,
                lambda: dist.gather_object(
                    local,
                    gathered if self.is_coordinator else None,
                    dst=self._coordinator_global,
                    group=self.group,
                ),
                error=error,
            )
        outputs: list[Any] = []
        if self.is_coordinator:
            failed = [g for g in gathered if isinstance(g, _Failed)]
            if failed:
                outputs = [failed] * self.world_size
            else:
                result = self._run(phase, lambda: list(global_fn(gathered)))
                outputs = [[result]] * self.world_size if isinstance(result, _Failed) else result
        mine: list[Any] = [None]
        if not self.distributed:
            mine = [outputs[0]]
        else:
            self._collective(
                phase,
                what,
                lambda: dist.scatter_object_list(
                    mine,
                    outputs if self.is_coordinator else None,
                    src=self._coordinator_global,
                    group=self.group,
                ),
                error=error,
            )
        self._raise_failures(phase, mine[0], what, error)
        return mine[0]  # type: ignore[no-any-return]

    def all_gather(
        self,
        phase: Phase,
        local_fn: Callable[[], T],
        *,
        what: str = "checkpoint",
        error: type[DistributedFailure] = DistributedFailure,
    ) -> list[T]:
        """Run ``local_fn`` everywhere and give every rank the list of all results."""
        local = self._run(phase, local_fn)
        if not self.distributed:
            gathered: list[Any] = [local]
        else:
            gathered = [None] * self.world_size
            self._collective(
                phase,
                what,
                lambda: dist.all_gather_object(gathered, local, group=self.group),
                error=error,
            )
        self._raise_failures(phase, [g for g in gathered if isinstance(g, _Failed)], what, error)
        return gathered

    def broadcast(
        self,
        phase: Phase,
        fn: Callable[[], T],
        *,
        what: str = "checkpoint",
        error: type[DistributedFailure] = DistributedFailure,
    ) -> T:
        """Run ``fn`` on rank 0 only and give its result (or its failure) to every rank."""
        box: list[Any] = [self._run(phase, fn) if self.is_coordinator else None]
        if self.distributed:
            self._collective(
                phase,
                what,
                lambda: dist.broadcast_object_list(
                    box, src=self._coordinator_global, group=self.group
                ),
                error=error,
            )
        self._raise_failures(phase, box[0], what, error)
        return box[0]  # type: ignore[no-any-return]

    def all(
        self,
        flag: bool,
        phase: Phase = Phase.AGREE,
        *,
        error: type[DistributedFailure] = DistributedFailure,
    ) -> bool:
        """True on every rank when ``flag`` is true on all ranks."""
        return not self.max_ints([0 if flag else 1], phase, error=error)[0]

    def max_ints(
        self,
        values: Sequence[int],
        phase: Phase = Phase.AGREE,
        *,
        track: bool = True,
        error: type[DistributedFailure] = DistributedFailure,
    ) -> list[int]:
        """Element-wise maximum over ranks of small non-negative integers: one tiny
        all-reduce that can carry several decisions (flags, rank 0's choices) at once.
        ``track=False`` skips the arrival bookkeeping (for per-step use)."""
        if not self.distributed:
            return list(values)
        tensor = torch.tensor(list(values), dtype=torch.int64)
        self._collective(
            phase,
            "agreement",
            lambda: dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=self.group),
            error=error,
            track=track,
        )
        return [int(v) for v in tensor.tolist()]

    # ------------------------------------------------------------------ internals

    def _run(self, phase: Phase, fn: Callable[[], T]) -> T | _Failed:
        try:
            return fn()
        except Exception as exc:
            log.debug("rank %d failed in %s", self.rank, phase, exc_info=True)
            return _Failed(self.rank, phase, exc)

    def _collective(
        self,
        phase: Phase,
        what: str,
        op: Callable[[], Any],
        *,
        error: type[DistributedFailure],
        track: bool = True,
    ) -> None:
        if not track:
            try:
                op()
            except Exception as exc:
                raise self._collective_error(phase, what, exc, error, []) from exc
            return
        self._seq += 1
        arrival = self.key("arrive", self._seq, self.rank)
        self.store.set(arrival, "1")
        try:
            op()
        except Exception as exc:
            missing = [
                r
                for r in range(self.world_size)
                if not self.store.check([self.key("arrive", self._seq, r)])
            ]
            raise self._collective_error(phase, what, exc, error, missing) from exc
        if self._seq > 1:
            self.store.delete_key(self.key("arrive", self._seq - 1, self.rank))

    def _collective_error(
        self,
        phase: Phase,
        what: str,
        exc: Exception,
        error: type[DistributedFailure],
        missing: list[int],
    ) -> DistributedFailure:
        """What a failed collective means: an exception that is not a lost peer (an object
        that does not pickle, ...) is this rank's own failure; a timeout or a lost connection
        blames the ranks that never arrived, or, when all arrived, the other ranks."""
        own = RankFailure.from_exception(self.rank, phase, exc)
        if not _lost_peer(exc):  # e.g. an object that does not pickle: ours, whoever is late
            return error(what, [own])
        seconds = self.timeout.total_seconds()
        timeout = timeout_error_for(error)
        if missing:
            return timeout(what, phase, missing, seconds)
        others = [r for r in range(self.world_size) if r != self.rank]
        return timeout(what, phase, others, seconds, failures=[own])

    def _raise_failures(
        self, phase: Phase, value: Any, what: str, error: type[DistributedFailure]
    ) -> None:
        failed: list[_Failed] = []
        if isinstance(value, _Failed):
            failed = [value]
        elif isinstance(value, list) and value and all(isinstance(v, _Failed) for v in value):
            failed = value
        if not failed:
            return
        failed.sort(key=lambda f: f.failure.rank)
        originals = [f.exception() for f in failed]
        kinds = {type(e) for e in originals}
        first = originals[0]
        if (
            len(kinds) == 1
            and isinstance(first, ElasticCheckpointError)
            and not isinstance(first, DistributedFailure)
        ):
            raise first  # one typed cause: re-raise it as is, on every rank
        if len(failed) == 1 and isinstance(first, DistributedFailure):
            raise first
        raise error(what, [f.failure for f in failed])


# Words of gloo/c10d errors that mean the other side stopped answering (torch 2.13 raises
# these as RuntimeError/DistBackendError, without a dedicated type).
_LOST_PEER_WORDS = (
    "timed out",
    "timeout",
    "connection closed",
    "connection reset",
    "broken pipe",
    "connection refused",
)


def _lost_peer(exc: BaseException) -> bool:
    if isinstance(exc, (TimeoutError, ConnectionError)):
        return True
    text = str(exc).lower()
    return any(word in text for word in _LOST_PEER_WORDS)
