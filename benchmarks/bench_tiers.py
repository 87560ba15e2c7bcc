"""Multi-tier checkpoints (#11): recovery time per tier, training throughput with local saves
every ~2 s, and the memory the local tier takes.

A sharded state of ``--gb`` GB (1.1 by default: on each of 2 ranks, ten float32 DTensor
shards that differ per rank, as bench_large builds them) on 2 "nodes" (rank r on node
``"ab"[r]``), each node's local root under ``/dev/shm`` (a temporary directory where there is
none), the persistent root on ``throttled://`` (lightning_elastic/testing/throttled.py: local
files at ``--bandwidth`` bytes/s per process and direction, ``--latency`` s per request;
100 MB/s and 20 ms by default, one rank's share of an object store's throughput and its
round trip within a region). Measured in one invocation:

* **recovery**: after a checkpoint is saved and persisted, fresh processes construct an engine
  and load it into a zeroed state, with (local) both local roots intact, (peer) node b's root
  wiped, (persistent) both wiped. Per scenario: seconds from the engine's construction to the
  load's end (worst rank), from the spawn of the processes to the load's end, where the
  recovery spent them, the tier and the bytes by source per node. A fresh interpreter's
  imports (torch, DCP, the engine) are timed apart: the forkserver of the spawn helper
  preloads them. Target: local and peer recovery >= 5x faster than persistent.
* **throughput**: both ranks train (a step of ``--step-ms``, then a 1 MB all-reduce; the state
  is not recomputed), in windows that alternate no checkpointing with a save every
  ~``--save-every-s`` s (persisted every ``--persist-every``-th save, ~30 s); steps/s of each,
  their ratio (target >= 0.95), and the seconds each save call blocked. The windows follow
  ``local_keep + 2`` warm-up saves (the first persisted), so each node's local tier holds
  what it holds in a long run, spare files included; a run's first saves write into new
  memory, their times are printed apart. Two kinds of step (``--steps``), each measured
  apart:

  - ``accelerator``: the step's compute runs on a device; the host thread waits for it (a
    sleep, where a CUDA synchronize would block), so the host's cores are free for the
    background work, as on a GPU node. The state is still host memory: staging is a host
    copy, where a GPU node copies device to pinned host memory.
  - ``cpu``: the step is matmuls on the host, one core per rank: training and every
    background thread (writes, replication, persist) compete for the same 2 cores. This
    bounds what a CPU-only job sees, not a GPU job.
  With ``--snapshots blocking,lazy`` (the default) every round has one window per snapshot
  mode (``CheckpointEngine(snapshot=...)``, switched between windows on one engine), so both
  are measured against the same no-checkpoint windows in one run. The step's in-place update
  of the state stands for the optimizer step: it first calls ``engine.wait_snapshot()`` (the
  guard), whose waits count as that save's blocked time. Per mode: the ratio, the blocked
  seconds per save and the staging copy's seconds per save (``SaveResult.staging_s``).
* **memory**: each local root's bytes (du) at the end and the most seen during training,
  against ``state / nodes x (1 + replicas) x local_keep`` (and ``x (local_keep + 1)`` while a
  save is written), and each rank's peak RSS.

The machine has 2 cores: the two ranks, the background writers, the replication and the
persister threads all share them (the output says so).

    python benchmarks/bench_tiers.py [--gb 1.1] [--bandwidth 100e6] [--latency 0.02]
        [--window 30] [--rounds 3] [--out benchmarks/results/tiers.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.distributed as dist

from lightning_elastic.testing.spawn import run_distributed

NODES = ("a", "b")
PIECES = 10  # tensors per rank
MATMUL = 512  # ~5 ms each on this machine: steps of --step-ms to within a few ms
RECOVERY_TARGET = 5.0  # local and peer at least this much faster than persistent
RATIO_TARGET = 0.95
WARMUP_SAVES = 2  # + local_keep: see train_worker
# where recovery spends its time: function -> the module whose calls of it are timed
# (core/tiers/restore.py, gather.py; the load walk's load_checkpoint, core/load/walk.py)
PHASES = {
    "survey": "restore",
    "manifest_text": "restore",
    "_drop_corrupt": "gather",
    "_fetch": "gather",
    "_commit_copy": "restore",
    "load_checkpoint": "walk",
}


@dataclass(frozen=True)
class Config:
    gb: float
    bandwidth: float
    latency: float
    persist_every: int
    local_keep: int
    replicas: int
    step_ms: float
    steps: tuple[str, ...]  # the kinds of step measured ("accelerator", "cpu")
    save_every_s: float
    window_s: float
    snapshots: tuple[str, ...]  # the snapshot modes measured ("blocking", "lazy")
    rounds: int
    persistent: str  # the throttled:// URL
    local_base: str

    def local_root(self, node: str) -> str:
        return os.path.join(self.local_base, f"local_{node}")


def rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def du(path: str) -> int:
    """Bytes a directory takes (allocated blocks, as du counts them)."""
    total = 0
    for dirpath, _, names in os.walk(path):
        for name in names:
            with contextlib.suppress(FileNotFoundError):  # removed by retention meanwhile
                total += os.lstat(os.path.join(dirpath, name)).st_blocks * 512
    return total


def device_mesh() -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (dist.get_world_size(),))


def build_state(cfg: Config, mesh: Any, *, zeros: bool) -> dict[str, Any]:
    """This rank's shards: ``PIECES`` row-sharded DTensors, random per rank (or zeros)."""
    from torch.distributed.tensor import DTensor, Shard

    rank, world = dist.get_rank(), dist.get_world_size()
    rows = int(cfg.gb * 1e9 / world / PIECES / 4 / 1024)
    torch.manual_seed(rank)
    make: Callable[..., torch.Tensor] = torch.zeros if zeros else torch.randn
    return {f"w{i}": DTensor.from_local(make(rows, 1024), mesh, [Shard(0)]) for i in range(PIECES)}


def fingerprint(state: dict[str, Any]) -> list[float]:
    return [float(t.to_local().double().sum()) for t in state.values()]


def make_engine(cfg: Config) -> Any:
    import lightning_elastic.testing.throttled  # noqa: F401  (registers throttled://)
    from lightning_elastic import CheckpointEngine

    node = NODES[dist.get_rank()]
    return CheckpointEngine(
        cfg.persistent,
        storage_options={"bandwidth": cfg.bandwidth, "latency": cfg.latency},
        local_root=cfg.local_root(node),
        node=node,
        persist_every_n_saves=cfg.persist_every,
        replicas=cfg.replicas,
        local_keep=cfg.local_keep,
    )


def time_calls(module: Any, names: tuple[str, ...], into: dict[str, float]) -> None:
    """Wrap ``module``'s functions ``names`` to add their seconds to ``into`` (nested calls
    are counted in both)."""
    for name in names:
        fn = getattr(module, name)

        def timed(*args: Any, _fn: Any = fn, _name: str = name, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return _fn(*args, **kwargs)
            finally:
                into[_name] = into.get(_name, 0.0) + time.perf_counter() - t0

        setattr(module, name, timed)


# ---------------------------------------------------------------------------- training


class Trainer:
    """A fixed step (``kind``: matmuls on the host, or the host waiting for a device), then
    a 1 MB all-reduce as DDP's gradient sync would do; it also carries rank 0's decisions
    (save now, window over) to every rank, as the library's time triggers do."""

    def __init__(self, cfg: Config, state: dict[str, Any], kind: str) -> None:
        self.state, self.kind, self.wait_s = state, kind, cfg.step_ms / 1e3
        self.a, self.b = torch.randn(MATMUL, MATMUL), torch.randn(MATMUL, MATMUL)
        self.c = torch.empty(MATMUL, MATMUL)
        self.grad = torch.zeros(256 * 1024)
        self.step = 0
        self.guard: Callable[[], float] | None = None  # engine.wait_snapshot, while saving
        self.guard_s = 0.0  # what the guard waited since the last save
        self.matmuls = 10
        self()  # untimed: first-call costs
        if kind == "accelerator":
            return
        for _ in range(3):  # full steps on both ranks at once, as in training
            t0 = time.perf_counter()
            for _ in range(5):
                self()
            took = torch.tensor([(time.perf_counter() - t0) / 5])
            dist.all_reduce(took, op=dist.ReduceOp.MAX)
            self.matmuls = max(1, round(self.matmuls * cfg.step_ms / 1e3 / float(took)))

    def __call__(self, save: bool = False, stop: bool = False) -> tuple[bool, bool]:
        if self.kind == "accelerator":
            time.sleep(self.wait_s)  # the host waits for the device's step
        else:
            for _ in range(self.matmuls):
                torch.mm(self.a, self.b, out=self.c)
        self.grad[0], self.grad[1] = float(save), float(stop)
        dist.all_reduce(self.grad)
        if self.guard is not None:  # the optimizer step: a lazy snapshot's copy must be done
            self.guard_s += self.guard()
        first = self.state["w0"].to_local()
        first[self.step % first.shape[0], 0] += 1.0  # the state changes between saves
        self.step += 1
        return bool(self.grad[0] > 0), bool(self.grad[1] > 0)


def run_window(train: Trainer, engine: Any, cfg: Config, root: str) -> dict[str, Any]:
    """``cfg.window_s`` seconds of steps, saving every ``cfg.save_every_s`` s (save call to save
    call, rank 0's clock) when ``engine`` is given."""
    lead = dist.get_rank() == 0
    blocked, handles, step_s, local_peak = [], [], [], 0
    train.guard = None if engine is None else engine.wait_snapshot
    dist.barrier()
    t0 = last = time.perf_counter()
    while True:
        ts = time.perf_counter()
        due = engine is not None and ts - last >= cfg.save_every_s
        save, stop = train(lead and due, lead and ts - t0 >= cfg.window_s)
        if save:
            if blocked:  # the previous save's guard waits are its blocked time too
                blocked[-1] += train.guard_s
            train.guard_s = 0.0
            last = time.perf_counter()
            handles.append(engine.save(train.state, step=train.step))
            blocked.append(time.perf_counter() - last)
        step_s.append(time.perf_counter() - ts)
        # in both variants, so the rate of each pays the same for it
        local_peak = max(local_peak, du(root))
        if stop:
            break
    elapsed = time.perf_counter() - t0
    if blocked:
        blocked[-1] += train.guard_s
    train.guard, train.guard_s = None, 0.0
    drain = 0.0
    if engine is not None:  # outside the rate: steady training would overlap it
        td = time.perf_counter()
        engine.wait()
        drain = time.perf_counter() - td
    results = [h.result() for h in handles]
    return {
        "steps": len(step_s),
        "seconds": elapsed,
        "steps_per_s": len(step_s) / elapsed,
        "step_s_median": statistics.median(step_s),
        "step_s_max": max(step_s),
        "saves": len(handles),
        "blocked_s": blocked,  # the save call, as the training loop sees it
        "engine_blocked_s": [r.blocked_s for r in results],
        "staging_s": [r.staging_s for r in results],
        "snapshot": [r.snapshot for r in results],
        "commit_s": [r.total_s for r in results],
        "drain_s": drain,
        "local_peak_bytes": local_peak,
        "loadavg_1min": os.getloadavg()[0],  # other work on the machine, if any
    }


#: where a save's time goes: (owner, attribute) wrapped with timers in the training ranks
SAVE_PARTS = {
    "lane.ready": "wait for the previous save",
    "tiers.decide": "persist decision (all-reduce)",
    "engine_mod.plan_save": "plan (collective)",
    "engine_mod.stage_save": "stage (copy)",
    "runtime.finish_save": "bg: write + local commit",
    "tiers._share_manifest": "bg: manifest to every rank",
    "runtime.execute_transfers": "bg: replicate to the peer",
    "runtime.persist_checkpoint": "persister: upload",
}


def instrument(engine: Any) -> dict[str, list[float]]:
    """Wrap the parts of a save listed in ``SAVE_PARTS`` with timers."""
    import lightning_elastic.core.engine as engine_mod
    from lightning_elastic.core.tiers import runtime

    owners = {
        "lane": engine._lane,
        "tiers": engine._placement.tiers,
        "engine_mod": engine_mod,
        "runtime": runtime,
    }
    parts: dict[str, list[float]] = {}
    for key in SAVE_PARTS:
        owner_name, attr = key.split(".")
        owner = owners[owner_name]
        fn = getattr(owner, attr)
        bucket = parts.setdefault(key, [])

        def timed(*args: Any, _fn: Any = fn, _bucket: Any = bucket, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return _fn(*args, **kwargs)
            finally:
                _bucket.append(time.perf_counter() - t0)

        setattr(owner, attr, timed)
    return parts


def train_worker(cfg: Config) -> dict[str, Any]:
    torch.set_num_threads(1)  # two ranks on two cores
    rank = dist.get_rank()
    state = build_state(cfg, device_mesh(), zeros=False)
    trainers = {kind: Trainer(cfg, state, kind) for kind in cfg.steps}
    engine = make_engine(cfg)
    # warm-up: the arena, the plan, the lease, and each node's local tier as a long run holds
    # it: its checkpoints, one kept while it is persisted, the spare files of those retention
    # deleted (the next saves write into them). A run's first saves write into new memory:
    # their seconds (save call to local commit and copies) are reported apart.
    warmup_s = []
    for step in range(WARMUP_SAVES + cfg.local_keep):
        t = time.perf_counter()
        engine.save(state, step=step, persist=step == 0).result()
        warmup_s.append(time.perf_counter() - t)
    engine.wait()
    timers = instrument(engine)
    parts: dict[str, dict[str, list[float]]] = {}
    root = cfg.local_root(NODES[rank])
    windows: list[dict[str, Any]] = []
    step = len(warmup_s)
    for kind, train in trainers.items():
        marks = {key: len(times) for key, times in timers.items()}
        train.step = step  # one run of steps: save names keep rising
        for r in range(cfg.rounds):
            modes = (
                cfg.snapshots[r % len(cfg.snapshots) :] + cfg.snapshots[: r % len(cfg.snapshots)]
            )
            for variant in ("none", *modes):  # modes rotated: neither always follows "none"
                use = None
                if variant != "none":
                    use, engine.snapshot = engine, variant
                run = run_window(train, use, cfg, root)
                windows.append({"kind": kind, "variant": variant, **run})
        step = train.step
        parts[kind] = {key: times[marks[key] :] for key, times in timers.items()}
    t = time.perf_counter()
    engine.save(state, step=step + 1, persist=True)  # the checkpoint recovery loads
    engine.wait()
    final_s = time.perf_counter() - t
    out = {
        "rank": rank,
        "bytes": sum(v.to_local().nbytes for v in state.values()),
        "matmuls": trainers.get("cpu", trainers[cfg.steps[0]]).matmuls,
        "windows": windows,
        "save_parts": parts,
        "final_save_persist_s": final_s,
        "fingerprint": fingerprint(state),
        "local_end_bytes": du(root),
        "peak_rss": rss_kib("VmHWM") * 1024,
        "warmup_s": warmup_s,
    }
    engine.close()  # deletes the node's spare files
    dist.barrier()
    out["local_closed_bytes"] = du(root)
    return out


# ---------------------------------------------------------------------------- recovery


def recover_worker(cfg: Config) -> dict[str, Any]:
    entered = time.time()
    torch.set_num_threads(1)
    t = time.perf_counter()
    import lightning_elastic.testing.throttled  # noqa: F401
    from lightning_elastic import CheckpointEngine  # noqa: F401
    from lightning_elastic.core.load import walk
    from lightning_elastic.core.tiers import gather, restore

    imports_s = time.perf_counter() - t
    t = time.perf_counter()
    mesh = device_mesh()
    mesh_s = time.perf_counter() - t
    t = time.perf_counter()
    state = build_state(cfg, mesh, zeros=True)
    alloc_s = time.perf_counter() - t
    phases: dict[str, float] = {}
    modules = {"restore": restore, "gather": gather, "walk": walk}
    for name, module in PHASES.items():
        time_calls(modules[module], (name,), phases)
    t0 = time.perf_counter()
    engine = make_engine(cfg)
    t1 = time.perf_counter()
    engine.load(state)
    t2 = time.perf_counter()
    loaded = time.time()
    rec = engine.last_recovery
    engine.close()
    return {
        "rank": dist.get_rank(),
        "entered": entered,
        "loaded": loaded,
        "imports_s": imports_s,
        "mesh_s": mesh_s,
        "alloc_s": alloc_s,
        "construct_s": t1 - t0,
        "load_s": t2 - t1,
        "total_s": t2 - t0,
        "phases": phases,
        "recovery": rec.to_json() if rec is not None else None,
        "fingerprint": fingerprint(state),
        "peak_rss": rss_kib("VmHWM") * 1024,
    }


def fresh_imports_s() -> float:
    """A new interpreter importing torch, DCP and the engine (what the forkserver hides)."""
    code = "import torch, torch.distributed.checkpoint, lightning_elastic.core.engine"
    t = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], check=True, env=dict(os.environ))
    return time.perf_counter() - t


def run_recoveries(cfg: Config, expected: list[list[float]]) -> dict[str, Any]:
    """The three scenarios, in order (each wipes more); each in fresh processes."""
    out: dict[str, Any] = {}
    for scenario, wipe in (("local", ()), ("peer", ("b",)), ("persistent", NODES)):
        for node in wipe:
            shutil.rmtree(cfg.local_root(node), ignore_errors=True)
        spawned = time.time()
        ranks = run_distributed(recover_worker, 2, cfg, timeout=1800)
        correct = [r["fingerprint"] == expected[r["rank"]] for r in ranks]
        out[scenario] = {
            "ranks": ranks,
            "worst_s": max(r["total_s"] for r in ranks),
            "spawned": spawned,
            "spawn_to_loaded_s": max(r["loaded"] for r in ranks) - spawned,
            "correct": all(correct),
        }
    return out


# ---------------------------------------------------------------------------- report


def summarize_throughput(
    train: list[dict[str, Any]], kind: str, modes: tuple[str, ...]
) -> dict[str, Any]:
    def windows(variant: str) -> list[list[dict[str, Any]]]:
        return [
            [w for w in res["windows"] if w["variant"] == variant and w["kind"] == kind]
            for res in train
        ]

    def rate(variant: str) -> float:  # both ranks step together: the slower one's rate
        return min(
            sum(w["steps"] for w in ws) / sum(w["seconds"] for w in ws) for ws in windows(variant)
        )

    # per save, the slower rank's mean seconds in each part (the persister: per persist)
    parts = {
        key: max(statistics.mean(res["save_parts"][kind][key] or [0.0]) for res in train)
        for key in SAVE_PARTS
    }
    none_rate = rate("none")
    out: dict[str, Any] = {
        "step_s_none": statistics.median(w["step_s_median"] for ws in windows("none") for w in ws),
        "steps_per_s_none": none_rate,
        "parts_s": parts,
        "persists": len(train[0]["save_parts"][kind]["runtime.persist_checkpoint"]),
        "modes": {},
    }
    for mode in modes:
        ckpt = [w for ws in windows(mode) for w in ws]
        blocked = sorted(b for w in ckpt for b in w["blocked_s"])
        staging = [s for w in ckpt for s in w["staging_s"]]
        saves = sum(w["saves"] for w in ckpt) // len(train)
        ckpt_rate = rate(mode)
        out["modes"][mode] = {
            "steps_per_s_ckpt": ckpt_rate,
            "ratio": ckpt_rate / none_rate,
            "saves_per_rank": saves,
            "save_interval_s": sum(w["seconds"] for w in ckpt) / len(train) / max(1, saves),
            "blocked_s_median": statistics.median(blocked),
            "blocked_s_p95": blocked[int(0.95 * (len(blocked) - 1))],
            "blocked_s_max": blocked[-1],
            "staging_s_median": statistics.median(staging),
            "blocked_over_staging": statistics.median(blocked) / statistics.median(staging),
            "snapshots": sorted({m for w in ckpt for m in w["snapshot"]}),
            "commit_s_median": statistics.median(c for w in ckpt for c in w["commit_s"]),
            "drain_s_max": max(w["drain_s"] for w in ckpt),
        }
    return out


def summarize_memory(
    cfg: Config, train: list[dict[str, Any]], scenarios: dict[str, Any]
) -> dict[str, Any]:
    state_bytes = sum(t["bytes"] for t in train)
    rule = state_bytes / len(NODES) * (1 + cfg.replicas)
    return {
        "state_bytes": state_bytes,
        "rule_bytes": rule * cfg.local_keep,
        "rule_inflight_bytes": rule * (cfg.local_keep + 1),
        "nodes": [
            {
                "node": NODES[t["rank"]],
                "end_bytes": t["local_end_bytes"],
                "closed_bytes": t["local_closed_bytes"],
                "peak_bytes": max(w["local_peak_bytes"] for w in t["windows"]),
                "train_rss": t["peak_rss"],
                "recover_rss": max(
                    (s["ranks"][t["rank"]]["peak_rss"] for s in scenarios.values()), default=0
                ),
            }
            for t in train
        ],
    }


def verdict(ok: bool) -> str:
    return "MET" if ok else "MISSED"


def print_recovery(rec: dict[str, Any]) -> None:
    print(
        "\nrecovery    construct->loaded  spawn->loaded  tier (a,b)            MB local/peer/persistent (a | b)  ok"
    )
    for name, r in rec["scenarios"].items():
        tiers = ",".join(x["recovery"]["tier"] for x in r["ranks"])
        mb = " | ".join(
            "/".join(
                f"{x['recovery']['bytes'][k] / 1e6:.0f}" for k in ("local", "peer", "persistent")
            )
            for x in r["ranks"]
        )
        print(
            f"  {name:<10}{r['worst_s']:>12.2f} s{r['spawn_to_loaded_s']:>12.2f} s  {tiers:<22}{mb:<34}{r['correct']}"
        )
    print(
        "  the slowest rank's seconds: spawn->entry, mesh, alloc | construct | recovery phases (commit_copy: the manifest beside the copies)"
    )
    for name, r in rec["scenarios"].items():
        w = max(r["ranks"], key=lambda x: x["total_s"])
        phases = ", ".join(f"{p.strip('_')} {w['phases'].get(p, 0):.2f}" for p in PHASES)
        print(
            f"    {name:<10} {w['entered'] - r['spawned']:.2f}, {w['mesh_s']:.2f}, {w['alloc_s']:.2f} | "
            f"{w['construct_s']:.2f} | {phases}"
        )
    print(
        f"  fresh interpreter + imports (hidden by the forkserver above): {rec['fresh_imports_s']:.2f} s"
    )
    for name in ("local", "peer"):
        x = rec["speedup"][name]
        print(
            f"  {name} vs persistent: {x:.1f}x  (target >= {RECOVERY_TARGET}x) {verdict(x >= RECOVERY_TARGET)}"
        )


def print_throughput(
    cfg: Config, kind: str, thr: dict[str, Any], train: list[dict[str, Any]]
) -> None:
    what = (
        "the host waits for the device"
        if kind == "accelerator"
        else f"{train[0]['matmuls']} matmuls of {MATMUL} on the host"
    )
    print(
        f"\nthroughput, {kind} step: {thr['step_s_none'] * 1e3:.0f} ms (median, no saves; {what} + "
        f"1 MB all-reduce), a save every {cfg.save_every_s:g} s, persist "
        f"every {cfg.persist_every} saves; {cfg.rounds} x ({cfg.window_s:.0f} s none, "
        f"{cfg.window_s:.0f} s with saves) interleaved"
    )
    print(
        "  load average (1 min) at each window's end: "
        + ", ".join(
            f"{w['variant']} {w['loadavg_1min']:.1f}"
            for w in train[0]["windows"]
            if w["kind"] == kind
        )
    )
    for mode, m in thr["modes"].items():
        print(
            f"  {mode:<9} steps/s none {thr['steps_per_s_none']:.2f}, with saves "
            f"{m['steps_per_s_ckpt']:.2f}: ratio {m['ratio']:.3f} (target >= {RATIO_TARGET}) "
            f"{verdict(m['ratio'] >= RATIO_TARGET)}"
        )
        print(
            f"  {'':<9} {m['saves_per_rank']} saves/rank, one per {m['save_interval_s']:.1f} s; "
            f"blocked per save (call + guard waits) median {m['blocked_s_median']:.3f} s, p95 "
            f"{m['blocked_s_p95']:.3f} s, max {m['blocked_s_max']:.3f} s; staging copy median "
            f"{m['staging_s_median']:.3f} s: blocked = {m['blocked_over_staging']:.2f} x the copy; "
            f"save to local commit median {m['commit_s_median']:.2f} s ({', '.join(m['snapshots'])})"
        )
    warm = [max(ws) for ws in zip(*(t["warmup_s"] for t in train), strict=True)]
    print(
        f"  before the windows, {len(warm)} warm-up saves (the first persisted), save call to "
        "local commit and copies: " + ", ".join(f"{w:.2f}" for w in warm) + " s"
    )
    print(
        f"  mean s per save (slower rank; persister per persist, {thr['persists']} persists): "
        + ", ".join(f"{label} {thr['parts_s'][key]:.2f}" for key, label in SAVE_PARTS.items())
    )


def print_memory(mem: dict[str, Any]) -> None:
    print(
        f"\nmemory      sizing rule {mem['rule_bytes'] / 1e9:.2f} GB/node (x local_keep), "
        f"{mem['rule_inflight_bytes'] / 1e9:.2f} GB while a save is written (x (local_keep + 1))"
    )
    for m in mem["nodes"]:
        print(
            f"  node {m['node']}: {m['end_bytes'] / 1e9:.2f} GB at training's end (spare files "
            f"included), {m['closed_bytes'] / 1e9:.2f} GB after close, {m['peak_bytes'] / 1e9:.2f} GB "
            f"most seen; peak RSS training {m['train_rss'] / 1e9:.2f} GB, recovery "
            f"{m['recover_rss'] / 1e9:.2f} GB"
        )


def print_report(cfg: Config, out: dict[str, Any]) -> None:
    print(
        f"\n{cfg.gb:.2f} GB sharded state, 2 ranks on 2 nodes; local roots in {cfg.local_base}; "
        f"persistent: throttled:// {cfg.bandwidth / 1e6:.0f} MB/s per process, "
        f"{cfg.latency * 1e3:.0f} ms/request. 2 cores shared by both ranks and all background "
        "work (staging, writes, replication, persist)."
    )
    if out["recovery"] is not None:
        print_recovery(out["recovery"])
    for kind, thr in out["throughput"].items():
        print_throughput(cfg, kind, thr, out["train"])
    print_memory(out["memory"])


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--gb", type=float, default=1.1, help="state, all ranks")
    parser.add_argument("--bandwidth", type=float, default=100e6, help="bytes/s per process")
    parser.add_argument("--latency", type=float, default=0.02, help="seconds per request")
    parser.add_argument("--persist-every", type=int, default=15)
    parser.add_argument("--local-keep", type=int, default=2)
    parser.add_argument("--step-ms", type=float, default=75.0)
    parser.add_argument(
        "--steps",
        default="accelerator,cpu",
        help="kinds of training step to measure, comma-separated (see above)",
    )
    parser.add_argument(
        "--no-recovery", action="store_true", help="measure training only (no recovery scenarios)"
    )
    parser.add_argument("--save-every-s", type=float, default=2.0)
    parser.add_argument(
        "--snapshots",
        default="blocking,lazy",
        help="snapshot modes to measure, comma-separated, each in its own windows",
    )
    parser.add_argument("--window", type=float, default=30.0, help="seconds per window")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default="benchmarks/results/tiers.json")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
    local_base = tempfile.mkdtemp(prefix="le-tiers-", dir=shm)
    remote = tempfile.mkdtemp(prefix="le-tiers-persistent-", dir=os.getcwd())
    cfg = Config(
        gb=args.gb,
        bandwidth=args.bandwidth,
        latency=args.latency,
        persist_every=args.persist_every,
        local_keep=args.local_keep,
        replicas=1,
        step_ms=args.step_ms,
        steps=tuple(k for k in args.steps.split(",") if k),
        save_every_s=args.save_every_s,
        window_s=args.window,
        snapshots=tuple(m for m in args.snapshots.split(",") if m),
        rounds=args.rounds,
        persistent=f"throttled://{remote}",
        local_base=local_base,
    )
    started = time.perf_counter()
    try:
        train = run_distributed(train_worker, 2, cfg, timeout=3600)
        scenarios: dict[str, Any] = {}
        recovery: dict[str, Any] | None = None
        if not args.no_recovery:
            scenarios = run_recoveries(cfg, [t["fingerprint"] for t in train])
            persistent_s = scenarios["persistent"]["worst_s"]
            recovery = {
                "scenarios": scenarios,
                "fresh_imports_s": fresh_imports_s(),
                "speedup": {n: persistent_s / scenarios[n]["worst_s"] for n in ("local", "peer")},
            }
    finally:
        shutil.rmtree(local_base, ignore_errors=True)
        shutil.rmtree(remote, ignore_errors=True)
    out = {
        "config": {**asdict(cfg), "cores": os.cpu_count()},
        "targets": {"recovery_speedup": RECOVERY_TARGET, "throughput_ratio": RATIO_TARGET},
        "recovery": recovery,
        "throughput": {
            kind: summarize_throughput(train, kind, cfg.snapshots) for kind in cfg.steps
        },
        "memory": summarize_memory(cfg, train, scenarios),
        "train": train,
        "runtime_s": time.perf_counter() - started,
    }
    print_report(cfg, out)
    print(f"\nbenchmark runtime {out['runtime_s']:.0f} s")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
