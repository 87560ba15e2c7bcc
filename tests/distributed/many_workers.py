"""Rank functions for the many-ranks tests (module level: they pickle)."""

import torch
import torch.distributed as dist

from tests.distributed.workers import sharded


def every_rank_writes(step: int) -> dict:
    """A replicated tensor and a tensor sharded over every rank, so every rank writes a
    shard file of its own (for ``tests.faults.workers.save_good_then_faulty``)."""
    world = dist.get_world_size()
    rows = torch.arange(world * 4 * 3, dtype=torch.float32).reshape(world * 4, 3)
    return {"w": torch.full((1000,), float(step)), "emb": sharded(world, rows + step)}
