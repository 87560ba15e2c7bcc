"""What a training loop that checkpoints observes: step timings (for straggler detection and
the adaptive cadence), each save's cost, the resume's lost work and recovery time; exported as
metrics (:mod:`~lightning_elastic.core.observe.health`), to loggers (anything with
``log_metrics(metrics, step=)``, e.g. a Lightning logger), and into the run history in the
checkpoint directory (:mod:`~lightning_elastic.core.observe.history`, rank 0 writes it, from a
background thread).

No Lightning here: ``DistributedCheckpoint`` calls it from its hooks (see
:mod:`lightning_elastic.lightning.health`), and a loop of your own around
:class:`~lightning_elastic.CheckpointEngine` calls the same methods (docs/monitoring.md).

Which rank calls what: every rank calls every method in the same order at the same steps;
:meth:`HealthMonitor.start` and :meth:`HealthMonitor.train_start` are collectives (one gather,
one broadcast) and :meth:`HealthMonitor.shared` / :meth:`HealthMonitor.after_agreement` wrap
a per-step agreement the caller runs (a collective: the straggler window's timings travel in
it). Only rank 0 writes history, and only rank 0's cadence counts (the time trigger is rank
0's clock).
"""

from __future__ import annotations

import logging
import time
import warnings
from collections import deque
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Protocol

from lightning_elastic.core.dist.straggler import (
    StepWindow,
    Straggler,
    decode_slots,
    encode_slots,
    find_stragglers,
)
from lightning_elastic.core.observe.health import Health
from lightning_elastic.core.observe.lost_work import (
    PastLaunches,
    Resumed,
    past_launches,
    resume_record,
)
from lightning_elastic.core.observe.recorder import HistoryRecorder
from lightning_elastic.core.policy.cadence import AutoCadence, CadenceChoice, slowdown
from lightning_elastic.core.tiers.layout import node_name
from lightning_elastic.errors import ConfigError, Phase, StragglerWarning

if TYPE_CHECKING:
    from lightning_elastic.core.dist.coordinator import Coordinator
    from lightning_elastic.core.engine import CheckpointEngine
    from lightning_elastic.core.load.load import LoadResult
    from lightning_elastic.core.observe.history import RunHistory
    from lightning_elastic.core.save.request import SaveResult

__all__ = ["HealthMonitor", "MetricsLogger", "failure_phase"]

log = logging.getLogger(__name__)

_P = "lightning_elastic_"
_MAX_HOSTS = 64  # node names kept in a start event (with their count)


class MetricsLogger(Protocol):
    """Where :meth:`HealthMonitor.log_to` sends the metrics (a Lightning logger is one)."""

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        """Record ``metrics`` (name -> value) at ``step``."""
        ...


class HealthMonitor:
    """One rank's observations of one training run (a ``fit``); see the module docstring.

    Args:
        straggler_factor: a rank whose step time (less the time waiting for others and for
            saves) is over this multiple of the median rank's in a window is a straggler;
            ``None``: no straggler detection.
        straggler_window: the window, in optimizer steps.
        cadence: the adaptive checkpoint cadence, fed each save's cost (may be set later).
        clock: seconds, monotonic (injected in tests).
    """

    #: seconds between two progress records of rank 0, the resolution of the lost work a
    #: resume reports; ``None``: every step on a local or shared file system (a small write in
    #: the background, skipped while the previous one is still going), every second on an
    #: object store (~86,000 PUTs a day); read at :meth:`train_start`
    progress_every_s: float | None = None

    def __init__(
        self,
        *,
        straggler_factor: float | None,
        straggler_window: int,
        cadence: AutoCadence | None = None,
        clock: Any = time.perf_counter,
    ) -> None:
        self.health = Health()
        self.factor = straggler_factor
        self.window = StepWindow(straggler_window)
        self.cadence = cadence
        self.clock = clock
        self.history: RunHistory | None = None
        self.hosts: list[str] = []
        self.rank = 0
        self.world_size = 1
        self.stragglers: list[Straggler] = []  # found in the last window
        # the step being timed
        self._enter: float | None = None  # the first micro-batch's start
        self._last_end: float | None = None  # the previous step's end (after the agreement)
        self._data_s = 0.0
        self._save_s = 0.0
        self._mark: float | None = None  # forward start, or backward start
        self._backward_s = 0.0
        self._validation_s = 0.0
        self._validation_at: float | None = None
        # whole-step seconds (rank 0, for the cadence): steps a background write overlapped,
        # and recent ones it did not
        self._during: list[float] = []
        self._idle: deque[float] = deque(maxlen=200)
        self._recorder: HistoryRecorder | None = None  # rank 0's, with a history
        self._resume_fields: dict[str, Any] | None = None
        self._past = PastLaunches()
        self._setup_unix = self._loaded_unix = 0.0
        self.port: int | None = None
        self.history_mtbf_s: float | None = None

    # ------------------------------------------------------------------ setup

    def start(self, coordinator: Coordinator, *, port: int | None, local_rank: int) -> None:
        """Learn every rank's node and serve ``/metrics`` if asked (one gather per fit: a
        port that cannot be served fails every rank together, naming the ranks)."""
        self.rank, self.world_size = coordinator.rank, coordinator.world_size

        def local() -> tuple[str, str | None]:
            if port is None:
                return node_name(), None
            wanted = 0 if port == 0 else port + local_rank
            if wanted > 65535:
                return node_name(), f"port {port} + local rank {local_rank} is over 65535"
            try:
                self.port = self.health.serve(wanted)
            except ImportError:
                return node_name(), "prometheus_client is not installed"
            except OSError as exc:
                return node_name(), f"cannot serve port {wanted}: {exc}"
            log.info("rank %d serves metrics on port %d (/metrics)", self.rank, self.port)
            return node_name(), None

        gathered = coordinator.all_gather(Phase.AGREE, local, what="node names")
        self.hosts = [host for host, _error in gathered]
        failed = [f"rank {r}: {error}" for r, (_host, error) in enumerate(gathered) if error]
        if failed:
            self.health.close()
            raise ConfigError(
                f"metrics_port={port}: " + "; ".join(failed) + " (pip install "
                "'lightning_elastic[metrics]' for the endpoint; pass another metrics_port, "
                "0 for any free port, or None for none)"
            )
        self.health.set(f"{_P}world_size", self.world_size)

    @property
    def nodes(self) -> int:
        """Distinct nodes of the job."""
        return max(1, len(set(self.hosts)))

    # ------------------------------------------------------------------ step timing

    def batch_start(self) -> None:
        """A training batch starts (the step's first micro-batch starts its timing)."""
        now = self.clock()
        if self._enter is None:  # the step's first micro-batch
            self._enter = now
            if self._last_end is not None:
                self._data_s = max(0.0, now - self._last_end - self._validation_s)
            self._validation_s = 0.0
        self._mark = now

    def validation_started(self) -> None:
        """Validation runs between two steps: its time is not the next step's data wait."""
        self._validation_at = self.clock()

    def validation_ended(self) -> None:
        """See :meth:`validation_started`."""
        if self._validation_at is not None:
            self._validation_s += self.clock() - self._validation_at
            self._validation_at = None

    @contextmanager
    def saving(self) -> Iterator[None]:
        """Time spent on checkpoints inside a step (staging, waiting for a write)."""
        began = self.clock()
        try:
            yield
        finally:
            spent = self.clock() - began
            self._save_s += spent
            if self._mark is not None:
                self._mark += spent  # not part of the forward

    def before_backward(self) -> None:
        """The backward pass starts (the forward pass ends)."""
        self._mark = self.clock()

    def before_optimizer_step(self) -> None:
        """The optimizer step starts (the backward pass, paced by DDP's gradient sync, ends)."""
        if self._mark is not None:
            self._backward_s += self.clock() - self._mark
            self._mark = None

    def step_end(self, *, step: int, writing: bool) -> None:
        """At an optimizer step's last batch (before the agreement): close the step's timing;
        ``writing``: a save was being written in the background during it."""
        now = self.clock()
        if self._enter is None:
            return
        wall = now - self._enter
        local = max(0.0, wall - self._backward_s - self._save_s) + self._data_s
        self.window.add(local, self._save_s)
        (self._during if writing else self._idle).append(wall - self._save_s)
        self._enter, self._mark = None, None
        self._data_s = self._save_s = self._backward_s = 0.0
        self.health.at_step(step)

    def replica_events(self, events: Sequence[Any], participants: int, group: str) -> None:
        """Replica groups (``elastic_ft``): the groups taking part now, and this group's quorum
        events since the last call (:class:`~lightning_elastic.core.replicas.group.
        ReplicaEvent`), into the metrics and (rank 0 of each group) the run history."""
        self.health.set(f"{_P}replica_groups", participants)
        for event in events:
            self.health.inc(f"{_P}replica_events_total", kind=event.kind)
            self.health.set(f"{_P}replica_stall_seconds", event.stall_s, kind=event.kind)
            if event.kind == "join":
                self.health.set(f"{_P}replica_heal_seconds", event.stall_s, part="quorum")
                for part in ("transfer", "configure"):
                    value = event.detail.get(f"{part}_s")
                    if value is not None:
                        self.health.set(f"{_P}replica_heal_seconds", value, part=part)
                size = event.detail.get("transfer_bytes")
                if size is not None:
                    self.health.set(f"{_P}replica_heal_bytes", size)
            if self.rank == 0:
                self._record(
                    "replica",
                    event=event.kind,
                    group=group,
                    step=event.step,
                    quorum_id=event.quorum_id,
                    participants=event.participants,
                    stall_s=round(event.stall_s, 6),
                    **{k: round(v, 6) for k, v in event.detail.items()},
                )

    def step_done(self) -> None:
        """After the agreement: the next step's data wait starts now."""
        self._last_end = self.clock()

    # ------------------------------------------------------------------ stragglers

    def agree(
        self, coordinator: Coordinator, step: int, loggers: Sequence[MetricsLogger] = ()
    ) -> None:
        """For a loop without an agreement of its own (``DistributedCheckpoint`` carries the
        timings in its per-step one): at every optimizer step, on every rank, after
        :meth:`step_end`; where a window ends (the same steps everywhere) the window's timings
        are exchanged (one small all-reduce) and judged."""
        shared = self.shared(step)
        if shared:
            shared = coordinator.max_ints(shared, Phase.AGREE, track=False)
        self.after_agreement(step, shared, loggers)

    def window_ends(self, step: int) -> bool:
        """Whether a straggler window ends at ``step`` (the same answer on every rank)."""
        return self.factor is not None and self.world_size > 1 and step % self.window.steps == 0

    def shared(self, step: int) -> list[int]:
        """This rank's slots for the agreement vector (empty unless a window ends here)."""
        if not self.window_ends(step):
            return []
        return encode_slots(self.rank, self.world_size, self.window.take())

    def after_agreement(
        self, step: int, shared: Sequence[int], loggers: Sequence[MetricsLogger]
    ) -> None:
        """Judge the window's timings (the same verdict on every rank)."""
        if not self.window_ends(step) or len(shared) != 2 * self.world_size:
            return
        assert self.factor is not None
        timings = decode_slots(shared, self.world_size)
        mine = timings[self.rank]
        self.health.set(f"{_P}step_seconds", mine.local_s, part="local")
        self.health.set(f"{_P}step_seconds", mine.save_s, part="save")
        self.stragglers = find_stragglers(timings, self.hosts, factor=self.factor)
        self.health.set(f"{_P}stragglers", len(self.stragglers))
        for found in self.stragglers:
            self.health.inc(f"{_P}straggler_reports_total")
            if self.rank == 0:
                message = f"step {step}: {found.describe()}"
                log.warning(message)
                warnings.warn(message, StragglerWarning, stacklevel=2)
                self._record(
                    "straggler",
                    step=step,
                    rank=found.rank,
                    host=found.host,
                    factor=round(found.factor, 3),
                    local_s=found.local_s,
                    median_s=found.median_s,
                    where=found.where,
                )
        self.log_to(loggers, step, f"{_P}step_seconds", f"{_P}stragglers")

    # ------------------------------------------------------------------ saves

    def committed(self, result: SaveResult, *, reason: str) -> float | None:
        """A save is durable (every rank reports its own); returns the adaptive cadence's new
        interval, if there is one."""
        manifest = result.manifest  # rank 0's
        # when the saved step was reached: the commit time (rank 0: the manifest's) less the
        # save's duration
        taken_unix = (manifest.created_unix if manifest else time.time()) - result.total_s
        h = self.health
        h.set(f"{_P}save_blocked_seconds", result.blocked_s)
        h.set(f"{_P}save_write_seconds", result.writing_s)
        h.set(f"{_P}save_commit_seconds", result.total_s)
        h.set(f"{_P}save_bytes", result.bytes_written)
        h.inc(f"{_P}saved_bytes_total", result.bytes_written)
        h.inc(f"{_P}saves_total", reason=_reason_label(reason))
        h.set(f"{_P}save_in_flight", 0)
        h.checkpointed(taken_unix, result.step)
        if self._recorder is not None and manifest is not None:
            self._recorder.commit(
                name=result.name,
                step=result.step,
                reason=reason,
                bytes=manifest.total_bytes,
                blocked_s=result.blocked_s,
                write_s=result.writing_s,
                commit_s=result.total_s,
                world_size=manifest.world_size,
            )
        if self.cadence is not None:
            lost = slowdown(self._during, self._idle)
            choice = self.cadence.observe(
                blocked_s=result.blocked_s, slowdown_s=lost, write_s=result.total_s
            )
            self._during = []
            self._cadence_chosen(choice, result.step)
            return choice.interval_s
        return None

    def _cadence_chosen(self, choice: CadenceChoice, step: int) -> None:
        h = self.health
        h.set(f"{_P}checkpoint_interval_seconds", choice.interval_s)
        h.set(f"{_P}checkpoint_cost_seconds", choice.cost_s)
        if choice.mtbf_s is not None:
            h.set(f"{_P}mtbf_seconds", choice.mtbf_s)
        if self.rank == 0:
            log.info("checkpoint cadence: %s", choice.describe())
            self._record(
                "cadence",
                step=step,
                interval_s=choice.interval_s,
                cost_s=choice.cost_s,
                write_s=choice.write_s,
                mtbf_s=choice.mtbf_s,
                bound=choice.bound,
            )

    def in_flight(self) -> None:
        """A save is being written in the background."""
        self.health.set(f"{_P}save_in_flight", 1)

    def skipped(self) -> None:
        """A due save was skipped (the previous one was still being written)."""
        self.health.inc(f"{_P}saves_skipped_total")

    def failed(self, phase: str, step: int, error: BaseException) -> None:
        """A save failed in ``phase`` (counted; rank 0 records it in the history)."""
        self.health.inc(f"{_P}save_failures_total", phase=phase)
        self.health.set(f"{_P}save_in_flight", 0)
        if self.rank == 0:
            self._record("save_failed", step=step, phase=phase, error=repr(error)[:500])

    # ------------------------------------------------------------------ the run's history

    @staticmethod
    def history_for(engine: CheckpointEngine) -> RunHistory | None:
        """The run history to pass to :meth:`train_start` for a loop around ``engine``: rank
        0's, in the engine's root, for the engine's run (``None`` on the other ranks)."""
        from lightning_elastic.core.observe.history import RunHistory

        if engine.rank != 0:
            return None
        # the monitor throttles the progress records itself (progress_every_s)
        return RunHistory(engine.storage, run_id=engine.run_id, progress_every_s=0.0)

    def train_start(
        self,
        history: RunHistory | None,
        coordinator: Coordinator,
        *,
        step: int,
        resumed: Resumed | LoadResult | None,
        setup_unix: float,
    ) -> None:
        """Training starts (after any resume; every rank calls it: one broadcast). Rank 0
        opens the run's history and reads what the previous launches left there (the last
        progress record, earlier restarts); every rank gets those facts. Rank 0 records this
        launch's start and first progress before the first step, synchronously (a launch killed
        in its first step still counts); a resume's cost is recorded at the first step, when
        the recovery is complete."""
        if resumed is not None and not isinstance(resumed, Resumed):
            resumed = Resumed.from_load(resumed)  # CheckpointEngine.load's result
        self.history = history if self.rank == 0 else None
        if self.history is not None:
            self._recorder = HistoryRecorder(self.history, progress_every_s=self.progress_every_s)
        self._setup_unix, self._loaded_unix = setup_unix, time.time()

        def facts() -> PastLaunches:
            if self.history is None:
                return PastLaunches()
            return past_launches(self.history, resuming=resumed is not None)

        self._past = coordinator.broadcast(Phase.AGREE, facts, what="run history")
        self.history_mtbf_s = self._past.mtbf_s
        if resumed is not None:
            self._resume_fields = resume_record(
                resumed,
                self._past.last,
                world_size=self.world_size,
                setup_unix=self._setup_unix,
                loaded_unix=self._loaded_unix,
            )
            self.health.checkpointed(resumed.taken_unix, resumed.step)  # the work at risk
        else:
            self.health.at_risk_since(time.time(), step)
        if self._recorder is not None:
            nodes = sorted(set(self.hosts))
            self._recorder.now(
                "start",
                step=step,
                world_size=self.world_size,
                nodes=len(nodes),
                # the node names, capped: a start event stays small at any scale
                hosts=nodes[:_MAX_HOSTS],
                resumed_from=None if resumed is None else resumed.name,
                resumed_step=None if resumed is None else resumed.step,
            )

    def first_step(self, loggers: Sequence[MetricsLogger], step: int) -> None:
        """The first step after a resume is done: the recovery is complete; record it."""
        fields, self._resume_fields = self._resume_fields, None
        if fields is None:
            return
        fields["recovery"]["first_step_s"] = time.time() - self._loaded_unix
        h = self.health
        h.inc(f"{_P}restarts_total", self._past.restarts + 1)
        changed = fields["world_size"] != fields["previous_world_size"]
        h.inc(f"{_P}world_size_changes_total", self._past.world_size_changes + int(changed))
        if fields["lost_steps"] is not None and fields["planned"] is False:
            h.set(f"{_P}lost_work_steps", fields["lost_steps"])
            h.set(f"{_P}lost_work_seconds", fields["lost_s"])
        for phase, seconds in fields["recovery"].items():
            if seconds is not None:
                h.set(f"{_P}recovery_seconds", seconds, phase=phase.removesuffix("_s"))
        if self.rank == 0:
            log.info("resumed: %s", fields)
        self._record("resume", **fields)
        self.log_to(loggers, step)

    def step_recorded(self, step: int) -> None:
        """Rank 0: the run's progress (see :attr:`progress_every_s`)."""
        self._progress(step)

    def train_end(self, step: int, *, reason: str) -> None:
        """Training ends, normally or by a signal: either way not a failure (a resume after it
        lost nothing it did not plan to, and the MTBF does not count it)."""
        self._progress(step, force=True, planned=True)
        self._record("end", step=step, reason=reason)

    def flush(self, timeout: float | None = None) -> None:
        """Wait for the history writes queued so far (rank 0; a no-op elsewhere)."""
        if self._recorder is not None:
            self._recorder.flush(timeout)

    def crashed(self, step: int) -> None:
        """Training is ending with an exception: record how far it got, now (rank 0; the
        process may not live to run the background writer)."""
        if self._recorder is not None:
            self._recorder.crashed(step)

    def _progress(self, step: int, *, force: bool = False, planned: bool = False) -> None:
        if self._recorder is not None:
            self._recorder.progress(step, force=force, planned=planned)

    # ------------------------------------------------------------------ output

    def log_to(self, loggers: Sequence[MetricsLogger], step: int, *names: str) -> None:
        """Send the metrics (all, or ``names``) to the trainer's loggers."""
        values = self.health.snapshot(*names)
        if values:
            for logger in loggers:
                logger.log_metrics(values, step=step)

    def _record(self, kind: str, **fields: Any) -> None:
        if self._recorder is not None:
            self._recorder.record(kind, **fields)

    def close(self) -> None:
        """Finish the history writes (each is bounded by the storage's timeouts) and stop the
        metrics endpoint."""
        recorder, self._recorder = self._recorder, None
        if recorder is not None:
            recorder.close()
        self.health.close()


def failure_phase(exc: BaseException) -> str:
    """The phase a save failed in, for a metric label (one word)."""
    phases = getattr(exc, "phases", None)
    if phases:
        return str(sorted(phases)[0])
    return str(getattr(exc, "phase_name", None) or "unknown")


def _reason_label(reason: str) -> str:
    """``signal:SIGTERM`` -> ``signal`` (a bounded label set)."""
    return reason.split(":", 1)[0]
