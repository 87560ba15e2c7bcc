"""Resuming at another world size: data, metrics, optimizer partitions, global batch."""

import collections

import pytest
import torch

from lightning_elastic.testing.spawn import run_distributed
from tests.elastic import journal, workers

pytestmark = pytest.mark.timeout(400)
N = 120  # samples; batch 4 per rank


def test_chain_2_3_2_1_sees_every_sample_once_per_epoch(tmp_path) -> None:
    root = str(tmp_path)
    plan = [  # (world, kill at step): every rank dies there, after that step's checkpoint
        (2, 10),  # epoch 0 = 15 steps at 2 ranks; checkpoint at 8 (mid-epoch)
        (3, 18),  # resumes at 8; epoch 0 ends at 13; epoch 1 = 10 steps; checkpoint at 16
        (2, 34),  # resumes at 16; epoch 1 ends at 27; epoch 2 = 15 steps; checkpoint at 32
        (1, -1),  # resumes at 32; epoch 2 ends at 52
    ]
    for world, kill_at in plan:
        may_die = set(range(world)) if kill_at > 0 else set()
        results = run_distributed(workers.elastic_fit, world, root, 52, kill_at, may_die=may_die)
    assert all(r["global_step"] == 52 for r in results)
    assert results[0]["resumed_from"].endswith("step_000000032")
    records = journal.read(tmp_path / "journal")
    starts = sorted(
        {(r["world"], r["step"]) for r in records if r["kind"] == "start"}, key=lambda x: x[1]
    )
    assert starts == [(2, 0), (3, 8), (2, 16), (1, 32)]
    per_epoch = journal.samples_per_epoch(records, 52)
    assert sorted(per_epoch) == [0, 1, 2]
    for epoch, counts in per_epoch.items():
        assert counts == collections.Counter(range(N)), f"epoch {epoch} is not the dataset once"
    # the world-size change was noticed and logged
    assert any("written by a world of 2, in a world of 1" in m for m in results[0]["log"])


@pytest.mark.parametrize("worlds", [(2, 1), (1, 2)])
def test_epoch_metrics_survive_a_world_change(tmp_path, worlds) -> None:
    first, second = worlds
    steps_per_epoch = N // (4 * first)
    reference = run_distributed(workers.elastic_fit, first, str(tmp_path / "ref"), steps_per_epoch)
    # checkpoints every 2 steps; every rank dies at step `kill` (mid-epoch 0), after the
    # checkpoint of that step committed
    kill = steps_per_epoch // 2 + 1 if (steps_per_epoch // 2 + 1) % 2 == 0 else steps_per_epoch // 2
    root = str(tmp_path / "run")
    run_distributed(workers.elastic_fit, first, root, 100, kill, 2, may_die=set(range(first)))
    remaining = N - kill * 4 * first
    end_of_epoch = kill + -(-remaining // (4 * second))
    resumed = run_distributed(workers.elastic_fit, second, root, end_of_epoch)
    assert resumed[0]["resumed_from"].endswith(f"step_{kill:09d}")
    expected = reference[0]["epoch_metrics"][0]
    got = resumed[0]["epoch_metrics"][0]
    assert got["id_cat"] == list(range(N)) == expected["id_cat"]
    assert got["id_sum"] == expected["id_sum"] and got["id_max"] == expected["id_max"]
    assert got["y_mean"] == pytest.approx(expected["y_mean"], rel=1e-12)


@pytest.mark.parametrize(("saved", "loaded"), [(2, 1), (2, 2), (2, 3), (3, 2), (1, 3)])
def test_sharded_optimizer_state_reshards_bitwise(tmp_path, saved, loaded) -> None:
    root = str(tmp_path)
    before = run_distributed(workers.elastic_fit, saved, root, 6, every=6, shard=True)
    reference: dict[str, dict] = {}
    for r in before:
        assert not set(r["partition"]) & set(reference), "partitions overlap"
        reference.update(r["partition"])
    sizes = [sum(t.numel() for s in r["partition"].values() for t in s.values()) for r in before]
    assert max(sizes) <= sum(sizes) / saved * 1.5 + 200  # each rank holds ~1/N of the state
    after = run_distributed(workers.elastic_fit, loaded, root, 6, every=6, shard=True)
    restored: dict[str, dict] = {}
    for r in after:
        assert r["resumed_from"].endswith("step_000000006")
        assert r["sharded"] and r["lr"] == pytest.approx(0.01 * 0.7**2)  # StepLR(3, 0.7) kept
        restored.update(r["partition"])
    assert set(restored) == set(reference)
    for name, states in reference.items():
        for key, tensor in states.items():
            assert torch.equal(restored[name][key], tensor), (name, key)


@pytest.mark.parametrize(("shard_before", "shard_after"), [(False, True), (True, False)])
def test_replicated_and_sharded_states_convert(tmp_path, shard_before, shard_after) -> None:
    root = str(tmp_path)
    before = run_distributed(workers.elastic_fit, 2, root, 6, every=6, shard=shard_before)
    reference: dict[str, dict] = {}
    for r in before:
        reference.update(r["partition"])
    after = run_distributed(
        workers.elastic_fit, 2 if shard_after else 1, root, 6, every=6, shard=shard_after
    )
    restored: dict[str, dict] = {}
    for r in after:
        restored.update(r["partition"])
    for name, states in reference.items():
        for key, tensor in states.items():
            assert torch.equal(restored[name][key], tensor), (name, key)


@pytest.mark.parametrize("worlds", [(2, 1), (1, 2)])
def test_global_batch_size_keeps_the_trajectory(tmp_path, worlds) -> None:
    first, second = worlds
    kwargs = {"global_batch_size": 8, "dropout": 0.0, "every": 10}
    reference = run_distributed(workers.elastic_fit, first, str(tmp_path / "ref"), 20, **kwargs)
    root = str(tmp_path / "run")
    run_distributed(workers.elastic_fit, first, root, 10, **kwargs)
    resumed = run_distributed(workers.elastic_fit, second, root, 20, **kwargs)
    assert resumed[0]["resumed_from"].endswith("step_000000010")
    ref = dict(reference[0]["global_losses"] if first > 1 else reference[0]["losses"])
    got = dict(resumed[0]["global_losses"] if second > 1 else resumed[0]["losses"])
    assert sorted(got) == list(range(10, 20))
    for step, value in got.items():
        assert value == pytest.approx(ref[step], rel=1e-5), step
