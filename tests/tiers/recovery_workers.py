"""Rank functions for recovery from node-local copies (test_partial_recovery.py,
test_uncommitted_copies.py): need-based recovery, small replicated items on rank 0, replicas
sent from the staged payload, a rank 0 silent after its local commit. Module level, so they
pickle."""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

from tests.distributed.tier_engine_workers import engine, sharded_state


def load_sharded_then_persist(root: str, nodes: list[str]) -> dict[str, Any]:
    """Recover :func:`sharded_state` (need-based: a fresh node gets only what its ranks read
    and upload), then persist the recovered checkpoint right away (``persist_latest``)."""
    rank = dist.get_rank()
    state = sharded_state(0, zeros=True)
    out: dict[str, Any] = {}
    with engine(root, nodes) as eng:
        eng.load(state)
        out["step"] = state["meta"]["step"]
        try:
            out["persisted"] = eng.persist_latest()
        except Exception as exc:
            out["error"] = f"{type(exc).__name__}: {exc}"
    out["ok"] = bool(
        torch.equal(
            state["shards"].to_local(), torch.full((64, 32), float(100 * out["step"] + rank))
        )
    )
    return out


def load_with_extra_key(root: str, nodes: list[str]) -> dict[str, Any]:
    """Recover into a state with a key the checkpoint lacks (strict): the load must fail with
    the normal missing-key error on every rank, not a missing file or a hang."""
    state = sharded_state(0, zeros=True)
    state["not_saved"] = torch.zeros(8)
    with engine(root, nodes) as eng:
        try:
            eng.load(state)
        except Exception as exc:
            return {"error": f"{type(exc).__name__}: {exc}"}
    return {"error": None}


def nested_state(step: int, rank: int, zeros: bool = False) -> dict[str, Any]:
    """An optimizer-like nested state: int keys, lists of dicts, a per-rank tensor, empty
    tensors, objects, and one replicated tensor above the 1 MiB small-item threshold."""
    v = 0.0 if zeros else float(step)
    return {
        "model": {"w": torch.full((300_000,), v), "b": torch.full((7,), v)},  # w: 1.2 MB
        "optim": {
            "state": {0: {"exp_avg": torch.full((16,), v), "step": torch.tensor(v)}, 1: {}},
            "param_groups": [{"lr": 0.1, "params": [0, 1]}],
        },
        "empty": torch.zeros(0),
        "lists": [torch.full((3,), v), {"x": torch.full((2,), v)}],
        "mine": torch.full((32,), 0.0 if zeros else float(100 * step + rank)),
        "meta": {"step": -1 if zeros else step},
    }


def nested_steps(root: str, nodes: list[str], steps: list[int], **options: Any) -> None:
    rank = dist.get_rank()
    with engine(root, nodes, **options) as eng:
        for step in steps:
            eng.save(nested_state(step, rank), step=step, rank_state={"rank": rank})
        eng.wait()


def load_nested(root: str, nodes: list[str], **options: Any) -> dict[str, Any]:
    rank = dist.get_rank()
    state = nested_state(0, rank, zeros=True)
    with engine(root, nodes, **options) as eng:
        try:
            result = eng.load(state)
        except Exception as exc:
            return {"error": f"{type(exc).__name__}: {exc}"}
        rec = eng.last_recovery
    step = state["meta"]["step"]
    want = nested_state(step, rank)
    ok = all(
        torch.equal(a, b)
        for a, b in [
            (state["model"]["w"], want["model"]["w"]),
            (state["optim"]["state"][0]["exp_avg"], want["optim"]["state"][0]["exp_avg"]),
            (state["lists"][1]["x"], want["lists"][1]["x"]),
            (state["mine"], want["mine"]),
        ]
    )
    return {
        "error": None,
        "step": step,
        "ok": ok and result.rank_state == {"rank": rank},
        "recovery": rec.to_json() if rec is not None else None,
    }


def local_names(root: str, node: str) -> list[str]:
    path = os.path.join(root, f"local_{node}")
    return (
        sorted(n for n in os.listdir(path) if n.startswith("step_")) if os.path.isdir(path) else []
    )


def silent_after_local_commit(root: str, nodes: list[str]) -> dict[str, Any]:
    """Save step 1 (committed, not persisted), then step 2, where rank 0 dies right after its
    local commit, before it posts the manifest to the other ranks: what rank 1 is told."""
    from datetime import timedelta

    from lightning_elastic import CheckpointEngine
    from lightning_elastic.core.dist import channel
    from tests.distributed.tier_engine_workers import local_root, state_of

    rank = dist.get_rank()
    post = channel.CommitChannel.post

    def dies_at_step_2(self: Any, save_id: str, part: str, text: str) -> None:
        if part == "manifest" and '"step": 2' in text:
            os._exit(0)
        post(self, save_id, part, text)

    channel.CommitChannel.post = dies_at_step_2  # type: ignore[method-assign]
    eng = CheckpointEngine(
        os.path.join(root, "persistent"),
        local_root=local_root(root, nodes[rank]),
        node=nodes[rank],
        timeout=timedelta(seconds=4),
        persist_every_n_saves=10,
    )
    error = None
    try:
        for step in (1, 2):
            eng.save(state_of(step, rank), step=step, rank_state={"rank": rank})
        eng.wait()
    except Exception as exc:
        error = exc
    return {"error": type(error).__name__, "message": str(error), "is_save_error": error}
