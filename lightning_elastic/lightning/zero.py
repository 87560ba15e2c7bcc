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

The sharded optimizer is built from the class's constructor, not from ``optimizer.defaults``:
the two differ (``AdamW`` keeps ``decoupled_weight_decay`` in its defaults, a key its
``__init__`` refuses), so only the defaults the constructor accepts are passed, and every
parameter group's hyperparameters are then copied over from the original groups. A user's
optimizer whose constructor cannot be called that way is refused with a ``ConfigError`` that
names the class and the argument.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.optim import Optimizer

from lightning_elastic.core.format.optimizer_state import by_position
from lightning_elastic.errors import ConfigError
from lightning_elastic.lightning._compat import track_scheduler_steps

__all__ = [
    "as_named",
    "constructor_arguments",
    "load_optimizer",
    "named_groups",
    "optimizer_state",
    "repoint_scheduler",
    "shard",
]

_EMPTY = inspect.Parameter.empty
_NAMED = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
# ZeroRedundancyOptimizer's own keywords: a default with one of these names would be taken
# by the wrapper instead of reaching the optimizer
_ZERO_KEYWORDS = frozenset(
    a.name
    for a in inspect.signature(ZeroRedundancyOptimizer).parameters.values()
    if a.kind in _NAMED
)
# attributes every optimizer has: an __init__ argument of that name is not "kept" in them
_OPTIMIZER_ATTRIBUTES = frozenset({"defaults", "state", "param_groups"})


def shard(optimizer: Optimizer) -> ZeroRedundancyOptimizer:
    """Wrap ``optimizer`` (not stepped yet) in a ``ZeroRedundancyOptimizer`` of its class,
    with the same parameter groups and hyperparameters.

    Raises:
        ConfigError: the optimizer's class cannot be rebuilt from its ``defaults``.
    """
    if isinstance(optimizer, ZeroRedundancyOptimizer):
        return optimizer
    originals = [dict(group) for group in optimizer.param_groups]
    kwargs = constructor_arguments(optimizer)
    try:
        sharded = ZeroRedundancyOptimizer(
            [dict(group) for group in originals], optimizer_class=type(optimizer), **kwargs
        )
    except TypeError as e:  # the same on every rank: construction runs no collective
        raise ConfigError(
            f"shard_optimizer_state=True rebuilds {_qualname(optimizer)} from its defaults "
            f"with {sorted(kwargs)}, and that failed: {e}. Accept these keyword arguments "
            f"in __init__, or train without shard_optimizer_state"
        ) from e
    # a constructor may rewrite what it was given; the user's groups are the truth
    _restore_hyperparameters(sharded.param_groups, originals)
    _restore_hyperparameters(sharded.optim.param_groups, originals)
    return sharded


def constructor_arguments(optimizer: Optimizer) -> dict[str, Any]:
    """The keyword arguments, taken from ``optimizer.defaults``, that build another optimizer
    of its class: those its ``__init__`` accepts (following ``**kwargs`` up the base classes
    that forward them; all of them where they may land in ``Optimizer``'s defaults).

    Raises:
        ConfigError: an ``__init__`` argument the defaults cannot supply is required, or was
            given a value (kept as an attribute of that name) other than its default.
    """
    cls = type(optimizer)
    own = list(inspect.signature(cls).parameters.values())[1:]  # after the parameters
    for arg in own:
        if arg.name in optimizer.defaults or arg.kind not in (*_NAMED, arg.POSITIONAL_ONLY):
            continue
        kept = vars(optimizer) if arg.name not in _OPTIMIZER_ATTRIBUTES else {}
        value = kept.get(arg.name, arg.default)
        if arg.default is _EMPTY or _differs(value, arg.default):
            state = "is required" if arg.default is _EMPTY else f"was given {value!r}"
            raise ConfigError(
                f"shard_optimizer_state=True rebuilds {_qualname(optimizer)} from its "
                f"defaults, but its __init__ argument {arg.name!r} {state} and is not in "
                f"optimizer.defaults: store it there (Optimizer.__init__(params, defaults)), "
                f"or train without shard_optimizer_state"
            )
    accepted, open_kwargs = _accepted_keywords(cls)
    kwargs = {k: v for k, v in optimizer.defaults.items() if open_kwargs or k in accepted}
    clashes = sorted(_ZERO_KEYWORDS & set(kwargs))
    if clashes:
        raise ConfigError(
            f"shard_optimizer_state=True cannot pass {_qualname(optimizer)}'s argument(s) "
            f"{clashes}: ZeroRedundancyOptimizer takes these names itself"
        )
    return kwargs


def _accepted_keywords(cls: type) -> tuple[set[str], bool]:
    """The keyword names ``cls(params, **kw)`` accepts, and whether it accepts any keyword.

    A ``**kwargs`` is followed to the next ``__init__`` up the MRO (``class MyAdamW(AdamW)``
    with ``__init__(self, params, **kwargs)`` forwards to ``AdamW``); one that stays open up
    to ``Optimizer`` is taken to feed the defaults, so it accepts every key of them.
    """
    accepted: set[str] = set()
    for klass in cls.__mro__:
        if klass is Optimizer or klass is object:
            return accepted, True
        init = klass.__dict__.get("__init__")
        if init is None:
            continue
        args = list(inspect.signature(init).parameters.values())[2:]  # self, params
        accepted |= {a.name for a in args if a.kind in _NAMED}
        if not any(a.kind is a.VAR_KEYWORD for a in args):
            return accepted, False
    return accepted, True


def _differs(value: Any, default: Any) -> bool:
    if value is default:
        return False
    try:
        return bool(value != default)
    except Exception:  # e.g. a tensor of several elements: not provably equal
        return True


def _qualname(optimizer: Optimizer) -> str:
    cls = type(optimizer)
    return f"{cls.__module__}.{cls.__qualname__}"


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
        "param_groups": named_groups(optimizer.param_groups, names),
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
    # local group i is this rank's part of group i, empty or not (ZeRO keeps them aligned);
    # matching by owned names would leave an empty one with the constructor's values
    _restore_hyperparameters(optimizer.optim.param_groups, optimizer.param_groups)
    for group in optimizer.optim.param_groups:
        for param in group["params"]:
            values = saved["state"].get(names[param])
            if values is not None:
                optimizer.optim.state[param] = {
                    k: v.to(param.device) if isinstance(v, torch.Tensor) else v
                    for k, v in values.items()
                }


def as_named(
    saved: Mapping[str, Any], groups: list[dict[str, Any]], names: Mapping[torch.Tensor, str]
) -> dict[str, Any]:
    """A saved optimizer state in the name-keyed form (see the module docstring): as it is,
    or converted from a plain ``Optimizer.state_dict()`` by the current ``groups``' order."""
    if saved.get("sharded"):
        return dict(saved)
    return _plain_to_named(saved, groups, names)


def _detached(value: Any) -> Any:
    return value.detach() if isinstance(value, torch.Tensor) else value


def named_groups(
    groups: Iterable[Mapping[str, Any]], names: Mapping[torch.Tensor, str]
) -> list[dict[str, Any]]:
    """Parameter groups with their parameters as names (the name-keyed form's groups)."""
    return [
        {
            **{k: v for k, v in group.items() if k != "params"},
            "params": [names[p] for p in group["params"]],
        }
        for group in groups
    ]


def _restore_hyperparameters(
    groups: list[dict[str, Any]], saved_groups: Sequence[Mapping[str, Any]]
) -> None:
    """Copy saved hyperparameters (every key but ``params``: lr, betas, ...) into ``groups``,
    group ``i`` from saved group ``i``."""
    for group, source in zip(groups, saved_groups, strict=False):
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
    return by_position(saved, position)
