"""Rank functions for the fault tests: each returns what it saw (errors included)."""

import time
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist
from fsspec.implementations.local import LocalFileSystem

from lightning_elastic import CheckpointEngine, RetryPolicy, Storage
from lightning_elastic.testing.faults import Fault, FaultyFileSystem


def _engine(root: str, faults: list[Fault], timeout_s: float = 30.0) -> CheckpointEngine:
    retry = RetryPolicy(deadline_s=5, initial_backoff_s=0.01, max_backoff_s=0.05)
    storage = Storage(root, fs=FaultyFileSystem(LocalFileSystem(), faults), retry=retry)
    # one logical run across both engines, as after a resume (leftovers are per run)
    return CheckpointEngine(storage=storage, timeout=timedelta(seconds=timeout_s), run_id="run-x")


def _state(step: int) -> dict:
    return {"w": torch.full((1000,), float(step)), "meta": {"step": step}}


def save_good_then_faulty(
    root: str, faults: list[Fault], timeout_s: float = 30.0, state: Callable[[int], dict] = _state
) -> dict:
    """Commit step 1 cleanly, then attempt step 2 with ``faults`` armed for it (``state``:
    the state of a step)."""
    eng = _engine(root, [], timeout_s)
    eng.save(state(1), step=1).result()
    eng.close()
    dist.barrier()
    eng = _engine(root, faults, timeout_s)
    start = time.monotonic()
    outcome: dict = {"rank": dist.get_rank()}
    try:
        result = eng.save(state(2), step=2).result()
        outcome["committed"] = result.name
    except Exception as exc:
        outcome["error"] = exc
        outcome["error_type"] = type(exc).__name__
    outcome["elapsed"] = time.monotonic() - start
    return outcome


def resume_and_save(root: str) -> dict:
    """A fresh incarnation: resume from the newest valid checkpoint, then save again."""
    with CheckpointEngine(root) as eng:
        state = {"w": torch.zeros(1000), "meta": {"step": None}}
        result = eng.load(state)
        statuses_before = {i.name: i.status for i in eng.list()}
        eng.save(_state(3), step=3).result()
        statuses_after = {i.name: i.status for i in eng.list()}
    return {
        "resumed": result.info.name,
        "value": float(state["w"][0]),
        "before": statuses_before,
        "after": statuses_after,
    }
