"""A torchrun worker for the agent-store test, one per node on two nodes sharing torch's agent
store: in round 0, rank 1 fails once it is in the group and rank 0 waits without a collective,
so its agent restarts it because the other node waits for the next round (a restart its agent
does not count; the other agent counts one); in round 1, rank 0 starts late, after rank 1 has
looked for its address. The group is initialized as our strategies initialize it
(``attempt_store``), or with torch's own keys (``plain``: gloo's ``connectFullMesh ...
Connection refused``, rank 1 read the address rank 0 of round 0 had left)."""

import faulthandler
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

import torch
import torch.distributed as dist

from lightning_elastic.lightning.strategy import attempt_store

faulthandler.enable()  # a worker that aborts (once seen in CI: exit code -6) says where
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
marker = Path(f"rank{rank}.started")  # in the test's folder: a rank's first round
first = not marker.exists()
marker.touch()
if rank == 0 and not first:
    time.sleep(6)
store = None
if sys.argv[1] == "prefixed":
    store = attempt_store()
    store.set_timeout(timedelta(seconds=30))  # a group that never forms fails in the test's time
timeout = timedelta(seconds=30)
dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
if first and rank == 1:
    sys.exit(1)
if first:
    time.sleep(120)
tensor = torch.ones(1)
dist.all_reduce(tensor)
restarts = os.environ["TORCHELASTIC_RESTART_COUNT"]
shared = os.environ["TORCHELASTIC_USE_AGENT_STORE"]
print(f"rank {rank} restarts {restarts} agent store {shared} sum {tensor.item():.0f}", flush=True)
dist.barrier()  # neither rank leaves while the other may still use the group
dist.destroy_process_group()
