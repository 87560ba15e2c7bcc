"""Worker functions for attacks (module level, picklable)."""
from __future__ import annotations
import os, signal, json
from datetime import timedelta
from typing import Any
import torch
import torch.distributed as dist
from lightning_elastic.core.engine import CheckpointEngine


def eng(root, nodes, persistent=None, local=None, storage_options=None, timeout=20, **opt):
    rank = dist.get_rank()
    node = nodes[rank]
    return CheckpointEngine(
        persistent or os.path.join(root, "persistent"),
        storage_options=storage_options,
        local_root=local or os.path.join(root, f"local_{node}"),
        node=node, timeout=timedelta(seconds=timeout), **opt)


def st(tag: float, rank: int):
    return {"w": torch.full((1024,), float(tag)), "mine": torch.full((256,), float(tag * 100 + rank)), "tag": tag}


def save(root, nodes, saves, load=None, persist_last=True, kill_after=None, **opt):
    """saves: list of (step, tag). load: None, 'latest' or a checkpoint name."""
    rank = dist.get_rank()
    out: dict[str, Any] = {"errors": []}
    with eng(root, nodes, **opt) as e:
        if load is not None:
            s = {"w": torch.zeros(1024), "mine": torch.zeros(256), "tag": -1.0}
            e.load(s, checkpoint=None if load == "latest" else load)
            out["loaded"] = (e.resumed_from, s["tag"])
        names = []
        for i, (step, tag) in enumerate(saves):
            try:
                h = e.save(st(tag, rank), step=step, persist=persist_last and i == len(saves) - 1)
                names.append(h.name)
                h.result()
            except Exception as exc:
                out["errors"].append(f"{type(exc).__name__}: {exc}"[:300])
        try:
            e.wait()
        except Exception as exc:
            out["errors"].append(f"wait {type(exc).__name__}: {exc}"[:300])
        out["names"] = names
        out["replica_failures"] = e._tiers.replica_failures
    return out


def load(root, nodes, checkpoint=None, **opt):
    rank = dist.get_rank()
    s = {"w": torch.zeros(1024), "mine": torch.zeros(256), "tag": -1.0}
    with eng(root, nodes, **opt) as e:
        try:
            e.load(s, checkpoint=checkpoint)
        except Exception as exc:
            return {"error": f"{type(exc).__name__}: {exc}"[:400]}
        rec = e.last_recovery
        return {"name": e.resumed_from, "tag": s["tag"], "w": float(s["w"][0]),
                "mine": float(s["mine"][0]), "rec": rec.to_json() if rec else None}


def resume_persist_latest(root, nodes, **opt):
    """Resume, then (preempted before the first save) persist_latest()."""
    rank = dist.get_rank()
    s = {"w": torch.zeros(1024), "mine": torch.zeros(256), "tag": -1.0}
    with eng(root, nodes, **opt) as e:
        e.load(s)
        r = e.persist_latest()
        return {"resumed": e.resumed_from, "tier": e.last_recovery.tier, "persist_latest": r}


def options(root):
    from lightning_elastic.errors import ConfigError
    cases = {
        "local==persistent": dict(persistent=os.path.join(root, "p"), local=os.path.join(root, "p")),
        "local==persistent (trailing slash / ./)": dict(persistent=os.path.join(root, "p"), local=os.path.join(root, "p") + "/./"),
        "local==persistent (file:// URL)": dict(persistent="file://" + os.path.join(root, "p"), local=os.path.join(root, "p")),
        "local inside persistent": dict(persistent=os.path.join(root, "p"), local=os.path.join(root, "p", "local")),
        "persistent inside local": dict(persistent=os.path.join(root, "l", "p"), local=os.path.join(root, "l")),
        "replicas=True": dict(replicas=True),
        "replicas=1.0": dict(replicas=1.0),
        "replicas='1'": dict(replicas="1"),
        "persist_every=0": dict(persist_every_n_saves=0),
        "persist_every=True": dict(persist_every_n_saves=True),
        "local_keep=0": dict(local_keep=0),
        "node=''": dict(node=""),
        "node='..'": dict(node=".."),
        "node='a\\nb'": dict(node="a\nb"),
        "replicas=5 (1 node)": dict(replicas=5),
        "local_root=''": dict(local=""),
        "local_root=b'x'": dict(local=b"/tmp/x"),
        "local_root=s3 url": dict(local="memory://x/local"),
    }
    out = {}
    for k, c in cases.items():
        c = dict(c)
        persistent = c.pop("persistent", os.path.join(root, "p2"))
        local = c.pop("local", os.path.join(root, "l2"))
        try:
            rank = dist.get_rank()
            kw = dict(storage_options=None, local_root=local, timeout=timedelta(seconds=10))
            node = c.pop("node", "a")
            e = CheckpointEngine(persistent, node=node, **kw, **c)
            try:
                e.save({"w": torch.ones(4)}, step=1, blocking=True); e.wait()
                out[k] = "ACCEPTED, save ok"
            except Exception as exc:
                out[k] = f"accepted, save failed {type(exc).__name__}: {str(exc)[:120]}"
            finally:
                try: e.close()
                except Exception: pass
        except ConfigError as exc:
            out[k] = f"ConfigError: {str(exc)[:100]}"
        except Exception as exc:
            out[k] = f"OTHER {type(exc).__name__}: {str(exc)[:150]}"
    return out


def outage(root, nodes, faults, steps=6, **opt):
    """The persistent tier fails (``faults``); the job keeps calling save and catches errors."""
    import lightning_elastic.testing.faults  # noqa: F401
    from lightning_elastic.testing.faults import Fault
    rank = dist.get_rank()
    out = {"raised_at": [], "committed": []}
    with eng(root, nodes, persistent="faulty://" + os.path.join(root, "persistent"),
             storage_options={"faults": [Fault(**f) for f in faults]}, **opt) as e:
        for step in range(1, steps + 1):
            try:
                h = e.save(st(step, rank), step=step)
                h.result()
                out["committed"].append(step)
                import time; time.sleep(0.5)  # let the persist finish
            except Exception as exc:
                out["raised_at"].append((step, type(exc).__name__))
        try:
            e.wait()
        except Exception as exc:
            out["raised_at"].append(("wait", type(exc).__name__))
    return out


def same_node_id(root, steps, **opt):
    """Two real hosts report one node id (same hostname): each has its own /dev/shm."""
    rank = dist.get_rank()
    with CheckpointEngine(os.path.join(root, "persistent"), local_root=os.path.join(root, f"host{rank}"),
                          node="x", timeout=timedelta(seconds=20), persist_every_n_saves=100, **opt) as e:
        for s in range(1, steps + 1):
            e.save(st(s, rank), step=s).result()
        e.wait()
