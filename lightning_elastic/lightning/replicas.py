"""``ElasticFTStrategy`` (``strategy="elastic_ft"``): replica groups that leave and join while
the others keep training, on torchft's Lighthouse and Manager.

The job is made of *replica groups*, each one or more processes started by its own
``torchrun``/``lightning-elastic run`` with a process group of its own; torchft's Lighthouse
decides, at every optimizer step, which groups take part. What this strategy does at each
optimizer step (see :mod:`lightning_elastic.core.replicas.group` for the protocol):

* at the step's first batch (``batch_to_device``): join the quorum; a group that is behind
  receives the live state from a peer (model, optimizers, LR schedulers, precision plugin,
  callbacks, loop counters, the data queue) and takes part in this very step; the batch
  becomes this process's share of the step's samples (:mod:`.replica_data`);
* after the backward pass (``optimizer_step``): the gradients are summed over the group and
  then over the groups, weighted by the samples each process trained, and the step is voted;
  a committed step is applied (gradient clipping, ``on_before_optimizer_step`` and the
  optimizer step run on the reduced gradients); a step that did not commit (a peer died or was
  evicted) is redone at once with the new quorum: the logged values and torchmetrics states of
  the failed attempt are rolled back, the step's samples are shared out again and the forward
  and backward passes run again, so Lightning, callbacks and LR schedulers see each committed
  step exactly once, under one step count.

Within a group the model is not wrapped in ``DistributedDataParallel``: gradients are reduced
once, after the backward pass, over both levels. The loss of ``training_step`` is taken to be
a mean over the batch (as under DDP); each micro-batch's is weighted by its share of samples.
"""

from __future__ import annotations

import dataclasses
import logging
import socket
import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.plugins.environments.cluster_environment import ClusterEnvironment
from lightning.fabric.plugins.io import CheckpointIO
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from torch.distributed.constants import default_pg_timeout

from lightning_elastic.core.elastic.planned_exit import record_planned_exit
from lightning_elastic.core.format.catalog import split_location
from lightning_elastic.core.options import check_choice, check_signals
from lightning_elastic.core.policy.triggers import SignalFlag
from lightning_elastic.core.replicas.group import ReplicaGroup, ReplicaOptions, unflatten_into
from lightning_elastic.errors import ConfigError, ReplicaGroupError
from lightning_elastic.lightning._compat import (
    before_batch_transfer,
    set_closure_batch,
    trainer_of,
    training_results,
    validates_by_time,
)
from lightning_elastic.lightning.replica_data import (
    ReplicaBatchSampler,
    ReplicaData,
    Window,
    make_replica_loader,
)
from lightning_elastic.lightning.replica_state import LiveState, StepSnapshot
from lightning_elastic.lightning.strategy import ElasticCheckpointing

__all__ = ["ElasticFTStrategy", "ReplicaRole"]

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class ReplicaRole:
    """This group's part in the job after the last committed step, as checkpoint callbacks
    read it: ``leader`` (participant 0: it writes the job's checkpoints, once for every
    group), the participating groups, and a drain: this group ``leaving`` (a drain signal
    reached one of its processes; it leaves before the next step), and whether every group
    is (then the leader takes a last checkpoint first). ``leader_since`` changes whenever
    another group may have led in between (this group was not the leader, or healed): the
    leader then takes the run's lease anew before it writes."""

    leader: bool
    participants: int
    leader_since: int | None = None  # the step this group's current leadership began
    leaving: bool = False
    everyone_leaving: bool = False
    signum: int = 0


class ElasticFTStrategy(ElasticCheckpointing, DDPStrategy):
    """Replica groups that leave and join without stopping the others (torchft).

    Args:
        lighthouse: the Lighthouse's address (``http://host:port``; default
            ``$LIGHTNING_ELASTIC_LIGHTHOUSE``; start one with ``lightning-elastic lighthouse``).
        replica_group: this group's name, the same on each of its processes (default
            ``$LIGHTNING_ELASTIC_REPLICA_GROUP``, then the host name and launcher's id).
        min_replica_groups: the fewest groups a step may commit with.
        step_timeout: seconds one cross-group collective may take before the step fails and
            is redone without the group that did not answer.
        quorum_timeout: seconds to wait for a quorum (the Lighthouse gone, too few groups)
            before :class:`~lightning_elastic.errors.ReplicaGroupError`.
        connect_timeout: seconds to wait for the Lighthouse to answer when the group starts
            (a wrong address fails with ``ReplicaGroupError`` after this long).
        drain_signals: signals that make this group leave at the next step boundary (a planned
            drain: nothing is thrown away); when every group gets one, the leader writes a
            last checkpoint first. Exit code ``128 + signal``. They replace a
            ``DistributedCheckpoint``'s ``signals`` under this strategy (the callback refuses
            other ones).
        global_batch_size: samples per round whoever takes part (each process trains its share);
            default: the DataLoader's ``batch_size`` per process, so the global batch follows the
            number of processes taking part.
        accelerator, parallel_devices, cluster_environment, checkpoint_io, precision_plugin,
            process_group_backend, timeout, start_method: as for Lightning's ``DDPStrategy``
            (the group's own process group).
        checkpoint_timeout, verify, storage_options, trusted: as for ``ElasticStrategy`` (every
            checkpoint of this trainer, ``DistributedCheckpoint``'s included); ``trusted`` also
            loads a peer's live state without the safe-loading allowlist.
    """

    strategy_name = "elastic_ft"

    def __init__(
        self,
        accelerator: Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        start_method: str = "popen",
        *,
        lighthouse: str | None = None,
        replica_group: str | None = None,
        min_replica_groups: int = 1,
        step_timeout: float = 30.0,
        quorum_timeout: float = 300.0,
        connect_timeout: float = 30.0,
        drain_signals: Sequence[str | int] | str = ("SIGTERM", "SIGUSR1"),
        global_batch_size: int | None = None,
        checkpoint_timeout: timedelta | float | None = None,
        verify: str = "full",
        storage_options: dict[str, Any] | None = None,
        trusted: bool = False,
    ) -> None:
        check_choice(start_method, "start_method", ("popen", "spawn", "fork", "forkserver"))
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=timeout,
            start_method=start_method,  # type: ignore[arg-type]
        )
        self._configure_checkpoints(
            checkpoint_timeout=checkpoint_timeout,
            verify=verify,
            global_batch_size=global_batch_size,
            storage_options=storage_options,
            trusted=trusted,
        )
        self.replica_options = ReplicaOptions(
            lighthouse=lighthouse,
            name=replica_group,
            min_groups=min_replica_groups,
            step_timeout=step_timeout,
            quorum_timeout=quorum_timeout,
            connect_timeout=connect_timeout,
            trusted=trusted,
        )
        self.drain_signals = check_signals(drain_signals, "drain_signals")
        self.replicas: ReplicaGroup | None = None
        self.role: ReplicaRole | None = None
        self._leader_since: int | None = None
        self._led: dict[str, int | None] = {}  # checkpoint root -> leadership its lease is of
        self._flag: SignalFlag | None = None
        self._pending_checkpoint: dict[str, Any] | None = None
        self._data: ReplicaData | None = None
        self._sampler: ReplicaBatchSampler | None = None
        self._window: Window | None = None
        self._factor = 1.0
        self._snapshot: StepSnapshot | None = None
        self._live: LiveState | None = None
        self._store: Any = None  # the Managers' store, hosted by group rank 0
        self.view: Any = None  # the quorum of the step being trained (or the last one)
        # the sample indices this process trained in the last committed step (no padding)
        self.committed_samples: list[int] = []

    # ------------------------------------------------------------------ set-up

    def configure_ddp(self) -> None:
        """No ``DistributedDataParallel``: the gradients are reduced after the backward pass,
        over the group and the groups at once (:meth:`optimizer_step`)."""
        assert self.model is not None
        if self.world_size > 1:  # the group's processes start from the same weights
            for tensor in [*self.model.parameters(), *self.model.buffers()]:
                dist.broadcast(tensor.data, src=0)

    def setup(self, trainer: Any) -> None:
        """Set the group up and join the replica groups (fitting only)."""
        super().setup(trainer)
        if trainer.state.fn != TrainerFn.FITTING:
            return
        module = self.lightning_module
        assert module is not None
        if not module.automatic_optimization:
            raise ConfigError(
                "strategy='elastic_ft' supports automatic optimization only: a step that a "
                "lost group makes fail is redone, which needs Lightning's closure"
            )
        self._live = LiveState(self, trainer)
        store_addr, store_port = self._manager_store()
        self.replicas = ReplicaGroup(
            self.replica_options,
            get_state=self._live.capture,
            put_state=self._put_state,
            group_rank=self.global_rank,
            group_size=self.world_size,
            store_addr=store_addr,
            store_port=store_port,
            intra=dist.group.WORLD if self.world_size > 1 else None,
        )
        log.info(
            "replica group %r: process %d of %d, Lighthouse %s",
            self.replicas.name,
            self.global_rank,
            self.world_size,
            self.replica_options.resolved_lighthouse(),
        )

    def _manager_store(self) -> tuple[str, int]:
        """A TCP store of the group's own for torchft's Managers, new with every start of the
        group (group rank 0 hosts it): torchft keeps unprefixed keys (the Manager's address)
        in the store it is given, and a restarted group would read the dead Manager's from
        torchrun's, which outlives the workers."""
        from torch.distributed import TCPStore  # type: ignore[attr-defined]

        address: list[Any] = [None]
        if self.global_rank == 0:
            self._store = TCPStore("0.0.0.0", 0, is_master=True, wait_for_workers=False)
            host = "127.0.0.1" if self.world_size == 1 else socket.gethostname()
            address = [(host, int(self._store.port))]
        if self.world_size > 1:
            dist.broadcast_object_list(address, src=0)
        host, port = address[0]
        return str(host), int(port)

    def process_dataloader(self, dataloader: object) -> object:
        """The training dataloader draws its samples from the queue every group shares."""
        from lightning.pytorch.trainer.states import RunningStage

        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if trainer is None or trainer.state.stage != RunningStage.TRAINING:
            return DDPStrategy.process_dataloader(self, dataloader)
        rebuilt, data, sampler = make_replica_loader(
            dataloader,
            global_batch_size=self.global_batch_size,
            group_rank=self.global_rank,
            group_size=self.world_size,
            accumulate=int(trainer.accumulate_grad_batches),
        )
        if self._data is not None:  # reloaded dataloaders keep the epoch's queue
            data.queue = self._data.queue
        elif self._pending_checkpoint is not None:  # resumed: the checkpoint's queue
            data.load_state(self._pending_checkpoint["data"])
        self._data, self._sampler = data, sampler
        return rebuilt

    def teardown(self) -> None:
        """Leave the replica groups, then tear the strategy down."""
        replicas, self.replicas = self.replicas, None
        if self._flag is not None:
            self._flag.uninstall()
            self._flag = None
        try:
            if replicas is not None:
                replicas.close()
        finally:
            super().teardown()

    def on_train_start(self) -> None:
        """Training starts: the drain signals are this strategy's (installed after Lightning's
        and the callbacks' handlers), and torchft's step counter is the loop's."""
        super().on_train_start()
        if self.replicas is None:
            return
        trainer = self.lightning_module.trainer
        state = {"step": int(trainer.global_step), "batches_committed": 0}
        if self._pending_checkpoint is not None:
            state.update(self._pending_checkpoint.get("manager") or {})
            state["step"] = int(trainer.global_step)
            self._pending_checkpoint = None
        self.replicas.load_state_dict(state)
        if self.drain_signals:
            self._flag = SignalFlag(self.drain_signals)
            self._flag.install()

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        """A group that was drained leaves here, at the boundary after its last committed step
        (the checkpoint callbacks' ``on_train_batch_start`` ran first)."""
        role = self.role
        if self.replicas is not None and role is not None and role.leaving:
            trainer = self.lightning_module.trainer
            code = 128 + (role.signum or 15)
            log.warning(
                "replica group %r leaves after step %d (a drain signal); the others go on",
                self.replicas.name,
                trainer.global_step,
            )
            record_planned_exit(code, int(trainer.global_step))
            raise SystemExit(code)
        super().on_train_batch_start(batch, batch_idx)

    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None
    ) -> None:
        """``trainer.save_checkpoint`` (and Lightning's ``ModelCheckpoint``, on by default):
        only the leader group writes; the groups hold equal state, and every group writing the
        same path would collide. A group that leads again after another did takes the lease of
        that checkpoint root anew first."""
        role = self.role
        if self.replicas is not None and role is not None and not role.leader:
            return
        if self.replicas is not None and role is not None:
            root, _ = split_location(filepath)
            engine = self._session(self._trainer()).engine(root)
            if self._led.get(root) != role.leader_since:
                engine.take_over(renew=True)
                self._led[root] = role.leader_since
        super().save_checkpoint(checkpoint, filepath, storage_options)

    def remove_checkpoint(self, filepath: Any) -> None:
        """Only the leader group deletes (``ModelCheckpoint``'s top-k rotation)."""
        if self.replicas is not None and self.role is not None and not self.role.leader:
            return
        super().remove_checkpoint(filepath)

    def replica_checkpoint_state(self) -> dict[str, Any] | None:
        """What a durable checkpoint holds of the replica groups: the data queue and torchft's
        step state (replicated: the same in every group)."""
        if self.replicas is None or self._data is None:
            return None
        return {"data": self._data.state(), "manager": self.replicas.state_dict()}

    def restore_replica_checkpoint_state(self, state: dict[str, Any] | None) -> None:
        """Resume from a durable checkpoint's :meth:`replica_checkpoint_state` (applied when the
        training data is set up and training starts)."""
        self._pending_checkpoint = state if isinstance(state, dict) and "data" in state else None

    # ------------------------------------------------------------------ each step

    def batch_to_device(
        self, batch: Any, device: torch.device | None = None, dataloader_idx: int = 0
    ) -> Any:
        """A training batch becomes this process's share of the step (joining the quorum at
        the step's first batch)."""
        trainer = self._fit_trainer()
        if trainer is not None and not (self.role is not None and self.role.leaving):
            batch = self._share(trainer, batch)
        return super().batch_to_device(batch, device, dataloader_idx)

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        """The module's step, its loss weighted by this micro-batch's share of samples."""
        output = super().training_step(*args, **kwargs)
        if self.replicas is None or self._factor == 1.0:
            return output
        if isinstance(output, torch.Tensor):
            return output * self._factor
        if isinstance(output, dict) and isinstance(output.get("loss"), torch.Tensor):
            return {**output, "loss": output["loss"] * self._factor}
        return output

    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        """Reduce the gradients over the groups and vote; redo the step until it commits."""
        if self.replicas is None or self._window is None:
            return super().optimizer_step(optimizer, closure, model, **kwargs)
        trainer = self.lightning_module.trainer
        loss = closure()
        failures = 0
        began = time.perf_counter()
        while True:
            window = self._window
            params = self._params()
            used = [p.grad is not None for p in params]
            grads = [_grad_of(p) for p in params]
            assert self._data is not None
            reduced = self.replicas.reduce(
                grads,
                samples=float(window.samples),
                weight=float(len(window.rounds)) * window.nominal,
                view=window.view,
                leaving=self._flag is not None and self._flag.received != 0,
                used=used,
                agreement=self._data.agreement(),
            )
            committed = self.replicas.commit() and reduced is not None
            if committed and reduced is not None:
                break
            failures += 1
            self.replicas.failed(window.view, time.perf_counter() - began)
            if failures >= self.replica_options.max_failed_attempts:
                raise ReplicaGroupError(
                    f"replica group {self.replicas.name!r}: step {window.view.step} failed "
                    f"{failures} times in a row; the last error: {self.replicas.manager.errored()}"
                )
            loss = self._redo(trainer, closure)
        unflatten_into(grads, reduced.flats)
        for param, anyone in zip(params, reduced.used, strict=True):
            if not anyone:  # no process's backward reached it: unused, as under DDP
                param.grad = None
        self._data.commit(reduced.contributed)
        view = self._window.view
        self.committed_samples = [
            i
            for mine, f in zip(self._window.mine, self._window.factors, strict=True)
            if f > 0
            for i in mine
        ]
        leader = view.participant == 0
        if not leader:
            self._leader_since = None
        elif self._leader_since is None or view.healed:
            self._leader_since = int(trainer.global_step)
        self.role = ReplicaRole(
            leader=leader,
            participants=view.participants,
            leader_since=self._leader_since,
            leaving=reduced.leaving,
            everyone_leaving=reduced.groups_leaving >= view.participants,
            signum=self._flag.received if self._flag is not None and self._flag.received else 15,
        )
        self._window = None
        self._set_epoch_length(trainer)
        if self._data.rounds_left() == 0:  # the queue is empty: the epoch's last batch
            trainer.fit_loop.epoch_loop.batch_progress.is_last_batch = True
        return self.precision_plugin.optimizer_step(
            optimizer, model=model or self.lightning_module, closure=lambda: loss, **kwargs
        )

    # ------------------------------------------------------------------ internals

    def _fit_trainer(self) -> Any:
        module = self.lightning_module
        trainer = trainer_of(module) if module is not None else None
        if trainer is None or self.replicas is None or not trainer.training:
            return None
        return trainer

    def _share(self, trainer: Any, batch: Any) -> Any:
        assert self._data is not None and self._sampler is not None
        predicted = self._sampler.take()
        position = self._micro_batch(trainer)
        if position == 0:
            self._begin_window(trainer)
            position = self._micro_batch(trainer)
        window = self._window
        assert window is not None
        indices = list(window.mine[position])
        self._factor = window.factors[position]
        if predicted != indices:
            batch = self._transfer_ready(trainer, self._data.fetch(indices))
        return batch

    def _micro_batch(self, trainer: Any) -> int:
        ready = int(trainer.fit_loop.epoch_loop.batch_progress.current.ready)
        return ready % int(trainer.accumulate_grad_batches)

    def _window_length(self, trainer: Any) -> int:
        k = int(trainer.accumulate_grad_batches)
        ready = int(trainer.fit_loop.epoch_loop.batch_progress.current.ready)
        left = trainer.fit_loop.max_batches - ready
        return int(max(1, min(k, left)))

    def _begin_window(self, trainer: Any) -> None:
        assert self.replicas is not None and self._data is not None
        self._data.start_epoch(int(trainer.current_epoch))
        view = self.replicas.start_step()
        self._data.start_epoch(int(trainer.current_epoch))
        self._set_epoch_length(trainer)
        self._window = self._data.begin_window(view, self._window_length(trainer))
        self.view = view
        module = self.lightning_module
        assert module is not None
        self._snapshot = StepSnapshot(module, training_results(trainer))

    def _redo(self, trainer: Any, closure: Any) -> Any:
        """The step failed: roll its logging back, join the new quorum and run the window's
        micro-batches again with this slot's new shares."""
        assert self.replicas is not None and self._data is not None and self._window is not None
        length = len(self._window.rounds)
        if self._snapshot is not None:
            self._snapshot.restore()
        module = self.lightning_module
        assert module is not None
        module.zero_grad(set_to_none=True)
        view = self.replicas.start_step()
        if view.healed:
            assert self._live is not None
            self._live.replay_window(length)  # the loop is at the window's last micro-batch
        self._data.start_epoch(int(trainer.current_epoch))
        self._window = self._data.begin_window(view, length)
        self.view = view
        loss = None
        for position in range(length):
            batch = self._transfer_ready(trainer, self._data.fetch(self._window.mine[position]))
            batch = super().batch_to_device(batch)
            set_closure_batch(closure, batch)
            self._factor = self._window.factors[position]
            loss = closure()
        return loss

    def _transfer_ready(self, trainer: Any, batch: Any) -> Any:
        """A batch loaded here made ready for ``batch_to_device`` as the loop makes the
        DataLoader's (precision conversion, ``on_before_batch_transfer``)."""
        batch = trainer.precision_plugin.convert_input(batch)
        module = self.lightning_module
        assert module is not None
        return before_batch_transfer(module, batch)

    def _set_epoch_length(self, trainer: Any) -> None:
        """The loop's epoch ends when the queue is empty: ``num_training_batches`` is the
        batches started so far plus the rounds left."""
        assert self._data is not None
        loop = trainer.fit_loop
        ready = int(loop.epoch_loop.batch_progress.current.ready)
        if self._window is not None:
            ready -= self._micro_batch(trainer)  # the window's rounds are still in the queue
        loop.max_batches = ready + self._data.rounds_left()
        interval = trainer.val_check_interval
        if isinstance(interval, float) and not validates_by_time(trainer):
            trainer.val_check_batch = max(1, int(loop.max_batches * interval))

    def _params(self) -> list[torch.Tensor]:
        module = self.lightning_module
        assert module is not None
        return [p for p in module.parameters() if p.requires_grad]

    def _put_state(self, state: Any) -> None:
        assert self._live is not None
        self._live.apply(state)
        self._window = None


def _grad_of(param: torch.Tensor) -> torch.Tensor:
    if param.grad is None:
        param.grad = torch.zeros_like(param)
    return param.grad
