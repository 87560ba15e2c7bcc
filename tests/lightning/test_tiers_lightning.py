"""DistributedCheckpoint with a node-local tier (TierOptions) on 2 CPU processes of one
node: saves commit locally, every k-th is persisted, a resume reads the fastest tier and is
bitwise the uninterrupted run. Several nodes: tests/elastic/test_tiers_torchrun.py."""

import shutil
from pathlib import Path

import pytest

from lightning_elastic import DistributedCheckpoint, TierOptions
from lightning_elastic.errors import ConfigError, ElasticDeprecationWarning
from lightning_elastic.testing.spawn import run_distributed
from tests.lightning import workers
from tests.lightning.test_lightning import MAX_STEPS, assert_same_tail

pytestmark = pytest.mark.timeout(300)


def steps(root: Path) -> list[int]:
    return sorted(int(p.parent.name.split("_")[1]) for p in root.glob("step_*/manifest.json"))


def test_a_killed_run_resumes_from_the_local_tier_then_from_the_persistent_one(tmp_path) -> None:
    tiers = {"tiers": TierOptions(str(tmp_path / "local"), persist_every_n_saves=2)}
    reference = run_distributed(workers.fit, 2, str(tmp_path / "ref"), MAX_STEPS)
    run = str(tmp_path / "run")
    run_distributed(workers.fit, 2, run, MAX_STEPS, 13, may_die={0, 1}, **tiers)
    # saves at 5 and 10 committed locally; the 2nd save (10) was persisted
    assert steps(tmp_path / "local") == [5, 10]
    assert steps(tmp_path / "run" / "ckpts") == [10]
    resumed = run_distributed(workers.fit, 2, run, MAX_STEPS, **tiers)
    for rank in range(2):
        rec = resumed[rank]["recovery"]
        assert rec["checkpoint"] == "step_000000010" and rec["tier"] == "local"
        assert rec["bytes"]["persistent"] == rec["bytes"]["peer"] == 0 < rec["bytes"]["local"]
        assert_same_tail(reference[rank], resumed[rank], 10)
    # the end of the fit is persisted (step 20), the local tier keeps 2 (+ the resumed one)
    assert steps(tmp_path / "run" / "ckpts") == [10, 20]
    assert steps(tmp_path / "local") == [10, 15, 20]
    # the node is lost: the persistent tier, from its newest (the end of the fit)
    shutil.rmtree(tmp_path / "local")
    again = run_distributed(workers.fit, 2, run, MAX_STEPS + 5, **tiers)
    assert [r["recovery"]["tier"] for r in again] == ["persistent", "persistent"]
    assert again[0]["recovery"]["checkpoint"] == "step_000000020"


def test_a_world_size_change_resumes_from_a_checkpoint_only_the_local_tier_holds(
    tmp_path,
) -> None:
    """2 processes saved steps 5 and 10 locally, none persisted yet, and were killed; the
    job comes back with 1 process. A world-size change folds every saved rank's metric
    state into rank 0, read where the checkpoint was recovered (the node-local root), not
    from dirpath, which does not hold it."""
    tiers = {"tiers": TierOptions(str(tmp_path / "local"), persist_every_n_saves=3)}
    run = str(tmp_path / "run")
    run_distributed(workers.fit, 2, run, MAX_STEPS, 13, may_die={0, 1}, **tiers)
    assert steps(tmp_path / "local") == [5, 10] and steps(tmp_path / "run" / "ckpts") == []
    (resumed,) = run_distributed(workers.fit, 1, run, MAX_STEPS, devices=1, **tiers)
    rec = resumed["recovery"]
    assert rec["checkpoint"] == "step_000000010" and rec["tier"] == "local"
    assert resumed["global_step"] == MAX_STEPS
    assert steps(tmp_path / "run" / "ckpts")[-1] == MAX_STEPS  # the end is persisted


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"local_dirpath": "/tmp/x", "replicas": -1}, r"replicas must be an integer in \[0,"),
        ({"local_dirpath": "/tmp/x", "persist_every_n_saves": 0}, "persist_every_n_saves"),
        ({"local_dirpath": "/tmp/x", "local_keep": 1.5}, "local_keep"),
        ({"local_dirpath": "/tmp/x", "node": "a/b"}, "node must be"),
        ({"local_dirpath": 3}, "local_dirpath must be a path"),
    ],
)
def test_tier_options_are_validated_at_construction(kwargs, match) -> None:
    with pytest.raises(ConfigError, match=match):
        TierOptions(**kwargs)


def test_the_old_flat_tier_options_still_work_and_still_need_local_dirpath() -> None:
    with pytest.warns(ElasticDeprecationWarning, match=r"use tiers=TierOptions\(") as warned:
        old = DistributedCheckpoint("/tmp/ckpts", local_dirpath="/tmp/x", local_keep=3)
    assert len(warned) == 2  # one per old spelling
    assert old.tiers == TierOptions("/tmp/x", local_keep=3)
    with (
        pytest.warns(ElasticDeprecationWarning, match=r"TierOptions\(replicas="),
        pytest.raises(ConfigError, match="replicas need local_dirpath"),
    ):
        DistributedCheckpoint("/tmp/ckpts", replicas=1)


def test_the_local_root_cannot_be_the_persistent_root(tmp_path) -> None:
    with pytest.raises(ConfigError, match="same"):
        workers.fit(
            str(tmp_path), 4, strategy="auto", devices=1, tiers=TierOptions(tmp_path / "ckpts")
        )
