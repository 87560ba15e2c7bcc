"""Recovery that gives each node only the files its ranks read (core/tiers/restore.py), and what a
partial node-local copy means for the restarts after it: a second node loss, ``persist_latest``
right after, a missing key, nested optimizer-like state, a changed world size (where no node holds
a shard, and every sample once per epoch through Lightning). Unless said otherwise three nodes
a, b, c, one rank each, replicas on the next node of the ring (a's on b, b's on c, c's on a)."""

from __future__ import annotations

import shutil
from collections import Counter
from pathlib import Path

import pytest

from lightning_elastic.testing.spawn import run_distributed
from tests.distributed.tier_engine_workers import (
    load_latest,
    load_sharded,
    save_steps,
    sharded_steps,
)
from tests.tiers import lightning_workers as w
from tests.tiers.recovery_workers import (
    load_nested,
    load_sharded_then_persist,
    load_with_extra_key,
    nested_steps,
)

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


def local(root: Path, node: str) -> Path:
    return root / "local" / node


def _epochs(runs: list[tuple[list[dict], int, int]]) -> dict[int, Counter]:
    """Sample ids per epoch over the kept part of each run: steps in [start, end)."""
    seen: dict[int, Counter] = {}
    for results, start, end in runs:
        for r in results:
            for step, epoch, ids in r["seen"]:
                if start <= step < end:
                    seen.setdefault(epoch, Counter()).update(ids)
    return seen


@pytest.mark.timeout(240)
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


@pytest.mark.timeout(240)
def test_persist_latest_right_after_a_partial_recovery(tmp_path: Path) -> None:
    """The recovered checkpoint (not persisted) is persisted straight away from the nodes'
    partial copies: each rank uploads saved rank r % world's file, which its node fetched."""
    replaced_b_recovers_partially(tmp_path)
    got = run_distributed(load_sharded_then_persist, 3, str(tmp_path), NODES)
    assert all("error" not in g and g["persisted"] and g["ok"] for g in got), got
    assert (tmp_path / "persistent" / CKPT / "manifest.json").exists()


@pytest.mark.timeout(240)
def test_a_missing_key_after_a_partial_recovery_fails_with_the_normal_error(
    tmp_path: Path,
) -> None:
    """strict load of a key the checkpoint lacks: files_to_read cannot plan (None: every
    file); the load must fail with the missing-key error on every rank."""
    replaced_b_recovers_partially(tmp_path)
    got = run_distributed(load_with_extra_key, 3, str(tmp_path), NODES)
    assert all(g["error"] and "not_saved" in g["error"] for g in got), got


@pytest.mark.timeout(240)
def test_a_nested_optimizer_like_state_recovers_on_a_fresh_node(tmp_path: Path) -> None:
    """Int keys, lists of dicts, empty tensors, objects, a replicated tensor above 1 MiB (DCP
    balances it onto some rank's file), per-rank tensors: the fresh node must get every file
    its rank reads."""
    run_distributed(nested_steps, 3, str(tmp_path), NODES, [1, 2], persist_every_n_saves=10)
    shutil.rmtree(tmp_path / "local_c")
    got = run_distributed(load_nested, 3, str(tmp_path), NODES)
    assert all(g["error"] is None and g["ok"] and g["step"] == 2 for g in got), got


@pytest.mark.timeout(180)
def test_a_changed_world_size_with_a_shard_on_no_node_reads_it_from_the_persistent_tier(
    tmp_path,
) -> None:
    """Issue 11 (2): a changed world size recovers from the persistent tier where no node
    holds every shard. Without replicas node b's shard was on b alone, and b is gone: 3 ranks
    on a, a and a fresh b read b's old shard from the persistent tier; then 1 rank on node a
    alone (b's copy may now be on b only) recovers the same step."""
    run_distributed(save_steps, 2, str(tmp_path), ["a", "b"], [1, 2, 3], per_rank=False, replicas=0)
    shutil.rmtree(tmp_path / "local_b")
    got = run_distributed(
        load_latest, 3, str(tmp_path), ["a", "a", "b"], per_rank=False, replicas=0
    )
    assert [(g["step"], g["w_ok"]) for g in got] == [(3, True)] * 3, got
    assert {g["recovery"]["plan_tier"] for g in got} == {"persistent"}, got
    assert sum(g["recovery"]["bytes"]["persistent"] for g in got) > 0, got
    shutil.rmtree(tmp_path / "local_b")
    (one,) = run_distributed(load_latest, 1, str(tmp_path), ["a"], per_rank=False, replicas=0)
    assert one["step"] == 3 and one["w_ok"], one


@pytest.mark.timeout(120)
@pytest.mark.timeout(180)
def test_world_size_changes_after_a_partial_recovery_skip_and_repeat_nothing(tmp_path) -> None:
    """As above, but every leg ends normally at a max_steps (persisted, the local tiers keep
    theirs) so each leg's samples come back: 2 nodes to step 10; b wiped, 2 nodes to 12
    (b recovers from a's replica); node a alone to 22 (mid epoch 2); then a and b to 37
    (b's root has old copies only). Epochs 0-3 each see the 64 samples exactly once."""
    root = str(tmp_path)
    tiers = {"persist_every_n_saves": 100, "every": 2}
    legs = []
    first = run_distributed(w.fit, 2, root, 10, **tiers)
    legs.append((first, 0, 10))
    shutil.rmtree(local(tmp_path, "b"))
    second = run_distributed(w.fit, 2, root, 12, **tiers)
    assert [r["recovery"]["tier"] for r in second] == ["local", "peer"]
    assert [r["first_step"] for r in second] == [10, 10]
    legs.append((second, 10, 12))
    third = run_distributed(w.fit, 1, root, 22, **tiers)
    assert third[0]["first_step"] == 12 and third[0]["recovery"]["tier"] == "local"
    legs.append((third, 12, 22))
    fourth = run_distributed(w.fit, 2, root, 37, **tiers)
    assert [r["first_step"] for r in fourth] == [22, 22]
    assert fourth[0]["recovery"]["checkpoint"].startswith("step_000000022")
    legs.append((fourth, 22, 37))
    seen = _epochs(legs)
    assert sorted(seen) == [0, 1, 2, 3]
    for epoch, counts in seen.items():
        dupes = {i: c for i, c in counts.items() if c != 1}
        missing = set(range(64)) - set(counts)
        assert not dupes and not missing, (epoch, dupes, missing)
