"""The load walk: select -> load -> verify -> quarantine -> the next older, wherever the
checkpoints live.

Which rank calls what, in what order (every rank calls :func:`load_walk` together, from the
training thread, with no save in flight; the engine does):

1. **Select**: the placement (:class:`Candidates`, see :mod:`~lightning_elastic.core.placement`)
   chooses the newest checkpoint the :class:`Filters` allow, verifies it as far as it does
   before a load and makes it readable: one root lists, verifies a share on every rank and
   quarantines corrupt ones as it goes (:mod:`~lightning_elastic.core.load.select`); tiers
   survey every node, agree on a plan and gather the copies
   (:mod:`~lightning_elastic.core.tiers.restore`). Nothing selectable:
   :class:`~lightning_elastic.errors.CheckpointNotFoundError`, worded by the placement.
2. **Load** (:func:`~lightning_elastic.core.load.load.load_checkpoint`) from where the
   placement put it, at this world size; with ``Selected.fused`` the shard checksums are
   computed while reading, and a mismatch is :class:`CorruptWhileLoading` on every rank.
3. **Quarantine and go on**: a checkpoint found corrupt while loading is handed back to the
   placement (:meth:`Candidates.drop`: one root quarantines it) and never tried again in
   this walk; the walk selects the next older one. A named checkpoint is not walked past.
4. **Done**: the placement records what the load did (:meth:`Candidates.loaded`).

The retry rule, one for every placement: every pass either loads, or excludes the checkpoint
it found corrupt (quarantined, or corrupt in its only source) and goes on to the next older,
or - a placement with several copies of a checkpoint - drops a corrupt copy and selects the
same checkpoint again (:class:`Retry` with nothing excluded). The first kind is bounded by the
checkpoints there are; at most :data:`RETRIES` passes in a row may be of the second kind.

"Partly loaded" is decided here, in one place: a load into the caller's state or targets that
found a checkpoint corrupt after reading part of it must overwrite all of that from the one it
loads instead; when it cannot (none is left, the load fails, the older one lacks an entry) the
walk raises :class:`~lightning_elastic.errors.IntegrityError` saying the state is partly the
corrupt checkpoint's.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from lightning_elastic.core.dist.coordinator import Coordinator
from lightning_elastic.core.format.catalog import CheckpointInfo
from lightning_elastic.core.load.load import (
    CorruptWhileLoading,
    LoadResult,
    Targets,
    load_checkpoint,
)
from lightning_elastic.core.load.per_rank import PerRankRule
from lightning_elastic.core.storage.base import Storage
from lightning_elastic.errors import (
    CheckpointLoadError,
    CheckpointNotFoundError,
    IntegrityError,
    Phase,
    RankFailure,
)

__all__ = [
    "RETRIES",
    "Candidates",
    "Filters",
    "LoadRequest",
    "Retry",
    "Selected",
    "load_walk",
]

#: passes in a row that exclude no checkpoint (each dropped a corrupt copy of the chosen one,
#: which lives on in another tier) before the walk gives up
RETRIES = 5


@dataclass(frozen=True)
class Filters:
    """Which checkpoints a load may choose."""

    checkpoint: str | None = None  # only this one
    run_id: str | None = None  # only this run's
    skip_named: bool = False  # not a named run's (an unnamed job never continues one)

    @classmethod
    def of(cls, checkpoint: str | None, run_id: str | None, skip_named: bool) -> Filters:
        """``checkpoint`` only; else the newest of run ``run_id`` (a run named explicitly),
        or, no run named, with ``skip_named`` the newest that is not a named run's."""
        if checkpoint is not None:
            return cls(checkpoint)
        return cls(None, run_id, skip_named and run_id is None)


@dataclass(frozen=True)
class LoadRequest:
    """One load as the caller asked for it (see ``CheckpointEngine.load``)."""

    state: dict[str, Any] | None
    filters: Filters = Filters()
    verify: str = "full"
    strict: bool = True
    trusted: bool = False
    per_rank_rules: Sequence[PerRankRule] = ()
    targets: Targets | None = None

    @property
    def in_place(self) -> bool:
        """Whether the load writes into the caller's tensors (its state, or its targets)."""
        return self.state is not None or self.targets is not None

    @property
    def fusable(self) -> bool:
        """Whether ``verify="full"`` may check the shard files while loading them (one pass
        over the bytes): not with ``trusted`` (objects would be unpickled before their bytes
        are verified), nor into a state loaded non-strictly (entries it lacks are not read)."""
        return self.verify == "full" and not self.trusted and (self.state is None or self.strict)


@dataclass(frozen=True)
class Selected:
    """A checkpoint the placement chose and made readable in ``storage``."""

    info: CheckpointInfo
    storage: Storage
    verify_s: float = 0.0  # spent verifying it before the load
    fused: bool = False  # its shard checksums are left to the load (LoadRequest.fusable)
    detail: Any = None  # the placement's own record of the selection, for ``loaded``


@dataclass(frozen=True)
class Retry:
    """Select again, leaving out ``excluded`` (found corrupt in their only source); nothing
    excluded: a corrupt copy of ``checkpoint`` was dropped, it is tried from another."""

    checkpoint: str
    excluded: frozenset[str] = frozenset()


class Candidates(Protocol):
    """What the walk needs of a placement (every method: every rank, together)."""

    def select(self, request: LoadRequest, excluded: Collection[str]) -> Selected | Retry | None:
        """The newest checkpoint ``request.filters`` allow, not in ``excluded``, verified and
        readable; or what to do first; ``None`` when there is none. A named checkpoint that
        is not valid raises (``CheckpointNotFoundError``, ``IntegrityError``)."""
        ...

    def drop(self, info: CheckpointInfo, file: str, reason: str) -> None:
        """``file`` of ``info`` was found corrupt while loading: no later load may use it."""
        ...

    def not_found(self, filters: Filters) -> CheckpointNotFoundError:
        """The error for "nothing to load" (naming where the placement looked)."""
        ...

    def loaded(self, selected: Selected, seconds: float) -> None:
        """``selected`` was loaded, ``seconds`` after the walk began."""
        ...


def load_walk(
    candidates: Candidates, coord: Coordinator, request: LoadRequest
) -> tuple[CheckpointInfo, LoadResult]:
    """Every rank: the module's steps; the loaded checkpoint and the load's result."""
    start = time.monotonic()
    corrupt: dict[str, CorruptWhileLoading] = {}  # by checkpoint name
    excluded: set[str] = set()
    touched: set[tuple[Any, ...]] = set()  # the targets corrupt attempts loaded into
    retries = 0
    while True:
        chosen = candidates.select(request, frozenset(excluded))
        if isinstance(chosen, Retry):
            retries = 0 if chosen.excluded else retries + 1
            if retries > RETRIES:
                raise _gave_up(coord, chosen.checkpoint)
            excluded |= chosen.excluded
            continue
        if chosen is None:
            if corrupt and request.in_place:
                only = _only(request.filters)
                raise _partly(corrupt, f"no older valid checkpoint{only} is left")
            raise candidates.not_found(request.filters)
        info, handed = chosen.info, set[tuple[Any, ...]]()
        try:
            result = _load(coord, request, chosen, handed)
        except CorruptWhileLoading as exc:
            if request.filters.checkpoint is not None:  # named: as from selection
                if request.in_place:
                    raise _partly({info.name: exc}) from None
                raise
            candidates.drop(info, exc.file, exc.reason)
            corrupt[info.name] = exc
            excluded.add(info.name)
            touched |= handed
            retries = 0
            continue
        except Exception as exc:
            if corrupt and request.in_place:
                why = f"loading {info.location} instead failed ({type(exc).__name__}: {exc})"
                raise _partly(corrupt, why) from exc
            raise
        stale = touched - handed
        if stale:
            shown = ", ".join(".".join(map(str, p)) for p in sorted(stale, key=str)[:3])
            raise _partly(corrupt, f"{info.location}, loaded instead, does not hold {shown}")
        candidates.loaded(chosen, time.monotonic() - start)
        return info, result


def _load(
    coord: Coordinator, request: LoadRequest, chosen: Selected, handed: set[tuple[Any, ...]]
) -> LoadResult:
    return load_checkpoint(
        chosen.storage,
        coord,
        chosen.info,
        request.state,
        strict=request.strict,
        verify_s=chosen.verify_s,
        trusted=request.trusted,
        per_rank_rules=request.per_rank_rules,
        targets=_recording(request.targets, handed),
        fused=chosen.fused,
    )


def _only(filters: Filters) -> str:
    return "" if filters.run_id is None else f" of run {filters.run_id!r}"


def _recording(targets: Targets | None, handed: set[tuple[Any, ...]]) -> Targets | None:
    """``targets``, noting the path of every tensor it hands out in ``handed``."""
    if targets is None:
        return None
    give = targets

    def recorded(path: tuple[Any, ...], shape: torch.Size, dtype: torch.dtype) -> Any:
        tensor = give(path, shape, dtype)
        if tensor is not None:
            handed.add(tuple(path))
        return tensor

    return recorded


def _partly(corrupt: Mapping[str, CorruptWhileLoading], why: str = "") -> IntegrityError:
    """The error of a load that found a checkpoint corrupt only after reading part of it into
    the caller's state or targets, and could not overwrite all of that from another one."""
    last = list(corrupt.values())[-1]
    return IntegrityError(
        last.checkpoint,
        last.file,
        f"{last.reason}; found while loading it{', and ' + why if why else ''}: what was "
        "loaded in place (the state or targets passed in) is partly that corrupt "
        "checkpoint's. Start from a fresh state (a restarted job finds the corrupt "
        "checkpoint quarantined)",
    )


def _gave_up(coord: Coordinator, checkpoint: str) -> CheckpointLoadError:
    """The error every rank raises (the same message) when copies kept turning up corrupt."""
    message = (
        f"the load gave up after {RETRIES + 1} passes in a row that each found a corrupt copy "
        "of it; inspect the node-local roots with `lightning-elastic ls DIR --local PATH`"
    )
    failure = RankFailure(coord.rank, Phase.LOAD, "RecoveryError", message)
    return CheckpointLoadError(checkpoint, [failure])
