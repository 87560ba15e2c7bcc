"""``DistributedCheckpoint``: barrier-synchronized, asynchronous, sharded checkpoints.

Every decision to save is the same on every rank: step and epoch triggers come from the
training counters; the time trigger is rank 0's clock and a caught signal is any rank's,
agreed with one small all-reduce at the end of each optimizer step (the last batch of a
gradient-accumulation window: a save inside a window would lose its partial gradients). A
signal (SIGTERM, SIGUSR1 by default) makes every rank take a *synchronous* checkpoint at the
same step and then exit with ``128 + signum`` (143 for SIGTERM): a non-zero code that
torchrun's elastic agent and SLURM's requeue treat as "restart me", after which
``resume="auto"`` picks up the checkpoint.

When a save is taken: a checkpoint of step N holds the state after everything Lightning does
for step N, as ``ModelCheckpoint`` saving after validation would, and more: the validation
loop (and every callback's ``on_validation_end``, e.g. ``EarlyStopping``), the
``ReduceLROnPlateau`` step that follows it, and at an epoch's end the epoch-end hooks and
epoch-interval schedulers. The decision is made at the end of step N's batch (where every rank
is, together); the save itself is deferred to the next quiet point: the next batch's
``on_train_batch_start`` (also across an epoch boundary) or ``on_train_end``. Saving at
``on_train_batch_end`` instead records the state *before* that step's validation, and a resume
never runs it: losses, LR plateaus, early-stopping counters and the recorded ``monitor`` value
all drift. Lightning restores these checkpoints through its usual restart path (the loop
counters say "between two batches"); see :func:`_between_batches_checkpoint`.
"""

from __future__ import annotations

import contextlib
import logging
import signal as signal_module
import time
from collections.abc import Iterator, Sequence
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Checkpoint
from typing_extensions import Unpack

from lightning_elastic.core.elastic.planned_exit import record_planned_exit
from lightning_elastic.core.engine import CheckpointEngine, SaveHandle
from lightning_elastic.core.forking_loaders import warn_forking_workers
from lightning_elastic.core.observe.history import RunHistory
from lightning_elastic.core.observe.lost_work import Resumed
from lightning_elastic.core.observe.monitor import HealthMonitor, failure_phase
from lightning_elastic.core.options import (
    MonitoringOptions,
    TierOptions,
    check_bool,
    check_choice,
    check_count,
    check_run_name,
    check_signals,
)
from lightning_elastic.core.policy.cadence import Cadence, CadenceOptions
from lightning_elastic.core.policy.retention import RetentionPolicy
from lightning_elastic.core.policy.schedule import SaveSchedule
from lightning_elastic.core.save.snapshot import SNAPSHOT_MODES
from lightning_elastic.errors import (
    CheckpointSaveError,
    ConfigError,
    SnapshotChangedError,
    StaleWriterError,
)
from lightning_elastic.lightning._compat import callback_state_key, checkpoint_after_batch
from lightning_elastic.lightning.checkpoint_options import (
    DeprecatedOptions,
    recorded_metrics,
    retention_policies,
    session_options,
    translate,
)
from lightning_elastic.lightning.resume import (
    install_dataloader_hook,
    install_resume_hook,
    uninstall_dataloader_hook,
    uninstall_resume_hook,
)
from lightning_elastic.lightning.session import ElasticSession, ResumeCost
from lightning_elastic.lightning.supported import check_strategy

if TYPE_CHECKING:
    from lightning_elastic.core.save.request import SaveResult

__all__ = ["DEFAULT_SIGNALS", "DistributedCheckpoint"]

log = logging.getLogger(__name__)

#: the signals that trigger a checkpoint-and-exit by default (SLURM's and torchrun's)
DEFAULT_SIGNALS = ("SIGTERM", "SIGUSR1")
_Group = TypeVar("_Group")


class DistributedCheckpoint(Checkpoint):
    """Sharded, asynchronous, two-phase-committed checkpoints with automatic resume.

    The options most runs set are flat and named as ``ModelCheckpoint`` names them; the
    advanced ones come in small groups (``cadence``, ``tiers``, ``monitoring``, ``retention``)
    that also work from a LightningCLI YAML. What applies to every checkpoint the trainer reads
    or writes (``checkpoint_timeout``, ``verify``, ``trusted``, ``storage_options``) is the
    strategy's: see ``ElasticStrategy`` and docs/options.md.

    Args:
        dirpath: directory or fsspec URL for the checkpoints (default:
            ``<default_root_dir>/checkpoints``; credentials: the strategy's
            ``storage_options``).
        every_n_train_steps: save every N optimizer steps (``global_step``).
        every_n_epochs: save at the end of every N-th training epoch.
        train_time_interval: save when this much training time passed since the last save
            (a ``timedelta``, seconds or a string like ``"30m"``); decided by rank 0's clock
            for all ranks. ``"auto"``: the interval follows Young-Daly,
            ``sqrt(2 x cost x MTBF)``, from each save's measured cost; ``"continuous"``: save
            as soon as the previous save committed and a minimum interval passed (both tuned
            by ``cadence``; docs/cadence.md).
        save_on_train_end: save when training ends (unless the last step is saved already).
        monitor: metric recorded with each checkpoint (from ``trainer.callback_metrics``);
            ``best_model_path`` follows it.
        mode: ``"min"`` or ``"max"``: which values of ``monitor`` are better.
        keep_last_n: keep the N newest checkpoints of this run.
        keep_best_k: also keep the K best checkpoints by ``monitor``.
        retention: more rules for which checkpoints to keep, as the policy classes:
            ``[KeepEveryNSteps(10_000), KeepBestK(3, "val_acc", "max")]`` (a checkpoint
            survives when any rule keeps it; each ``KeepBestK``'s metric is recorded too).
            Without any rule, every checkpoint is kept.
        resume: ``"auto"`` resumes a fresh ``fit`` from the newest valid checkpoint in
            ``dirpath``; ``"never"`` starts fresh (an explicit ``ckpt_path`` always wins).
        run_name: this run's identity, recorded in every manifest: ``resume="auto"`` resumes only
            this run's checkpoints and retention only deletes them. Default: the run whose
            checkpoint is newest in ``dirpath`` is continued (see docs/resuming.md).
        async_save: return to training once the state is staged in host memory.
        snapshot: how an asynchronous save stages the state: ``"lazy"`` returns to training
            once the copy is scheduled and copies the parameters and the optimizer state while
            the next step's forward and backward run (its optimizer step waits for the copy
            if it is not done); ``"blocking"`` copies everything before returning. Buffers
            and everything else the forward may change are copied before returning either
            way; a tensor changed in place outside the optimizer step turns lazy off for the
            run (docs/guarantees.md).
        when_busy: a save due while the previous one is still being written ``"wait"``s for
            it or is ``"skip"``ped (all ranks decide together).
        compression: ``None`` or ``"zstd"``.
        full_every_n_saves: incremental checkpoints (off by default): a tensor equal to the one
            the previous save of this run holds (a frozen base in fine-tuning) is not written
            again, the manifest refers to it; every n-th save is full, so a load reads from at
            most n checkpoints (docs/guarantees.md, "Incremental checkpoints"). Not with
            ``tiers``.
        signals: signals that trigger a checkpoint-and-exit: names (``"SIGTERM"``), numbers,
            or one comma-separated string (empty: none). Under ``strategy="elastic_ft"`` a
            signal drains a replica group instead: that strategy's ``drain_signals``.
        exit_on_signal: exit the process after the signal checkpoint (else just stop fitting).
        cadence: how ``train_time_interval="auto"`` or ``"continuous"`` chooses its interval
            (``CadenceOptions(mtbf=..., max_overhead=..., min_interval=...)``).
        tiers: multi-tier checkpoints (``TierOptions(local_dirpath=..., persist_every_n_saves=
            ..., replicas=..., local_keep=..., node=...)``; docs/tiers.md): every save commits
            on a node-local directory first and is copied to other nodes; ``dirpath`` becomes
            the persistent tier.
        monitoring: health metrics, stragglers and the run's history
            (``MonitoringOptions(metrics_port=..., straggler_factor=..., straggler_window=...,
            history=...)``; docs/monitoring.md). Default: ``MonitoringOptions()``.
        deprecated: the old flat spellings of the options that moved (``mtbf``,
            ``local_dirpath``, ``metrics_port``, ``timeout``, ``verify``, ...) still work, with
            an ``ElasticDeprecationWarning`` naming the new spelling.
    """

    def __init__(
        self,
        dirpath: str | Path | None = None,
        *,
        every_n_train_steps: int | None = None,
        every_n_epochs: int | None = None,
        train_time_interval: timedelta | float | str | None = None,
        save_on_train_end: bool = True,
        monitor: str | None = None,
        mode: str = "min",
        keep_last_n: int | None = None,
        keep_best_k: int | None = None,
        retention: Sequence[RetentionPolicy] | None = None,
        resume: str = "auto",
        run_name: str | None = None,
        async_save: bool = True,
        snapshot: str = "lazy",
        when_busy: str = "wait",
        compression: str | None = None,
        full_every_n_saves: int | None = None,
        signals: Sequence[str | int] | str = DEFAULT_SIGNALS,
        exit_on_signal: bool = True,
        cadence: CadenceOptions | None = None,
        tiers: TierOptions | None = None,
        monitoring: MonitoringOptions | None = None,
        **deprecated: Unpack[DeprecatedOptions],
    ) -> None:
        moved = translate(
            type(self).__name__, deprecated, cadence=cadence, tiers=tiers, monitoring=monitoring
        )
        if dirpath is not None and not isinstance(dirpath, (str, Path)):
            raise ConfigError(f"dirpath must be a path or URL string, got {dirpath!r}")
        self.dirpath = None if dirpath is None else str(dirpath)
        self.run_name = None if run_name is None else check_run_name(run_name)
        self.signals = check_signals(signals)
        self.cadence = _group(moved.cadence, CadenceOptions, "cadence")
        self.tiers = _group(moved.tiers, TierOptions, "tiers")
        self.monitoring = (
            _group(moved.monitoring, MonitoringOptions, "monitoring") or MonitoringOptions()
        )
        self._schedule = SaveSchedule(
            every_n_train_steps=every_n_train_steps,
            every_n_epochs=every_n_epochs,
            cadence=Cadence.of(train_time_interval, self.cadence),
            signals=self.signals,
        )
        self._strategy_options = moved.session  # deprecated spellings, applied at setup
        self._monitor: HealthMonitor | None = None
        self.save_on_train_end = check_bool(save_on_train_end, "save_on_train_end")
        self.async_save = check_bool(async_save, "async_save")
        self.snapshot = check_choice(snapshot, "snapshot", SNAPSHOT_MODES)
        self.when_busy = check_choice(when_busy, "when_busy", ("wait", "skip"))
        self.mode = check_choice(mode, "mode", ("min", "max"))
        if monitor is not None and not (isinstance(monitor, str) and monitor):
            raise ConfigError(f"monitor must be a metric name, got {monitor!r}")
        self.monitor = monitor
        self.retention = retention_policies(
            keep_last_n=keep_last_n,
            keep_best_k=keep_best_k,
            monitor=monitor,
            mode=self.mode,
            retention=retention,
            keep_every_n_steps=moved.keep_every_n_steps,
        )
        self._recorded = recorded_metrics(monitor, self.retention)
        self.resume = check_choice(resume, "resume", ("auto", "never"))
        self.exit_on_signal = check_bool(exit_on_signal, "exit_on_signal")
        self._leading = False  # elastic_ft: this group wrote the job's last checkpoint
        self._led_since: int | None = None
        self._pending_since: int | None = None  # the leadership the save in flight began in
        self._replica_seen = 0  # quorum events of the strategy already reported
        self.compression = check_choice(compression, "compression", (None, "zstd"))
        self.full_every_n_saves = (
            None
            if full_every_n_saves is None
            else check_count(full_every_n_saves, "full_every_n_saves")
        )
        if self.tiers is not None and (self.full_every_n_saves or 1) > 1:
            raise ConfigError(
                f"full_every_n_saves={self.full_every_n_saves} (incremental saves) is not "
                "supported with tiers yet: leave full_every_n_saves unset"
            )

        self.best_model_path = ""
        self.best_model_score: float | None = None
        self.last_model_path = ""
        self.preempted_by: int | None = None
        self._engine: CheckpointEngine | None = None
        self._session: ElasticSession | None = None
        self._pending: SaveHandle | None = None
        self._reason = ""  # of the save in flight
        self._first_step = False
        self._setup_unix = 0.0
        self._recovery: dict[str, Any] | None = None

    # ------------------------------------------------------------------ public API

    @property
    def state_key(self) -> str:
        return callback_state_key(self, dirpath=self.dirpath)

    @property
    def engine(self) -> CheckpointEngine:
        """The checkpoint engine of ``dirpath``; raises :class:`ConfigError` until ``fit`` sets it
        up."""
        if self._engine is None:
            raise ConfigError("DistributedCheckpoint is not set up yet (it is set up by fit)")
        return self._engine

    @property
    def resume_cost(self) -> ResumeCost | None:
        """What loading the checkpoint this fit resumed from cost this rank (selection,
        verification, read, bytes), or ``None`` when it started fresh."""
        return None if self._session is None else self._session.resume_cost

    @property
    def health(self) -> HealthMonitor | None:
        """What this rank observed in the last ``fit`` (``health.health``: the metrics;
        ``stragglers``: the last window's findings; ``port``: the metrics endpoint's)."""
        return self._monitor

    @property
    def recovery(self) -> dict[str, Any] | None:
        """Multi-tier (``local_dirpath``): what this rank's resume read, and from which tier
        (``checkpoint``, ``step``, ``tier``, ``plan_tier``, ``node``, ``bytes`` by source);
        ``None`` without tiers or on a fresh start."""
        return self._recovery

    def request_checkpoint(self) -> None:
        """Ask for a checkpoint at the end of the current optimizer step (any rank may ask);
        it holds the state after that step's validation, like every other checkpoint."""
        self._schedule.requested = True

    # ------------------------------------------------------------------ setup / teardown

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        check_strategy(trainer)
        if self.dirpath is None:
            self.dirpath = str(Path(trainer.default_root_dir) / "checkpoints")
        options = session_options(trainer.strategy, self._strategy_options)
        session = ElasticSession.of(trainer, options.timeout)
        session.timeout = options.timeout
        session.storage_options = options.storage_options
        session.trusted = options.trusted
        session.named_run = self.run_name is not None
        session.resume_cost = None  # set again if this fit resumes
        self._session = session
        self._engine = session.engine(
            self.dirpath,
            async_save=self.async_save,
            snapshot=self.snapshot,
            when_busy=self.when_busy,
            retention=self.retention,
            compression=self.compression,
            full_every_n_saves=self.full_every_n_saves,
            run_id=self.run_name,
            **({} if self.tiers is None else self.tiers.engine_options()),
        )
        session.writer = self._engine
        if stage == "fit":
            self._engine.check_writable()  # a bad dirpath fails here, not at the first save
        self._schedule.bind(session.ensure_coordinator())
        if _replica_role(trainer) is not _NOT_REPLICAS:
            # elastic_ft: a signal drains one replica group (the strategy's drain_signals,
            # agreed with the other groups at the step); the job's checkpoints are the leader
            # group's
            self._check_drain_signals(trainer.strategy)
            self._schedule.signals = ()
        self._setup_unix = time.time()
        if stage == "fit":
            monitoring = self.monitoring
            self._monitor = HealthMonitor(
                straggler_factor=monitoring.straggler_factor,
                straggler_window=monitoring.straggler_window,
            )
            self._monitor.start(
                session.ensure_coordinator(),
                port=monitoring.metrics_port,
                local_rank=trainer.local_rank,
            )
        install_resume_hook(
            trainer,
            session,
            self._engine,
            auto=self.resume == "auto" and stage == "fit",
            verify=options.verify,
        )
        install_dataloader_hook(trainer, session)

    def _check_drain_signals(self, strategy: Any) -> None:
        """Under ``elastic_ft`` the strategy's ``drain_signals`` are the signals: signals set
        on this callback that differ from them would be ignored, so they are refused."""
        drain = tuple(getattr(strategy, "drain_signals", ()))
        if self.signals not in (check_signals(DEFAULT_SIGNALS), drain):
            names = ",".join(signal_module.Signals(s).name for s in self.signals) or "none"
            raise ConfigError(
                f"DistributedCheckpoint(signals={names!r}) does not apply under "
                "strategy='elastic_ft', where a signal drains a replica group: set "
                "ElasticFTStrategy(drain_signals=...) instead"
            )

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._session is not None:
            self._session.on_train_start()  # the last logged values, for the hooks to come
        warn_forking_workers(  # CPython gh-112275 (Python < 3.11.10): see getting-started.md
            trainer.train_dataloader, async_save=self.async_save, rank=trainer.global_rank
        )
        self._schedule.start(trainer.global_step)
        last = self.engine.last_recovery
        self._recovery = None if last is None else last.to_json()
        self.preempted_by = None
        self._first_step = True
        if self._monitor is not None:
            self._start_monitor(trainer)

    def _start_monitor(self, trainer: pl.Trainer) -> None:
        """Open the run's history (rank 0), note the resume, choose the adaptive cadence."""
        assert self._monitor is not None and self._session is not None
        engine = self.engine
        history = None
        if self.monitoring.history and engine.rank == 0:
            history = RunHistory(
                engine.storage,
                run_id=engine.run_id,
                progress_every_s=0.0,  # the monitor throttles (see its progress_every_s)
            )
        self._monitor.train_start(
            history,
            self._session.ensure_coordinator(),
            step=trainer.global_step,
            resumed=Resumed.of(self._session.resumed, self._session.resume_cost),
            setup_unix=self._setup_unix,
        )
        schedule = self._schedule
        cadence = schedule.cadence.build_auto(
            nodes=self._monitor.nodes, history_mtbf_s=self._monitor.history_mtbf_s
        )
        self._monitor.cadence = cadence
        if cadence is not None and schedule.interval is not None:
            schedule.interval.seconds = cadence.interval_s

    def on_before_backward(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Any
    ) -> None:
        if self._monitor is not None:
            self._monitor.before_backward()

    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any
    ) -> None:
        # the first thing that changes the saved parameters and optimizer state: a lazy
        # snapshot's copy must be done (with accumulation, the accumulation boundary; under
        # manual optimization, each optimizer.step()). Lightning calls this after the
        # closure's forward and backward, so the copy overlaps them; torch's own step
        # pre-hook would run before the closure and wait before the forward.
        if self._engine is not None:
            if self._monitor is None:
                self._engine.wait_snapshot()
            else:
                with self._monitor.saving():  # time lost to checkpoints, not to the step
                    self._engine.wait_snapshot()
        if self._monitor is not None:
            self._monitor.before_optimizer_step()

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._schedule.stop()
        self._take_deferred(trainer, between_batches=False)  # may exit (a signal)
        if self.save_on_train_end and trainer.global_step != self._schedule.last_step:
            checkpoint = self._train_end_checkpoint(trainer)
            self._save(trainer, reason="train_end", blocking=True, checkpoint=checkpoint)
        self._finish_pending(trainer, wait=True)
        self.engine.persist_latest()  # multi-tier: the newest save of a fit is persisted
        if self._monitor is not None:
            self._monitor.train_end(trainer.global_step, reason="train_end")

    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        self._schedule.deferred = None
        self._schedule.stop()
        # our own checkpoint-and-exit on a signal, or Ctrl-C, is a planned end (recorded as one)
        planned = self.preempted_by is not None or isinstance(exception, KeyboardInterrupt)
        if self._monitor is not None and isinstance(exception, KeyboardInterrupt):
            self._monitor.train_end(trainer.global_step, reason="keyboard_interrupt")
        elif self._monitor is not None and not planned:
            self._monitor.crashed(trainer.global_step)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        uninstall_resume_hook(trainer)
        uninstall_dataloader_hook(trainer)
        if self._monitor is not None:
            self._monitor.close()  # kept: its metrics stay readable after fit
        try:
            if self._session is not None:
                self._session.close()
        except Exception as exc:
            # never mask the error that ended training (the save's error surfaced before)
            log.error("closing the checkpoint engine failed: %r", exc)
            if not trainer.interrupted:
                raise
        finally:
            self._engine = None

    # ------------------------------------------------------------------ triggers

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        # the quiet point: everything Lightning does for the previous step (validation,
        # schedulers, epoch end) is done, and nothing of this batch has run but the callbacks'
        # on_train_batch_start before ours (Lightning runs Checkpoint callbacks last)
        monitor = self._monitor
        role = _replica_role(trainer)
        if role is not _NOT_REPLICAS and role is not None and role.leaving:
            self._leave(trainer, role)  # exits (a drained replica group)
        if monitor is None:
            self._take_deferred(trainer, between_batches=True)
        else:
            monitor.batch_start()
            with monitor.saving():
                self._take_deferred(trainer, between_batches=True)
        self._schedule.batch_start_step = trainer.global_step
        if self._session is not None:
            self._session.on_train_batch_start()

    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        self._finish_pending(trainer, wait=False)
        step = trainer.global_step
        if self._schedule.in_window(step):
            return
        busy = self._pending is not None and not self._pending.done()
        monitor = self._monitor
        if monitor is None:
            self._schedule.decide(step, busy=busy)
            return
        monitor.step_end(step=step, writing=busy)
        replicas = getattr(trainer.strategy, "replicas", None)
        if replicas is not None and _replica_role(trainer) is not _NOT_REPLICAS:
            events, self._replica_seen = replicas.events[self._replica_seen :], len(replicas.events)
            role = _replica_role(trainer)
            participants = 1 if role is None else role.participants
            monitor.replica_events(events, participants, replicas.name)
        decision = self._schedule.decide(step, busy=busy, shared=monitor.shared(step))
        monitor.after_agreement(step, decision.shared, trainer.loggers)
        if self._first_step:
            monitor.first_step(trainer.loggers, step)
            self._first_step = False
        monitor.step_recorded(step)
        monitor.step_done()

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._monitor is not None and trainer.state.fn == "fit":
            self._monitor.validation_started()

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """A ``monitor`` (or a ``KeepBestK``'s metric) that the validation just run did not
        log is a mistake (a misspelled name): raise, as ``ModelCheckpoint`` does, rather than
        record nothing forever."""
        if self._monitor is not None:
            self._monitor.validation_ended()
        if trainer.sanity_checking or trainer.state.fn != "fit":
            return  # validate()/test() on their own may log other metrics than fit does
        for name in self._recorded:
            if name not in trainer.callback_metrics:
                logged = ", ".join(sorted(trainer.callback_metrics)) or "none"
                raise ConfigError(
                    f"DistributedCheckpoint({self._metric_option(name)}): no such metric after "
                    f"validation (logged: {logged}); log it with self.log({name!r}, ...) "
                    "or fix the name"
                )

    def _metric_option(self, name: str) -> str:
        """The option that asked to record the metric ``name``, as the user wrote it."""
        if name == self.monitor:
            return f"monitor={name!r}"
        return f"retention=[KeepBestK(monitor={name!r})]"

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._schedule.epoch_end(trainer.current_epoch, trainer.global_step)

    # ------------------------------------------------------------------ saving

    def _take_deferred(self, trainer: pl.Trainer, *, between_batches: bool) -> None:
        """Take the save decided at the end of the last optimizer step (every rank reaches
        the same quiet point: the decision was agreed and the loops are in lockstep)."""
        deferred = self._schedule.take()
        if deferred is None:
            return
        reason, signum = deferred
        # the save was decided at the end of the last batch: it holds the state as of then
        # (after that step's validation), in Lightning's own form for that moment
        checkpoint = (
            checkpoint_after_batch(trainer, at_train_end=False)
            if between_batches
            else self._train_end_checkpoint(trainer)
        )
        if signum:
            self._preempt(trainer, signum, checkpoint=checkpoint)
        else:
            self._save(trainer, reason=reason, checkpoint=checkpoint)

    @staticmethod
    def _train_end_checkpoint(trainer: pl.Trainer) -> dict[str, Any] | None:
        """At ``on_train_end``: when training stopped inside an epoch (``max_steps``, a
        stop request), the loop already marked the epoch done; undo that, so a resumed run
        continues the epoch rather than starting the next one."""
        if trainer.fit_loop.epoch_loop.batch_progress.is_last_batch:
            return None  # the epoch really ended: Lightning's own end-of-training form
        return checkpoint_after_batch(trainer, at_train_end=True)

    def _save(
        self,
        trainer: pl.Trainer,
        *,
        reason: str,
        blocking: bool | None = None,
        checkpoint: dict[str, Any] | None = None,
    ) -> None:
        assert self._session is not None and self._engine is not None
        if not self._writes_for_the_job(trainer):
            self._schedule.saved(trainer.global_step)  # the leader group saved this step
            return
        metrics = {}
        for name in self._recorded:
            if name in trainer.callback_metrics:
                metrics[name] = float(trainer.callback_metrics[name])
            elif not trainer.enable_validation:
                # no validation will ever log it: a misspelled training metric, or a
                # validation metric without a validation loop (with one, on_validation_end
                # checks)
                logged = ", ".join(sorted(trainer.callback_metrics)) or "none"
                raise ConfigError(
                    f"DistributedCheckpoint({self._metric_option(name)}): no such metric at "
                    f"this save and this fit runs no validation (logged: {logged}); log it with "
                    f"self.log({name!r}, ...) or fix the name"
                )
        # the previous save's failure surfaces here too (the engine waits for it first)
        failing = self._pending.step if self._pending is not None else trainer.global_step
        with self._counting_failures(failing):
            handle = self._session.save(
                self._engine,
                reason=reason,
                blocking=blocking,
                metrics=metrics,
                checkpoint=checkpoint,
            )
        if handle is None:  # skipped: the previous save is still being written
            if self._monitor is not None:
                self._monitor.skipped()
            return
        self._finish_pending(trainer, wait=True)  # the engine waited for it: report it
        self._schedule.saved(trainer.global_step)
        self._reason = reason
        self.last_model_path = self._engine.storage.display(handle.name)
        score = metrics.get(self.monitor) if self.monitor else None
        if score is not None and self._better(score):
            self.best_model_score, self.best_model_path = score, self.last_model_path
        if handle.done():
            self._report(trainer, handle, since=self._led_since)
        else:
            self._pending, self._pending_since = handle, self._led_since
            if self._monitor is not None:
                self._monitor.in_flight()

    def _better(self, score: float) -> bool:
        best = self.best_model_score
        return best is None or (score < best if self.mode == "min" else score > best)

    def _finish_pending(self, trainer: pl.Trainer, *, wait: bool) -> None:
        """Report a finished save. A failure is raised only where every rank waits (the next
        save, the end of training): ranks finish at different moments, and raising on one
        while the others enter the next step's agreement would split the job."""
        handle = self._pending
        if handle is None or not (wait or (handle.done() and handle.succeeded())):
            return
        self._pending = None
        # with wait: raises the save's error, on every rank
        self._report(trainer, handle, since=self._pending_since)

    @contextlib.contextmanager
    def _counting_failures(self, step: int) -> Iterator[None]:
        """Count a save that fails (by phase) before its error goes on."""
        try:
            yield
        except CheckpointSaveError as exc:
            if self._monitor is not None:
                self._monitor.failed(failure_phase(exc), step, exc)
            raise

    def _report(self, trainer: pl.Trainer, handle: SaveHandle, *, since: int | None = None) -> None:
        monitor = self._monitor
        try:
            with self._counting_failures(handle.step):
                result: SaveResult = handle.result()
        except SnapshotChangedError as exc:
            # not committed on any rank (it would have mixed two states); the engine warned
            # once and takes blocking snapshots from now on
            log.warning("checkpoint of step %d not committed: %s", handle.step, exc)
            return
        except StaleWriterError as exc:
            role = _replica_role(trainer)
            leads = role is None or (role.leader and role.leader_since == since)
            if role is _NOT_REPLICAS or leads:
                raise  # refused while this group still leads: another writer of the run
            # elastic_ft: this group led when it started the save; another group led since
            # (this one was stopped, evicted and healed) and took the run's lease, so this
            # older state is not committed over the newer leader's checkpoints
            log.warning("checkpoint of step %d not committed: %s", handle.step, exc)
            return
        if monitor is not None:
            chosen = monitor.committed(result, reason=self._reason)
            if chosen is not None and self._schedule.interval is not None:
                self._schedule.interval.seconds = chosen  # the adaptive cadence's new interval
        seconds = max(result.total_s, 1e-9)
        stats = {
            "checkpoint/blocked_s": result.blocked_s,
            "checkpoint/snapshot_wait_s": result.snapshot_wait_s,
            "checkpoint/lazy_snapshot": float(result.snapshot == "lazy"),
            "checkpoint/commit_s": result.total_s,
            "checkpoint/bytes": float(result.bytes_written),
            "checkpoint/GBps": result.bytes_written / seconds / 1e9,
        }
        for logger in trainer.loggers:
            logger.log_metrics(stats, step=result.step)
        if monitor is not None:
            monitor.log_to(trainer.loggers, result.step)
        log.info("checkpoint %s committed (%s)", result.location, stats)

    def _preempt(
        self, trainer: pl.Trainer, signum: int, *, checkpoint: dict[str, Any] | None = None
    ) -> None:
        name = signal_module.Signals(signum).name
        log.warning(
            "%s received on some rank: synchronous checkpoint at step %d, then exit",
            name,
            trainer.global_step,
        )
        self._finish_pending(trainer, wait=True)
        if trainer.global_step != self._schedule.last_step:
            self._save(trainer, reason=f"signal:{name}", blocking=True, checkpoint=checkpoint)
        self._finish_pending(trainer, wait=True)
        self.engine.persist_latest()  # multi-tier: a preempted job's nodes may not come back
        self.preempted_by = signum
        self._schedule.stop()
        trainer.should_stop = True
        if self._monitor is not None:
            self._monitor.train_end(trainer.global_step, reason=f"signal:{name}")
        if self.exit_on_signal:
            # tell `lightning-elastic run` this exit is a planned one (nothing outside it)
            record_planned_exit(128 + signum, trainer.global_step)
            raise SystemExit(128 + signum)

    def _writes_for_the_job(self, trainer: pl.Trainer) -> bool:
        """Under ``elastic_ft`` only the leader group (participant 0 of the step) writes the
        job's checkpoints, once for all groups; a group that becomes the leader takes the run's
        lease first (collective within the group: every process sees the same role)."""
        role = _replica_role(trainer)
        if role is _NOT_REPLICAS:
            return True
        leader = role is None or role.leader
        since = None if role is None else role.leader_since
        if leader and (not self._leading or since != self._led_since):
            # a save of an earlier leadership still in flight is settled first (it may be
            # refused: another group led in between), then the lease is this leadership's
            self._finish_pending(trainer, wait=True)
            self.engine.take_over(renew=True)
        self._leading, self._led_since = leader, since
        return leader

    def _leave(self, trainer: pl.Trainer, role: Any) -> None:
        """A drained replica group leaves at this boundary; when every group is drained, the
        leader writes a last checkpoint first."""
        self._schedule.deferred = None
        if role.everyone_leaving and role.leader:
            self._preempt(trainer, role.signum)  # synchronous checkpoint, then exit
        self._finish_pending(trainer, wait=True)
        self._schedule.stop()
        if self._monitor is not None:
            self._monitor.train_end(trainer.global_step, reason="replica_group_left")
        if self.exit_on_signal:
            record_planned_exit(128 + role.signum, trainer.global_step)
            raise SystemExit(128 + role.signum)
        trainer.should_stop = True

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict[str, Any]:
        return {
            "best_model_path": self.best_model_path,
            "best_model_score": self.best_model_score,
            "last_model_path": self.last_model_path,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.best_model_path = state_dict.get("best_model_path", "")
        self.best_model_score = state_dict.get("best_model_score")
        self.last_model_path = state_dict.get("last_model_path", "")


_NOT_REPLICAS: Any = object()


def _replica_role(trainer: pl.Trainer) -> Any:
    """The strategy's :class:`~lightning_elastic.lightning.replicas.ReplicaRole` under
    ``elastic_ft`` (``None`` before the first committed step), else ``_NOT_REPLICAS``."""
    if not hasattr(trainer.strategy, "replica_checkpoint_state"):
        return _NOT_REPLICAS
    return getattr(trainer.strategy, "role", None)


def _group(value: _Group | None, cls: type[_Group], name: str) -> _Group | None:
    """``value`` if it is a ``cls`` (or ``None``), else a ``ConfigError`` naming the class."""
    if value is not None and not isinstance(value, cls):
        raise ConfigError(f"{name} must be a {cls.__name__}(...), got {value!r}")
    return value
