"""Rank functions that run a tiered CheckpointEngine on two or three "nodes" of this machine,
for the rollback, persist/replicate and local-root tests of this folder (module level, so they
pickle).

Rank ``r`` runs on node ``nodes[r]``; node-local roots ``<root>/local_<node>``, the persistent
root ``<root>/persistent`` (unless given). ``tag`` marks which branch a state came from."""

from __future__ import annotations

import contextlib
import os
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from lightning_elastic.core.engine import CheckpointEngine


def engine(
    root: str,
    nodes: list[str],
    *,
    persistent: str | None = None,
    storage_options: dict[str, Any] | None = None,
    timeout: float = 20,
    **options: Any,
) -> CheckpointEngine:
    node = nodes[dist.get_rank()]
    return CheckpointEngine(
        persistent or os.path.join(root, "persistent"),
        storage_options=storage_options,
        local_root=os.path.join(root, f"local_{node}"),
        node=node,
        timeout=timedelta(seconds=timeout),
        **options,
    )


def state(tag: float) -> dict[str, Any]:
    return {"w": torch.full((1024,), float(tag)), "tag": float(tag)}


def save(
    root: str,
    nodes: list[str],
    saves: list[tuple[int, float]] | list[tuple[int, float, bool]],
    load: str | None = None,
    resume: bool = False,
    settle: bool = False,
    **options: Any,
) -> list[str]:
    """Optionally load ``load`` (or the newest with ``resume``), then save ``(step, tag)``
    pairs, the last persisted, or ``(step, tag, persist)`` triples. Each save is waited for;
    with ``settle`` its persist too (which saves persist is then certain). Returns the names
    saved."""
    with engine(root, nodes, **options) as eng:
        if load is not None:
            eng.load(state(-1), checkpoint=load)
        elif resume:
            eng.load(state(-1))
        names = []
        for i, (step, tag, *persist) in enumerate(saves):
            last = i == len(saves) - 1
            handle = eng.save(state(tag), step=step, persist=persist[0] if persist else last)
            assert handle is not None
            names.append(handle.name)
            handle.result()
            if settle:
                eng.wait()
        eng.wait()
        return names


def load(root: str, nodes: list[str], **options: Any) -> dict[str, Any]:
    s = state(-1)
    with engine(root, nodes, **options) as eng:
        eng.load(s)
        return {"name": eng.resumed_from, "tag": s["tag"]}


def resume_then_persist_latest(root: str, nodes: list[str], **options: Any) -> bool:
    with engine(root, nodes, **options) as eng:
        eng.load(state(-1))
        return eng.persist_latest()


def persistent_full(root: str, nodes: list[str], steps: int) -> list[int]:
    """The persistent root refuses every manifest (ENOSPC); saves go on, errors caught."""
    import lightning_elastic.testing.faults  # noqa: F401  (registers faulty://)
    from lightning_elastic.testing.faults import Fault

    faults = [Fault("write", "*step_*manifest.json*", "ENOSPC", times=0, ranks=(0,))]
    committed = []
    with engine(
        root,
        nodes,
        persistent="faulty://" + os.path.join(root, "persistent"),
        storage_options={"faults": faults},
        local_keep=10,
    ) as eng:
        for step in range(1, steps + 1):
            try:
                handle = eng.save(state(step), step=step)
                assert handle is not None
                handle.result()
                committed.append(step)
            except Exception:
                pass
            time.sleep(0.3)  # let the persist finish
        with contextlib.suppress(Exception):
            eng.wait()
    return committed


def slow_replication_once(root: str, nodes: list[str], delay: float, timeout: float) -> int:
    """Rank 1 starts the replication of the 2nd save ``delay`` s late (longer than the
    timeout, shorter than two: rank 0 waits one timeout in the transfer and one at the next
    save's decision), once; returns how many saves' replicas failed over 4 saves."""
    from lightning_elastic.core.tiers import runtime

    rank = dist.get_rank()
    real, calls = runtime.execute_transfers, [0]

    def slow(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        if rank == 1 and calls[0] == 2:
            time.sleep(delay)
        return real(*args, **kwargs)

    runtime.execute_transfers = slow  # type: ignore[assignment]
    with engine(root, nodes, timeout=timeout, persist_every_n_saves=100) as eng:
        for step in (1, 2, 3, 4, 5):
            handle = eng.save(state(step), step=step)
            assert handle is not None
            handle.result()
        eng.wait()
        return eng._placement.tiers.replica_failures  # type: ignore[attr-defined]


def one_node_id_two_hosts(root: str, steps: int) -> None:
    """Two hosts report the same node id (identical host names): each has its own local root."""
    rank = dist.get_rank()
    with CheckpointEngine(
        os.path.join(root, "persistent"),
        local_root=os.path.join(root, f"host{rank}"),
        node="x",
        timeout=timedelta(seconds=20),
        persist_every_n_saves=100,
    ) as eng:
        for step in range(1, steps + 1):
            handle = eng.save(state(step), step=step)
            assert handle is not None
            handle.result()
        eng.wait()


def store_keys(root: str, nodes: list[str], saves: int, **options: Any) -> list[int]:
    """Key count of the c10d store (rank 0) after construction and after each 10 saves."""
    counts = []
    with engine(root, nodes, **options) as eng:
        store = eng.coordinator.store
        dist.barrier()
        counts.append(store.num_keys())
        for step in range(1, saves + 1):
            handle = eng.save(state(step), step=step)
            assert handle is not None
            handle.result()
            if step % 10 == 0:
                eng.wait()
                time.sleep(0.2)
                dist.barrier()
                counts.append(store.num_keys())
        eng.wait()
    return counts


def shared_local_root(root: str, nodes: list[str], saves: int) -> dict[str, Any]:
    """Two node ids, one local directory (local_dirpath on NFS/Lustre, or a ReadWriteMany
    volume): save, then recover; what the ranks saw."""
    rank = dist.get_rank()
    out: dict[str, Any] = {}
    with CheckpointEngine(
        os.path.join(root, "persistent"),
        local_root=os.path.join(root, "shared"),
        node=nodes[rank],
        timeout=timedelta(seconds=20),
        persist_every_n_saves=100,
    ) as eng:
        for step in range(1, saves + 1):
            handle = eng.save(state(step), step=step)
            assert handle is not None
            handle.result()
        eng.wait()
        out["replica_failures"] = eng._placement.tiers.replica_failures  # type: ignore[attr-defined]
    s = state(-1)
    with CheckpointEngine(
        os.path.join(root, "persistent"),
        local_root=os.path.join(root, "shared"),
        node=nodes[rank],
        timeout=timedelta(seconds=20),
    ) as eng:
        eng.load(s)
        out["tag"] = s["tag"]
    return out


def close_while_uploading(root: str, nodes: list[str]) -> dict[str, Any]:
    """Rank 0's upload of the first persist stalls 3 s; saves 2 and 3 go on (local_keep=1);
    close() right after. What each tier holds afterwards."""
    import lightning_elastic.testing.faults  # noqa: F401  (registers faulty://)
    from lightning_elastic.testing.faults import Fault

    rank = dist.get_rank()
    faults = [Fault("write", "*.distcp", "stall", times=1, ranks=(0,), seconds=3.0)]
    eng = CheckpointEngine(
        "faulty://" + os.path.join(root, "persistent"),
        storage_options={"faults": faults},
        local_root=os.path.join(root, f"local_{nodes[rank]}"),
        node=nodes[rank],
        timeout=timedelta(seconds=20),
        local_keep=1,
    )
    for step in (1, 2, 3):
        handle = eng.save(state(step), step=step)
        assert handle is not None
        handle.result()
    t = time.monotonic()
    eng.close()
    failures = eng._placement.tiers.persist_failures  # type: ignore[attr-defined]
    return {"close_s": round(time.monotonic() - t, 2), "failures": failures}
