"""Rank functions for the two directions of checkpoint file transfers
(core/tiers/transfer.py: a rank sends its transfers on the calling thread while it receives
its own on a thread). Module level, so they pickle.

:func:`lanes_worker` applies this module's ``lane_hooks`` (``(rank, name, kwargs)``: they
patch module-level code, and record what they see in ``SEEN``), then runs
:func:`~tests.tiers.transfer_pipeline_workers.hostile_worker` (its own storage ``hooks``).
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from typing import Any

from lightning_elastic.core.tiers import transfer
from tests.tiers import transfer_pipeline_workers as workers

SEEN: dict[str, Any] = {}


def lanes_worker(
    root: str,
    files: dict[int, dict[str, bytes]],
    transfers: list[Any],
    *,
    lane_hooks: list[tuple[int, str, dict[str, Any]]] = (),  # type: ignore[assignment]
    **kwargs: Any,
) -> dict[str, Any]:
    import torch.distributed as dist

    rank = dist.get_rank()
    for hook_rank, name, hook_kwargs in lane_hooks:
        if hook_rank == rank:
            globals()[name](**hook_kwargs)
    _threads_at_return()
    out = workers.hostile_worker(root, files, transfers, **kwargs)
    out["lanes"] = dict(SEEN)
    return out


def _threads_at_return() -> None:
    """Record the transfer threads alive the moment ``execute_transfers`` returns or raises."""
    call = workers.execute_transfers

    def recorded(*args: Any, **kwargs: Any) -> Any:
        try:
            return call(*args, **kwargs)
        finally:
            names = sorted(t.name for t in threading.enumerate() if "transfer" in t.name)
            SEEN["threads_at_return"] = names
            SEEN["returned_at"] = time.monotonic()

    workers.execute_transfers = recorded  # type: ignore[assignment]


# ----------------------------------------------------------------------------- hooks


def abort_memory_source(delay: float = 0.0) -> None:
    """A memory source given as ``"raise"`` raises a BaseException (an interrupt while the
    payload is read, ``delay`` seconds into it) instead of a RuntimeError."""

    def aborting() -> Any:
        time.sleep(delay)
        raise workers.Abort("interrupted while reading the staged payload")

    workers._raising_source = aborting  # type: ignore[assignment]


def interrupt_after(delay: float) -> None:
    """A SIGINT (Ctrl-C) reaches the calling thread ``delay`` seconds into the call (not
    after it: cancelled when it returns first)."""
    call = workers.execute_transfers

    def interrupted(*args: Any, **kwargs: Any) -> Any:
        main = threading.main_thread().ident
        assert main == threading.get_ident()
        timer = threading.Timer(delay, signal.pthread_kill, (main, signal.SIGINT))
        timer.start()
        try:
            return call(*args, **kwargs)
        finally:
            timer.cancel()

    workers.execute_transfers = interrupted  # type: ignore[assignment]


def time_receives() -> None:
    """Record when each receive of this rank ended (``received_at``: path -> monotonic)."""
    receive = transfer._receive
    SEEN["received_at"] = {}

    def timed(t: Any, *args: Any) -> Any:
        try:
            return receive(t, *args)
        finally:
            SEEN["received_at"][t.path] = time.monotonic()

    transfer._receive = timed


def rebuild_worker(
    root: str,
    files: dict[int, dict[str, bytes]],
    first: list[Any],
    second: list[Any],
    *,
    chunk_bytes: int,
    timeout_s: float,
    hooks: list[tuple[int, str, dict[str, Any]]] = (),  # type: ignore[assignment]
) -> dict[str, Any]:
    """Run ``first`` on a gloo group (the storage ``hooks`` of the hostile workers applied),
    then replace the group as the tier runtime does after a failed transfer
    (``TierSet._rebuild_group``) and run ``second`` on the new one. Each call's outcome: the
    stats, the error (or a non-TransferError's type name); the transfer threads alive at the
    end."""
    from datetime import timedelta

    import torch.distributed as dist

    from lightning_elastic.core.tiers.transfer import TransferError, execute_transfers

    rank, storage, _ = workers.prepared(root, files, hooks)
    out: dict[str, Any] = {}
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
    for key, transfers in (("first", first), ("second", second)):
        outcome: dict[str, Any] = {"error": None, "stats": None, "other": None}
        try:
            outcome["stats"] = execute_transfers(
                transfers,
                rank=rank,
                group=group,
                storage=storage,
                chunk_bytes=chunk_bytes,
                timeout=timedelta(seconds=timeout_s),
            )
        except TransferError as exc:
            outcome["stats"], outcome["error"] = exc.stats, exc.with_traceback(None)
        except BaseException as exc:
            outcome["other"] = f"{type(exc).__name__}: {exc}"
        out[key] = outcome
        if key == "first":
            dist.barrier()  # the runtime rebuilds after a collective (TierSet.decide)
            with contextlib.suppress(Exception):
                dist.destroy_process_group(group)
            group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
    time.sleep(0.5)
    out["threads"] = sorted(t.name for t in threading.enumerate() if "transfer" in t.name)
    return out
