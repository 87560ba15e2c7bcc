"""A warning when training dataloader workers are forked while checkpoints are written in the
background, on a Python whose forked children can hang (CPython gh-112275).

A ``DataLoader`` with ``num_workers > 0`` and ``persistent_workers=False`` forks its workers
again at every epoch start (``fork`` is the default start method on Linux). On CPython before
3.10.15 / 3.11.10 a forked child hangs for ever inside ``os.fork()`` when another thread held
the interpreter's ``HEAD_LOCK`` at that instant, and only a thread entering Python from C/C++
(a pybind11 callback, for example) holds it without the GIL; see
:mod:`lightning_elastic.core.forksafe` for what our writer thread can and cannot hold. The
epoch then waits for that worker's batches for ever. Only the user can close this: workers
forked once (``persistent_workers=True``) or started by a forkserver
(``multiprocessing_context="forkserver"``), or a fixed Python.

Nothing here needs Lightning (a Lightning ``CombinedLoader`` is recognised by its
``flattened`` attribute): ``DistributedCheckpoint`` calls :func:`warn_forking_workers` at
training start, and a ``CheckpointEngine`` user with asynchronous saves can call it with the
training loader.
"""

from __future__ import annotations

import multiprocessing
import sys
import warnings
from collections.abc import Iterable, Mapping
from typing import Any

from torch.utils.data import DataLoader

from lightning_elastic.core.forksafe import python_fork_hang_fixed
from lightning_elastic.errors import ForkingWorkersWarning

__all__ = ["ForkingWorkersWarning", "forking_loaders", "warn_forking_workers"]

_warned = False  # once per process


def forking_loaders(dataloaders: Any) -> list[DataLoader[Any]]:
    """The ``DataLoader`` objects in ``dataloaders`` (a loader, a Lightning
    ``CombinedLoader``, or a dict/list/tuple of them) that fork new workers for every epoch:
    ``num_workers > 0``, ``persistent_workers=False`` and the ``fork`` start method."""
    return [loader for loader in _loaders(dataloaders) if _forks_every_epoch(loader)]


def warn_forking_workers(
    dataloaders: Any,
    *,
    async_save: bool,
    rank: int = 0,
    python_fixed: bool | None = None,
) -> str | None:
    """Warn once per process (on ``rank`` 0) when asynchronous saves are on, this Python can
    hang in a forked child (``python_fixed``, default: :func:`python_fork_hang_fixed`) and a
    training dataloader forks its workers at every epoch; return the message, or ``None``
    when there is nothing to say (or it was said already)."""
    global _warned
    fixed = python_fork_hang_fixed() if python_fixed is None else python_fixed
    if _warned or fixed or not async_save or rank != 0:
        return None
    loaders = forking_loaders(dataloaders)
    if not loaders:
        return None
    loader = loaders[0]
    message = (
        f"The training DataLoader forks {loader.num_workers} new worker processes at every "
        "epoch (persistent_workers=False, start method 'fork') while checkpoints are written "
        f"in a background thread. On Python {sys.version.split()[0]} a forked worker can hang "
        "for ever if another thread holds an interpreter lock at that instant (CPython "
        "gh-112275, fixed in 3.10.15, 3.11.10 and 3.12), and the epoch then waits for it. "
        "Pass persistent_workers=True (workers are forked once) or "
        "multiprocessing_context='forkserver' to the DataLoader, or use a fixed Python."
    )
    _warned = True
    warnings.warn(message, ForkingWorkersWarning, stacklevel=2)
    return message


def _loaders(dataloaders: Any) -> Iterable[DataLoader[Any]]:
    if isinstance(dataloaders, DataLoader):
        yield dataloaders
    elif hasattr(dataloaders, "flattened"):  # Lightning's CombinedLoader
        for inner in dataloaders.flattened:
            yield from _loaders(inner)
    elif isinstance(dataloaders, Mapping):
        for inner in dataloaders.values():
            yield from _loaders(inner)
    elif isinstance(dataloaders, (list, tuple)):
        for inner in dataloaders:
            yield from _loaders(inner)


def _forks_every_epoch(loader: DataLoader[Any]) -> bool:
    if loader.num_workers <= 0 or loader.persistent_workers:
        return False
    return _start_method(loader.multiprocessing_context) == "fork"


def _start_method(context: Any) -> str | None:
    """The start method a loader's workers use. ``None`` means torch.multiprocessing's
    default; asked without fixing it (``get_start_method()`` would set it for good)."""
    if context is None:
        chosen = multiprocessing.get_start_method(allow_none=True)
        return chosen or multiprocessing.get_all_start_methods()[0]  # the first is the default
    if isinstance(context, str):
        return context
    method = context.get_start_method()
    return str(method) if method is not None else None
