"""8 and 16 ranks on this 2-core machine (oversubscribed, small state, #10 item 3): save,
load at another world size, a rank killed before the commit, a stalled rank named."""

import pytest

from lightning_elastic.errors import CheckpointTimeoutError
from lightning_elastic.testing.faults import Fault
from lightning_elastic.testing.spawn import run_distributed
from tests.distributed import many_workers, workers
from tests.faults.test_faults import statuses
from tests.faults.workers import save_good_then_faulty

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]


@pytest.mark.parametrize(("saved", "loaded"), [(8, 3), (16, 5)])
def test_many_ranks_save_and_load_at_another_world_size(tmp_path, saved, loaded) -> None:
    """Every replicated and resharded value comes back (12 rows over 8 or 16 ranks: some
    ranks hold no row); each of the first ``loaded`` ranks gets its own rank-local state."""
    root = str(tmp_path / "ckpts")
    saves = run_distributed(workers.save_two_ranks, saved, root, timeout=300)
    assert saves[0]["world_size"] == saved
    results = run_distributed(workers.load_any_world, loaded, root, timeout=300)
    assert {r["name"] for r in results} == {"step_000000010"}
    assert [r["saved_world"] for r in results] == [saved] * loaded
    assert [r["rank_state"] for r in results] == list(range(loaded))


def eight_ranks_with(tmp_path, fault: str, guilty: int, **fault_options) -> list:
    """Save step 1 on 8 ranks, then step 2 with ``fault`` on ``guilty``'s shard file; every
    other rank must time out naming ``guilty`` alone."""
    faults = [Fault("closed", f"*rank{guilty:05d}.distcp", fault, ranks=(guilty,), **fault_options)]
    results = run_distributed(
        save_good_then_faulty,
        8,
        str(tmp_path),
        faults,
        8.0,
        many_workers.every_rank_writes,
        may_die={guilty} if fault == "kill" else set(),
        timeout=300,
    )
    for rank in set(range(8)) - {guilty}:
        exc = results[rank]["error"]
        assert isinstance(exc, CheckpointTimeoutError), results[rank]
        assert exc.missing_ranks == [guilty] and f"rank {guilty}" in str(exc)
    return results


def test_eight_ranks_one_killed_before_the_commit(tmp_path) -> None:
    results = eight_ranks_with(tmp_path, "kill", 5)
    assert results[5] is None  # SIGKILLed
    assert statuses(tmp_path) == {"step_000000001": "valid", "step_000000002": "incomplete"}


def test_eight_ranks_a_stalled_rank_is_named_in_the_timeout(tmp_path) -> None:
    results = eight_ranks_with(tmp_path, "stall", 6, seconds=18.0)  # the timeout is 8 s
    for rank in set(range(8)) - {6}:
        assert results[rank]["elapsed"] < 18.0  # before the straggler even woke up
    assert isinstance(results[6]["error"], CheckpointTimeoutError)
    assert statuses(tmp_path).get("step_000000002") != "valid"
