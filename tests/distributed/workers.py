"""Functions run on every rank by the distributed tests (module level, so they pickle)."""

import time
from datetime import timedelta

import torch
import torch.distributed as dist
from fsspec.implementations.local import LocalFileSystem
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from lightning_elastic import CheckpointEngine, Storage
from lightning_elastic.testing.faults import Fault, FaultyFileSystem

SHARDED_SHAPE = (12, 6)


def replicated_state(seed: int = 0) -> dict:
    """The same state in every process, bit for bit: seeded parameters and gradients, one
    Adam step. No forward or backward: a CPU matmul's sums may come out differently in two
    processes (their threads, their buffers' alignment), and a rank whose weights differed
    in their last bits was rightly saved per rank, so a resharded load refused it (seen once
    under load)."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 256), torch.nn.ReLU(), torch.nn.Linear(256, 64))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    return {"model": model.state_dict(), "optim": opt.state_dict(), "step_count": 7}


def full_sharded(seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + seed)
    return torch.randn(*SHARDED_SHAPE, generator=g)


def sharded(world: int, value: torch.Tensor):
    mesh = init_device_mesh("cpu", (world,))
    return distribute_tensor(value, mesh, [Shard(0)])


def save_two_ranks(root: str, storage_options: dict | None = None) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    state = replicated_state()
    state["emb"] = sharded(world, full_sharded())
    with CheckpointEngine(root, storage_options=storage_options) as eng:
        result = eng.save(
            state, step=10, epoch=1, rank_state={"who": rank, "rng": torch.randn(3)}
        ).result()
        manifest = result.manifest
        return {
            "bytes_written": result.bytes_written,
            "files": None
            if manifest is None
            else [(f.path, f.size, f.rank) for f in manifest.files],
            "world_size": None if manifest is None else manifest.world_size,
            "rank_rng": torch.get_rng_state(),
        }


def load_any_world(root: str, storage_options: dict | None = None) -> dict:
    _rank, world = dist.get_rank(), dist.get_world_size()
    fresh = replicated_state(seed=99)  # different values, same structure
    fresh["emb"] = sharded(world, torch.zeros(*SHARDED_SHAPE))
    fresh["step_count"] = None
    with CheckpointEngine(root, storage_options=storage_options) as eng:
        result = eng.load(fresh)
    expected = replicated_state()
    for key, value in expected["model"].items():
        assert torch.equal(fresh["model"][key], value), key
    for pid, st in expected["optim"]["state"].items():
        for name, tensor in st.items():
            assert torch.equal(fresh["optim"]["state"][pid][name], tensor), (pid, name)
    assert fresh["step_count"] == 7
    emb = fresh["emb"].full_tensor()
    assert torch.equal(emb, full_sharded()), "resharded DTensor differs"
    return {
        "name": result.info.name,
        "rank_state": None if result.rank_state is None else result.rank_state["who"],
        "saved_world": result.manifest.world_size,
    }


def back_to_back(root: str, saves: int) -> list:
    rank = dist.get_rank()
    state = {"w": torch.zeros(256, 64), "opt": {"m": torch.zeros(64)}}
    steps = []
    with CheckpointEngine(root, timeout=timedelta(seconds=60)) as eng:
        for step in range(1, saves + 1):
            state["w"].fill_(step)
            handle = eng.save(state, step=step, rank_state={"rank": rank, "step": step})
            state["w"].fill_(-1)  # mutate right after the call
            steps.append(handle.step)
        eng.wait()
        assert eng.arena.allocations == 1
        loaded = {"w": torch.empty(256, 64), "opt": {"m": torch.empty(64)}}
        result = eng.load(loaded)
        assert torch.all(loaded["w"] == saves)
        assert result.rank_state == {"rank": rank, "step": saves}
        listed = [i.step for i in eng.list() if i.status == "valid"]
    return [steps, listed]


def skip_when_busy(root: str) -> list:
    """Rank 1 writes slowly: the second save must be skipped on *both* ranks."""
    faults = [Fault("closed", "*rank00001.distcp", "stall", seconds=1.0, times=1)]
    storage = Storage(root, fs=FaultyFileSystem(LocalFileSystem(), faults))
    out = []
    with CheckpointEngine(storage=storage, when_busy="skip") as eng:
        out.append(eng.save({"x": torch.ones(10)}, step=1) is not None)
        out.append(eng.save({"x": torch.ones(10)}, step=2) is not None)
        eng.wait()
        out.append(eng.save({"x": torch.ones(10)}, step=3) is not None)
        eng.wait()
        out.append(sorted(i.step for i in eng.list()))
    return out


def timed_sleep(seconds: float) -> float:
    time.sleep(seconds)
    return seconds


def plan_changes_on_one_rank(root: str) -> list:
    """Rank 1 alone changes its state's structure: every rank must take the full plan path."""
    rank = dist.get_rank()
    out = []
    with CheckpointEngine(root) as eng:
        for step in (1, 2, 3):
            state = {"w": torch.full((8,), float(step))}
            if rank == 1 and step == 3:
                # only rank 1's plan changes; rank 0 must not reuse its cached metadata, or
                # the committed metadata would lack "extra"
                state["extra"] = torch.ones(3)
            eng.save(state, step=step).result()
        loaded = {"w": torch.empty(8), "extra": torch.empty(3)}
        eng.load(loaded)
        out.append(float(loaded["w"][0]))
    return out


BIG_SHAPE = (3000, 512)  # 6 MB: chunks above the ranged-read threshold


def save_big(root: str) -> None:
    value = torch.arange(BIG_SHAPE[0] * BIG_SHAPE[1], dtype=torch.float32).view(BIG_SHAPE)
    with CheckpointEngine(root) as eng:
        eng.save({"big": sharded(dist.get_world_size(), value)}, step=1).result()


def load_big(root: str, verify: str = "full") -> int:
    target = {"big": sharded(dist.get_world_size(), torch.zeros(BIG_SHAPE))}
    with CheckpointEngine(root) as eng:
        result = eng.load(target, verify=verify)
    expected = torch.arange(BIG_SHAPE[0] * BIG_SHAPE[1], dtype=torch.float32).view(BIG_SHAPE)
    assert torch.equal(target["big"].full_tensor(), expected)
    return result.bytes_read


def load_fails_on_one_rank(root: str, failing_rank: int) -> str:
    """Every rank loads the checkpoint of ``save_two_ranks``; ``failing_rank`` asks for a
    shape that was not saved. Each rank plans its reads alone (no DCP collective), so the
    failure must still reach every rank, naming the rank and what failed there."""
    from lightning_elastic.errors import CheckpointLoadError

    rank, world = dist.get_rank(), dist.get_world_size()
    fresh = replicated_state(seed=99)
    fresh["emb"] = sharded(world, torch.zeros(*SHARDED_SHAPE))
    if rank == failing_rank:
        fresh["model"]["0.weight"] = torch.zeros(3, 3)
    with CheckpointEngine(root) as eng:
        try:
            eng.load(fresh)
        except CheckpointLoadError as exc:
            assert exc.failed_ranks == [failing_rank], exc.failures
            return str(exc)
    raise AssertionError("the load did not fail")


def save_incremental(root: str, saves: int) -> list:
    """``saves`` saves of a frozen sharded embedding and a frozen replicated model, with a
    small replicated head that changes every step (``full_every_n_saves`` above ``saves``:
    every save after the first refers to it). Rank 0 returns each manifest's references."""
    world = dist.get_world_size()
    state = replicated_state()
    state["emb"] = sharded(world, full_sharded())
    out = []
    with CheckpointEngine(root, full_every_n_saves=saves + 1) as eng:
        for step in range(1, saves + 1):
            state["head"] = torch.full((4,), float(step))
            result = eng.save(state, step=step).result()
            if result.manifest is not None:
                out.append(sorted(result.manifest.referenced_checkpoints))
    return out


def load_incremental(root: str, step: int) -> str:
    """Load the newest checkpoint at this world size into a fresh state; check it bitwise."""
    world = dist.get_world_size()
    fresh = replicated_state(seed=99)
    fresh["emb"] = sharded(world, torch.zeros(*SHARDED_SHAPE))
    fresh["head"] = torch.zeros(4)
    with CheckpointEngine(root) as eng:
        result = eng.load(fresh)
    expected = replicated_state()
    for key, value in expected["model"].items():
        assert torch.equal(fresh["model"][key], value), key
    assert torch.equal(fresh["emb"].full_tensor(), full_sharded()), "resharded DTensor differs"
    assert torch.equal(fresh["head"], torch.full((4,), float(step)))
    return result.info.name
