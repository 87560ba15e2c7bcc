"""Rank functions for the per-rank entry tests (module level, so they pickle)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from lightning_elastic import CheckpointEngine, PerRankRule
from lightning_elastic.errors import PerRankStateError


def rank_state_of(rank: int) -> dict[str, Any]:
    """A "replicated" state in which some entries differ per rank, as a user's do."""
    return {
        "model": {"w": torch.ones(3), "bn": torch.full((4,), float(rank))},
        "cb": {"count": 10 + rank, "name": "same", "history": [1, 2, rank]},
        "loader": [{"n": rank, "generator": torch.arange(5) + rank, "same": 1}],
        # each rank its own keys (ZeRO-1's sharded optimizer state): the union, no conflict
        "owned": {f"p{rank}": torch.zeros(2) + rank},
    }


def save_twice(root: str) -> dict[str, Any]:
    rank = dist.get_rank()
    state = rank_state_of(rank)
    with CheckpointEngine(root) as engine:
        gathers = 0
        all_gather = engine.coordinator.all_gather

        def counted(*args: Any, **kwargs: Any) -> Any:
            nonlocal gathers
            gathers += 1
            return all_gather(*args, **kwargs)

        engine.coordinator.all_gather = counted  # type: ignore[method-assign]
        engine.save(state, step=1, rank_state={"r": rank}).result()
        first = gathers
        state["cb"]["count"] += 100
        engine.save(state, step=2, rank_state={"r": rank}).result()
        return {
            "per_rank": engine._replicas.per_rank,
            "gathers": (first, gathers - first),
            "saved": state,
        }


def load(root: str, rules: list[tuple[tuple, str]] | None = None, in_place: bool = False) -> Any:
    rank = dist.get_rank()
    per_rank_rules = [PerRankRule(prefix, action) for prefix, action in rules or []]
    template = None
    if in_place:
        template = rank_state_of(99)
        template["owned"] = {"p0": torch.empty(2), "p1": torch.empty(2)}
    with CheckpointEngine(root) as engine:
        try:
            result = engine.load(template, per_rank_rules=per_rank_rules)
        except PerRankStateError as exc:
            return {"error": exc}
        return {
            "rank": rank,
            "state": result.state,
            "rank_state": result.rank_state,
            "per_rank": result.per_rank,
            "same_object": result.state is template,
        }
