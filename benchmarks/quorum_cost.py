"""What a synchronous quorum per step costs against torchft's asynchronous one.

``ElasticFTStrategy`` joins each step's quorum synchronously (``use_async_quorum=False``):
the participants must be known before the step's samples are chosen (every sample once per
epoch, split over the groups taking part in *that* step), and a healing group receives the
live state before its step starts. torchft's default computes the quorum in a background
thread while the forward and backward passes run, and waits for it at the first collective.

This measures both on torchft's own Manager, fault-free, with a Lighthouse in this process and
``--groups`` replica groups of one process each (gloo on loopback): every step is
``start_quorum`` -> ``--compute`` seconds of work (a sleep standing in for forward and
backward) -> an allreduce of ``--numel`` floats -> ``should_commit``. Reported per mode: the
median step time, the time ``start_quorum`` held the training thread, and the difference to
the compute alone (what the protocol adds to a step)::

    python benchmarks/quorum_cost.py --steps 200 --compute 0.25
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import time
from datetime import timedelta
from typing import Any


def _group(
    index: int, lighthouse: str, asynchronous: bool, args: argparse.Namespace, out: Any
) -> None:
    import torch
    from torch.distributed import TCPStore
    from torchft.manager import Manager
    from torchft.process_group import ProcessGroupGloo

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=10)),
        load_state_dict=lambda _: None,
        state_dict=lambda: {},
        min_replica_size=args.groups,
        use_async_quorum=asynchronous,
        timeout=timedelta(seconds=10),
        quorum_timeout=timedelta(seconds=60),
        rank=0,
        world_size=1,
        store_addr="127.0.0.1",
        store_port=store.port,
        lighthouse_addr=lighthouse,
        replica_id=f"group-{index}",
        heartbeat_interval=timedelta(milliseconds=100),
    )
    grad = torch.ones(args.numel)
    quorum_s: list[float] = []
    step_s: list[float] = []
    try:
        for step in range(args.warmup + args.steps):
            began = time.perf_counter()
            manager.start_quorum()
            held = time.perf_counter() - began
            time.sleep(args.compute)  # forward and backward
            manager.allreduce(grad).wait()
            committed = manager.should_commit()
            if step >= args.warmup and committed:
                quorum_s.append(held)
                step_s.append(time.perf_counter() - began)
    finally:
        manager.shutdown(wait=False)
    out.put({"quorum_s": quorum_s, "step_s": step_s})


def measure(asynchronous: bool, args: argparse.Namespace) -> dict[str, float]:
    """One fault-free run of ``args.groups`` groups; the medians of group 0."""
    from torchft.coordination import LighthouseServer

    lighthouse = LighthouseServer(
        bind="[::]:0", min_replicas=args.groups, join_timeout_ms=100, heartbeat_timeout_ms=1000
    )
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [
        ctx.Process(target=_group, args=(i, lighthouse.address(), asynchronous, args, out))
        for i in range(args.groups)
    ]
    try:
        for p in procs:
            p.start()
        results = [out.get(timeout=600) for _ in procs]
        for p in procs:
            p.join(timeout=60)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        lighthouse.shutdown()
    steps = [s for r in results for s in r["step_s"]]
    quorums = [q for r in results for q in r["quorum_s"]]
    step = statistics.median(steps)
    return {
        "steps": len(steps),
        "median_step_s": step,
        "median_quorum_held_s": statistics.median(quorums),
        "p90_quorum_held_s": statistics.quantiles(quorums, n=10)[-1],
        "added_to_step_s": step - args.compute,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--groups", type=int, default=2)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--compute", type=float, default=0.25, help="seconds of work per step")
    parser.add_argument("--numel", type=int, default=1 << 16, help="floats allreduced per step")
    args = parser.parse_args()
    result = {
        "synchronous (ours)": measure(False, args),
        "asynchronous (torchft default)": measure(True, args),
    }
    sync, asyn = result["synchronous (ours)"], result["asynchronous (torchft default)"]
    result["sync_minus_async_per_step_s"] = sync["median_step_s"] - asyn["median_step_s"]
    result["sync_cost_fraction_of_step"] = (
        result["sync_minus_async_per_step_s"] / (asyn["median_step_s"])
    )
    result["args"] = vars(args)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
