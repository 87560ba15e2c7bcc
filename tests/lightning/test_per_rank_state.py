"""State that differs per rank inside Lightning's checkpoint dict (a callback's counter,
torchdata's StatefulDataLoader over a shard per rank): SIGKILL mid-epoch and resume, on 2 CPU
processes; and what a world-size change does with it."""

import collections
import shutil

import pytest

from lightning_elastic.errors import PerRankStateError
from lightning_elastic.testing.spawn import run_distributed
from tests.lightning import per_rank_workers

pytestmark = pytest.mark.timeout(300)

MAX_STEPS = 20  # 64 samples, 2 ranks x batch 4: 8 steps per epoch; the kill at 13 resumes
KILL_AT = 13  # from the save at step 10 (mid-epoch 1) and runs into epoch 2


def killed_and_resumed(root: str, **kwargs) -> list[dict]:
    run_distributed(per_rank_workers.fit, 2, root, MAX_STEPS, KILL_AT, may_die={0, 1}, **kwargs)
    return run_distributed(per_rank_workers.fit, 2, root, MAX_STEPS, **kwargs)


def assert_continues_exactly(reference: dict, resumed: dict) -> None:
    assert resumed["resumed_from"].endswith("step_000000010")
    expected_seen = [s for s in reference["seen"] if s[0] >= 10]
    assert resumed["seen"] == expected_seen, "batches replayed or skipped after the resume"
    ref = dict(reference["losses"])
    mismatched = [(s, ref[s], loss) for s, loss in resumed["losses"] if ref[s] != loss]
    assert not mismatched, f"losses differ after resume: {mismatched[:3]}"
    assert resumed["tally"] == reference["tally"]


def test_a_callback_state_that_differs_per_rank_resumes_on_every_rank(tmp_path) -> None:
    reference = run_distributed(per_rank_workers.fit, 2, str(tmp_path / "ref"), MAX_STEPS)
    resumed = killed_and_resumed(str(tmp_path / "run"))
    for rank in range(2):
        # each rank got its own saved state back, not another rank's
        assert resumed[rank]["loaded"]["rank"] == rank
        assert resumed[rank]["loaded"]["batches"] == 10
        assert_continues_exactly(reference[rank], resumed[rank])
    assert reference[0]["tally"]["id_sum"] != reference[1]["tally"]["id_sum"]


@pytest.mark.parametrize("workers", [0, 2])
def test_a_stateful_dataloader_per_rank_resumes_every_rank_exactly(tmp_path, workers) -> None:
    pytest.importorskip("torchdata")
    reference = run_distributed(
        per_rank_workers.fit, 2, str(tmp_path / "ref"), MAX_STEPS, loader=True, workers=workers
    )
    resumed = killed_and_resumed(str(tmp_path / "run"), loader=True, workers=workers)
    for rank in range(2):
        assert resumed[rank]["loaded"]["rank"] == rank
        assert_continues_exactly(reference[rank], resumed[rank])
        # every sample of the rank's shard exactly once per whole epoch (0 and 1)
        per_epoch = collections.defaultdict(collections.Counter)
        steps = dict(((s, e), ids) for s, e, ids in reference[rank]["seen"] if s < 10)
        steps.update(((s, e), ids) for s, e, ids in resumed[rank]["seen"])
        for (_, epoch), ids in steps.items():
            per_epoch[epoch].update(ids)
        shard = collections.Counter(range(rank, 64, 2))
        assert per_epoch[0] == shard and per_epoch[1] == shard


def test_a_replaced_node_gives_each_rank_its_own_per_rank_state_from_the_replicas(
    tmp_path,
) -> None:
    # multi-tier, each rank its own node: saves at 5 and 10 are local only (every 3rd is
    # persisted); node b comes back empty, and its rank's tally and loader position (saved
    # per rank, in its own shard) come from the replica on node a, not from rank 0's state
    pytest.importorskip("torchdata")
    kw = {"loader": True, "nodes": True}
    reference = run_distributed(per_rank_workers.fit, 2, str(tmp_path / "ref"), MAX_STEPS, **kw)
    root = tmp_path / "run"
    run_distributed(per_rank_workers.fit, 2, str(root), MAX_STEPS, KILL_AT, may_die={0, 1}, **kw)
    assert not list((root / "ckpts").glob("step_*/manifest.json"))
    shutil.rmtree(root / "local" / "b")
    resumed = run_distributed(per_rank_workers.fit, 2, str(root), MAX_STEPS, **kw)
    assert [r["recovery"]["tier"] for r in resumed] == ["local", "peer"]
    for rank in range(2):
        assert resumed[rank]["loaded"]["rank"] == rank
        assert_continues_exactly(reference[rank], resumed[rank])


def test_a_world_size_change_refuses_a_per_rank_callback_state(tmp_path) -> None:
    root = str(tmp_path)
    run_distributed(per_rank_workers.fit, 2, root, MAX_STEPS, KILL_AT, may_die={0, 1})
    (result,) = run_distributed(per_rank_workers.fit, 1, root, MAX_STEPS)
    error = result["error"]
    assert isinstance(error, PerRankStateError)
    assert error.paths == (
        "['callbacks']['RankTally']['id_sum']",
        "['callbacks']['RankTally']['rank']",
    )
    message = str(error)
    assert "Resume with 2 processes" in message
    assert "per_rank_state_on_resize = 'rank0'" in message


def test_a_world_size_change_restarts_per_rank_loaders_loudly(tmp_path) -> None:
    pytest.importorskip("torchdata")
    root = str(tmp_path)
    kwargs = {"loader": True, "tally": "fresh"}
    run_distributed(per_rank_workers.fit, 2, root, 24, KILL_AT, may_die={0, 1}, **kwargs)
    (result,) = run_distributed(per_rank_workers.fit, 1, root, 24, **kwargs)
    assert result["resumed_from"].endswith("step_000000010") and result["global_step"] == 24
    assert result["loaded"] is None  # the declared callback kept its initial state
    assert result["tally"]["batches"] == 14
    loader_lines = [m for m in result["log"] if "['combined_loader']" in m]
    assert len(loader_lines) == 1
    assert "restart from their initial state" in loader_lines[0]
    assert "Resume with the saved number of processes" in loader_lines[0]
    # the new loader is the one-rank loader from its start: its first batches, in its order
    fresh = run_distributed(per_rank_workers.fit, 1, str(tmp_path / "fresh"), 14, **kwargs)
    assert [ids for _, _, ids in result["seen"]] == [ids for _, _, ids in fresh[0]["seen"]]
