"""Rank functions for the many-ranks tests (module level: they pickle)."""

import time

import torch
import torch.distributed as dist

from lightning_elastic.testing.faults import Fault
from tests.distributed.workers import sharded
from tests.faults.workers import _engine


def _state(step: int, world: int) -> dict:
    """A replicated tensor, an object, and a tensor sharded over every rank (so every rank
    writes a shard file of its own)."""
    rows = torch.arange(world * 4 * 3, dtype=torch.float32).reshape(world * 4, 3)
    return {"w": torch.full((1000,), float(step)), "emb": sharded(world, rows + step)}


def save_then_fault(root: str, faults: list[Fault], timeout_s: float) -> dict:
    """Commit step 1 cleanly, then attempt step 2 with ``faults`` armed for it."""
    world = dist.get_world_size()
    eng = _engine(root, [], timeout_s)
    eng.save(_state(1, world), step=1).result()
    eng.close()
    dist.barrier()
    eng = _engine(root, faults, timeout_s)
    start = time.monotonic()
    outcome: dict = {"rank": dist.get_rank()}
    try:
        outcome["committed"] = eng.save(_state(2, world), step=2).result().name
    except Exception as exc:
        outcome["error"] = exc
    outcome["elapsed"] = time.monotonic() - start
    return outcome
