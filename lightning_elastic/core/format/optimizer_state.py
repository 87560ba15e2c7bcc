"""Optimizer states by parameter name, and back to torch's by-position form.

Sharded optimizers (ZeRO-1 ``ElasticStrategy``, FSDP2 ``elastic_fsdp``) save their state keyed
by parameter name: ``{"sharded": True, "param_groups": [{hyperparameters..., "params":
[names]}], "state": {name: {...}}}``, so it can be split and rejoined at any world size. A
plain ``torch.optim.Optimizer.load_state_dict`` wants positions instead: the parameters
numbered in their groups' order, the order an optimizer built the same way over the same
model has.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["by_position", "is_named", "named_to_positional"]


def is_named(saved: Any) -> bool:
    """Whether ``saved`` is an optimizer state in the name-keyed form."""
    return isinstance(saved, Mapping) and bool(saved.get("sharded"))


def named_to_positional(saved: Mapping[str, Any]) -> dict[str, Any]:
    """The name-keyed form -> a plain ``Optimizer.state_dict()``, positions numbered in the
    saved groups' order."""
    position: dict[str, int] = {}
    for group in saved["param_groups"]:
        for name in group["params"]:
            position.setdefault(name, len(position))
    return by_position(saved, position)


def by_position(saved: Mapping[str, Any], position: Mapping[str, int]) -> dict[str, Any]:
    """The name-keyed form with every name replaced by its ``position`` (names without one,
    parameters the optimizer does not hold, are left out)."""
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
