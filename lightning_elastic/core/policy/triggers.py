"""When to save: small, pure policies, and the one agreement that makes all ranks agree.

Step and epoch triggers are pure functions of the (identical) training counters. Time and
signal triggers are local observations, so :class:`Agreement` turns them into one decision
for every rank with a single tiny all-reduce per check: rank 0's clock alone decides the
time trigger, and a signal seen by *any* rank counts for all. Clocks are injected.
"""

from __future__ import annotations

import signal as signal_module
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

from lightning_elastic.core.dist.coordinator import Coordinator
from lightning_elastic.core.options import check_count, check_seconds
from lightning_elastic.errors import Phase

__all__ = [
    "Agreement",
    "EveryInterval",
    "EveryNEpochs",
    "EveryNSteps",
    "SignalFlag",
    "StepDecision",
]


@dataclass(frozen=True)
class EveryNSteps:
    """Due at every global step that is a positive multiple of ``n``."""

    n: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "n", check_count(self.n, "every_n_train_steps"))

    def due(self, step: int) -> bool:
        """Whether a save is due at global step ``step``."""
        return step > 0 and step % self.n == 0


@dataclass(frozen=True)
class EveryNEpochs:
    """Due at the end of every ``n``-th epoch (``epoch`` counts from 0)."""

    n: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "n", check_count(self.n, "every_n_epochs"))

    def due(self, epoch: int) -> bool:
        """Whether a save is due at the end of ``epoch``."""
        return (epoch + 1) % self.n == 0


@dataclass
class EveryInterval:
    """Due once ``seconds`` have passed since the last save (or the start)."""

    seconds: float
    clock: Callable[[], float] = time.monotonic
    last: float | None = field(default=None)

    def __post_init__(self) -> None:
        self.seconds = check_seconds(self.seconds, "train_time_interval")

    def start(self) -> None:
        """Start counting now (the callback calls it when training starts)."""
        self.last = self.clock()

    def due(self) -> bool:
        """Whether ``seconds`` have passed since the last save; the first call starts the interval
        when :meth:`start` was not called."""
        if self.last is None:
            self.start()
        assert self.last is not None
        return self.clock() - self.last >= self.seconds

    def saved(self) -> None:
        """Record a save now: the next one is due ``seconds`` from here."""
        self.last = self.clock()


class SignalFlag:
    """Handlers for ``signals`` that only record which signal arrived (async-signal safe)."""

    def __init__(self, signals: Sequence[int]) -> None:
        self.signals = tuple(int(s) for s in signals)
        self.received = 0
        self._previous: dict[int, Any] = {}

    def install(self) -> None:
        """Install the handlers, keeping the previous ones; does nothing outside the main thread."""
        if threading.current_thread() is not threading.main_thread():
            return  # handlers can only be installed from the main thread
        for signum in self.signals:
            self._previous[signum] = signal_module.signal(signum, self._handle)

    def uninstall(self) -> None:
        """Put back the handlers :meth:`install` replaced."""
        for signum, previous in self._previous.items():
            signal_module.signal(signum, previous)
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.received = signum


@dataclass(frozen=True)
class StepDecision:
    """What all ranks agreed at one step boundary."""

    time_due: bool = False
    signal: int = 0  # 0: none; else the (largest) signal number any rank received
    requested: bool = False  # some rank asked for a checkpoint (e.g. on demand)
    shared: tuple[int, ...] = ()  # the element-wise maximum of what ranks passed as ``shared``

    @property
    def save(self) -> bool:
        """Whether to save now: the interval is due, a rank asked, or a signal arrived."""
        return self.time_due or self.requested or self.signal != 0


class Agreement:
    """One all-reduce per check: ``[signal, time_due (rank 0), requested, *shared]`` by
    maximum. ``shared`` lets other per-step information ride along (every rank's step timings,
    each in its own slots: see :mod:`~lightning_elastic.core.dist.straggler`); all ranks pass
    vectors of the same length at the same step."""

    def __init__(self, coordinator: Coordinator) -> None:
        self.coordinator = coordinator

    def decide(
        self,
        *,
        interval: EveryInterval | None,
        flag: SignalFlag | None,
        requested: bool,
        time_due: bool = False,
        shared: Sequence[int] = (),
    ) -> StepDecision:
        """The decision every rank shares for this step boundary (a collective: all ranks call it
        together); only rank 0 checks ``interval`` and its ``time_due`` counts (another time
        policy's verdict, e.g. the adaptive cadence's)."""
        due_here = self.coordinator.is_coordinator and (
            time_due or (interval is not None and interval.due())
        )
        received = flag.received if flag is not None else 0
        signum, due, asked, *rest = self.coordinator.max_ints(
            [received, int(due_here), int(requested), *shared], Phase.SAVE_DECIDE, track=False
        )
        return StepDecision(
            time_due=bool(due), signal=signum, requested=bool(asked), shared=tuple(rest)
        )
