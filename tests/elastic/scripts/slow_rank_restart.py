"""A torchrun worker for the stale-store test: the default process group is initialized the
way our strategies initialize it (``attempt_store``), rank 0 of the second attempt starts
late, and the first attempt's rank 0 dies after a collective (its address stays in the
agent's store)."""

import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

import torch
import torch.distributed as dist

from lightning_elastic.lightning.strategy import attempt_store

attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
rank = int(os.environ["RANK"])
if rank == 0 and attempt == 1:
    time.sleep(6)  # rank 1 of the new attempt looks for rank 0's address first
store = attempt_store() if sys.argv[1] == "prefixed" else None
dist.init_process_group("gloo", store=store, rank=rank, world_size=int(os.environ["WORLD_SIZE"]))
tensor = torch.ones(1)
dist.all_reduce(tensor)
print(f"attempt {attempt} rank {rank} sum {tensor.item():.0f}", flush=True)
if attempt == 0:
    time.sleep(0.5)
    os.kill(os.getpid(), signal.SIGKILL)
