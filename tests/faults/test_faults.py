"""Failures on one rank: every rank raises the same typed error, nothing partial is committed."""

import pytest

from lightning_elastic.errors import CheckpointSaveError, CheckpointTimeoutError
from lightning_elastic.testing.faults import Fault
from lightning_elastic.testing.spawn import run_distributed
from tests.faults import workers

pytestmark = pytest.mark.timeout(240)
SHARD_1 = "*rank00001.distcp"


def statuses(root) -> dict:
    from lightning_elastic import Storage
    from lightning_elastic.core.format.catalog import Catalog

    return {i.name: i.status for i in Catalog(Storage(root)).scan()}


def test_transient_errors_on_one_rank_are_retried(tmp_path) -> None:
    faults = [Fault("write", SHARD_1, "EIO", times=2, ranks=(1,))]
    results = run_distributed(workers.save_good_then_faulty, 2, str(tmp_path), faults)
    assert [r.get("committed") for r in results] == ["step_000000002"] * 2
    assert statuses(tmp_path) == {"step_000000001": "valid", "step_000000002": "valid"}


@pytest.mark.parametrize("error", ["EACCES", "ENOSPC"])
def test_permanent_error_on_one_rank_fails_all_and_commits_nothing(tmp_path, error) -> None:
    faults = [Fault("write", SHARD_1, error, times=0, ranks=(1,))]
    results = run_distributed(workers.save_good_then_faulty, 3, str(tmp_path), faults)
    for r in results:
        exc = r["error"]
        assert isinstance(exc, CheckpointSaveError), r
        assert exc.failed_ranks == [1] and exc.phases == {"write"}
        assert "rank 1" in str(exc)
    assert statuses(tmp_path) == {"step_000000001": "valid"}  # nothing partial left behind


def test_rank_killed_between_write_and_commit(tmp_path) -> None:
    faults = [Fault("closed", SHARD_1, "kill", ranks=(1,))]
    results = run_distributed(
        workers.save_good_then_faulty, 2, str(tmp_path), faults, 3.0, may_die={1}
    )
    assert results[1] is None  # SIGKILLed
    exc = results[0]["error"]
    assert isinstance(exc, CheckpointTimeoutError) and exc.missing_ranks == [1]
    assert results[0]["elapsed"] < 3.0 + 10  # raised near the timeout: no hang
    assert statuses(tmp_path)["step_000000002"] == "incomplete"
    # the next incarnation resumes from the previous checkpoint and cleans the leftover
    resumed = run_distributed(workers.resume_and_save, 2, str(tmp_path))
    for r in resumed:
        assert r["resumed"] == "step_000000001" and r["value"] == 1.0
        assert r["before"]["step_000000002"] == "incomplete"
    assert statuses(tmp_path) == {"step_000000001": "valid", "step_000000003": "valid"}


def test_stalled_rank_makes_others_time_out_naming_it(tmp_path) -> None:
    timeout = 2.0
    faults = [Fault("closed", SHARD_1, "stall", seconds=6.0, ranks=(1,))]
    results = run_distributed(workers.save_good_then_faulty, 3, str(tmp_path), faults, timeout)
    for rank in (0, 2):
        exc = results[rank]["error"]
        assert isinstance(exc, CheckpointTimeoutError), results[rank]
        assert exc.missing_ranks == [1]
        assert "rank 1" in str(exc) and "did not report" in str(exc)
        assert results[rank]["elapsed"] < 6.0  # before the straggler even woke up
    # the straggler learns the verdict too, and nothing was committed
    assert isinstance(results[1]["error"], CheckpointTimeoutError)
    assert statuses(tmp_path)["step_000000001"] == "valid"
    assert statuses(tmp_path).get("step_000000002") != "valid"


def test_coordinator_killed_makes_others_time_out(tmp_path) -> None:
    faults = [Fault("closed", "*rank00000.distcp", "kill", ranks=(0,))]
    results = run_distributed(
        workers.save_good_then_faulty, 2, str(tmp_path), faults, 2.0, may_die={0}
    )
    exc = results[1]["error"]
    assert isinstance(exc, CheckpointTimeoutError) and exc.missing_ranks == [0]
    assert statuses(tmp_path)["step_000000001"] == "valid"


def test_commit_failure_is_reported_to_every_rank(tmp_path) -> None:
    faults = [Fault("write", "*manifest.json*", "EACCES", ranks=(0,), times=0)]
    results = run_distributed(workers.save_good_then_faulty, 2, str(tmp_path), faults)
    for r in results:
        exc = r["error"]
        assert isinstance(exc, CheckpointSaveError) and exc.phases == {"commit"}
        assert exc.failed_ranks == [0]
    assert statuses(tmp_path) == {"step_000000001": "valid"}
