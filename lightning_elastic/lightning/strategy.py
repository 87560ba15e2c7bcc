"""``ElasticStrategy``: DDP whose checkpoints are sharded, verified and world-size independent.

Differences from Lightning's ``DDPStrategy`` (everything else is DDP as usual):

* ``trainer.save_checkpoint(path)`` writes a sharded, committed checkpoint *directory* at
  ``path`` through the engine (every rank writes its share; replicated tensors once), with
  per-rank RNG and metric states; ``fit(ckpt_path=path)`` loads one back at any world size;
* map-style training dataloaders get an :class:`~lightning_elastic.lightning.data.ElasticSampler`
  so a resume continues the epoch where it stopped (no batch replayed or skipped);
* under ``torchrun`` the devices and nodes come from ``LOCAL_WORLD_SIZE``/``WORLD_SIZE`` (so
  ``devices="auto"`` works on CPU and the world may change between restarts);
* the signature lists the few DDP options it forwards instead of ``**kwargs``, so a config
  saved by LightningCLI does not depend on the installed torch's DDP keywords.

Registered as ``strategy="elastic"``.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.plugins.environments.cluster_environment import ClusterEnvironment
from lightning.fabric.plugins.io import CheckpointIO
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy
from torch.distributed.constants import default_pg_timeout
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.optim import Optimizer

from lightning_elastic.core.elastic.planned_exit import WORKER_GENERATION_ENV
from lightning_elastic.core.format.catalog import split_location
from lightning_elastic.core.format.integrity import VERIFY_MODES
from lightning_elastic.core.options import (
    check_bool,
    check_choice,
    check_count,
    check_duration,
    check_seconds,
    one_timeout,
)
from lightning_elastic.errors import ConfigError
from lightning_elastic.lightning import zero
from lightning_elastic.lightning._compat import (
    optimizer_to_device,
    process_group_backend,
    process_group_timeout,
    set_strategy_devices,
    set_strategy_nodes,
    strategy_devices,
    strategy_nodes,
    trainer_of,
    unwrap_optimizer,
)
from lightning_elastic.lightning.resume import is_elastic_checkpoint
from lightning_elastic.lightning.session import ElasticSession

__all__ = ["ElasticCheckpointing", "ElasticStrategy"]

log = logging.getLogger(__name__)


class ElasticCheckpointing:
    """What every strategy of ours adds to its Lightning base strategy (listed first among the
    bases): checkpoints saved and loaded through the engine, resumable training dataloaders,
    and the torchrun topology (devices and nodes from ``LOCAL_WORLD_SIZE``/``WORLD_SIZE``).
    Subclasses call :meth:`_configure_checkpoints` from ``__init__``.
    """

    # set by the Lightning base strategy
    lightning_module: Any
    is_global_zero: bool

    def _configure_checkpoints(
        self,
        *,
        checkpoint_timeout: timedelta | float | None,
        verify: str,
        global_batch_size: int | None,
        storage_options: dict[str, Any] | None,
        trusted: bool,
    ) -> None:
        """Check and keep the checkpoint options every strategy of ours takes."""
        if global_batch_size is not None:
            global_batch_size = check_count(global_batch_size, "global_batch_size")
        check_choice(verify, "verify", VERIFY_MODES)
        check_bool(trusted, "trusted")
        if checkpoint_timeout is not None:
            check_seconds(checkpoint_timeout, "checkpoint_timeout")
        if storage_options is not None and not isinstance(storage_options, dict):
            raise ConfigError(f"storage_options must be a dict, got {storage_options!r}")
        self.checkpoint_timeout = checkpoint_timeout
        self.verify = verify
        self.global_batch_size = global_batch_size
        self.storage_options = dict(storage_options or {})
        self.trusted = trusted

    # ------------------------------------------------------------------ torchrun topology

    @property
    def parallel_devices(self) -> list[torch.device] | None:
        """The devices of this node; under torchrun, one per local rank (``LOCAL_WORLD_SIZE``)."""
        devices: list[torch.device] | None = strategy_devices(self)
        return devices

    @parallel_devices.setter
    def parallel_devices(self, devices: list[torch.device] | None) -> None:
        local = _torchrun("LOCAL_WORLD_SIZE")
        if devices and local and len(devices) != local:
            kind = devices[0].type
            devices = [
                torch.device(kind) if kind == "cpu" else torch.device(kind, i) for i in range(local)
            ]
        set_strategy_devices(self, devices)

    @property
    def num_nodes(self) -> int:
        """The number of nodes; under torchrun, ``WORLD_SIZE // LOCAL_WORLD_SIZE``."""
        return strategy_nodes(self)

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        world, local = _torchrun("WORLD_SIZE"), _torchrun("LOCAL_WORLD_SIZE")
        if world and local and world % local == 0:
            num_nodes = world // local
        set_strategy_nodes(self, num_nodes)

    # ------------------------------------------------------------------ setup and data

    def setup_distributed(self) -> None:
        """Lightning's process group set-up (``DDPStrategy``), on :func:`attempt_store`."""
        self._init_on_attempt_store()
        super().setup_distributed()  # type: ignore[misc]

    def _init_on_attempt_store(self) -> None:
        """Initialize the default process group as Lightning would, with the group's store keys
        under a prefix of this worker group's round when torchrun's agent hosts the store: the
        agent keeps its store across restarts, and a restarted rank read the address a dead
        rank of the previous round had left there (gloo: ``connectFullMesh failed ...
        Connection refused``, seen when rank 0 of the new round started a few seconds after
        rank 1). Lightning's own set-up then finds the group initialized and keeps it. Every
        strategy of ours calls this where its Lightning base initializes the group."""
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or dist.is_initialized():
            return
        self.set_world_ranks()  # type: ignore[attr-defined]
        device = self.root_device  # type: ignore[attr-defined]
        dist.init_process_group(
            process_group_backend(self),
            rank=self.global_rank,  # type: ignore[attr-defined]
            world_size=self.world_size,  # type: ignore[attr-defined]
            timeout=process_group_timeout(self) or default_pg_timeout,
            store=attempt_store(),
            device_id=device if device.type != "cpu" else None,
        )

    def setup(self, trainer: Any) -> None:
        """Set the strategy up, with our session knowing the global batch size."""
        self._session(trainer).global_batch_size = self.global_batch_size
        super().setup(trainer)  # type: ignore[misc]

    def process_dataloader(self, dataloader: object) -> object:
        """A training dataloader made resumable (``ElasticSampler``, sharded iterable)."""
        dataloader = super().process_dataloader(dataloader)  # type: ignore[misc]
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if trainer is None:
            return dataloader
        return self._session(trainer).process_train_dataloader(dataloader)

    # ------------------------------------------------------------------ checkpoints

    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None
    ) -> None:
        """Every rank writes its share of ``checkpoint`` into the directory ``filepath``."""
        trainer = self._trainer()
        root, name = split_location(filepath)
        session = self._session(trainer)
        options = dict(storage_options) if isinstance(storage_options, dict) else {}
        engine = session.engine(root, storage_options=options or session.storage_options)
        handle = session.save(
            engine,
            reason="save_checkpoint",
            name=name,
            overwrite=True,
            checkpoint=checkpoint,
            blocking=True,
        )
        assert handle is not None
        handle.result()

    def load_checkpoint(
        self, checkpoint_path: Any, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """Our checkpoint directory ``checkpoint_path`` loaded through the engine (verified,
        resharded); any other path as Lightning loads it."""
        trainer = self._trainer()
        session = self._session(trainer)
        if not is_elastic_checkpoint(checkpoint_path, session.storage_options):
            loaded: dict[str, Any] = super().load_checkpoint(  # type: ignore[misc]
                checkpoint_path, weights_only=weights_only
            )
            return loaded
        root, name = split_location(checkpoint_path)
        checkpoint = session.load(session.engine(root), name=name, verify=self.verify)
        assert checkpoint is not None
        return checkpoint

    def remove_checkpoint(self, filepath: Any) -> None:
        """Delete a checkpoint: ours manifest first (rank 0), any other as Lightning does."""
        options = self._session(self._trainer()).storage_options
        if not is_elastic_checkpoint(filepath, options):
            super().remove_checkpoint(filepath)  # type: ignore[misc]
            return
        if self.is_global_zero:
            from lightning_elastic.core.format.catalog import Catalog
            from lightning_elastic.core.policy.housekeeping import delete_checkpoint
            from lightning_elastic.core.storage.base import Storage

            root, name = split_location(filepath)
            storage = Storage(root, storage_options=options)
            delete_checkpoint(storage, Catalog(storage), name)

    # ------------------------------------------------------------------ hooks

    def on_train_start(self) -> None:
        """Put back the last logged values of a resumed fit (``trainer.callback_metrics``)."""
        super().on_train_start()  # type: ignore[misc]
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if trainer is not None:
            self._session(trainer).on_train_start()

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        """Note the loaders' states; before the first resumed step, restore RNG and metrics."""
        super().on_train_batch_start(batch, batch_idx)  # type: ignore[misc]
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if trainer is not None:
            self._session(trainer).on_train_batch_start()

    def teardown(self) -> None:
        """Close our engines and checkpoint group, then tear the strategy down."""
        session = getattr(self, "_lightning_elastic_session", None)
        try:
            if session is not None:
                session.close()
        finally:
            super().teardown()  # type: ignore[misc]

    # ------------------------------------------------------------------ helpers

    def _trainer(self) -> Any:
        if self.lightning_module is None or trainer_of(self.lightning_module) is None:
            raise ConfigError(f"{type(self).__name__} checkpoints need a Trainer that is set up")
        return self.lightning_module.trainer

    def _session(self, trainer: Any) -> ElasticSession:
        return ElasticSession.of(trainer, one_timeout(checkpoint_timeout=self.checkpoint_timeout))


class ElasticStrategy(ElasticCheckpointing, DDPStrategy):
    """DDP with sharded, asynchronous, elastic checkpoints.

    Args:
        accelerator: the accelerator (default: chosen by the Trainer).
        parallel_devices: devices of this node (default: from the Trainer; under torchrun,
            ``LOCAL_WORLD_SIZE`` of them).
        cluster_environment: the cluster environment (default: detected).
        checkpoint_io: used only for plain (non-elastic) checkpoint files.
        precision_plugin: the precision plugin (default: from the Trainer).
        process_group_backend: backend of the training process group (default: nccl on
            GPUs, gloo on CPUs). Checkpoint traffic always uses its own gloo group.
        timeout: timeout of the training process group (a ``timedelta`` or seconds, at most a
            year).
        start_method: how Lightning starts the processes (``"popen"``, ``"spawn"``, ...).
        find_unused_parameters: forwarded to ``DistributedDataParallel``.
        static_graph: forwarded to ``DistributedDataParallel``.
        gradient_as_bucket_view: forwarded to ``DistributedDataParallel``.
        checkpoint_timeout: how long ranks wait for each other in a checkpoint save or load (a
            ``timedelta`` or seconds; default 10 minutes): the timeout of the one gloo group
            every checkpoint of this trainer uses, ``DistributedCheckpoint``'s included.
        verify: verification before loading any checkpoint (a resume, ``ckpt_path``):
            ``"full"`` (sizes and checksums), ``"size"`` or ``"none"``.
        shard_optimizer_state: ZeRO-1: each rank keeps (and saves) the optimizer state of its
            share of the parameters only; checkpoints reshard to any world size.
        global_batch_size: keep this many samples per optimizer step whatever the world size:
            each rank's dataloader batch becomes ``global_batch_size / world_size``.
        storage_options: fsspec options (credentials, ``endpoint_url``, ...) for every
            checkpoint location this trainer opens: a ``DistributedCheckpoint``'s ``dirpath``,
            ``fit(ckpt_path=...)``, ``save_checkpoint`` (whose own ``storage_options``
            argument wins for its path).
        trusted: load checkpoint objects without the safe-loading allowlist (unpickling may run
            code from the checkpoint): only for checkpoints whose origin you trust.

    These four are the strategy's because every checkpoint of the trainer uses them, whoever
    reads or writes it (``DistributedCheckpoint``'s old spellings of them are deprecated; see
    docs/options.md).
    """

    strategy_name = "elastic"

    def __init__(
        self,
        accelerator: Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | float | None = default_pg_timeout,
        start_method: str = "popen",
        *,
        find_unused_parameters: bool = False,
        static_graph: bool = False,
        gradient_as_bucket_view: bool = False,
        checkpoint_timeout: timedelta | float | None = None,
        verify: str = "full",
        shard_optimizer_state: bool = False,
        global_batch_size: int | None = None,
        storage_options: dict[str, Any] | None = None,
        trusted: bool = False,
    ) -> None:
        check_choice(start_method, "start_method", ("popen", "spawn", "fork", "forkserver"))
        for name, flag in (
            ("find_unused_parameters", find_unused_parameters),
            ("static_graph", static_graph),
            ("gradient_as_bucket_view", gradient_as_bucket_view),
            ("shard_optimizer_state", shard_optimizer_state),
        ):
            check_bool(flag, name)
        timeout = None if timeout is None else check_duration(timeout, "timeout")
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=timeout,
            start_method=start_method,  # type: ignore[arg-type]
            find_unused_parameters=find_unused_parameters,
            static_graph=static_graph,
            gradient_as_bucket_view=gradient_as_bucket_view,
        )
        self._configure_checkpoints(
            checkpoint_timeout=checkpoint_timeout,
            verify=verify,
            global_batch_size=global_batch_size,
            storage_options=storage_options,
            trusted=trusted,
        )
        self.shard_optimizer_state = shard_optimizer_state

    # ------------------------------------------------------------------ optimizers

    def setup_optimizers(self, trainer: Any) -> None:
        super().setup_optimizers(trainer)
        if not self.shard_optimizer_state:
            return
        sharded = {id(opt): zero.shard(opt) for opt in self.optimizers}
        self.optimizers = [sharded[id(opt)] for opt in self.optimizers]
        for config in self.lr_scheduler_configs:
            original = getattr(config.scheduler, "optimizer", None)
            if id(original) in sharded:
                zero.repoint_scheduler(config.scheduler, sharded[id(original)])

    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        inner = unwrap_optimizer(optimizer)
        if isinstance(inner, ZeroRedundancyOptimizer):
            return zero.optimizer_state(inner, self._param_names())
        return super().optimizer_state(optimizer)

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """Load the saved optimizer states, sharded (ZeRO) or plain, into the current optimizers,
        whichever kind they are and from any world size."""
        names = self._param_names()
        for optimizer, saved in zip(self.optimizers, checkpoint["optimizer_states"], strict=False):
            inner = unwrap_optimizer(optimizer)
            zero.load_optimizer(inner, saved, names)
            optimizer_to_device(inner, self.root_device)

    def _param_names(self) -> dict[torch.Tensor, str]:
        assert self.lightning_module is not None
        return {param: name for name, param in self.lightning_module.named_parameters()}


def attempt_store() -> Any:
    """A client of torchrun's agent store whose keys live under a prefix of this worker group:
    its rendezvous round when ``lightning-elastic run`` started the workers (the same on every
    node, new at every restart), else torchrun's ``TORCHELASTIC_RESTART_COUNT``.

    Not the restart count when the round is known: it is each agent's own count, so the nodes
    of one round may disagree (a node that restarted after its worker failed counts one more
    than the node whose agent restarted because that node was waiting to join), and a group
    whose ranks look under different prefixes never forms (its ranks wait for each other until
    the process group's timeout). Plain torchrun gives the workers nothing better; there, set
    ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` for a job whose nodes may leave and join (rank 0's
    worker then hosts a store of the group's own, and this one is not used)."""
    from torch.distributed import PrefixStore, TCPStore  # type: ignore[attr-defined]

    generation = os.environ.get(WORKER_GENERATION_ENV)
    if generation is not None:
        prefix = f"round_{generation}"
    else:
        prefix = f"attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    client = TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        int(os.environ.get("WORLD_SIZE", "1")),
        is_master=False,
        timeout=default_pg_timeout,
    )
    return PrefixStore(f"lightning_elastic/{prefix}", client)  # joined with "/"


def _torchrun(name: str) -> int | None:
    """A torchrun-provided size, only when running under torchrun/TorchElastic."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return None
    value = os.environ.get(name, "")
    return int(value) if value.isdigit() else None
