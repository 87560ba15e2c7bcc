"""Rank functions for the multi-tier engine tests (module level, so they pickle).

Rank ``r`` runs on node ``nodes[r]``; each node's local root is ``<root>/local_<node>``, the
persistent root ``<root>/persistent``."""

from __future__ import annotations

import os
from concurrent import futures
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from lightning_elastic.core.engine import CheckpointEngine


def local_root(root: str, node: str) -> str:
    return os.path.join(root, f"local_{node}")


def engine(root: str, nodes: list[str], **options: Any) -> CheckpointEngine:
    rank = dist.get_rank() if dist.is_initialized() else 0
    node = nodes[rank]
    return CheckpointEngine(
        os.path.join(root, "persistent"),
        local_root=local_root(root, node),
        node=node,
        timeout=timedelta(seconds=30),
        **options,
    )


def state_of(step: int, rank: int, per_rank: bool = True) -> dict[str, Any]:
    """Replicated weights and (``per_rank``) a per-rank entry, both a function of the step."""
    state: dict[str, Any] = {"w": torch.arange(4096, dtype=torch.float32) + step, "step": step}
    if per_rank:
        state["mine"] = torch.full((2048,), float(100 * step + rank))
    return state


def save_steps(
    root: str,
    nodes: list[str],
    steps: list[int],
    per_rank: bool = True,
    persist_last: bool = True,
    resume: bool = False,
    settle: bool = False,
    **options: Any,
) -> dict[str, Any]:
    """Save ``steps`` (the last one persisted unless ``persist_last=False``; after recovering
    with ``resume``) and return what this rank saw."""
    rank = dist.get_rank()
    with engine(root, nodes, **options) as eng:
        if resume:
            eng.load(state_of(0, rank, per_rank))
        for step in steps:
            eng.save(
                state_of(step, rank, per_rank),
                step=step,
                rank_state={"rank": rank, "step": step},
                persist=persist_last and step == steps[-1],
            )
            if settle:  # the save and its persist are done: which saves persist is certain
                eng.wait()
        eng.wait()
        return {"replica_failures": eng._tiers.replica_failures}  # type: ignore[union-attr]


def load_latest(
    root: str, nodes: list[str], per_rank: bool = True, **options: Any
) -> dict[str, Any]:
    """Recover into a fresh state; return the recovery record and what was loaded."""
    state: dict[str, Any] = {"w": torch.zeros(4096), "step": -1}
    if per_rank:
        state["mine"] = torch.zeros(2048)
    with engine(root, nodes, **options) as eng:
        result = eng.load(state)
        rec = eng.last_recovery
        assert rec is not None
        return {
            "recovery": rec.to_json(),
            "step": state["step"],
            "w_ok": bool(torch.equal(state["w"], torch.arange(4096.0) + state["step"])),
            "mine": float(state["mine"][0]) if per_rank else None,
            "rank_state": result.rank_state,
        }


def persist_fails(root: str, nodes: list[str]) -> dict[str, Any]:
    """Persists fail on rank 1 (ENOSPC on its shard upload): the local tier keeps committing,
    every save retries the persist, and ``wait`` raises the failure on every rank."""
    import lightning_elastic.testing.faults  # noqa: F401  (registers faulty://)
    from lightning_elastic.testing.faults import Fault

    rank = dist.get_rank()
    node = nodes[rank]
    faults = [Fault("write", "*.distcp", "ENOSPC", times=0, ranks=(1,))]
    out: dict[str, Any] = {}
    with CheckpointEngine(
        "faulty://" + os.path.join(root, "persistent"),
        storage_options={"faults": faults},
        local_root=local_root(root, node),
        node=node,
        timeout=timedelta(seconds=30),
    ) as eng:
        eng.save(state_of(1, rank), step=1, blocking=True)  # committed locally
        futures.wait([eng._tiers._persisting])  # type: ignore[union-attr,list-item]
        for step in (2, 3):  # the failed persist does not stop these
            eng.save(state_of(step, rank), step=step)
        try:
            eng.wait()
        except Exception as exc:
            out["wait_error"] = f"{type(exc).__name__}: {exc}"
        out["persist_failures"] = eng._tiers.persist_failures  # type: ignore[union-attr]
    return out
