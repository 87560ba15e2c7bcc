"""Every private Lightning, torch and torchmetrics API the adapters rely on, one named function
each, with what it relies on. Tested with lightning 2.4 - 2.6, torchmetrics 1.4 - 1.8,
torch 2.6 - 2.13.

After an upgrade, run ``tests/unit/test_compat.py``: it calls :func:`missing` and names anything
that moved, before a training run finds out.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any

import torch

from lightning_elastic.core._compat import unmet

__all__ = [
    "REQUIREMENTS",
    "before_batch_transfer",
    "callback_state_key",
    "checkpoint_after_batch",
    "dump_checkpoint",
    "finish_fit_loop_restart",
    "first_batch_of_epoch",
    "forgive_changed_log_arguments",
    "install_on_connector",
    "is_distributed",
    "last_checkpoint_files",
    "limit_train_batches",
    "litdata_children",
    "logger_connector_state",
    "loop_progress",
    "metric_reductions",
    "metric_update_count",
    "missing",
    "model_checkpoint_dir",
    "new_result_metric",
    "optimizer_to_device",
    "parallel_sizes",
    "pending_loader_states",
    "prefetched_batches",
    "process_group_backend",
    "process_group_timeout",
    "reinstantiate_dataloader",
    "restore_results",
    "result_entry",
    "set_ckpt_path",
    "set_closure_batch",
    "set_data_parallel_size",
    "set_loaded_checkpoint",
    "set_logger_connector_state",
    "set_loop_progress",
    "set_metric_update_count",
    "set_strategy_devices",
    "set_strategy_nodes",
    "snapshot_results",
    "strategy_devices",
    "strategy_nodes",
    "track_scheduler_steps",
    "train_combined_loader",
    "train_loader_mode",
    "train_loader_states",
    "trainer_of",
    "training_epoch_open",
    "training_results",
    "uninstall_from_connector",
    "unwrap_optimizer",
    "validates_by_time",
    "wrap_checkpoint_loaders",
    "wrap_ckpt_path_parser",
    "wrap_strategy_connection",
    "wrapped_checkpoint_io",
]

# modules whose `pl_load` reads checkpoint files: saving.py (load_from_checkpoint) and
# torch_io.py (TorchCheckpointIO, what Trainer.fit/validate/test/predict(ckpt_path=) use)
_CHECKPOINT_LOADERS = ("lightning.pytorch.core.saving", "lightning.fabric.plugins.io.torch_io")
_WRAPPED = "__lightning_elastic_wrapped__"

REQUIREMENTS: tuple[tuple[str, str], ...] = (
    # the trainer's checkpoint connector: resume_start is where Lightning loads a checkpoint,
    # dump_checkpoint builds the dict we save, _ckpt_path/_loaded_checkpoint hold the restore
    ("lightning.pytorch.trainer.connectors.checkpoint_connector", "_CheckpointConnector"),
    (
        "lightning.pytorch.trainer.connectors.checkpoint_connector",
        "_CheckpointConnector.resume_start",
    ),
    (
        "lightning.pytorch.trainer.connectors.checkpoint_connector",
        "_CheckpointConnector.dump_checkpoint",
    ),
    ("lightning.pytorch.utilities.migration.utils", "_pl_migrate_checkpoint"),
    # where ckpt_path="last"/"best" become paths (before any callback is set up)
    (
        "lightning.pytorch.trainer.connectors.checkpoint_connector",
        "_CheckpointConnector._parse_ckpt_path",
    ),
    # where a Trainer's or Fabric's connector gives the strategy its plugins (checkpoint_io):
    # ElasticCheckpointIO refuses the strategies that do not save through it, there
    (
        "lightning.pytorch.trainer.connectors.accelerator_connector",
        "_AcceleratorConnector._lazy_init_strategy",
    ),
    ("lightning.fabric.connector", "_Connector._lazy_init_strategy"),
    ("lightning.pytorch.plugins.io.wrapper", "_WrappingCheckpointIO"),
    # the directory a ModelCheckpoint without dirpath will write (ckpt_path="last" with
    # ElasticCheckpointIO looks there before the callback is set up)
    (
        "lightning.pytorch.callbacks.model_checkpoint",
        "ModelCheckpoint._ModelCheckpoint__resolve_ckpt_dir",
    ),
    # the last*.ckpt files Lightning's own ckpt_path="last" chooses among
    ("lightning.pytorch.callbacks.model_checkpoint", "ModelCheckpoint._find_last_checkpoints"),
    # the file loader (cloud_io._load) that LightningModule.load_from_checkpoint and
    # TorchCheckpointIO.load_checkpoint call, under the name each module imported it as
    *((module, "pl_load") for module in _CHECKPOINT_LOADERS),
    ("lightning.fabric.utilities.optimizer", "_optimizer_to_device"),
    # rebuilding a dataloader with another sampler (Lightning's sampler injection)
    ("lightning.pytorch.utilities.data", "_get_dataloader_init_args_and_kwargs"),
    ("lightning.fabric.utilities.data", "_reinstantiate_wrapped_cls"),
    # recounting the training epoch after the sampler's length changed (instance attributes
    # FitLoop._combined_loader, FitLoop._combined_loader_states_to_load, CombinedLoader._mode,
    # Trainer._val_check_time_interval are checked by tests/unit/test_compat.py on a live
    # trainer)
    ("lightning.pytorch.trainer.connectors.data_connector", "_parse_num_batches"),
    # the training dataloaders' states as the fit loop saves them, and the batches its data
    # fetcher has taken from them ahead of the loop
    ("lightning.pytorch.utilities.combined_loader", "CombinedLoader._state_dicts"),
    ("lightning.pytorch.loops.fetchers", "_PrefetchDataFetcher"),
    # torchmetrics keeps the update count and the reduction of each state privately
    ("torchmetrics", "Metric.metric_state"),
    # replica groups (lightning/replicas.py): the automatic-optimization closure's step
    # function keeps the batch in its kwargs (a redone step trains other samples); the loop's
    # progress counters (a healing group takes the others'); the training loop's logged
    # results (a redone step's logging is rolled back first)
    # (instance attributes, checked on a live trainer by the tests: Closure._step_fn,
    # epoch_loop.batch_progress / _batches_that_stepped / _results, fit_loop.epoch_progress)
    ("lightning.pytorch.loops.optimization.automatic", "Closure"),
    ("lightning.pytorch.loops.training_epoch_loop", "_TrainingEpochLoop"),
    ("lightning.pytorch.loops.fit_loop", "_FitLoop"),
    # what self.log keeps: the logger connector's last values (_callback_metrics,
    # _logged_metrics, _progress_bar_metrics, _first_loop_iter, _current_fx: instance
    # attributes, checked by tests/unit/test_compat.py on a live trainer) and the training
    # loop's _ResultCollection of _ResultMetric (a torchmetrics Metric with _Metadata/_Sync)
    ("lightning.pytorch.trainer.connectors.logger_connector.logger_connector", "_LoggerConnector"),
    ("lightning.pytorch.trainer.connectors.logger_connector.result", "_ResultCollection"),
    ("lightning.pytorch.trainer.connectors.logger_connector.result", "_ResultMetric"),
    ("lightning.pytorch.trainer.connectors.logger_connector.result", "_Metadata"),
    ("lightning.pytorch.trainer.connectors.logger_connector.result", "_Sync"),
    # whether self.log(sync_dist=True) syncs under this trainer
    (
        "lightning.pytorch.trainer.connectors.accelerator_connector",
        "_AcceleratorConnector.is_distributed",
    ),
    # where ModelParallelStrategy initializes the default process group (DDPStrategy does it in
    # the public setup_distributed): ElasticFSDPStrategy overrides it to initialize the group on
    # torchrun's agent store under the round's prefix first (strategy.py attempt_store)
    ("lightning.pytorch.strategies.model_parallel", "ModelParallelStrategy._setup_distributed"),
    # our strategies keep the devices and nodes torchrun gives in the attributes the Lightning
    # bases keep them in (ParallelStrategy._parallel_devices, DDPStrategy._num_nodes), and
    # ElasticFSDPStrategy follows the world with ModelParallelStrategy's _data_parallel_size /
    # _tensor_parallel_size; the process group's backend and timeout are DDPStrategy's
    # (instance attributes, checked on live strategies by tests/unit/test_compat.py)
    ("lightning.pytorch.strategies.ddp", "DDPStrategy._get_process_group_backend"),
    # a callback's state key as Lightning's own callbacks form it
    ("lightning.pytorch.callbacks.callback", "Callback._generate_state_key"),
    # replica groups: a batch loaded outside the loop made ready as the loop makes the
    # DataLoader's (the module's on_before_batch_transfer hook, through its private caller)
    ("lightning.pytorch.core.module", "LightningModule._on_before_batch_transfer"),
)


def strategy_devices(strategy: Any) -> Any:
    """The devices a Lightning ``ParallelStrategy`` keeps (its ``_parallel_devices``)."""
    return strategy._parallel_devices


def set_strategy_devices(strategy: Any, devices: Any) -> None:
    """Keep ``devices`` where ``ParallelStrategy.parallel_devices`` reads them."""
    strategy._parallel_devices = devices


def strategy_nodes(strategy: Any) -> int:
    """The node count a Lightning ``DDPStrategy`` keeps (its ``_num_nodes``)."""
    return int(strategy._num_nodes)


def set_strategy_nodes(strategy: Any, num_nodes: int) -> None:
    """Keep ``num_nodes`` where ``DDPStrategy.num_nodes`` reads it."""
    strategy._num_nodes = num_nodes


def parallel_sizes(strategy: Any) -> tuple[Any, Any]:
    """``(data_parallel_size, tensor_parallel_size)`` of a ``ModelParallelStrategy`` (either
    may still be ``"auto"``)."""
    return strategy._data_parallel_size, strategy._tensor_parallel_size


def set_data_parallel_size(strategy: Any, size: int) -> None:
    """Set a ``ModelParallelStrategy``'s data-parallel size (before its environment set-up)."""
    strategy._data_parallel_size = size


def process_group_backend(strategy: Any) -> str:
    """The backend a ``DDPStrategy`` initialises its process group with."""
    backend: str = strategy._get_process_group_backend()
    return backend


def process_group_timeout(strategy: Any) -> Any:
    """The process-group timeout a Lightning strategy was given (``None`` when it keeps none)."""
    return getattr(strategy, "_timeout", None)


def callback_state_key(callback: Any, **kwargs: Any) -> str:
    """A callback's ``state_key`` as Lightning's own callbacks form it (the class's qualified
    name and ``kwargs``)."""
    key: str = callback._generate_state_key(**kwargs)
    return key


def before_batch_transfer(module: Any, batch: Any) -> Any:
    """``batch`` through the module's ``on_before_batch_transfer`` hook, as the training loop
    calls it for a DataLoader's batch."""
    return module._on_before_batch_transfer(batch, dataloader_idx=0)


def litdata_children(dataset: Any) -> Any:
    """The datasets a LitData ``CombinedStreamingDataset``/``ParallelStreamingDataset``
    combines (its ``_datasets``), or ``None``."""
    return getattr(dataset, "_datasets", None)


def trainer_of(module: Any) -> Any:
    """The trainer a LightningModule is attached to, or ``None`` (``module.trainer`` raises
    when detached; ``_trainer`` does not)."""
    return getattr(module, "_trainer", None)


def unwrap_optimizer(optimizer: Any) -> Any:
    """The torch optimizer inside a ``LightningOptimizer`` (its ``_optimizer``)."""
    from lightning.pytorch.core.optimizer import LightningOptimizer

    return optimizer._optimizer if isinstance(optimizer, LightningOptimizer) else optimizer


def optimizer_to_device(optimizer: Any, device: Any) -> None:
    """Move an optimizer's state tensors to ``device`` (Lightning's own helper)."""
    from lightning.fabric.utilities.optimizer import _optimizer_to_device

    _optimizer_to_device(optimizer, device)


def dump_checkpoint(trainer: Any) -> dict[str, Any]:
    """The full checkpoint dict Lightning would save (model, loops, callbacks, ...)."""
    checkpoint: dict[str, Any] = trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
    return checkpoint


def checkpoint_after_batch(trainer: Any, *, at_train_end: bool) -> dict[str, Any]:
    """Lightning's checkpoint dict in the form of a save in ``on_train_batch_end`` of the last
    batch done (k, counted in the epoch), taken later: in ``on_train_batch_start`` of batch k+1
    (``at_train_end=False``) or in ``on_train_end`` after training stopped inside an epoch
    (``max_steps``, ``should_stop``; ``at_train_end=True``).

    Lightning reads the loop counters to tell where a checkpoint was taken. Its native form for
    "all of batch k done" is: k ready, started and processed, k-1 completed, batch k not the
    epoch's last, the epoch neither processed nor completed. From it a restart completes batch
    k, skips a validation due at batch k (it ran before our save, as did the
    ``ReduceLROnPlateau`` step) and trains batch k+1, as the uninterrupted run does; it also adds
    1 to ``_batches_that_stepped`` (the loggers' step), which that save had not counted yet and
    ours has, unless batch k was inside an accumulation window.

    As dumped later the counters say "batch k+1 ready" (one ahead after a restore), or, at
    train end, "epoch done" (a restart would begin the next epoch: the rest of this one would
    never be trained). Both are rewritten here (the layout of ``checkpoint["loops"]`` is
    Lightning's, checked by the tests).
    """
    checkpoint = dump_checkpoint(trainer)
    loop = checkpoint["loops"]["fit_loop"]
    progress = loop["epoch_loop.batch_progress"]
    for counters in (progress["total"], progress["current"]):
        if not at_train_end:
            counters["ready"] -= 1
        counters["completed"] -= 1
    if at_train_end:
        for counters in (loop["epoch_progress"]["total"], loop["epoch_progress"]["current"]):
            counters["processed"] -= 1
            counters["completed"] -= 1
    progress["is_last_batch"] = False
    if progress["current"]["ready"] % trainer.accumulate_grad_batches == 0:
        loop["epoch_loop.state_dict"]["_batches_that_stepped"] -= 1
    return checkpoint


def install_on_connector(trainer: Any, name: str, replacement: Callable[..., Any]) -> Any:
    """Replace method ``name`` of the trainer's checkpoint connector for this trainer only;
    returns the original (bound) method. :func:`uninstall_from_connector` undoes it."""
    connector = trainer._checkpoint_connector
    original = getattr(connector, name)
    connector.__dict__[f"_lightning_elastic_original_{name}"] = original
    setattr(connector, name, replacement)
    return original


def uninstall_from_connector(trainer: Any, name: str) -> None:
    connector = trainer._checkpoint_connector
    if connector.__dict__.pop(f"_lightning_elastic_original_{name}", None) is not None:
        connector.__dict__.pop(name, None)


def wrap_checkpoint_loaders(wrap: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    """Replace Lightning's checkpoint file loader ``pl_load(path, map_location, weights_only)``
    in the modules that call it (``load_from_checkpoint``, ``TorchCheckpointIO``) with
    ``wrap(original)``; idempotent: a loader wrapped once is never wrapped again."""
    for name in _CHECKPOINT_LOADERS:
        module = importlib.import_module(name)
        namespace = vars(module)  # pl_load is an import alias there (not re-exported, for mypy)
        if not getattr(namespace["pl_load"], _WRAPPED, False):
            namespace["pl_load"] = _marked(wrap(namespace["pl_load"]))


def wrap_ckpt_path_parser(wrap: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    """Replace ``_CheckpointConnector._parse_ckpt_path(self, state_fn, ckpt_path, ...)``, which
    turns ``ckpt_path="last"/"best"`` into a path, with ``wrap(original)`` for every trainer;
    idempotent like :func:`wrap_checkpoint_loaders`."""
    from lightning.pytorch.trainer.connectors.checkpoint_connector import _CheckpointConnector

    current = _CheckpointConnector._parse_ckpt_path
    if not getattr(current, _WRAPPED, False):
        _CheckpointConnector._parse_ckpt_path = _marked(wrap(current))  # type: ignore[method-assign]


def wrap_strategy_connection(check: Callable[[Any, Any], None]) -> None:
    """Call ``check(strategy, checkpoint_io)`` whenever a Trainer's or a Fabric's connector is
    about to give the strategy its plugins (``_lazy_init_strategy``, in the constructor; the
    ``checkpoint_io`` is the one from ``plugins=[...]`` or from the strategy's own argument, or
    ``None``); idempotent like :func:`wrap_checkpoint_loaders`."""
    from lightning.fabric.connector import _Connector
    from lightning.pytorch.trainer.connectors.accelerator_connector import _AcceleratorConnector

    for connector in (_AcceleratorConnector, _Connector):
        current = connector._lazy_init_strategy
        if getattr(current, _WRAPPED, False):
            continue

        def _lazy_init_strategy(self: Any, _original: Any = current) -> None:
            check(self.strategy, self.checkpoint_io)
            _original(self)

        connector._lazy_init_strategy = _marked(_lazy_init_strategy)  # type: ignore[method-assign]


def wrapped_checkpoint_io(io: Any) -> Any:
    """The plugin an ``AsyncCheckpointIO`` (any ``_WrappingCheckpointIO``) wraps, or ``None``
    when ``io`` wraps nothing."""
    from lightning.pytorch.plugins.io.wrapper import _WrappingCheckpointIO

    return io._checkpoint_io if isinstance(io, _WrappingCheckpointIO) else None


def model_checkpoint_dir(callback: Any, trainer: Any) -> str:
    """Where a ``ModelCheckpoint`` writes: its ``dirpath``, or before ``setup`` the directory
    it will choose (the logger's, else ``default_root_dir/checkpoints``)."""
    if callback.dirpath is not None:
        return str(callback.dirpath)
    return str(callback._ModelCheckpoint__resolve_ckpt_dir(trainer))


def last_checkpoint_files(callback: Any, trainer: Any) -> list[str]:
    """The ``last*.ckpt`` paths of a ``ModelCheckpoint``'s directory, as Lightning's own
    ``ckpt_path="last"`` finds them."""
    return [str(p) for p in callback._find_last_checkpoints(trainer)]


def set_ckpt_path(trainer: Any, location: str) -> None:
    """Make ``trainer.ckpt_path`` say which checkpoint was restored (``ModelCheckpoint`` never
    deletes that one)."""
    trainer._checkpoint_connector._ckpt_path = location


def _marked(fn: Callable[..., Any]) -> Callable[..., Any]:
    setattr(fn, _WRAPPED, True)
    return fn


def set_loaded_checkpoint(trainer: Any, checkpoint: dict[str, Any], location: str) -> None:
    """Make ``checkpoint`` the one Lightning restores from (what ``resume_start`` does after
    ``torch.load``), migrated to the installed Lightning's format."""
    from lightning.pytorch.utilities.migration.utils import _pl_migrate_checkpoint

    connector = trainer._checkpoint_connector
    connector._ckpt_path = location
    connector._loaded_checkpoint = _pl_migrate_checkpoint(checkpoint, location)


def reinstantiate_dataloader(
    dataloader: Any, sampler: Any, *, if_given: Mapping[str, Any] | None = None, **overrides: Any
) -> Any:
    """The same DataLoader class and arguments with ``sampler`` (and ``overrides``, e.g. a
    new ``batch_size``); raises ``KeyError`` naming an override the class does not take.
    ``if_given`` are overrides of arguments the DataLoader was built with, left out
    otherwise."""
    from lightning.fabric.utilities.data import _reinstantiate_wrapped_cls
    from lightning.pytorch.trainer.states import RunningStage
    from lightning.pytorch.utilities.data import _get_dataloader_init_args_and_kwargs

    args, kwargs = _get_dataloader_init_args_and_kwargs(dataloader, sampler, RunningStage.TRAINING)
    for key, value in overrides.items():
        if key not in kwargs:
            raise KeyError(key)
        kwargs[key] = value
    for key, value in (if_given or {}).items():
        if key in kwargs:
            kwargs[key] = value
    return _reinstantiate_wrapped_cls(dataloader, *args, **kwargs)


def train_combined_loader(trainer: Any) -> Any:
    """The fit loop's ``CombinedLoader`` of training dataloaders (``_combined_loader``), or
    ``None`` before the data is set up."""
    return getattr(trainer.fit_loop, "_combined_loader", None)


def train_loader_states(trainer: Any) -> list[dict[str, Any]] | None:
    """The states of the stateful training dataloaders, as the fit loop saves them under
    ``checkpoint["loops"]["fit_loop"]["state_dict"]["combined_loader"]``
    (``CombinedLoader._state_dicts``), or ``None`` before the data is set up."""
    combined = train_combined_loader(trainer)
    if combined is None:
        return None
    return list(combined._state_dicts())


def pending_loader_states(trainer: Any) -> list[Any]:
    """The training dataloaders' states a resumed fit loop will hand to their
    ``load_state_dict`` when it sets the data up (``FitLoop._combined_loader_states_to_load``:
    restored from the checkpoint before the dataloaders are built, emptied once loaded)."""
    return list(getattr(trainer.fit_loop, "_combined_loader_states_to_load", None) or ())


def prefetched_batches(trainer: Any) -> int:
    """How many batches the fit loop's data fetcher has taken from the training dataloaders
    beyond the one being trained (``_PrefetchDataFetcher.batches``: 1 for a dataloader
    without a length, 0 otherwise)."""
    fetcher = getattr(trainer.fit_loop, "_data_fetcher", None)
    return len(getattr(fetcher, "batches", None) or ())


def train_loader_mode(combined: Any) -> str:
    """How a ``CombinedLoader`` combines its loaders (``_mode``: ``max_size_cycle`` when
    Lightning builds it from a plain dataloader)."""
    return str(getattr(combined, "_mode", "max_size_cycle"))


def validates_by_time(trainer: Any) -> bool:
    """The trainer validates every ``val_check_interval`` of wall time, not every N batches
    (``_val_check_time_interval``, Lightning >= 2.5; never on older versions)."""
    return getattr(trainer, "_val_check_time_interval", None) is not None


def limit_train_batches(length: int | float, limit: int | float) -> int | float:
    """Lightning's training epoch length for a loader of ``length`` batches under
    ``limit_train_batches=limit`` (``_parse_num_batches``)."""
    from lightning.pytorch.trainer.connectors.data_connector import _parse_num_batches
    from lightning.pytorch.trainer.states import RunningStage

    return _parse_num_batches(RunningStage.TRAINING, length, limit)


def track_scheduler_steps(optimizer: Any) -> None:
    """Install the step tracking torch's LR schedulers put on their optimizer's ``step``
    (``_opt_called`` / ``_wrapped_by_lr_sched``), so a scheduler re-pointed at ``optimizer``
    does not warn that the optimizer never stepped."""
    step = optimizer.step
    if hasattr(step, "_wrapped_by_lr_sched"):
        return

    def tracked(*args: Any, **kwargs: Any) -> Any:
        optimizer._opt_called = True
        return step(*args, **kwargs)

    tracked._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    optimizer.step = tracked


def metric_update_count(metric: Any) -> int:
    """How many times a torchmetrics ``Metric`` was updated (``_update_count``)."""
    return int(metric._update_count)


def set_metric_update_count(metric: Any, count: int) -> None:
    """Set the update count and drop the cached ``compute()`` result (``_computed``)."""
    metric._update_count = int(count)
    metric._computed = None


def metric_reductions(metric: Any) -> dict[str, Any]:
    """State name -> reduction function of a torchmetrics ``Metric`` (``_reductions``)."""
    return dict(metric._reductions)


def set_closure_batch(closure: Any, batch: Any) -> None:
    """Make Lightning's automatic-optimization ``Closure`` train ``batch`` when called again
    (its step function is ``partial(_training_step, kwargs)``; ``kwargs["batch"]``)."""
    step_fn = getattr(closure, "_step_fn", None)
    kwargs = getattr(step_fn, "args", (None,))[0] if step_fn is not None else None
    if not isinstance(kwargs, dict) or "batch" not in kwargs:
        raise TypeError(f"not Lightning's automatic-optimization closure: {closure!r}")
    kwargs["batch"] = batch


_PROGRESS: tuple[tuple[str, Callable[[Any], Any]], ...] = (
    ("epoch_progress", lambda t: t.fit_loop.epoch_progress),
    ("batch_progress", lambda t: t.fit_loop.epoch_loop.batch_progress),
    ("scheduler_progress", lambda t: t.fit_loop.epoch_loop.scheduler_progress),
    ("optimizer_progress", lambda t: t.fit_loop.epoch_loop.automatic_optimization.optim_progress),
    ("val_batch_progress", lambda t: t.fit_loop.epoch_loop.val_loop.batch_progress),
)


def loop_progress(trainer: Any) -> dict[str, Any]:
    """The fit loop's progress counters (epochs, batches, optimizer steps, scheduler steps,
    validation batches; what ``global_step`` and ``current_epoch`` are read from), as plain
    dicts, plus the logging step (``_batches_that_stepped``)."""
    state: dict[str, Any] = {name: get(trainer).state_dict() for name, get in _PROGRESS}
    state["batches_that_stepped"] = int(trainer.fit_loop.epoch_loop._batches_that_stepped)
    return state


def set_loop_progress(trainer: Any, state: dict[str, Any]) -> None:
    """Put back :func:`loop_progress` (counters only: the loops keep running)."""
    for name, get in _PROGRESS:
        if name in state:
            get(trainer).load_state_dict(state[name])
    trainer.fit_loop.epoch_loop._batches_that_stepped = int(state["batches_that_stepped"])


def snapshot_results(results: Any) -> dict[str, Any]:
    """What ``self.log`` has accumulated so far, for :func:`restore_results` (tensor values:
    states cloned; logged ``Metric`` objects are the module's own, snapshotted with it)."""
    from lightning.pytorch.trainer.connectors.logger_connector.result import _ResultMetric

    saved: dict[str, Any] = {}
    for key, item in results.items():
        if isinstance(item, _ResultMetric) and item.is_tensor:
            states: dict[str, Any] = dict(item.metric_state)
            saved[key] = (
                {k: v.clone() for k, v in states.items()},
                item._forward_cache,
                item._update_count,
            )
        else:
            saved[key] = None
    return saved


def restore_results(results: Any, saved: dict[str, Any]) -> None:
    """Roll the logged results back to :func:`snapshot_results`' (keys logged since are
    dropped)."""
    for key in [k for k in results if k not in saved]:
        del results[key]
    for key, entry in saved.items():
        if entry is None or key not in results:
            continue
        states, cache, count = entry
        item = results[key]
        for name, value in states.items():
            setattr(item, name, value.clone())
        item._forward_cache = cache
        item._update_count = count
        item._computed = None


# self.log's reductions by name (what _Metadata._parse_reduce_fx accepts, as it stores them)
_REDUCTIONS: tuple[tuple[str, Callable[..., Any]], ...] = (
    ("mean", torch.mean),
    ("sum", torch.sum),
    ("max", torch.max),
    ("min", torch.min),
    ("builtins.sum", sum),
    ("builtins.max", max),
    ("builtins.min", min),
)
_META_FIELDS = (
    "fx",
    "name",
    "prog_bar",
    "logger",
    "on_step",
    "on_epoch",
    "enable_graph",
    "add_dataloader_idx",
    "dataloader_idx",
    "metric_attribute",
)


def logger_connector_state(trainer: Any) -> dict[str, Any]:
    """What the trainer's logger connector keeps between hooks: the last values it gave
    callbacks (``_callback_metrics``), loggers (``_logged_metrics``) and the progress bar
    (``_progress_bar_metrics``), without merging the running results in as the public
    properties do, and where the loop stands for ``self.log`` (``_first_loop_iter``: ``None``
    outside an epoch's batches, ``True`` in its first, ``False`` after; ``_current_fx``: the
    hook that logged last)."""
    connector = trainer._logger_connector
    return {
        "callback": dict(connector._callback_metrics),
        "log": dict(connector._logged_metrics),
        "pbar": dict(connector._progress_bar_metrics),
        "first_loop_iter": connector._first_loop_iter,
        "current_fx": connector._current_fx,
    }


def set_logger_connector_state(
    trainer: Any,
    *,
    callback: dict[str, Any],
    log: dict[str, Any],
    pbar: dict[str, Any],
    first_loop_iter: bool | None,
    current_fx: str | None,
) -> None:
    """Put back what :func:`logger_connector_state` returned."""
    connector = trainer._logger_connector
    connector._callback_metrics = callback
    connector._logged_metrics = log
    connector._progress_bar_metrics = pbar
    connector._first_loop_iter = first_loop_iter
    connector._current_fx = current_fx


def training_results(trainer: Any) -> dict[str, Any]:
    """The training loop's ``_ResultCollection`` (a dict of ``_ResultMetric`` by
    ``"<hook>.<name>"``): every ``self.log`` of the training hooks, with its epoch-level
    accumulators (``fit_loop.epoch_loop._results``)."""
    results: dict[str, Any] = trainer.fit_loop.epoch_loop._results
    return results


def training_epoch_open(trainer: Any) -> bool:
    """Whether a training epoch of a fit has started and its end has not yet been reached
    (``fit_loop.epoch_progress.current``: started > processed): its ``self.log``
    accumulators are live, also during a validation inside it; at ``on_train_epoch_end``
    and after, Lightning computes, logs and resets them."""
    if getattr(trainer.state, "fn", None) != "fit" or trainer.sanity_checking:
        return False
    current = trainer.fit_loop.epoch_progress.current
    return bool(current.started > current.processed)


def first_batch_of_epoch(trainer: Any) -> bool:
    """Whether the training batch now starting is its epoch's first (what Lightning's logger
    connector marks ``_first_loop_iter=True``): ``batch_progress.current.ready == 1``."""
    return bool(trainer.fit_loop.epoch_loop.batch_progress.current.ready == 1)


def is_distributed(trainer: Any) -> bool:
    """Whether ``self.log(sync_dist=True)`` syncs under ``trainer``
    (``_accelerator_connector.is_distributed``: a DDP-like strategy, even on one device)."""
    return bool(trainer._accelerator_connector.is_distributed)


def result_entry(metric: Any) -> dict[str, Any]:
    """One ``_ResultMetric`` in plain values: ``is_tensor`` (else it wraps a torchmetrics
    ``Metric`` of the module, ``meta["metric_attribute"]``), ``meta`` (``self.log``'s
    arguments as ``_Metadata`` holds them; ``reduce_fx`` by name, ``None`` for one Lightning
    does not take; ``sync_dist``, ``rank_zero_only`` and whether a ``sync_dist_group`` was
    given), ``state`` (the accumulators of a tensor value: ``value``, and for a mean
    ``cumulated_batch_size``), the last step value (``forward_cache``), the cached epoch
    value (``computed``), ``has_reset`` and ``update_count``. Tensors are the live ones."""
    meta = metric.meta
    sync = meta._sync
    fields = {name: getattr(meta, name) for name in _META_FIELDS}
    fields["reduce_fx"] = next((n for n, f in _REDUCTIONS if f is meta.reduce_fx), None)
    fields["sync_dist"] = bool(sync is not None and sync.should)
    fields["rank_zero_only"] = bool(sync is not None and sync.rank_zero_only)
    fields["sync_group"] = sync is not None and sync.group is not None
    return {
        "is_tensor": bool(metric.is_tensor),
        "meta": fields,
        "state": dict(metric.metric_state) if metric.is_tensor else {},
        "forward_cache": metric._forward_cache,
        "computed": metric._computed,
        "has_reset": bool(metric.has_reset),
        "update_count": int(metric._update_count),
    }


def new_result_metric(trainer: Any, entry: dict[str, Any], *, sync_dist: bool) -> Any:
    """A ``_ResultMetric`` equal to the one :func:`result_entry` described, as
    ``LightningModule.log`` would create it under ``trainer`` (its ``_Metadata`` compares
    equal to the next ``self.log`` with the same arguments, or Lightning raises), holding
    ``entry``'s accumulators (an empty ``state`` keeps the initial ones) and, for a
    torchmetrics value, ``entry["metric"]``. ``KeyError``/``ValueError``: no such
    reduction."""
    from lightning.pytorch.trainer.connectors.logger_connector.result import (
        _Metadata,
        _ResultMetric,
        _Sync,
    )

    fields = entry["meta"]
    reduce_fx = dict(_REDUCTIONS)[fields["reduce_fx"]]
    meta = _Metadata(**{name: fields[name] for name in _META_FIELDS}, reduce_fx=reduce_fx)
    meta.sync = _Sync(
        _should=sync_dist,
        fn=trainer.strategy.reduce,
        rank_zero_only=bool(fields["rank_zero_only"]),
    )
    metric = _ResultMetric(meta, bool(entry["is_tensor"]))
    if not metric.is_tensor:
        metric.value = entry["metric"]
    for attr, value in entry["state"].items():
        if attr not in metric.metric_state:
            raise ValueError(f"{fields['name']!r} has no state {attr!r}")
        setattr(metric, attr, value)
    metric._update_count = int(entry["update_count"])
    metric._forward_cache = entry["forward_cache"]
    metric._computed = entry["computed"]
    metric.has_reset = bool(entry["has_reset"])
    return metric


def forgive_changed_log_arguments(
    trainer: Any, keys: set[str], replaced: Callable[[str], None]
) -> None:
    """Let the first ``self.log`` of each restored entry (``keys`` of :func:`training_results`)
    change its arguments: Lightning raises ``MisconfigurationException`` when a ``self.log``
    differs from the entry's (``_ResultCollection.log``: "twice ... with different
    arguments"), which after an edit of the code between the save and the resume (a
    ``prog_bar=True`` added) would fail every restart. Such an entry is dropped instead,
    ``replaced(name)`` called, and the value logged afresh; a key's later calls, and every
    other, are Lightning's own (the wrapper goes when no key is left to confirm)."""
    from lightning.fabric.utilities.exceptions import MisconfigurationException

    results: Any = training_results(trainer)
    pending = set(keys)
    original = type(results).log

    def log(fx: str, name: str, value: Any, *args: Any, **kwargs: Any) -> None:
        key = f"{fx}.{name}"  # as _ResultCollection.log names its entries
        if kwargs.get("add_dataloader_idx", True) and results.dataloader_idx is not None:
            key += f".{results.dataloader_idx}"
        if key not in pending:
            original(results, fx, name, value, *args, **kwargs)
            return
        try:
            original(results, fx, name, value, *args, **kwargs)
        except MisconfigurationException:
            if key not in results:
                raise
            del results[key]  # Lightning raised before changing anything
            replaced(name)
            original(results, fx, name, value, *args, **kwargs)
        pending.discard(key)
        if not pending:
            results.__dict__.pop("log", None)

    results.__dict__.pop("log", None)
    if pending:
        results.log = log


def finish_fit_loop_restart(trainer: Any) -> bool:
    """End the fit loop's restart state now (``_restarting``, not its children's), if it is
    in one; returns whether it was.

    After a restore, Lightning leaves the fit loop "restarting" until the end of the epoch
    it resumed in, and at that epoch's end skips the epoch-interval ``ReduceLROnPlateau``
    steps (``FitLoop.on_advance_end``: "metric-based schedulers require access to metrics and
    those are not currently saved in the checkpoint"). Called once the metrics they read are
    back, before a batch of that epoch trains, so that its end steps them as the uninterrupted
    run does."""
    loop = trainer.fit_loop
    if not loop._restarting:
        return False
    loop._restarting = False
    return True


def missing() -> list[str]:
    """The requirements of this module this installation no longer meets, as
    ``module:attribute`` strings (instance attributes such as ``Metric._update_count`` are
    checked by the tests)."""
    return unmet(REQUIREMENTS)
