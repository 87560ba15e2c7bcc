"""``ElasticFSDPStrategy``: FSDP2 (Lightning's ``ModelParallelStrategy``) whose checkpoints are
sharded, verified and world-size independent.

Model and optimizer states are taken with ``torch.distributed.checkpoint.state_dict``
(``get_model_state_dict``/``get_optimizer_state_dict``, sharded: ``DTensor`` values), so every
rank saves only its own shards of parameters and optimizer states; nothing is gathered. The
optimizer state is keyed by parameter name, the same form ZeRO-1 ``ElasticStrategy``
checkpoints use (``{"sharded": True, "param_groups": [... names ...], "state": {name: ...}}``).

Loading plans each saved tensor straight into this world's ``DTensor`` of the same name
(DCP reshards N -> M and reads only the local shard's bytes), then hands the states to
``set_model_state_dict``/``set_optimizer_state_dict``. A checkpoint written by
``ElasticStrategy`` (replicated or ZeRO-1) loads the same way, and one written here loads under
``ElasticStrategy``, a single device or ``ddp`` as full tensors.

The data-parallel size follows the world: ``data_parallel_size="auto"`` is
``world_size // tensor_parallel_size`` at every (re)start.

Registered as ``strategy="elastic_fsdp"``.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from datetime import timedelta
from typing import Any, Literal

import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.constants import default_pg_timeout
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from lightning_elastic.core.load.load import Targets
from lightning_elastic.core.options import check_count, check_duration
from lightning_elastic.errors import ConfigError
from lightning_elastic.lightning import zero
from lightning_elastic.lightning._compat import (
    parallel_sizes,
    set_data_parallel_size,
    unwrap_optimizer,
)
from lightning_elastic.lightning.strategy import ElasticCheckpointing

__all__ = ["ElasticFSDPStrategy"]

log = logging.getLogger(__name__)
_SHARDED = StateDictOptions(full_state_dict=False, cpu_offload=False)


class ElasticFSDPStrategy(ElasticCheckpointing, ModelParallelStrategy):
    """FSDP2 with sharded, asynchronous, elastic checkpoints.

    Apply ``fully_shard`` (and tensor parallelism, if any) in the LightningModule's
    ``configure_model``, on ``self.device_mesh["data_parallel"]``, as with Lightning's
    ``ModelParallelStrategy``.

    Args:
        data_parallel_size: ranks that shard the model (FSDP); ``"auto"`` (default): the world
            size divided by ``tensor_parallel_size``, recomputed at every (re)start so the job
            may change size.
        tensor_parallel_size: ranks of one tensor-parallel group (default 1: FSDP only).
        process_group_backend: backend of the training process group (default: nccl on
            GPUs, gloo on CPUs). Checkpoint traffic always uses its own gloo group.
        timeout: timeout of the training process group (a ``timedelta`` or seconds, at most a
            year).
        checkpoint_timeout: how long ranks wait for each other in a checkpoint save or load (a
            ``timedelta`` or seconds; default 10 minutes), for every checkpoint of this trainer.
        verify: verification before loading any checkpoint: ``"full"``, ``"size"`` or
            ``"none"``.
        global_batch_size: keep this many samples per optimizer step whatever the world size:
            each data-parallel rank's batch becomes ``global_batch_size / data_parallel_size``.
        storage_options: fsspec options for every checkpoint location this trainer opens (a
            ``DistributedCheckpoint``'s ``dirpath``, ``fit(ckpt_path=...)``,
            ``save_checkpoint``).
        trusted: load checkpoint objects without the safe-loading allowlist: only for
            checkpoints whose origin you trust.
    """

    strategy_name = "elastic_fsdp"

    def __init__(
        self,
        data_parallel_size: Literal["auto"] | int = "auto",
        tensor_parallel_size: int = 1,
        process_group_backend: str | None = None,
        timeout: timedelta | float | None = default_pg_timeout,
        *,
        checkpoint_timeout: timedelta | float | None = None,
        verify: str = "full",
        global_batch_size: int | None = None,
        storage_options: dict[str, Any] | None = None,
        trusted: bool = False,
    ) -> None:
        if data_parallel_size != "auto":
            data_parallel_size = check_count(data_parallel_size, "data_parallel_size")
        tensor_parallel_size = check_count(tensor_parallel_size, "tensor_parallel_size")
        timeout = None if timeout is None else check_duration(timeout, "timeout")
        super().__init__(
            data_parallel_size=data_parallel_size,
            tensor_parallel_size=tensor_parallel_size,
            save_distributed_checkpoint=True,
            process_group_backend=process_group_backend,
            timeout=timeout,
        )
        self._configure_checkpoints(
            checkpoint_timeout=checkpoint_timeout,
            verify=verify,
            global_batch_size=global_batch_size,
            storage_options=storage_options,
            trusted=trusted,
        )
        self._auto_data_parallel = data_parallel_size == "auto"

    # ------------------------------------------------------------------ topology

    def setup_environment(self) -> None:
        world = self.num_nodes * self.num_processes
        data, tensor = parallel_sizes(self)
        tensor = int(tensor)
        if world % tensor:
            raise ConfigError(
                f"tensor_parallel_size={tensor} does not divide the world size {world}: "
                "run on a multiple of it"
            )
        if self._auto_data_parallel:
            set_data_parallel_size(self, world // tensor)
        elif int(data) * tensor != world:
            raise ConfigError(
                f"data_parallel_size={data} x tensor_parallel_size="
                f"{tensor} is not the world size {world}; pass data_parallel_size='auto' to "
                "follow the world when it changes"
            )
        super().setup_environment()

    def _setup_distributed(self) -> None:
        """Lightning's process group set-up (``ModelParallelStrategy``'s, not the public
        ``setup_distributed`` DDP has), on torchrun's agent store under the round's prefix
        (:func:`~lightning_elastic.lightning.strategy.attempt_store`)."""
        self._init_on_attempt_store()
        super()._setup_distributed()

    # ------------------------------------------------------------------ saving

    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The model's sharded state dict: this rank's ``DTensor`` shards, not gathered."""
        assert self.model is not None
        state: dict[str, Any] = get_model_state_dict(self.model, options=_SHARDED)
        return state

    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """The optimizer's sharded state, keyed by parameter name (see the module docstring).
        An optimizer that has not stepped yet has no state to save: its groups only (torch's
        ``get_optimizer_state_dict`` would create the state with a zero-lr step on the live
        optimizer, which counts as a step for Adam's bias correction)."""
        assert self.model is not None
        inner = unwrap_optimizer(optimizer)
        if not inner.state:
            return {
                "sharded": True,
                "param_groups": zero.named_groups(inner.param_groups, self._param_names()),
                "state": {},
            }
        state = get_optimizer_state_dict(self.model, inner, options=_SHARDED)
        return {"sharded": True, **state}

    # ------------------------------------------------------------------ loading

    def checkpoint_targets(self) -> Targets:
        """Where the tensors of a checkpoint being loaded go: this world's ``DTensor`` of the
        same name (model parameters, and optimizer states when fitting); everything else is
        loaded as saved. The templates are taken at the first call (when a checkpoint was
        found): creating an optimizer's states takes a zero-lr step, which must not happen
        to a run that starts fresh."""
        assert self.model is not None
        model: dict[str, Any] = {}
        optimizers: list[tuple[dict[str, Any], list[str]]] = []
        taken: list[bool] = []

        def templates() -> None:
            assert self.model is not None
            taken.append(True)
            model.update(get_model_state_dict(self.model, options=_SHARDED))
            if self._fitting():
                for optimizer in self.optimizers:
                    state: dict[str, Any] = get_optimizer_state_dict(
                        self.model, unwrap_optimizer(optimizer), options=_SHARDED
                    )
                    order = [name for group in state["param_groups"] for name in group["params"]]
                    optimizers.append((state["state"], order))

        def target(path: tuple[str | int, ...], shape: torch.Size, dtype: torch.dtype) -> Any:
            if not taken:
                templates()
            found: Any = None
            if len(path) == 2 and path[0] == "state_dict":
                found = model.get(str(path[1]))
            elif len(path) == 5 and path[0] == "optimizer_states" and path[2] == "state":
                index = int(path[1])
                if index < len(optimizers):
                    states, order = optimizers[index]
                    key = str(path[3])
                    if key not in states and key.isdigit() and int(key) < len(order):
                        key = order[int(key)]  # a plain optimizer's state, saved by position
                    found = states.get(key, {}).get(str(path[4]))
            if isinstance(found, DTensor) and tuple(found.shape) == tuple(shape):
                return found
            return None

        return target

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        """Put the loaded (sharded) model state into the model, and when fitting the optimizer
        states into the optimizers (Lightning does not restore optimizers for this strategy:
        ``lightning_restore_optimizer`` is False, as ``ModelParallelStrategy`` loads its own
        checkpoints in place)."""
        if "state_dict" not in checkpoint:
            return  # a Lightning checkpoint: ModelParallelStrategy loaded it in place
        assert self.model is not None
        set_model_state_dict(
            self.model,
            dict(checkpoint["state_dict"]),
            options=StateDictOptions(full_state_dict=False, strict=strict),
        )
        if self._fitting():
            self.load_optimizer_state_dict(checkpoint)

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """Put the loaded optimizer states (sharded here, ZeRO-1 or plain) into the optimizers."""
        if "optimizer_states" not in checkpoint:
            return  # a Lightning checkpoint: ModelParallelStrategy loaded it in place
        assert self.model is not None
        names = self._param_names()
        for optimizer, saved in zip(self.optimizers, checkpoint["optimizer_states"], strict=False):
            inner = unwrap_optimizer(optimizer)
            named = zero.as_named(saved, inner.param_groups, names)
            state = {"state": named["state"], "param_groups": named["param_groups"]}
            # not strict: a parameter that never had a gradient has no state in the checkpoint
            options = StateDictOptions(full_state_dict=False, cpu_offload=False, strict=False)
            set_optimizer_state_dict(self.model, inner, state, options=options)
            for param in list(inner.state):  # states the load template created, not loaded
                if names.get(param) not in named["state"]:
                    del inner.state[param]

    def _param_names(self) -> dict[torch.Tensor, str]:
        assert self.lightning_module is not None
        return {param: name for name, param in self.lightning_module.named_parameters()}

    def _fitting(self) -> bool:
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        return trainer is not None and trainer.state.fn == TrainerFn.FITTING
