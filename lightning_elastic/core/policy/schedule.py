"""When a training loop saves: its triggers, and the decision every rank agrees on.

Step and epoch triggers come from the training counters (the same on every rank); the time
trigger (fixed, ``"auto"`` or ``"continuous"``) is rank 0's clock and a caught signal is any
rank's, agreed with one small all-reduce at the end of each optimizer step (the last batch of
a gradient-accumulation window: a save inside a window would lose its partial gradients). A
decision is *deferred*: taken at the next quiet point (the next batch's start, or the end of
training), after everything Lightning does for the step (see the callback's docstring).

Which rank calls what: every rank calls every method, at the same points of the loop
(``DistributedCheckpoint`` calls them from its hooks; a loop around ``CheckpointEngine`` may
too); :meth:`SaveSchedule.decide` is a collective. No Lightning here.
"""

from __future__ import annotations

import signal as signal_module
from collections.abc import Sequence

from lightning_elastic.core.dist.coordinator import Coordinator
from lightning_elastic.core.policy.cadence import Cadence
from lightning_elastic.core.policy.triggers import (
    Agreement,
    EveryNEpochs,
    EveryNSteps,
    SignalFlag,
    StepDecision,
)

__all__ = ["SaveSchedule"]


class SaveSchedule:
    """The triggers of one callback and the save they decided (``deferred``)."""

    def __init__(
        self,
        *,
        every_n_train_steps: int | None,
        every_n_epochs: int | None,
        cadence: Cadence,
        signals: Sequence[int],
    ) -> None:
        self.step_trigger = (
            None if every_n_train_steps is None else EveryNSteps(every_n_train_steps)
        )
        self.epoch_trigger = None if every_n_epochs is None else EveryNEpochs(every_n_epochs)
        self.cadence = cadence
        self.interval = cadence.interval
        self.signals = tuple(signals)
        self.flag: SignalFlag | None = None
        self.agreement: Agreement | None = None
        self.requested = False
        self.last_step = -1  # the step of the last save (never saved twice)
        self.batch_start_step = -1
        # decided at a step's end, taken at the next quiet point: (reason, signal number or 0)
        self.deferred: tuple[str, int] | None = None

    def bind(self, coordinator: Coordinator) -> None:
        """Agree through ``coordinator`` (at setup)."""
        self.agreement = Agreement(coordinator)

    def start(self, step: int) -> None:
        """Training starts at ``step``: install the signal handlers, start the clock."""
        if self.signals:
            self.flag = SignalFlag(self.signals)
            self.flag.install()  # after Lightning's own handlers: ours decide for all ranks
        if self.interval is not None:
            self.interval.start()
        if self.cadence.continuous is not None:
            self.cadence.continuous.start()
        self.last_step = step  # never re-save the step we resumed at
        self.deferred = None

    def stop(self) -> None:
        """Put the previous signal handlers back."""
        if self.flag is not None:
            self.flag.uninstall()
            self.flag = None

    def take(self) -> tuple[str, int] | None:
        """The deferred decision, if any (and forget it)."""
        deferred, self.deferred = self.deferred, None
        return deferred

    def in_window(self, step: int) -> bool:
        """Inside a gradient-accumulation window (no optimizer step since the batch began):
        requests, signals and the clock wait for its last batch (at most one window). Every
        rank has the same windows (equal batch counts), so every rank skips the agreement
        together."""
        return step == self.batch_start_step

    def decide(self, step: int, *, busy: bool, shared: Sequence[int] = ()) -> StepDecision:
        """At the end of optimizer step ``step`` (a collective; ``busy``: a save is still being
        written): agree, and defer the save it calls for."""
        due = self.step_trigger is not None and self.step_trigger.due(step)
        continuous = self.cadence.continuous
        # Every rank joins this agreement at every optimizer step, whatever it saw locally (a
        # signal, a request, rank 0's clock): a collective entered by some ranks only would hang.
        assert self.agreement is not None
        decision = self.agreement.decide(
            interval=self.interval,
            flag=self.flag,
            requested=self.requested,
            time_due=continuous is not None and continuous.due(busy=busy),
            shared=shared,
        )
        self.requested = False
        if decision.signal:
            name = signal_module.Signals(decision.signal).name
            self.deferred = (f"signal:{name}", decision.signal)
        elif (due or decision.save) and step != self.last_step:
            reason = "step" if due else ("interval" if decision.time_due else "request")
            self.deferred = (reason, 0)
        return decision

    def epoch_end(self, epoch: int, step: int) -> None:
        """At an epoch's end (before the module's epoch-end hooks and the epoch-interval
        schedulers: the save waits for the next quiet point too)."""
        due = self.epoch_trigger is not None and self.epoch_trigger.due(epoch)
        if due and step != self.last_step and self.deferred is None:
            self.deferred = ("epoch", 0)

    def saved(self, step: int) -> None:
        """A save of ``step`` was taken: the time triggers count from now."""
        self.last_step = step
        if self.interval is not None:
            self.interval.saved()
        if self.cadence.continuous is not None:
            self.cadence.continuous.saved()
