"""Multi-tier checkpoints, third hostile review: recovery that gives each node only the
files its ranks read (core/tiers/restore.py), and what a partial node-local copy means for
the restarts after it. Three nodes a, b, c, one rank each, replicas on the next node of the
ring (a's on b, b's on c, c's on a)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from lightning_elastic.errors import CheckpointSaveError
from lightning_elastic.testing.spawn import run_distributed
from tests.distributed.tier_engine_workers import load_latest, load_sharded, sharded_steps
from tests.faults.tier_hostile3_workers import (
    load_nested,
    load_sharded_then_persist,
    load_with_extra_key,
    nested_steps,
    silent_after_local_commit,
)

pytestmark = [pytest.mark.timeout(240)]
NODES = ["a", "b", "c"]
CKPT = "step_000000002"


def held(path: Path) -> list[str]:
    return sorted(p.name for p in path.iterdir()) if path.exists() else []


def replaced_node_recovers(tmp_path: Path, node: str) -> None:
    """Steps 1, 2 saved (only step 1 persisted); ``node`` is replaced and recovers step 2."""
    run_distributed(sharded_steps, 3, str(tmp_path), NODES, [1, 2], persist_every_n_saves=10)
    assert not (tmp_path / "persistent" / CKPT / "manifest.json").exists()
    shutil.rmtree(tmp_path / f"local_{node}")
    got = run_distributed(load_sharded, 3, str(tmp_path), NODES)
    assert all(g["ok"] and g["step"] == 2 for g in got), got


def replaced_b_recovers_partially(tmp_path: Path) -> None:
    """Node b is replaced and recovers step 2 holding its own shard and rank 0's (which is
    also a's replica, held by b); c's shard it neither reads nor holds a replica of."""
    replaced_node_recovers(tmp_path, "b")
    shards = [f for f in held(tmp_path / "local_b" / CKPT) if f.endswith(".distcp")]
    assert len(shards) == 2 and not any(f.endswith("rank00002.distcp") for f in shards)


def test_a_second_node_loss_after_a_partial_recovery_still_recovers_the_newest(
    tmp_path: Path,
) -> None:
    """The replaced node c gets, besides what its rank reads, the replica of b's shard it held
    (a recovery leaves every shard on 1 + replicas nodes, as the save did). Found by the
    review when c fetched only what it read: b's shard then lived on b alone, and losing b
    next (no save in between) lost step 2 on every tier, the job going back to step 1."""
    replaced_node_recovers(tmp_path, "c")
    shutil.rmtree(tmp_path / "local_b")
    got = run_distributed(load_sharded, 3, str(tmp_path), NODES)
    assert all(g["ok"] for g in got), got
    assert [g["step"] for g in got] == [2, 2, 2], [g["recovery"] for g in got]


def test_persist_latest_right_after_a_partial_recovery(tmp_path: Path) -> None:
    """The recovered checkpoint (not persisted) is persisted straight away from the nodes'
    partial copies: each rank uploads saved rank r % world's file, which its node fetched."""
    replaced_b_recovers_partially(tmp_path)
    got = run_distributed(load_sharded_then_persist, 3, str(tmp_path), NODES)
    assert all("error" not in g and g["persisted"] and g["ok"] for g in got), got
    assert (tmp_path / "persistent" / CKPT / "manifest.json").exists()


def test_a_missing_key_after_a_partial_recovery_fails_with_the_normal_error(
    tmp_path: Path,
) -> None:
    """strict load of a key the checkpoint lacks: files_to_read cannot plan (None: every
    file); the load must fail with the missing-key error on every rank."""
    replaced_b_recovers_partially(tmp_path)
    got = run_distributed(load_with_extra_key, 3, str(tmp_path), NODES)
    assert all(g["error"] and "not_saved" in g["error"] for g in got), got


def test_a_nested_optimizer_like_state_recovers_on_a_fresh_node(tmp_path: Path) -> None:
    """Int keys, lists of dicts, empty tensors, objects, a replicated tensor above 1 MiB (DCP
    balances it onto some rank's file), per-rank tensors: the fresh node must get every file
    its rank reads."""
    run_distributed(nested_steps, 3, str(tmp_path), NODES, [1, 2], persist_every_n_saves=10)
    shutil.rmtree(tmp_path / "local_c")
    got = run_distributed(load_nested, 3, str(tmp_path), NODES)
    assert all(g["error"] is None and g["ok"] and g["step"] == 2 for g in got), got


@pytest.mark.timeout(120)
@pytest.mark.parametrize("b_copy", ["intact", "corrupt"])
def test_a_rank_0_silent_after_its_local_commit_is_reported_as_committed_and_recoverable(
    tmp_path, b_copy
) -> None:
    # two nodes; rank 0 dies after committing step 2 on node a, before rank 1 got the
    # manifest. Rank 1 must not say "not committed": the checkpoint is on node a, and the
    # next start recovers it (b gets its files from a's copy, checked against the manifest)
    nodes = ["a", "b"]
    got = run_distributed(silent_after_local_commit, 2, str(tmp_path), nodes, may_die={0})
    error = got[1]
    assert error["error"] == "ManifestNotReceivedError", error
    assert isinstance(error["is_save_error"], CheckpointSaveError)
    assert "was committed on rank 0's node" in error["message"]
    assert "not committed" not in error["message"]
    assert (tmp_path / "local_a" / CKPT / "manifest.json").exists()
    assert not (tmp_path / "local_b" / CKPT / "manifest.json").exists()
    if b_copy == "corrupt":  # b's shard of step 2 (the only copy) is checked like any copy
        (shard,) = (tmp_path / "local_b" / CKPT).glob("*rank00001.distcp")
        data = bytearray(shard.read_bytes())
        data[100] ^= 0xFF
        shard.write_bytes(bytes(data))
    loaded = run_distributed(load_latest, 2, str(tmp_path), nodes)
    step = 2 if b_copy == "intact" else 1
    assert [r["step"] for r in loaded] == [step, step]
    assert [r["mine"] for r in loaded] == [100.0 * step, 100.0 * step + 1]
    assert all(r["w_ok"] for r in loaded)
    if b_copy == "intact":
        assert loaded[1]["recovery"]["tier"] == "peer"
        assert (tmp_path / "local_b" / CKPT / "manifest.json").exists()  # b's copy committed
