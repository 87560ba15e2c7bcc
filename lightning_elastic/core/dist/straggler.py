"""Straggler detection that costs no collective of its own.

Each rank keeps a window of its own step timings: the *local* seconds of a step (data wait,
forward, optimizer step: the parts no collective paces; a backward pass with DDP waits for the
slowest rank's gradients, so every rank's backward looks as slow as the straggler's) and the
seconds spent on checkpoints (staging, waiting for the previous save). At the last step of a
window every rank puts its two medians, in microseconds, into its own slots of the per-step
agreement vector (:class:`~lightning_elastic.core.policy.triggers.Agreement`, an all-reduce by
maximum that runs at every optimizer step anyway): the maximum of vectors that are zero
except in each rank's own slots is every rank's timings. Between windows the vector carries
only the three decision flags.

:func:`find_stragglers` then judges, identically on every rank, which ranks took more than
``factor`` × the median rank's time (the lower median of an even count), and whether the excess went into the step or the save.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from statistics import median, median_low

__all__ = [
    "RankTiming",
    "StepWindow",
    "Straggler",
    "decode_slots",
    "encode_slots",
    "find_stragglers",
]

_US = 1e6
_MAX_US = 2**62  # the all-reduce carries int64


@dataclass(frozen=True)
class RankTiming:
    """One rank's medians over a window, in seconds."""

    local_s: float
    save_s: float

    @property
    def total_s(self) -> float:
        """Local and checkpoint seconds together."""
        return self.local_s + self.save_s


class StepWindow:
    """This rank's step timings since the last window ended."""

    def __init__(self, steps: int) -> None:
        if steps < 1:
            raise ValueError(f"a straggler window needs >= 1 step, got {steps}")
        self.steps = steps
        self._local: list[float] = []
        self._save: list[float] = []

    def add(self, local_s: float, save_s: float) -> None:
        """Record one optimizer step."""
        self._local.append(max(0.0, local_s))
        self._save.append(max(0.0, save_s))

    def take(self) -> RankTiming:
        """The window's medians (zeros when it is empty); starts the next window."""
        timing = RankTiming(
            median(self._local) if self._local else 0.0,
            median(self._save) if self._save else 0.0,
        )
        self._local.clear()
        self._save.clear()
        return timing


def encode_slots(rank: int, world_size: int, timing: RankTiming) -> list[int]:
    """``2 × world_size`` integers, zero but for this rank's two slots (microseconds)."""
    slots = [0] * (2 * world_size)
    slots[2 * rank] = min(_MAX_US, round(timing.local_s * _US))
    slots[2 * rank + 1] = min(_MAX_US, round(timing.save_s * _US))
    return slots


def decode_slots(slots: Sequence[int], world_size: int) -> list[RankTiming]:
    """Every rank's timing from the reduced slots."""
    return [
        RankTiming(slots[2 * r] / _US, slots[2 * r + 1] / _US) for r in range(world_size)
    ]


@dataclass(frozen=True)
class Straggler:
    """A rank slower than the median rank by more than the configured factor."""

    rank: int
    host: str
    factor: float  # its time over the median rank's
    local_s: float  # its step time (local part + checkpoint part)
    median_s: float  # the median rank's
    where: str  # "step": the step itself is slow; "save": the time went into checkpoints

    def describe(self) -> str:
        """One line for the log: rank, node, times and where the time went."""
        return (
            f"rank {self.rank} on {self.host} is a straggler: {self.local_s * 1e3:.1f} ms per "
            f"step against the median rank's {self.median_s * 1e3:.1f} ms ({self.factor:.2f}x), "
            + (
                "the time goes into the step itself (compute or data)"
                if self.where == "step"
                else "the time goes into checkpoint saves (staging or waiting for a write)"
            )
        )


def find_stragglers(
    timings: Sequence[RankTiming],
    hosts: Sequence[str],
    *,
    factor: float,
    min_excess_s: float = 0.005,
) -> list[Straggler]:
    """The ranks whose step (local + checkpoint) time exceeds ``factor`` × the median rank's
    and the median by at least ``min_excess_s`` (5 ms: on steps of a millisecond or two, rank
    0's own logging alone looked like a straggler)."""
    if len(timings) < 2:
        return []
    # the lower median: with 2 ranks the plain median is the mean, and a rank 10x slower
    # than the other would be only ~2x "the median"
    mid = median_low(t.total_s for t in timings)
    mid_local = median_low(t.local_s for t in timings)
    mid_save = median_low(t.save_s for t in timings)
    found = []
    for rank, t in enumerate(timings):
        if t.total_s > factor * mid and t.total_s - mid >= min_excess_s:
            where = "save" if t.save_s - mid_save > t.local_s - mid_local else "step"
            host = hosts[rank] if rank < len(hosts) else "?"
            found.append(
                Straggler(rank, host, t.total_s / max(mid, 1e-9), t.total_s, mid, where)
            )
    return found
