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
        return {"replica_failures": eng._placement.tiers.replica_failures}  # type: ignore[attr-defined]


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
        futures.wait([eng._placement.tiers._persisting])  # type: ignore[attr-defined]
        for step in (2, 3):  # the failed persist does not stop these
            eng.save(state_of(step, rank), step=step)
        try:
            eng.wait()
        except Exception as exc:
            out["wait_error"] = f"{type(exc).__name__}: {exc}"
        out["persist_failures"] = eng._placement.tiers.persist_failures  # type: ignore[attr-defined]
    return out


def sharded_state(step: int, zeros: bool = False) -> dict[str, Any]:
    """A row-sharded DTensor per rank (as FSDP holds parameters), a replicated tensor and an
    object: what each rank reads of a checkpoint depends on the layout."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    local = torch.zeros(64, 32) if zeros else torch.full((64, 32), float(100 * step + rank))
    return {
        "shards": DTensor.from_local(local, mesh, [Shard(0)]),
        "w": torch.zeros(256) if zeros else torch.arange(256.0) + step,
        "meta": {"step": -1 if zeros else step},
    }


def files_read(root: str, nodes: list[str], shapes: list[str]) -> dict[str, Any]:
    """Save a sharded state with a per-rank entry and rank state (tiered, persisted), then
    for each load shape of the persisted copy
    the files ``files_to_read`` plans and the files the load reads (ShardReader.read_data
    patched to note them): ``same`` (the saved structure), ``none`` (state=None, the whole
    checkpoint), ``partial`` (strict=False, a subset)."""
    from lightning_elastic.core.format.catalog import Catalog
    from lightning_elastic.core.load import load as load_mod
    from lightning_elastic.core.load.reader import ShardReader
    from lightning_elastic.core.storage.base import Storage

    rank = dist.get_rank()
    path = os.path.join(root, "persistent")  # holds every file once persisted
    with engine(root, nodes) as eng:
        state = sharded_state(3)
        state["mine"] = torch.full((16,), float(rank))
        eng.save(state, step=3, rank_state={"rank": rank}, blocking=True, persist=True)
        eng.wait()
        coord = eng.coordinator
    read: set[str] = set()
    original = ShardReader.read_data

    def noting(self: Any, plan: Any, planner: Any) -> Any:
        for item in plan.items:
            read.add(self.metadata.storage_data[item.storage_index].file)
        return original(self, plan, planner)

    ShardReader.read_data = noting  # type: ignore[method-assign]
    storage = Storage(path)
    info = Catalog(storage).valid()[0]
    out: dict[str, Any] = {}
    try:
        for shape in shapes:
            target: dict[str, Any] | None = sharded_state(0, zeros=True)
            strict = True
            if shape == "same":
                target["mine"] = torch.zeros(16)  # type: ignore[index]
            elif shape == "none":
                target = None
            else:  # partial: the sharded tensor only
                target = {"shards": target["shards"]}  # type: ignore[index]
                strict = False
            planned = load_mod.files_to_read(storage, coord, info, target, strict=strict)
            read.clear()
            load_mod.load_checkpoint(storage, coord, info, target, strict=strict)
            out[shape] = {"planned": sorted(planned or ()), "read": sorted(read)}
    finally:
        ShardReader.read_data = original  # type: ignore[method-assign]
    return out


def sharded_steps(root: str, nodes: list[str], steps: list[int], **options: Any) -> None:
    """Save :func:`sharded_state` at ``steps`` (tiers, not persisted unless the cadence says)."""
    with engine(root, nodes, **options) as eng:
        for step in steps:
            eng.save(sharded_state(step), step=step, rank_state={"rank": dist.get_rank()})
        eng.wait()


def load_sharded(root: str, nodes: list[str], **options: Any) -> dict[str, Any]:
    """Recover :func:`sharded_state`; the record, and whether every value is the saved one."""
    rank = dist.get_rank()
    state = sharded_state(0, zeros=True)
    with engine(root, nodes, **options) as eng:
        result = eng.load(state)
        rec = eng.last_recovery
        assert rec is not None
    step = state["meta"]["step"]
    local = state["shards"].to_local()
    return {
        "recovery": rec.to_json(),
        "step": step,
        "ok": bool(
            torch.equal(local, torch.full((64, 32), float(100 * step + rank)))
            and torch.equal(state["w"], torch.arange(256.0) + step)
            and result.rank_state == {"rank": rank}
        ),
    }


def spare_cycle(root: str, nodes: list[str], steps: list[int], leftover: int = 0) -> dict[str, Any]:
    """Save ``steps`` with a 2 MiB per-rank entry (one rank per node, so each rank is its
    node's lead): after each save, the inodes of the node's spare files and of the files of
    its checkpoints, and the bytes of each; the spare files left at the end, before and after
    ``close``. ``leftover`` 8 MiB spare files are planted first, as a killed run leaves them."""
    rank = dist.get_rank()
    local = local_root(root, nodes[rank])
    pool = os.path.join(local, ".spares")
    os.makedirs(pool, exist_ok=True)
    for i in range(leftover):
        with open(os.path.join(pool, f"killed{i}.spare"), "wb") as f:
            f.write(b"\xee" * (8 << 20))

    def inodes(top: str) -> set[int]:
        return {os.stat(os.path.join(d, n)).st_ino for d, _, names in os.walk(top) for n in names}

    def size(top: str) -> int:
        return sum(
            os.path.getsize(os.path.join(d, n)) for d, _, names in os.walk(top) for n in names
        )

    out: dict[str, Any] = {"pool": [], "checkpoints": [], "pool_bytes": [], "saved_bytes": []}
    out["planted"] = sorted(inodes(pool))
    eng = engine(root, nodes, local_keep=2)
    with eng:
        for step in steps:
            state = {"w": torch.arange(4096.0) + step, "step": step}
            state["mine"] = torch.full((512 * 1024,), float(100 * step + rank))
            eng.save(state, step=step, rank_state={"rank": rank, "step": step}).result()
            eng.wait()
            out["pool"].append(sorted(inodes(pool)) if os.path.isdir(pool) else [])
            ckpts = [os.path.join(local, n) for n in os.listdir(local) if n.startswith("step_")]
            out["checkpoints"].append(sorted(set().union(*(inodes(c) for c in ckpts))))
            out["pool_bytes"].append(size(pool))
            out["saved_bytes"].append(size(os.path.join(local, f"step_{step:09d}")))
        out["before_close"] = len(os.listdir(pool)) if os.path.isdir(pool) else 0
    out["after_close"] = os.listdir(pool) if os.path.isdir(pool) else []
    return out


def load_spared(root: str, nodes: list[str]) -> dict[str, Any]:
    """Recover :func:`spare_cycle`'s newest save into zeros."""
    rank = dist.get_rank()
    state: dict[str, Any] = {"w": torch.zeros(4096), "step": -1, "mine": torch.zeros(512 * 1024)}
    with engine(root, nodes) as eng:
        eng.load(state)
        rec = eng.last_recovery
        assert rec is not None
        step = state["step"]
        return {
            "step": step,
            "tier": rec.to_json()["tier"],
            "ok": bool(torch.equal(state["w"], torch.arange(4096.0) + step))
            and bool(torch.all(state["mine"] == 100 * step + rank)),
        }


def gated_background(root: str, nodes: list[str]) -> dict[str, Any]:
    """Save step 1 (persisted) while the save's copies between nodes and its upload wait on a
    gate: whether the handle was done when the call returned and 0.5 s later; then the state
    is changed (after the call: not what is saved), the gate opened, and the group the copies
    ran on compared with the engine's own and the default one."""
    import threading
    import time

    from lightning_elastic.core.tiers import runtime

    rank = dist.get_rank()
    gate = threading.Event()
    seen: dict[str, Any] = {}
    real_transfers, real_persist = runtime.execute_transfers, runtime.persist_checkpoint

    def transfers(*args: Any, **kwargs: Any) -> Any:
        seen["group"] = kwargs["group"]
        seen["transfers_gated"] = gate.wait(60)
        return real_transfers(*args, **kwargs)

    def persist(*args: Any, **kwargs: Any) -> Any:
        seen["persist_gated"] = gate.wait(60)
        return real_persist(*args, **kwargs)

    runtime.execute_transfers, runtime.persist_checkpoint = transfers, persist  # type: ignore[assignment]
    out: dict[str, Any] = {}
    try:
        with engine(root, nodes) as eng:
            state = state_of(1, rank)
            handle = eng.save(state, step=1, persist=True)
            out["done_at_return"] = handle.done()
            state["w"] += 1000.0
            state["mine"] += 1000.0
            time.sleep(0.5)
            out["done_while_gated"] = handle.done()
            gate.set()
            handle.result()
            eng.wait()
            group = seen["group"]
            tiers = eng._placement.tiers  # type: ignore[attr-defined]
            out["tier_group"] = group is not None and group is tiers.group
            out["not_default"] = group is not dist.group.WORLD
            out["gated"] = (seen["transfers_gated"], seen.get("persist_gated"))
    finally:
        runtime.execute_transfers, runtime.persist_checkpoint = real_transfers, real_persist  # type: ignore[assignment]
    return out
