"""Crash workers: save step 1 (persisted), then step 2 with a crash at ``point``."""
from __future__ import annotations
import os, time
import torch.distributed as dist
from attack import w
from lightning_elastic.core.tiers import runtime, persist


def _die():
    os._exit(9)


def crash_save(root, nodes, point, who=0, **opt):
    rank = dist.get_rank()
    t0 = time.monotonic()
    with w.eng(root, nodes, timeout=8, **opt) as e:
        e.save(w.st(1, rank), step=1, persist=True).result(); e.wait()
        if point == "after_local_commit" and rank == who:
            orig = runtime.TierSet._share_manifest
            runtime.TierSet._share_manifest = lambda *a, **k: _die()
        if point == "before_peer_manifest" and rank == who:
            orig = runtime.after_commit
            import lightning_elastic.core.storage.base as sb
            real = e._ctx.storage.write_bytes
            def wb(rel, body, **k):
                if rel.endswith("manifest.json"):
                    _die()
                return real(rel, body, **k)
            e._ctx.storage.write_bytes = wb
        if point == "during_upload" and rank == who:
            persist._upload = lambda *a, **k: _die()
        if point == "before_persist_manifest" and rank == who:
            real_ck = persist.check_lease
            persist.check_lease = lambda *a, **k: _die()
        try:
            e.save(w.st(2, rank), step=2, persist=True).result()
            e.wait()
            return {"ok": True, "s": time.monotonic() - t0}
        except Exception as exc:
            return {"err": f"{type(exc).__name__}: {exc}"[:300], "s": round(time.monotonic() - t0, 1)}


def slow_peer(root, nodes, delay, **opt):
    """Rank 1's replication of save 2 starts ``delay`` s late (alive, just slow)."""
    import time as _t
    from lightning_elastic.core.tiers import runtime as rt
    rank = dist.get_rank()
    real = rt.execute_transfers
    calls = {"n": 0}
    def slow(*a, **k):
        calls["n"] += 1
        if rank == 1 and calls["n"] == 2:
            _t.sleep(delay)
        return real(*a, **k)
    rt.execute_transfers = slow
    out = {"errors": []}
    t0 = _t.monotonic()
    with w.eng(root, nodes, timeout=5, **opt) as e:
        for step in (1, 2, 3, 4):
            try:
                e.save(w.st(step, rank), step=step, persist=step == 4).result()
            except Exception as exc:
                out["errors"].append(f"step {step}: {type(exc).__name__}: {str(exc)[:200]}")
        try:
            e.wait()
        except Exception as exc:
            out["errors"].append(f"wait: {type(exc).__name__}: {str(exc)[:200]}")
        out["replica_failures"] = e._tiers.replica_failures
    out["s"] = round(_t.monotonic() - t0, 1)
    return out
