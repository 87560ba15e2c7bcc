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
from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Checkpoint

from lightning_elastic.core.elastic.planned_exit import record_planned_exit
from lightning_elastic.core.engine import CheckpointEngine, SaveHandle
from lightning_elastic.core.forking_loaders import warn_forking_workers
from lightning_elastic.core.format.integrity import VERIFY_MODES
from lightning_elastic.core.observe.history import RunHistory
from lightning_elastic.core.observe.lost_work import Resumed
from lightning_elastic.core.observe.monitor import HealthMonitor, failure_phase
from lightning_elastic.core.options import (
    check_bool,
    check_choice,
    check_count,
    check_factor,
    check_port,
    check_run_name,
    check_seconds,
    check_signals,
    one_timeout,
    tier_options,
)
from lightning_elastic.core.policy.cadence import Cadence
from lightning_elastic.core.policy.retention import KeepBestK, KeepEveryNSteps, KeepLastN
from lightning_elastic.core.policy.schedule import SaveSchedule
from lightning_elastic.errors import CheckpointSaveError, ConfigError, StaleWriterError
from lightning_elastic.lightning._compat import callback_state_key, checkpoint_after_batch
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

__all__ = ["DistributedCheckpoint"]

log = logging.getLogger(__name__)


class DistributedCheckpoint(Checkpoint):
    """Sharded, asynchronous, two-phase-committed checkpoints with automatic resume.

    Args:
        dirpath: directory or fsspec URL for the checkpoints (default:
            ``<default_root_dir>/checkpoints``).
        storage_options: fsspec options for ``dirpath`` (credentials, endpoint_url, ...).
        every_n_train_steps: save every N optimizer steps (``global_step``).
        train_time_interval: save when this much training time passed since the last save
            (a ``timedelta`` or seconds); decided by rank 0's clock for all ranks. ``"auto"``:
            the interval follows Young-Daly, ``sqrt(2 x cost x MTBF)``, from each save's
            measured cost (see ``mtbf``, ``max_overhead`` and docs/cadence.md);
            ``"continuous"``: save as soon as the previous save committed and
            ``min_interval`` passed.
        every_n_epochs: save at the end of every N-th training epoch.
        save_on_train_end: save when training ends (unless the last step is saved already).
        async_save: return to training once the state is staged in host memory.
        when_busy: a save due while the previous one is still being written ``"wait"``s for
            it or is ``"skip"``ped (all ranks decide together).
        keep_last_n: keep the N newest checkpoints of this run.
        keep_every_n_steps: also keep every checkpoint whose step is a multiple of N.
        monitor: metric recorded with each checkpoint (from ``trainer.callback_metrics``).
        mode: ``"min"`` or ``"max"``: which values of ``monitor`` are better.
        keep_best_k: also keep the K best checkpoints by ``monitor``.
        verify: check checkpoints before loading: ``"full"`` (checksums), ``"size"``, ``"none"``.
        resume: ``"auto"`` resumes a fresh ``fit`` from the newest valid checkpoint in
            ``dirpath``; ``"never"`` starts fresh (an explicit ``ckpt_path`` always wins).
        timeout: how long ranks wait for each other in a save or load before failing (a
            ``timedelta`` or seconds; default: the strategy's ``checkpoint_timeout`` when it has
            one, else 10 minutes; giving both with different values is an error).
        signals: signals that trigger a checkpoint-and-exit: names (``"SIGTERM"``), numbers,
            or one comma-separated string (empty: none).
        exit_on_signal: exit the process after the signal checkpoint (else just stop fitting).
        compression: ``None`` or ``"zstd"``.
        trusted: load checkpoint objects without the safe-loading allowlist (unpickling may run
            code from the checkpoint): only for checkpoints whose origin you trust. By default a
            checkpoint holding a type outside the allowlist raises ``UnsafeCheckpointError``.
        run_name: this run's identity, recorded in every manifest: ``resume="auto"`` resumes only
            this run's checkpoints and retention only deletes them. Default: the run whose
            checkpoint is newest in ``dirpath`` is continued (see docs/resuming.md).
        mtbf: with ``train_time_interval="auto"``: one node's mean time between failures
            (``"4h"``, ``"90m"``, seconds or a ``timedelta``, up to a century); the job's is
            this over the number of nodes. Default: measured from the run's restart history in
            ``dirpath`` (until a first failure, saves are only bounded by ``max_overhead``).
        max_overhead: with ``"auto"``: the largest fraction of training time saves may cost
            (default 0.01).
        min_interval: with ``"continuous"``: the least time between two saves, and from the
            start to the first (default 60 s; seconds, a ``timedelta`` or ``"5m"``).
        metrics_port: serve this rank's health metrics for Prometheus on
            ``metrics_port + local rank`` (``0``: any free port; needs ``prometheus_client``,
            the ``metrics`` extra). Default: not served (the loggers still get them).
        straggler_factor: report a rank whose step time exceeds the median rank's by this
            factor over a window (``None``: never).
        straggler_window: optimizer steps per straggler window (every rank's timings ride on
            the per-step agreement at each window's last step).
        history: record the run's events (starts, resumes, commits, progress) in
            ``dirpath/_history`` for ``lightning-elastic report`` and the lost-work metrics.
        local_dirpath: a node-local directory (``/dev/shm/...``, a local NVMe disk): multi-tier
            checkpoints (docs/tiers.md). Every save commits there first and each rank's shard
            is copied to ``replicas`` other nodes; ``dirpath`` becomes the persistent tier,
            written every ``persist_every_n_saves``-th save and at the end of a fit or on a
            signal; resume reads each node's files from the fastest tier holding them.
        persist_every_n_saves: with ``local_dirpath``: persist every k-th save (default 1).
        replicas: with ``local_dirpath``: other nodes holding a copy of each rank's shard
            (default 1).
        local_keep: with ``local_dirpath``: checkpoints kept per node (default 2).
        node: with ``local_dirpath``: this node's id (default ``$LIGHTNING_ELASTIC_NODE``,
            else the host name).
    """

    def __init__(
        self,
        dirpath: str | Path | None = None,
        *,
        storage_options: dict[str, Any] | None = None,
        every_n_train_steps: int | None = None,
        train_time_interval: timedelta | float | str | None = None,
        every_n_epochs: int | None = None,
        save_on_train_end: bool = True,
        async_save: bool = True,
        when_busy: str = "wait",
        keep_last_n: int | None = None,
        keep_every_n_steps: int | None = None,
        monitor: str | None = None,
        mode: str = "min",
        keep_best_k: int | None = None,
        verify: str = "full",
        resume: str = "auto",
        timeout: timedelta | float | None = None,
        signals: Sequence[str | int] | str = ("SIGTERM", "SIGUSR1"),
        exit_on_signal: bool = True,
        compression: str | None = None,
        trusted: bool = False,
        run_name: str | None = None,
        mtbf: timedelta | float | str | None = None,
        max_overhead: float | None = None,
        min_interval: timedelta | float | str | None = None,
        metrics_port: int | None = None,
        straggler_factor: float | None = 1.5,
        straggler_window: int = 50,
        history: bool = True,
        local_dirpath: str | Path | None = None,
        persist_every_n_saves: int | None = None,
        replicas: int | None = None,
        local_keep: int | None = None,
        node: str | None = None,
    ) -> None:
        if dirpath is not None and not isinstance(dirpath, (str, Path)):
            raise ConfigError(f"dirpath must be a path or URL string, got {dirpath!r}")
        self.dirpath = None if dirpath is None else str(dirpath)
        if storage_options is not None and not isinstance(storage_options, dict):
            raise ConfigError(f"storage_options must be a dict, got {storage_options!r}")
        self.storage_options = dict(storage_options or {})
        self.run_name = None if run_name is None else check_run_name(run_name)
        self.signals = check_signals(signals)
        self._schedule = SaveSchedule(
            every_n_train_steps=every_n_train_steps,
            every_n_epochs=every_n_epochs,
            cadence=Cadence.of(
                train_time_interval,
                mtbf=mtbf,
                max_overhead=max_overhead,
                min_interval=min_interval,
            ),
            signals=self.signals,
        )
        self.metrics_port = check_port(metrics_port)
        self.straggler_factor = check_factor(straggler_factor)
        self.straggler_window = check_count(straggler_window, "straggler_window")
        self.history = check_bool(history, "history")
        self._tiers = tier_options(
            local_dirpath,
            persist_every_n_saves=persist_every_n_saves,
            replicas=replicas,
            local_keep=local_keep,
            node=node,
        )
        self._monitor: HealthMonitor | None = None
        self.save_on_train_end = check_bool(save_on_train_end, "save_on_train_end")
        self.async_save = check_bool(async_save, "async_save")
        self.when_busy = check_choice(when_busy, "when_busy", ("wait", "skip"))
        self.mode = check_choice(mode, "mode", ("min", "max"))
        if monitor is not None and not (isinstance(monitor, str) and monitor):
            raise ConfigError(f"monitor must be a metric name, got {monitor!r}")
        if keep_best_k is not None and not monitor:
            raise ConfigError("keep_best_k needs monitor=<metric name>")
        self.monitor = monitor
        self._retention: list[Any] = []
        if keep_last_n is not None:
            self._retention.append(KeepLastN(keep_last_n))
        if keep_every_n_steps is not None:
            self._retention.append(KeepEveryNSteps(keep_every_n_steps))
        if keep_best_k is not None:
            assert monitor is not None
            self._retention.append(KeepBestK(keep_best_k, monitor, mode))
        self.verify = check_choice(verify, "verify", VERIFY_MODES)
        self.resume = check_choice(resume, "resume", ("auto", "never"))
        # one timeout: this one or the strategy's checkpoint_timeout (see setup)
        self.timeout = (
            None if timeout is None else timedelta(seconds=check_seconds(timeout, "timeout"))
        )
        self.exit_on_signal = check_bool(exit_on_signal, "exit_on_signal")
        self._leading = False  # elastic_ft: this group wrote the job's last checkpoint
        self._led_since: int | None = None
        self._replica_seen = 0  # quorum events of the strategy already reported
        self.compression = check_choice(compression, "compression", (None, "zstd"))
        self.trusted = check_bool(trusted, "trusted")

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
        timeout = one_timeout(
            timeout=self.timeout,
            checkpoint_timeout=getattr(trainer.strategy, "checkpoint_timeout", None),
        )
        session = ElasticSession.of(trainer, timeout)
        session.timeout = timeout
        if self.storage_options:
            session.storage_options = self.storage_options
        session.trusted = session.trusted or self.trusted
        session.named_run = self.run_name is not None
        session.resume_cost = None  # set again if this fit resumes
        self._session = session
        self._engine = session.engine(
            self.dirpath,
            storage_options=self.storage_options,
            async_save=self.async_save,
            when_busy=self.when_busy,
            retention=self._retention,
            compression=self.compression,
            run_id=self.run_name,
            **self._tiers,
        )
        session.writer = self._engine
        if stage == "fit":
            self._engine.check_writable()  # a bad dirpath fails here, not at the first save
        self._schedule.bind(session.ensure_coordinator())
        if _replica_role(trainer) is not _NOT_REPLICAS:
            # elastic_ft: a signal drains one replica group (the strategy's, agreed with the
            # other groups at the step); the job's checkpoints are the leader group's
            self._schedule.signals = ()
        self._setup_unix = time.time()
        if stage == "fit":
            self._monitor = HealthMonitor(
                straggler_factor=self.straggler_factor, straggler_window=self.straggler_window
            )
            self._monitor.start(
                session.ensure_coordinator(),
                port=self.metrics_port,
                local_rank=trainer.local_rank,
            )
        install_resume_hook(
            trainer,
            session,
            self._engine,
            auto=self.resume == "auto" and stage == "fit",
            verify=self.verify,
        )
        install_dataloader_hook(trainer, session)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
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
        if self.history and engine.rank == 0:
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
        """A ``monitor`` that the validation just run did not log is a mistake (a misspelled
        name): raise, as ``ModelCheckpoint`` does, rather than record nothing forever."""
        if self._monitor is not None:
            self._monitor.validation_ended()
        if self.monitor is None or trainer.sanity_checking or trainer.state.fn != "fit":
            return  # validate()/test() on their own may log other metrics than fit does
        if self.monitor not in trainer.callback_metrics:
            logged = ", ".join(sorted(trainer.callback_metrics)) or "none"
            raise ConfigError(
                f"DistributedCheckpoint(monitor={self.monitor!r}): no such metric after "
                f"validation (logged: {logged}); log it with self.log({self.monitor!r}, ...) "
                "or fix the name"
            )

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
        if self.monitor is not None and self.monitor in trainer.callback_metrics:
            metrics[self.monitor] = float(trainer.callback_metrics[self.monitor])
        elif self.monitor is not None and not trainer.enable_validation:
            # no validation will ever log it: a misspelled training metric, or a validation
            # metric without a validation loop (with one, on_validation_end checks)
            logged = ", ".join(sorted(trainer.callback_metrics)) or "none"
            raise ConfigError(
                f"DistributedCheckpoint(monitor={self.monitor!r}): no such metric at this save "
                f"and this fit runs no validation (logged: {logged}); log it with "
                f"self.log({self.monitor!r}, ...) or fix the name"
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
            self._report(trainer, handle)
        else:
            self._pending = handle
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
        self._report(trainer, handle)  # with wait: raises the save's error, on every rank

    @contextlib.contextmanager
    def _counting_failures(self, step: int) -> Iterator[None]:
        """Count a save that fails (by phase) before its error goes on."""
        try:
            yield
        except CheckpointSaveError as exc:
            if self._monitor is not None:
                self._monitor.failed(failure_phase(exc), step, exc)
            raise

    def _report(self, trainer: pl.Trainer, handle: SaveHandle) -> None:
        monitor = self._monitor
        try:
            with self._counting_failures(handle.step):
                result: SaveResult = handle.result()
        except StaleWriterError as exc:
            if self._leading or _replica_role(trainer) is _NOT_REPLICAS:
                raise
            # elastic_ft: this group was the leader when it started the save; another group
            # leads now (this one was stopped, evicted and healed) and its commit won
            log.warning("checkpoint of step %d not committed: %s", handle.step, exc)
            return
        if monitor is not None:
            chosen = monitor.committed(result, reason=self._reason)
            if chosen is not None and self._schedule.interval is not None:
                self._schedule.interval.seconds = chosen  # the adaptive cadence's new interval
        seconds = max(result.total_s, 1e-9)
        stats = {
            "checkpoint/blocked_s": result.blocked_s,
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
