"""Coordinator collectives on two gloo processes: results, failures that reach every rank,
and an object that cannot be broadcast (rank 0's own failure, a timeout on rank 1)."""

import threading
import time
from datetime import timedelta

import pytest

from lightning_elastic.core.dist.coordinator import Coordinator
from lightning_elastic.errors import (
    CheckpointLoadError,
    CheckpointSaveError,
    DistributedFailure,
    IntegrityError,
    Phase,
    StorageError,
)
from lightning_elastic.testing.spawn import run_distributed

pytestmark = pytest.mark.timeout(120)


def _outcome(fn) -> tuple:
    """What a call gave this rank, as plain picklable values."""
    try:
        return ("ok", fn())
    except DistributedFailure as exc:
        failures = {r: (f.phase, f.error_type, f.message) for r, f in exc.failures.items()}
        missing = getattr(exc, "missing_ranks", None)
        return (type(exc).__name__, failures, missing)
    except Exception as exc:
        return (type(exc).__name__, str(exc))


def _raise(exc: Exception):
    raise exc


def collectives_and_failures() -> dict:
    """Every rank: several collectives in a row on one coordinator."""
    coord = Coordinator.from_environment(timeout=timedelta(seconds=30))
    rank = coord.rank
    out: dict = {"rank": rank, "world": coord.world_size}
    out["gather_scatter"] = _outcome(
        lambda: coord.gather_scatter(
            Phase.SAVE_PLAN, lambda: rank + 1, lambda vs: [sum(vs) * 10 + i for i in range(2)]
        )
    )
    out["all_gather"] = _outcome(lambda: coord.all_gather(Phase.AGREE, lambda: f"r{rank}"))
    out["broadcast"] = _outcome(lambda: coord.broadcast(Phase.INIT, lambda: f"from {rank}"))
    out["max_ints"] = _outcome(lambda: coord.max_ints([3, 0] if rank else [1, 5]))
    out["all_true"] = _outcome(lambda: coord.all(True))
    out["all_rank0"] = _outcome(lambda: coord.all(rank == 0))
    # one rank's typed failure reaches every rank as is
    out["typed"] = _outcome(
        lambda: coord.gather_scatter(
            Phase.WRITE,
            lambda: _raise(StorageError("write", "mem://r/f", "disk full")) if rank == 1 else 0,
            lambda vs: vs,
            error=CheckpointSaveError,
        )
    )
    # different failures on the two ranks: the caller's error naming both
    out["mixed"] = _outcome(
        lambda: coord.all_gather(
            Phase.LOAD,
            lambda: _raise(ValueError("r0") if rank == 0 else KeyError("r1")),
            error=CheckpointLoadError,
        )
    )
    # a failure of rank 0's broadcast function reaches rank 1 too
    out["broadcast_failure"] = _outcome(
        lambda: coord.broadcast(
            Phase.LOAD_VERIFY,
            lambda: _raise(IntegrityError("ckpt", "a.distcp", "checksum")),
            error=CheckpointLoadError,
        )
    )
    out["after"] = _outcome(lambda: coord.max_ints([rank]))  # still in step afterwards
    coord.close()
    return out


def broadcast_unpicklable() -> tuple:
    coord = Coordinator.from_environment(timeout=timedelta(seconds=3))

    def value():
        time.sleep(1.0)  # rank 1 is inside the broadcast by now
        return threading.Lock()

    started = time.monotonic()
    outcome = _outcome(lambda: coord.broadcast(Phase.INIT, value, error=CheckpointSaveError))
    return (*outcome, time.monotonic() - started)


def test_collectives_give_every_rank_the_same_results_and_failures() -> None:
    results = run_distributed(collectives_and_failures, 2, timeout=90)
    for rank, out in enumerate(results):
        assert (out["rank"], out["world"]) == (rank, 2)
        assert out["gather_scatter"] == ("ok", 30 + rank)
        assert out["all_gather"] == ("ok", ["r0", "r1"])
        assert out["broadcast"] == ("ok", "from 0")
        assert out["max_ints"] == ("ok", [3, 5])
        assert out["all_true"] == ("ok", True)
        assert out["all_rank0"] == ("ok", False)
        assert out["typed"] == ("StorageError", "storage write failed for 'mem://r/f': disk full")
        assert out["mixed"] == (
            "CheckpointLoadError",
            {0: ("load", "ValueError", "r0"), 1: ("load", "KeyError", "'r1'")},
            None,
        )
        assert out["broadcast_failure"][0] == "IntegrityError"
        assert "a.distcp" in out["broadcast_failure"][1]
        assert out["after"] == ("ok", [1])


def test_an_unpicklable_broadcast_is_rank_zeros_failure_and_a_timeout_on_rank_one() -> None:
    (kind0, failures0, missing0, took0), (kind1, failures1, missing1, took1) = run_distributed(
        broadcast_unpicklable, 2, timeout=90
    )
    # rank 0 cannot pickle its value: its own failure, at once, not a timeout
    assert kind0 == "CheckpointSaveError" and missing0 is None
    assert list(failures0) == [0]
    phase, error_type, message = failures0[0]
    assert (phase, error_type) == ("init", "TypeError") and "pickle" in message
    assert took0 < 2.9
    # rank 1 never gets a value: a save timeout blaming rank 0, with its own failure attached
    assert kind1 == "SaveTimeoutError" and missing1 == [0]
    assert set(failures1) == {0, 1} and failures1[0][1] == "Timeout"
    assert took1 < 30
