"""One traversal of a state per save, shared by the replica check, the plan cache and staging.

A state of 20,000 small tensors was walked three times per save (the replica check, the plan
cache's skeleton, and its leaf lookup), at 1-2 us per entry each. :func:`walk_state` walks it
once, following DCP's traversal rules (mappings, and lists that hold tensors or containers;
everything else is one leaf), and records per top-level key a :class:`Branch`: the skeleton,
every leaf with its path, and each leaf's plan-relevant properties. The plan phase walks its
own state again only below the top-level keys whose value is not the very object the replica
check walked (an entry moved out per rank copies the containers on its way; the engine adds
two small keys): nothing runs between the two walks of one save, so an identical object has
the same contents.

Which rank calls what: no collective; every rank walks its own state on the training thread,
once in the replica check (:mod:`~lightning_elastic.core.save.replicated`) and once more,
reusing the branches, in the plan phase (:mod:`~lightning_elastic.core.save.plan`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from lightning_elastic.core.format.skeleton import Skeleton, is_leaf
from lightning_elastic.errors import ConfigError

__all__ = ["Branch", "StateWalk", "leaf_properties", "walk_state"]

Path = tuple[Any, ...]
_PLAIN = (torch.Tensor, torch.nn.Parameter)


class _Unequal:
    """A leaf property equal to nothing (a sharded or subclassed tensor: always re-planned)."""

    __slots__ = ()

    def __eq__(self, other: object) -> bool:
        return False

    def __hash__(self) -> int:
        return id(self)


def leaf_properties(value: Any) -> Any:
    """What DCP's local plan depends on, for one leaf: a plain tensor's shape, dtype, layout,
    device, ``requires_grad`` and pinning (DCP's ``TensorProperties``); for any other value only
    that it is not a tensor (``None``). A sharded or subclassed tensor is equal to nothing."""
    if type(value) in _PLAIN:
        return (
            value.shape,
            value.dtype,
            value.layout,
            value.device,
            value.requires_grad,
            value.is_pinned(),
        )
    if isinstance(value, torch.Tensor) or hasattr(value, "__get_tensor_shard__"):
        return _Unequal()
    return None


@dataclass
class Branch:
    """One top-level entry of a state, walked: ``value`` is the object walked (kept so the
    plan phase can tell it is the same), ``paths``/``leaves``/``props`` list every leaf in
    DCP's order, ``in_mapping`` whether each is a mapping item, and ``containers`` every
    traversed mapping or list below the top level: ``(path, list length or -1, in_mapping)``."""

    value: Any
    skeleton: Skeleton
    paths: list[Path] = field(default_factory=list)
    leaves: list[Any] = field(default_factory=list)
    props: list[Any] = field(default_factory=list)
    in_mapping: list[bool] = field(default_factory=list)
    containers: list[tuple[Path, int, bool]] = field(default_factory=list)


@dataclass
class StateWalk:
    """Every top-level entry of one state, walked (see the module docstring)."""

    branches: dict[Any, Branch]

    def skeleton(self) -> Skeleton:
        """The state's skeleton, as :func:`~lightning_elastic.core.format.skeleton.describe`
        gives it."""
        return {"d": [[_key(k), b.skeleton] for k, b in self.branches.items()]}

    def leaves(self) -> list[Any]:
        """Every leaf, in DCP's order."""
        return [leaf for b in self.branches.values() for leaf in b.leaves]

    def paths(self) -> list[Path]:
        """The path of every leaf, in DCP's order."""
        return [path for b in self.branches.values() for path in b.paths]

    def props(self) -> list[Any]:
        """Every leaf's :func:`leaf_properties`, in DCP's order."""
        return [prop for b in self.branches.values() for prop in b.props]


def walk_state(state: Mapping[str, Any], reuse: StateWalk | None = None) -> StateWalk:
    """Walk ``state`` once; a top-level value that is the very object ``reuse`` walked keeps
    its branch (see the module docstring: only within one save)."""
    branches: dict[Any, Branch] = {}
    for key, value in state.items():
        old = None if reuse is None else reuse.branches.get(key)
        if old is not None and old.value is value:
            branches[key] = old
        else:
            branches[key] = _walk_branch(key, value)
    return StateWalk(branches)


def _walk_branch(key: Any, value: Any) -> Branch:
    branch = Branch(value, None)
    branch.skeleton = _Walker(branch).visit(value, (key,), True)
    return branch


class _Walker:
    """Fills one :class:`Branch`. A class, not a recursive closure: a closure that calls
    itself is a reference cycle, which kept every walk's lists (60,000 objects at 20,000
    tensors) alive until the cycle collector ran, 10-20 ms at the end of every save."""

    def __init__(self, branch: Branch) -> None:
        self.paths, self.leaves, self.props = branch.paths, branch.leaves, branch.props
        self.in_mapping, self.containers = branch.in_mapping, branch.containers
        # Pinned host memory needs an accelerator: without one every tensor answers False,
        # and asking 20,000 of them cost ~7 ms of every save.
        self.pinnable = not hasattr(torch, "accelerator") or torch.accelerator.is_available()

    def visit(self, value: Any, path: Path, mapped: bool) -> Skeleton:
        if type(value) is dict or isinstance(value, Mapping):
            self.containers.append((path, -1, mapped))
            return {"d": self._items(value, path)}
        if isinstance(value, list) and not is_leaf(value):
            self.containers.append((path, len(value), mapped))
            return {"l": [self.visit(v, (*path, i), False) for i, v in enumerate(value)]}
        self.paths.append(path)
        self.leaves.append(value)
        self.props.append(leaf_properties(value))
        self.in_mapping.append(mapped)
        return None

    def _items(self, mapping: Mapping[Any, Any], path: Path) -> list[list[Any]]:
        paths, leaves, props, in_mapping = self.paths, self.leaves, self.props, self.in_mapping
        pinnable, tensor = self.pinnable, torch.Tensor
        items: list[list[Any]] = []
        for k, v in mapping.items():
            child = (*path, k)
            if type(v) is tensor:  # inlined: a state of 20,000 tensors spends its walk here
                paths.append(child)
                leaves.append(v)
                pinned = pinnable and v.is_pinned()
                props.append((v.shape, v.dtype, v.layout, v.device, v.requires_grad, pinned))
                in_mapping.append(True)
                items.append([k if type(k) is str else _key(k, child), None])
            else:
                items.append([_key(k, child), self.visit(v, child, True)])
        return items


def _key(key: Any, path: Path = ()) -> str | int:
    """A mapping key as the skeleton records it. DCP addresses leaves by ``str(key)`` and the
    skeleton (JSON) restores only ``str`` and ``int`` keys: any other key (a tuple, ``None``,
    a float, a bool, a NumPy integer) would load back as its string, silently, so it is
    refused when the state is saved."""
    if isinstance(key, (str, int)) and not isinstance(key, bool):
        return key
    where = ".".join(map(str, path[:-1])) or "the state"
    raise ConfigError(
        f"cannot save the key {key!r} ({type(key).__name__}) of {where}: a checkpoint keeps "
        "mapping keys that are str or int only (any other key would load back as the string "
        f"{str(key)!r}); use str or int keys, or store that mapping as a list of pairs"
    )
