"""Sharded optimizer state (ZeRO-1) that saves per rank and reshards N -> M.

``shard_optimizer_state=True`` wraps each optimizer in torch's ``ZeroRedundancyOptimizer``:
parameters are partitioned over the ranks balanced by size, each rank keeps optimizer state
for its partition only, and updated parameters are broadcast after each step.

In a checkpoint the optimizer is stored *by parameter name*:
``{"sharded": True, "param_groups": [{hyperparameters..., "params": [names]}],
"state": {name: {"exp_avg": ..., ...}}}``. Every rank contributes the names it owns, so each
rank writes only its partition and the union is the whole state; the hyperparameters are the
same on every rank and written once. Loading at any world size gives every parameter's state to
its new owner, unchanged; a plain (replicated) optimizer state loads into a sharded optimizer
and the other way round.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.optim import Optimizer

from lightning_elastic.lightning._compat import track_scheduler_steps

__all__ = ["load_optimizer", "optimizer_state", "repoint_scheduler", "shard"]


def shard(optimizer: Optimizer) -> ZeroRedundancyOptimizer:
    """Wrap ``optimizer`` (not stepped yet) in a ``ZeroRedundancyOptimizer`` of its class,
    with the same parameter groups and hyperparameters."""
    if isinstance(optimizer, ZeroRedundancyOptimizer):
        return optimizer
    groups = [dict(group) for group in optimizer.param_groups]
    return ZeroRedundancyOptimizer(groups, optimizer_class=type(optimizer), **optimizer.defaults)


def repoint_scheduler(scheduler: Any, optimizer: Optimizer) -> None:
    """Make an LR scheduler built for the original optimizer drive ``optimizer`` instead, with
    the step tracking torch's schedulers install (so they do not warn that the optimizer
    never stepped)."""
    scheduler.optimizer = optimizer
    track_scheduler_steps(optimizer)


def optimizer_state(optimizer: Optimizer, names: Mapping[torch.Tensor, str]) -> dict[str, Any]:
    """The name-keyed state of this rank's partition (see the module docstring)."""
    assert isinstance(optimizer, ZeroRedundancyOptimizer)
    local = optimizer.optim
    state = {
        names[param]: {k: _detached(v) for k, v in values.items()}
        for param, values in local.state.items()
    }
    return {
        "sharded": True,
        "param_groups": _named_groups(optimizer.param_groups, names),
        "state": state,
    }


def load_optimizer(
    optimizer: Optimizer, saved: Mapping[str, Any], names: Mapping[torch.Tensor, str]
) -> None:
    """Load ``saved`` (sharded or plain, from any world size) into ``optimizer``."""
    sharded_now = isinstance(optimizer, ZeroRedundancyOptimizer)
    if not saved.get("sharded"):
        if not sharded_now:
            optimizer.load_state_dict(dict(saved))
            return
        saved = _plain_to_named(saved, optimizer.param_groups, names)
    if not sharded_now:
        optimizer.load_state_dict(_named_to_plain(saved, optimizer.param_groups, names))
        return
    assert isinstance(optimizer, ZeroRedundancyOptimizer)
    _restore_hyperparameters(optimizer.param_groups, saved["param_groups"])
    _restore_hyperparameters(
        optimizer.optim.param_groups, saved["param_groups"], match_params=names
    )
    for group in optimizer.optim.param_groups:
        for param in group["params"]:
            values = saved["state"].get(names[param])
            if values is not None:
                optimizer.optim.state[param] = {
                    k: v.to(param.device) if isinstance(v, torch.Tensor) else v
                    for k, v in values.items()
                }


def _detached(value: Any) -> Any:
    return value.detach() if isinstance(value, torch.Tensor) else value


def _named_groups(
    groups: Iterable[Mapping[str, Any]], names: Mapping[torch.Tensor, str]
) -> list[dict[str, Any]]:
    return [
        {
            **{k: v for k, v in group.items() if k != "params"},
            "params": [names[p] for p in group["params"]],
        }
        for group in groups
    ]


def _restore_hyperparameters(
    groups: list[dict[str, Any]],
    saved_groups: list[Mapping[str, Any]],
    match_params: Mapping[torch.Tensor, str] | None = None,
) -> None:
    """Copy saved hyperparameters (lr, betas, ...) into ``groups``; local (partition) groups
    are matched to saved groups by the names of the parameters they hold."""
    for index, group in enumerate(groups):
        if match_params is None:
            source = saved_groups[index] if index < len(saved_groups) else None
        else:
            owned = {match_params[p] for p in group["params"]}
            source = next((g for g in saved_groups if owned & set(g["params"])), None)
        if source is not None:
            group.update({k: v for k, v in source.items() if k != "params"})


def _plain_to_named(
    saved: Mapping[str, Any], groups: list[dict[str, Any]], names: Mapping[torch.Tensor, str]
) -> dict[str, Any]:
    """A plain ``Optimizer.state_dict()`` (state keyed by position) -> the name-keyed form,
    positions mapped to the current optimizer's parameters in order."""
    order = [names[p] for group in groups for p in group["params"]]
    saved_groups = saved["param_groups"]
    positions = [i for group in saved_groups for i in group["params"]]
    by_position = dict(zip(positions, order, strict=True))
    return {
        "sharded": True,
        "param_groups": [
            {
                **{k: v for k, v in g.items() if k != "params"},
                "params": [by_position[i] for i in g["params"]],
            }
            for g in saved_groups
        ],
        "state": {by_position[int(k)]: dict(v) for k, v in saved["state"].items()},
    }


def _named_to_plain(
    saved: Mapping[str, Any], groups: list[dict[str, Any]], names: Mapping[torch.Tensor, str]
) -> dict[str, Any]:
    """The name-keyed form -> a plain state dict for the current (unsharded) optimizer."""
    position = {names[p]: i for i, p in enumerate(p for group in groups for p in group["params"])}
    return {
        "state": {
            position[name]: dict(v) for name, v in saved["state"].items() if name in position
        },
        "param_groups": [
            {
                **{k: v for k, v in g.items() if k != "params"},
                "params": [position[n] for n in g["params"]],
            }
            for g in saved["param_groups"]
        ],
    }
