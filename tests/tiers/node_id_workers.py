"""Rank functions for node ids checked per rank (test_local_root_checks.py): one rank's id is
illegal, every rank must fail with ConfigError. Module level, so they pickle."""

from __future__ import annotations

import os
import time
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from lightning_elastic.core.engine import CheckpointEngine
from lightning_elastic.core.tiers.layout import NODE_ENV
from tests.distributed.tier_engine_workers import local_root


def bad_node_id_on_one_rank(root: str, nodes: list[str]) -> dict[str, Any]:
    """Build a tiered engine with ``nodes[rank]`` as this rank's id (one of them illegal), given
    as a host's ``$LIGHTNING_ELASTIC_NODE``: what each rank raises, and how long it took."""
    rank = dist.get_rank()
    os.environ[NODE_ENV] = nodes[rank]
    start = time.monotonic()
    try:
        eng = CheckpointEngine(
            os.path.join(root, "persistent"),
            local_root=local_root(root, f"n{rank}"),
            timeout=timedelta(seconds=8),
        )
    except Exception as exc:
        return {
            "error": type(exc).__name__,
            "message": str(exc),
            "seconds": time.monotonic() - start,
        }
    eng.close()
    return {"error": None, "message": "", "seconds": time.monotonic() - start}
