"""``Trainer(strategy="elastic")`` (and ``"elastic_fsdp"``, ``"elastic_ft"``) after
``import lightning_elastic``, without that import loading Lightning or torch.

Lightning resolves a strategy name through ``lightning.pytorch.strategies.StrategyRegistry``,
whose entries are callables that build the strategy. We register a small factory per name that
imports our strategy module only when a Trainer asks for it. The registry exists once
``lightning.pytorch.strategies`` is imported: if it is already, we register at once; otherwise
a finder at the front of ``sys.meta_path`` waits for that one module, lets the usual finders
and loader import it, registers, and removes itself. Lightning has no entry point for
strategies (only for callbacks, and those load after the strategy is resolved), so this is the
one way a plain ``import lightning_elastic`` can make the names work in either import order.

Which process calls what: :func:`install` runs at ``import lightning_elastic`` (every process
that imports any part of the package); nothing else calls it. This is the one place the names
are registered: the strategy modules do not register themselves.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence
from importlib.machinery import ModuleSpec
from types import ModuleType
from typing import TYPE_CHECKING, Any, cast

if TYPE_CHECKING:
    from importlib.abc import Loader

__all__ = ["STRATEGIES", "install"]

_TARGET = "lightning.pytorch.strategies"

#: name -> (module, class, description)
STRATEGIES: dict[str, tuple[str, str, str]] = {
    "elastic": (
        "lightning_elastic.lightning.strategy",
        "ElasticStrategy",
        "DDP with sharded, asynchronous, elastic checkpoints (lightning_elastic)",
    ),
    "elastic_fsdp": (
        "lightning_elastic.lightning.fsdp",
        "ElasticFSDPStrategy",
        "FSDP2 with sharded, asynchronous, elastic checkpoints (lightning_elastic)",
    ),
    "elastic_ft": (
        "lightning_elastic.lightning.replicas",
        "ElasticFTStrategy",
        "replica groups that leave and join without a restart (lightning_elastic, torchft)",
    ),
}


class _Build:
    """Builds one of our strategies by name (its module imported on the first call)."""

    def __init__(self, module: str, name: str) -> None:
        self.module, self.name = module, name

    def __call__(self, **init_params: Any) -> Any:
        return getattr(importlib.import_module(self.module), self.name)(**init_params)

    def __repr__(self) -> str:
        return f"{self.module}.{self.name}"


def _register(strategies: ModuleType) -> None:
    registry = strategies.StrategyRegistry
    for name, (module, cls, description) in STRATEGIES.items():
        if name not in registry:
            registry.register(name, _Build(module, cls), description=description)


class _Loader:
    """The real loader of ``lightning.pytorch.strategies``, then our registration (the import
    system's loader protocol, duck-typed: ``importlib.abc`` costs milliseconds to import)."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader

    def create_module(self, spec: ModuleSpec) -> ModuleType | None:
        module: ModuleType | None = self.loader.create_module(spec)
        return module

    def exec_module(self, module: ModuleType) -> None:
        self.loader.exec_module(module)
        _register(module)

    def __getattr__(self, name: str) -> Any:  # get_source, get_filename, ... of the real one
        return getattr(self.loader, name)


class _AwaitStrategies:
    """Finds nothing itself: wraps the loader the other finders give for one module."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        if fullname != _TARGET:
            return None
        _remove()  # once: the module is imported once (and the finders below are asked now)
        spec: ModuleSpec | None = None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            spec = None if find is None else find(fullname, path, target)
            if spec is not None:
                break
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        spec.loader = cast("Loader", _Loader(spec.loader))
        return spec


def _remove() -> None:
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _AwaitStrategies)]


def install() -> None:
    """Register the names now if Lightning's strategies are imported, else when they are."""
    strategies = sys.modules.get(_TARGET)
    if strategies is not None and hasattr(strategies, "StrategyRegistry"):
        _register(strategies)
    elif not any(isinstance(f, _AwaitStrategies) for f in sys.meta_path):
        sys.meta_path.insert(0, _AwaitStrategies())
