"""The adaptive cadence on the 1.1 GB benchmark model: which interval ``train_time_interval="auto"``
chooses from measured save costs, with ``mtbf="4h"``.

The model and data are bench_lightning.py's (22 x Linear(2048, 2048) + Adam, ~1.1 GB of state,
2 CPU ranks, ``ElasticStrategy``). The first save falls after ``--initial`` seconds (the cadence
has nothing measured before it); after each committed save the cadence recomputes the interval
from that save's blocked time, the slowdown of the steps its write overlapped and its commit
time. The run's history (``_history/``, kind ``cadence``) holds each choice; this script prints
them, and what the same measured cost gives for larger jobs (the node MTBF divided by the
number of nodes).

    python benchmarks/bench_cadence.py [--steps 80] [--initial 5] [--mtbf 4h] [--max-overhead 0.01]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from benchmarks.bench_lightning import build_module
from lightning_elastic.testing.spawn import run_distributed


def worker(scratch: str, steps: int, initial: float, mtbf: str, max_overhead: float) -> Any:
    import lightning.pytorch as pl

    from lightning_elastic import CadenceOptions, DistributedCheckpoint, ElasticStrategy
    from lightning_elastic.core.policy.cadence import Cadence

    torch.set_num_threads(1)  # two ranks on two cores
    Cadence.AUTO_INITIAL_S = initial
    pl.seed_everything(0, verbose=False)
    checkpoint = DistributedCheckpoint(
        f"{scratch}/ckpts",
        train_time_interval="auto",
        cadence=CadenceOptions(mtbf=mtbf, max_overhead=max_overhead),
        keep_last_n=1,
        save_on_train_end=False,
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=ElasticStrategy(),
        max_steps=steps,
        callbacks=[checkpoint],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=scratch,
    )
    trainer.fit(build_module(22, 2048, 16))
    monitor = checkpoint.health
    assert monitor is not None
    return {"metrics": monitor.health.snapshot(), "nodes": monitor.nodes}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--initial", type=float, default=5.0)
    parser.add_argument("--mtbf", default="4h")
    parser.add_argument("--max-overhead", type=float, default=0.01)
    parser.add_argument("--out", default="benchmarks/results/cadence.json")
    args = parser.parse_args()
    from lightning_elastic.core.observe.history import read_history
    from lightning_elastic.core.policy.cadence import AutoCadence, parse_duration
    from lightning_elastic.core.storage.base import Storage

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    scratch = tempfile.mkdtemp(prefix="le-bench-cadence-", dir=os.getcwd())
    try:
        out = run_distributed(
            worker,
            2,
            scratch,
            args.steps,
            args.initial,
            args.mtbf,
            args.max_overhead,
            timeout=3600,
        )
        events, _ = read_history(Storage(f"{scratch}/ckpts"))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    choices = [e.fields for e in events if e.kind == "cadence"]
    commits = [e.fields for e in events if e.kind == "commit"]
    print(
        f"\n1.1 GB of model + Adam state, 2 ranks on {out[0]['nodes']} node, mtbf={args.mtbf}, "
        f"max_overhead={args.max_overhead}"
    )
    for c in commits:
        print(
            f"  save at step {c['step']}: blocked {c['blocked_s']:.3f} s, "
            f"commit {c['commit_s']:.2f} s, {c['bytes'] / 1e9:.2f} GB"
        )
    for c in choices:
        print(
            f"  chosen at step {c['step']}: interval {c['interval_s']:.1f} s ({c['bound']}): "
            f"cost {c['cost_s']:.3f} s, write {c['write_s']:.2f} s, job MTBF {c['mtbf_s']:.0f} s"
        )
    scaled = []
    if choices:
        last = choices[-1]
        print("  the same measured cost on larger jobs (node MTBF / nodes):")
        for nodes in (1, 16, 128, 1024):
            cadence = AutoCadence(
                mtbf_s=parse_duration(args.mtbf, "mtbf"),
                nodes=nodes,
                max_overhead=args.max_overhead,
            )
            choice = cadence.observe(
                blocked_s=last["cost_s"], slowdown_s=0.0, write_s=last["write_s"]
            )
            scaled.append({"nodes": nodes, **vars(choice)})
            print(f"    {nodes:>5} nodes: every {choice.interval_s:7.1f} s ({choice.bound})")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(
        json.dumps(
            {
                "commits": commits,
                "choices": choices,
                "scaled": scaled,
                "metrics_rank0": out[0]["metrics"],
            },
            indent=1,
        )
    )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
