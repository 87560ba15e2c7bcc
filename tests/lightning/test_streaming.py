"""Iterable data: ElasticShardedIterable resumed mid-epoch at the same and at other world sizes
(DataLoader workers included), every sample once per epoch; loaders that cannot resume."""

from __future__ import annotations

import collections

import pytest

from lightning_elastic.testing.spawn import run_distributed
from tests.elastic import journal
from tests.lightning import streaming_workers as w

pytestmark = pytest.mark.timeout(400)
N = sum(w.COUNTS)  # 64 samples in 10 shards of unequal length


def test_world_changes_mid_epoch_see_every_sample_once_per_epoch(tmp_path) -> None:
    root = str(tmp_path)
    w.write_shards(tmp_path / "shards")
    plan = [  # (world, DataLoader workers, kill at step): checkpoints every 3 steps
        (3, 2, 4),  # epoch 0: 6 batches at 3 ranks; resumes from step 3
        (2, 1, 11),  # the rest of epoch 0, then epoch 1 at 2 ranks; resumes from step 9
        (3, 0, -1),  # the rest of epoch 1, then epochs 2 and 3 whole at 3 ranks
    ]
    for world, workers, kill_at in plan:
        may_die = set(range(world)) if kill_at > 0 else set()
        results = run_distributed(
            w.fit, world, root, 25, kill_at=kill_at, workers=workers, may_die=may_die
        )
    assert all(r["global_step"] == 25 for r in results)
    assert results[0]["resumed_from"].endswith("step_000000009")
    records = journal.read(tmp_path / "journal")
    per_epoch = journal.samples_per_epoch(records, 25)
    assert sorted(per_epoch) == [0, 1, 2, 3]
    for epoch, counts in per_epoch.items():
        assert counts == collections.Counter(range(N)), f"epoch {epoch} is not the data once"


def test_global_batch_size_and_persistent_workers_across_a_change(tmp_path) -> None:
    # 12 samples per step at 2 and at 3 ranks (6 and 4 per rank); persistent workers keep
    # their copy of the dataset across epochs (set_epoch reaches the main process only)
    root = str(tmp_path)
    w.write_shards(tmp_path / "shards")
    kw = {"workers": 2, "persistent": True, "global_batch_size": 12}
    run_distributed(w.fit, 2, root, 100, kill_at=4, may_die={0, 1}, **kw)  # resumes from 3
    results = run_distributed(w.fit, 3, root, 18, **kw)  # the rest of epoch 0, then 2 epochs
    assert results[0]["resumed_from"].endswith("step_000000003")
    per_epoch = journal.samples_per_epoch(journal.read(tmp_path / "journal"), 18)
    assert sorted(per_epoch) == [0, 1, 2]
    for epoch, counts in per_epoch.items():
        assert counts == collections.Counter(range(N)), f"epoch {epoch} is not the data once"


def test_same_world_resume_is_exact_with_workers(tmp_path) -> None:
    for run in ("ref", "run"):
        w.write_shards(tmp_path / run / "shards")
    # persistent workers: one spawn per fit, not per epoch (workers that restart every epoch
    # are covered by the test above)
    kw = {"workers": 2, "persistent": True}
    reference = run_distributed(w.fit, 2, str(tmp_path / "ref"), 14, **kw)
    root = str(tmp_path / "run")
    run_distributed(w.fit, 2, root, 14, kill_at=7, may_die={0, 1}, **kw)
    resumed = run_distributed(w.fit, 2, root, 14, **kw)
    for rank in range(2):
        assert resumed[rank]["resumed_from"].endswith("step_000000006")
        assert resumed[rank]["seen"] == [s for s in reference[rank]["seen"] if s[0] >= 6]
        expected = dict(reference[rank]["losses"])
        assert all(expected[step] == loss for step, loss in resumed[rank]["losses"])


def test_a_loader_that_cannot_resume_warns_once_at_setup(tmp_path) -> None:
    (result,) = run_distributed(w.fit_plain, 1, str(tmp_path), 3)
    assert result["global_step"] == 5  # the second fit resumed and went on
    warnings = [m for m in result["log"] if "cannot resume within an epoch" in m]
    assert len(warnings) == 1, result["log"]
    assert "an IterableDataset, PlainStream" in warnings[0]
    assert (
        "state_dict()/load_state_dict()" in warnings[0] and "ElasticShardedIterable" in warnings[0]
    )
