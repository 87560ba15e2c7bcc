"""Which checkpoints to keep: small composable policies, pure functions over a listing.

A checkpoint survives when *any* policy keeps it. Whatever the policies say,
:func:`plan_deletions` never selects:

* a checkpoint that is not ``valid`` (corrupt ones are kept for inspection; incomplete
  ones are leftovers, cleaned separately);
* a checkpoint of another run id sharing the directory;
* the newest valid checkpoint in the directory, and the newest of this run;
* a protected checkpoint (the one this run resumed from);
* a checkpoint that a checkpoint it keeps refers to (an incremental save reads unchanged
  tensors from it), transitively: the references are read from the manifests themselves, so
  nothing but the manifests on storage decides what is still needed.

Deleting is the caller's job and goes manifest first, then data, so a crash in between
leaves an incomplete directory, never a committed checkpoint with missing files.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Protocol

from lightning_elastic.core.format.catalog import VALID, CheckpointInfo
from lightning_elastic.core.format.references import referenced_closure
from lightning_elastic.core.options import check_choice, check_count
from lightning_elastic.errors import ConfigError

__all__ = [
    "KeepAll",
    "KeepBestK",
    "KeepEveryNSteps",
    "KeepLastN",
    "RetentionPolicy",
    "plan_deletions",
]


class RetentionPolicy(Protocol):
    """What every retention policy offers: the names to keep among a run's checkpoints."""

    def keep(self, checkpoints: Sequence[CheckpointInfo]) -> set[str]:
        """Names to keep among ``checkpoints`` (valid, this run's, oldest first)."""
        ...


@dataclass(frozen=True)
class KeepLastN:
    """Keep the ``n`` newest checkpoints."""

    n: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "n", check_count(self.n, "keep_last_n"))

    def keep(self, checkpoints: Sequence[CheckpointInfo]) -> set[str]:
        """The names of the ``n`` newest (last) of ``checkpoints``."""
        return {c.name for c in checkpoints[-self.n :]}


@dataclass(frozen=True)
class KeepEveryNSteps:
    """Keep milestones: checkpoints whose step is a multiple of ``n``."""

    n: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "n", check_count(self.n, "keep_every_n_steps"))

    def keep(self, checkpoints: Sequence[CheckpointInfo]) -> set[str]:
        """The names of the checkpoints whose step is a multiple of ``n``."""
        return {c.name for c in checkpoints if c.step is not None and c.step % self.n == 0}


@dataclass(frozen=True)
class KeepBestK:
    """Keep the ``k`` best checkpoints by the metric ``monitor`` recorded at save time.

    Checkpoints without the metric do not compete; ties go to the newer checkpoint.
    """

    k: int
    monitor: str
    mode: str = "min"

    def __post_init__(self) -> None:
        object.__setattr__(self, "k", check_count(self.k, "keep_best_k"))
        check_choice(self.mode, "mode", ("min", "max"))
        if not self.monitor:
            raise ConfigError("keep_best_k needs the name of a metric to monitor")

    def keep(self, checkpoints: Sequence[CheckpointInfo]) -> set[str]:
        """The names of the ``k`` checkpoints with the lowest (``min``) or highest (``max``) value
        of ``monitor``."""
        return {c.name for c in self.ranked(checkpoints)[: self.k]}

    def ranked(self, checkpoints: Sequence[CheckpointInfo]) -> list[CheckpointInfo]:
        """Those of ``checkpoints`` (oldest first) that recorded ``monitor``, best first; of
        equal scores the later one first. ``ckpt_path="best"`` walks this order too."""
        scored = [
            (c.manifest.metrics[self.monitor], i, c)
            for i, c in enumerate(checkpoints)
            if c.manifest is not None and self.monitor in c.manifest.metrics
        ]
        sign = 1.0 if self.mode == "min" else -1.0
        scored.sort(key=lambda t: (sign * t[0], -t[1]))
        return [c for _, _, c in scored]


@dataclass(frozen=True)
class KeepAll:
    """Keep everything."""

    def keep(self, checkpoints: Sequence[CheckpointInfo]) -> set[str]:
        """The names of all ``checkpoints``."""
        return {c.name for c in checkpoints}


def plan_deletions(
    checkpoints: Sequence[CheckpointInfo],
    policies: Sequence[RetentionPolicy],
    *,
    run_id: str,
    protected: Collection[str] = (),
) -> list[CheckpointInfo]:
    """The checkpoints to delete, oldest first. No policies means keep everything."""
    if not policies:
        return []
    ordered = sorted(checkpoints, key=CheckpointInfo.sort_key)
    valid = [c for c in ordered if c.status == VALID]
    mine = [c for c in valid if c.run_id == run_id]
    keep = set(protected)
    for policy in policies:
        keep |= policy.keep(mine)
    if valid:
        keep.add(valid[-1].name)
    if mine:
        keep.add(mine[-1].name)
    doomed = {c.name for c in mine if c.name not in keep}
    survivors = {c.name for c in ordered} - doomed
    needed = referenced_closure({c.name: c.manifest for c in ordered}, survivors)
    return [c for c in mine if c.name in doomed and c.name not in needed]
