"""The core engine without Lightning: a plain DDP loop (run it under torchrun).

    torchrun --standalone --nproc-per-node 2 examples/train_core.py --dir /tmp/ckpts --steps 40

Each rank trains a replica of a small MLP (DDP); every 5 steps all ranks take an
asynchronous, sharded checkpoint. ``--kill-at N`` SIGKILLs rank 0 at step N, like a lost node.
Run it again with the same ``--dir``: it resumes from the newest valid checkpoint.
"""

from __future__ import annotations

import argparse
import os
import signal

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from lightning_elastic import CheckpointEngine, CheckpointNotFoundError, KeepLastN


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", required=True)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--every", type=int, default=5)
    parser.add_argument("--kill-at", type=int, default=-1)
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(
        torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    )
    optim = torch.optim.SGD(model.parameters(), lr=0.05)
    engine = CheckpointEngine(args.dir, retention=[KeepLastN(3)])

    step = 0
    try:
        state = {"model": model.module.state_dict(), "optim": optim.state_dict(), "step": 0}
        result = engine.load(state)
        model.module.load_state_dict(state["model"])
        optim.load_state_dict(state["optim"])
        step = state["step"]
        if rank == 0:
            print(f"resumed from {result.info.name} at step {step}", flush=True)
    except CheckpointNotFoundError:
        if rank == 0:
            print("no checkpoint yet: starting fresh", flush=True)

    g = torch.Generator().manual_seed(1234 + rank)
    while step < args.steps:
        x = torch.randn(16, 32, generator=g)
        loss = (model(x) - x.sum(dim=1, keepdim=True)).pow(2).mean()
        optim.zero_grad()
        loss.backward()
        optim.step()
        step += 1
        if step % args.every == 0:
            handle = engine.save(
                {"model": model.module.state_dict(), "optim": optim.state_dict(), "step": step},
                step=step,
                metrics={"loss": loss.item()},
            )
            if rank == 0:
                print(
                    f"step {step}: loss {loss.item():.4f}, saving {handle.name} "
                    f"(blocked {handle.blocked_s * 1000:.1f} ms)",
                    flush=True,
                )
        if step == args.kill_at and rank == 0:
            engine.wait()  # make the point: the last save is committed, then the node dies
            print(f"step {step}: rank 0 is SIGKILLed", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
    engine.close()
    if rank == 0:
        print(f"finished at step {step}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
