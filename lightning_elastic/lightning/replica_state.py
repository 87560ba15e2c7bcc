"""What replica groups must hold equal, handed to a group that heals (``strategy="elastic_ft"``),
and the rollback of a step attempt that did not commit.

The live state (:meth:`LiveState.capture`) is what a checkpoint would hold that every group
must have the same of: the model's ``state_dict``, the optimizers' and LR schedulers' states,
the precision plugin's (a gradient scaler), every callback's ``state_dict`` (by
``state_key``), the fit loop's progress counters (``global_step``, ``current_epoch``, the
batch within the epoch) and the data queue. It is captured at a step's start, in torchft's
quorum thread while the training thread waits for that quorum; tensors are copied, so the
copy served to a healing peer never changes under it. Not in it, by design: RNG states and
torchmetrics accumulators, which are each group's own (a joining group starts with empty
accumulators, so an epoch-level metric covers the samples trained by the groups that hold
them).
"""

from __future__ import annotations

from typing import Any

import torch

from lightning_elastic.core.elastic import rng
from lightning_elastic.errors import ConfigError
from lightning_elastic.lightning._compat import (
    loop_progress,
    metric_update_count,
    restore_results,
    set_loop_progress,
    set_metric_update_count,
    snapshot_results,
)

__all__ = ["LiveState", "StepSnapshot"]


class LiveState:
    """Captures and applies the live state of ``strategy``'s trainer."""

    def __init__(self, strategy: Any, trainer: Any) -> None:
        self.strategy = strategy
        self.trainer = trainer

    def capture(self) -> dict[str, Any]:
        """This group's state, copied (see the module docstring)."""
        strategy, trainer = self.strategy, self.trainer
        module = strategy.lightning_module
        data = strategy._data
        captured: dict[str, Any] = _copied(
            {
                "group_size": int(strategy.world_size),
                "model": module.state_dict(),
                "optimizers": [opt.state_dict() for opt in strategy.optimizers],
                "lr_schedulers": [
                    config.scheduler.state_dict() for config in strategy.lr_scheduler_configs
                ],
                "precision": strategy.precision_plugin.state_dict(),
                "callbacks": {
                    str(cb.state_key): state
                    for cb in trainer.callbacks
                    if (state := cb.state_dict())
                },
                "progress": loop_progress(trainer),
                "data": None if data is None else data.state(),
                "run_id": None if (writer := _writer(trainer)) is None else writer.run_id,
            }
        )
        return captured

    def apply(self, state: dict[str, Any]) -> None:
        """Make this group's state a peer's :meth:`capture`."""
        strategy, trainer = self.strategy, self.trainer
        if int(state.get("group_size", -1)) != strategy.world_size:
            raise ConfigError(
                f"replica groups must have the same number of processes: the peer's has "
                f"{state.get('group_size')}, this one {strategy.world_size}"
            )
        data = strategy._data
        if state.get("data") is not None and data is not None:
            data.load_state(state["data"], peer=True)  # first: refuses another configuration
        strategy.lightning_module.load_state_dict(state["model"])
        for optimizer, saved in zip(strategy.optimizers, state["optimizers"], strict=True):
            optimizer.load_state_dict(saved)
        for config, saved in zip(
            strategy.lr_scheduler_configs, state["lr_schedulers"], strict=True
        ):
            config.scheduler.load_state_dict(saved)
        strategy.precision_plugin.load_state_dict(state["precision"])
        callbacks = state.get("callbacks") or {}
        for callback in trainer.callbacks:
            saved = callbacks.get(str(callback.state_key))
            if saved:
                callback.load_state_dict(saved)
        set_loop_progress(trainer, state["progress"])
        writer = _writer(trainer)
        if writer is not None and isinstance(state.get("run_id"), str):
            writer.adopt_run(state["run_id"])  # one run, whichever group writes it

    def replay_window(self, length: int) -> None:
        """A heal while the step is redone: the peer's counters are those of the window's
        start, and this loop is at its last micro-batch, inside the optimizer step; count the
        window's batches and the step's start again, as the loop already did."""
        loop = self.trainer.fit_loop.epoch_loop
        progress = loop.batch_progress
        for _ in range(length - 1):
            progress.increment_ready()
            progress.increment_started()
            progress.increment_processed()
            progress.increment_completed()
        progress.increment_ready()
        progress.increment_started()
        loop.automatic_optimization.optim_progress.optimizer.step.increment_ready()


class StepSnapshot:
    """What a step attempt changes besides the gradients, taken at the step's start to roll a
    failed attempt back before it is redone: the logged results (``self.log``), torchmetrics
    states (tensors cloned, list states copied shallowly: their items are never changed in
    place), the module's buffers (BatchNorm running statistics move in every forward) and the
    RNG streams (a redone step draws the same dropout masks). A redo under the same quorum is
    then the very computation a step without failure would have done."""

    def __init__(self, module: torch.nn.Module, results: Any) -> None:
        from torchmetrics import Metric

        self.results = results
        self.logged = snapshot_results(results)
        self.metrics = [
            (
                metric,
                {name: _shallow(value) for name, value in metric.metric_state.items()},
                metric_update_count(metric),
            )
            for metric in module.modules()
            if isinstance(metric, Metric)
        ]
        self.buffers = [(b, b.detach().clone()) for b in module.buffers()]
        self.rng = rng.capture()

    def restore(self) -> None:
        """Put everything back as it was at the step's start."""
        restore_results(self.results, self.logged)
        for metric, states, count in self.metrics:
            for name, value in states.items():
                setattr(metric, name, _shallow(value))
            set_metric_update_count(metric, count)
        with torch.no_grad():
            for buffer, saved in self.buffers:
                buffer.copy_(saved)
        rng.restore(self.rng)


def _writer(trainer: Any) -> Any:
    """The engine the trainer's ``DistributedCheckpoint`` writes with, if any."""
    from lightning_elastic.lightning.session import ElasticSession

    return ElasticSession.of(trainer).writer


def _shallow(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, list):
        return list(value)
    return value


def _copied(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: _copied(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_copied(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_copied(v) for v in value)
    return value
