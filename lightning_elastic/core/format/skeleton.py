"""The shape of a state dict, so a checkpoint can be loaded without a template.

DCP flattens a state dict into leaves addressed by paths in which mapping keys are
stringified (``{0: ...}`` becomes ``"0"``), empty mappings vanish and list indices are ints.
Rebuilding from those paths alone would turn an optimizer's ``state`` dict (int keys) into a
dict of strings and drop an empty ``state`` entirely. The skeleton records, with DCP's own
traversal rules, every traversed container: mappings with their keys' original types (JSON
keeps ints and strings apart) including empty ones, and lists; ``None`` stands for a leaf.

Encoding: ``{"d": [[key, child], ...]}`` for a mapping, ``{"l": [child, ...]}`` for a list.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

__all__ = ["Skeleton", "build", "describe", "is_leaf", "keys", "merge", "subtree"]

Skeleton = dict[str, Any] | None
Path = tuple[str | int, ...]


def _is_terminal(value: Any) -> bool:
    """DCP's rule: mappings are traversed; lists only if they hold tensors or containers."""
    if isinstance(value, Mapping):
        return False
    if not isinstance(value, list):
        return True
    for entry in value:
        if isinstance(entry, (Mapping, list)) and not _is_terminal(entry):
            return False
        if isinstance(entry, torch.Tensor):
            return False
    return True


def is_leaf(value: Any) -> bool:
    """Whether DCP stores ``value`` as one leaf (a tensor or an object) rather than
    traversing it (mappings; lists that hold tensors or containers)."""
    return _is_terminal(value)


def describe(value: Any) -> Skeleton:
    """The skeleton of ``value`` (``None`` for a leaf), following DCP's traversal rules."""
    if isinstance(value, Mapping):
        return {"d": [[_key(k), describe(v)] for k, v in value.items()]}
    if _is_terminal(value):
        return None
    return {"l": [describe(v) for v in value]}


def _key(key: Any) -> str | int:
    return key if isinstance(key, (str, int)) and not isinstance(key, bool) else str(key)


def merge(a: Skeleton, b: Skeleton) -> Skeleton:
    """Union of two skeletons (ranks contribute different rank-local subtrees)."""
    if a is None or b is None:
        return a if b is None else b
    if "d" in a and "d" in b:
        merged = {_hashable(k): [k, child] for k, child in a["d"]}
        for k, child in b["d"]:
            h = _hashable(k)
            merged[h] = [k, merge(merged[h][1], child)] if h in merged else [k, child]
        return {"d": list(merged.values())}
    if "l" in a and "l" in b and len(a["l"]) == len(b["l"]):
        return {"l": [merge(x, y) for x, y in zip(a["l"], b["l"], strict=True)]}
    return a


def _hashable(key: str | int) -> tuple[str, str | int]:
    return (type(key).__name__, key)


def build(skeleton: Skeleton, leaf: Callable[[Path], Any], path: Path = ()) -> Any:
    """Rebuild containers from ``skeleton``; ``leaf(path)`` gives each leaf (DCP path)."""
    if skeleton is None:
        return leaf(path)
    if "d" in skeleton:
        return {k: build(child, leaf, (*path, str(k))) for k, child in skeleton["d"]}
    return [build(child, leaf, (*path, i)) for i, child in enumerate(skeleton["l"])]


def subtree(skeleton: Skeleton, keys: tuple[str | int, ...]) -> Skeleton:
    """The part of ``skeleton`` below the mapping keys ``keys``; ``KeyError`` when absent."""
    node = skeleton
    for key in keys:
        found = [child for k, child in (node or {}).get("d", []) if str(k) == str(key)]
        if not found:
            raise KeyError(keys)
        node = found[0]
    return node


def keys(skeleton: Skeleton) -> list[str | int]:
    """The keys of the mapping ``skeleton`` describes (``[]`` for a leaf or a list)."""
    return [k for k, _ in (skeleton or {}).get("d", [])]
