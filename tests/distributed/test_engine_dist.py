"""CheckpointEngine across processes (gloo on CPU)."""

import pytest

from lightning_elastic.testing.spawn import run_distributed
from tests.distributed import workers

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def saved_on_two(tmp_path_factory) -> tuple[str, list]:
    root = str(tmp_path_factory.mktemp("two") / "ckpts")
    return root, run_distributed(workers.save_two_ranks, 2, root)


def test_save_on_two_ranks_dedups_replicated_tensors(saved_on_two) -> None:
    _, results = saved_on_two
    files = results[0]["files"]
    assert results[1]["files"] is None  # only rank 0 knows the manifest
    shards = {rank: size for _, size, rank in files if rank is not None}
    assert set(shards) == {0, 1}, "both ranks write a share of the replicated state"
    # balanced: neither rank writes more than ~3/4 of the tensor bytes
    total = sum(shards.values())
    assert max(shards.values()) < 0.75 * total
    assert results[0]["world_size"] == 2


@pytest.mark.parametrize("world", [1, 2, 3])
def test_load_at_any_world_size(saved_on_two, world) -> None:
    root, _ = saved_on_two
    results = run_distributed(workers.load_any_world, world, root)
    assert {r["name"] for r in results} == {"step_000000010"}
    assert all(r["saved_world"] == 2 for r in results)
    expected = [r if r < 2 else None for r in range(world)]  # ranks new in this world get None
    assert [r["rank_state"] for r in results] == expected


@pytest.mark.parametrize("failing_rank", [0, 1])
def test_a_load_failing_on_one_rank_fails_every_rank_naming_it(saved_on_two, failing_rank) -> None:
    root, _ = saved_on_two
    messages = run_distributed(workers.load_fails_on_one_rank, 2, root, failing_rank)
    assert messages[0] == messages[1]
    assert "0.weight" in messages[0]


def test_twenty_back_to_back_async_saves(tmp_path) -> None:
    results = run_distributed(workers.back_to_back, 2, str(tmp_path), 20, timeout=180)
    for steps, listed in results:
        assert steps == list(range(1, 21))
        assert listed == list(range(1, 21))


def test_skip_policy_is_agreed_by_all_ranks(tmp_path) -> None:
    results = run_distributed(workers.skip_when_busy, 2, str(tmp_path))
    assert results[0] == results[1] == [True, False, True, [1, 3]]


@pytest.mark.s3
def test_two_ranks_on_s3(s3_root, s3_server) -> None:
    options = s3_server.storage_options
    run_distributed(workers.save_two_ranks, 2, s3_root, options)
    results = run_distributed(workers.load_any_world, 3, s3_root, options)
    assert {r["name"] for r in results} == {"step_000000010"}


def test_plan_cache_misses_when_structure_changes(tmp_path) -> None:
    assert run_distributed(workers.plan_changes_on_one_rank, 2, str(tmp_path)) == [[3.0], [3.0]]


def test_resharded_load_reads_only_the_needed_rows(tmp_path) -> None:
    run_distributed(workers.save_big, 2, str(tmp_path))
    read = run_distributed(workers.load_big, 3, str(tmp_path), "size")
    total = workers.BIG_SHAPE[0] * workers.BIG_SHAPE[1] * 4
    assert sum(read) == total  # each row read once, by the rank that owns it now
    # verify="full" hashes each of the 2 shard files while loading, on one rank (its writer's
    # rank): that rank also reads the rows of its file another rank owns now, nothing more
    verified = run_distributed(workers.load_big, 3, str(tmp_path), "full")
    shards = sum(p.stat().st_size for p in tmp_path.glob("*/*.distcp"))
    assert shards >= total and total < sum(verified) <= total + shards - total // 3


def test_an_incremental_chain_saved_on_two_ranks_loads_resharded(tmp_path) -> None:
    root = str(tmp_path / "ckpts")
    refs = run_distributed(workers.save_incremental, 2, root, 3)
    # both ranks' unchanged shards are referred to: saves 2 and 3 read from save 1
    assert refs[0] == [[], ["step_000000001"], ["step_000000001"]]
    names = run_distributed(workers.load_incremental, 3, root, 3)  # 2 -> 3 ranks
    assert set(names) == {"step_000000003"}
    names = run_distributed(workers.load_incremental, 1, root, 3)  # 2 -> 1 rank
    assert set(names) == {"step_000000003"}
