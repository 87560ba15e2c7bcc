"""Load time of a checkpoint written by 2 ranks, loaded by 2 (same size) and by 3 (resharded).

Two layouts of ~1.1 GB of model + Adam state: ``replicated`` (DDP: every rank loads all of
it) and ``sharded`` (every tensor a DTensor split by rows over the ranks: each rank loads its
rows, cut out of the 2-rank files when loading at 3). Rounds alternate 2 and 3 and the load
includes full verification (checksums). Reported: median load seconds per rank and the ratio
resharded / same-size (target <= 1.5).

    python benchmarks/bench_reshard.py [--small] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.distributed as dist

from lightning_elastic.testing.spawn import run_distributed


def state(layers: int, width: int, sharded: bool, zeros: bool = False) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    g = torch.Generator().manual_seed(0)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),)) if sharded else None
    out: dict[str, Any] = {}
    for i in range(layers):
        for kind in ("weight", "exp_avg", "exp_avg_sq"):
            t = torch.zeros(width, width) if zeros else torch.randn(width, width, generator=g)
            out[f"layer{i}.{kind}"] = (
                distribute_tensor(t, mesh, [Shard(0)]) if mesh is not None else t
            )
    return out


def save(root: str, layers: int, width: int, sharded: bool) -> None:
    from lightning_elastic import CheckpointEngine

    torch.set_num_threads(1)
    with CheckpointEngine(root) as engine:
        engine.save(state(layers, width, sharded), step=1).result()


def load(root: str, layers: int, width: int, sharded: bool) -> float:
    from lightning_elastic import CheckpointEngine

    torch.set_num_threads(1)
    target = state(layers, width, sharded, zeros=True)
    with CheckpointEngine(root) as engine:
        dist.barrier()
        start = time.perf_counter()
        engine.load(target, verify="full")
        seconds = time.perf_counter() - start
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--small", action="store_true")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default="benchmarks/results/reshard.json")
    args = parser.parse_args()
    layers, width = (4, 256) if args.small else (22, 2048)
    summary: dict[str, Any] = {}
    for layout in ("replicated", "sharded"):
        scratch = tempfile.mkdtemp(prefix="le-bench-reshard-", dir=os.getcwd())
        try:
            run_distributed(save, 2, scratch, layers, width, layout == "sharded", timeout=1800)
            times: dict[int, list[float]] = {2: [], 3: []}
            for r in range(args.rounds):
                for world in (2, 3) if r % 2 == 0 else (3, 2):
                    per_rank = run_distributed(
                        load, world, scratch, layers, width, layout == "sharded", timeout=1800
                    )
                    times[world].append(max(per_rank))
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        same, resharded = statistics.median(times[2]), statistics.median(times[3])
        summary[layout] = {
            "load_2_s": same,
            "load_3_s": resharded,
            "ratio": resharded / same,
            "raw": times,
        }
        print(
            f"{layout:<11} load at 2: {same:.2f}s  at 3 (resharded): {resharded:.2f}s  "
            f"ratio {resharded / same:.2f} (target <= 1.5: {'MET' if resharded / same <= 1.5 else 'MISSED'})"
        )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
