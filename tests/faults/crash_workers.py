"""The recorded run of the crash-point tests: ranks save through a RecordingFileSystem."""

from datetime import timedelta

import torch
import torch.distributed as dist

from lightning_elastic import CheckpointEngine, KeepLastN, RetryPolicy, Storage
from lightning_elastic.testing.recording import RecordingFileSystem

RUN_ID = "crash-run"
# never changes: an incremental save refers to it (the same tensor in every save of a process)
FROZEN = torch.arange(96, dtype=torch.float32) * 3


def state_for(step: int) -> dict:
    """The state saved at ``step`` (replicated: DCP has each tensor written by one rank)."""
    return {
        "a": torch.arange(64, dtype=torch.float32) + step,
        "b": torch.full((48,), float(step)),
        "frozen": FROZEN,
        "meta": {"step": step},
    }


def rank_state_for(step: int, rank: int) -> dict:
    return {"seen": torch.tensor([1000 * rank + step])}


def record_saves(
    root: str,
    log: str,
    steps: list[int],
    keep: int,
    object_store: bool = False,
    full_every_n_saves: int | None = None,
) -> list[str]:
    """Save ``steps`` (async, each awaited) with ``KeepLastN(keep)``; every mutating storage
    operation lands in ``log``. Returns the committed names. ``full_every_n_saves``: saves
    after the first refer to its unchanged tensor (incremental)."""
    retry = RetryPolicy(deadline_s=5, initial_backoff_s=0.01, max_backoff_s=0.05)
    fs = RecordingFileSystem(log=log, object_store=object_store)
    storage = Storage(root, fs=fs, retry=retry)
    names = []
    with CheckpointEngine(
        storage=storage,
        run_id=RUN_ID,
        retention=[KeepLastN(keep)],
        timeout=timedelta(seconds=30),
        full_every_n_saves=full_every_n_saves,
    ) as eng:
        for step in steps:
            handle = eng.save(
                state_for(step), step=step, rank_state=rank_state_for(step, dist.get_rank())
            )
            assert handle is not None
            names.append(handle.result().name)
    return names
