"""Multi-tier checkpoints through the engine: local commits on every node, replicas on the
other node, persistence, and recovery from the fastest tier (2-3 ranks, gloo, several
"nodes" on one machine, each with its own local root)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from lightning_elastic.testing.spawn import run_distributed
from tests.distributed.tier_engine_workers import (
    files_read,
    gated_background,
    load_latest,
    load_sharded,
    load_spared,
    persist_fails,
    save_steps,
    sharded_steps,
    spare_cycle,
)

pytestmark = pytest.mark.timeout(180)
NODES = ["a", "b"]


def names(path: Path) -> list[str]:
    return (
        sorted(p.name for p in path.iterdir() if p.name.startswith("step_"))
        if path.exists()
        else []
    )


def files(path: Path) -> list[str]:
    return sorted(p.name for p in path.iterdir())


def test_every_node_commits_each_save_with_the_other_nodes_replicas_and_recovers_locally(
    tmp_path,
) -> None:
    out = run_distributed(
        save_steps, 2, str(tmp_path), NODES, [1, 2, 3, 4], persist_every_n_saves=3
    )
    assert [o["replica_failures"] for o in out] == [0, 0]
    persistent = tmp_path / "persistent"
    # saves 3 (the 3rd) and 4 (forced: the last) persisted; retention keeps 2 per node
    assert names(persistent) == ["step_000000003", "step_000000004"]
    for node in NODES:
        local = tmp_path / f"local_{node}"
        assert names(local) == ["step_000000003", "step_000000004"]
        held = files(local / "step_000000004")
        assert "manifest.json" in held and sum(f.endswith(".distcp") for f in held) == 2
        same = json.loads((local / "step_000000004/manifest.json").read_text())
        persisted = json.loads((persistent / "step_000000004/manifest.json").read_text())
        assert (same["sequence"], same["files"]) == (persisted["sequence"], persisted["files"])
    got = run_distributed(load_latest, 2, str(tmp_path), NODES)
    for rank, g in enumerate(got):
        assert g["step"] == 4 and g["w_ok"] and g["mine"] == 400 + rank
        assert g["rank_state"] == {"rank": rank, "step": 4}
        assert g["recovery"]["tier"] == "local"
        assert g["recovery"]["bytes"]["peer"] == g["recovery"]["bytes"]["persistent"] == 0


def test_a_save_blocks_for_its_staging_only_and_copies_on_the_tier_group(tmp_path) -> None:
    """The copies between nodes and the upload of a persisted save wait on a gate: the save
    call returns all the same, and its handle stays pending until the gate opens (the local
    write, the copies and the upload run in the background). What is saved is the state as
    it was at the call (staged), not as it was changed after it, on every tier. The copies
    run on the engine's own gloo group, never the default (training) group."""
    out = run_distributed(gated_background, 2, str(tmp_path), NODES)
    for o in out:
        assert o["done_at_return"] is False and o["done_while_gated"] is False, o
        assert o["gated"] == (True, True) or o["gated"] == (True, None), o
        assert o["tier_group"] and o["not_default"], o
    assert any(o["gated"][1] for o in out), "no rank uploaded"
    got = run_distributed(load_latest, 2, str(tmp_path), NODES)
    assert [(g["step"], g["w_ok"], g["mine"]) for g in got] == [(1, True, 100), (1, True, 101)]
    shutil.rmtree(tmp_path / "local_a")
    shutil.rmtree(tmp_path / "local_b")
    got = run_distributed(load_latest, 2, str(tmp_path), NODES)
    assert [g["recovery"]["tier"] for g in got] == ["persistent"] * 2
    assert [(g["step"], g["w_ok"], g["mine"]) for g in got] == [(1, True, 100), (1, True, 101)]


def test_a_fresh_node_recovers_from_the_replicas_and_both_lost_from_the_persistent_tier(
    tmp_path,
) -> None:
    run_distributed(save_steps, 2, str(tmp_path), NODES, [1, 2, 3], persist_every_n_saves=10)
    # only step 3 (the last) was persisted; now node b is a fresh node
    shutil.rmtree(tmp_path / "local_b")
    got = run_distributed(load_latest, 2, str(tmp_path), NODES)
    assert [g["recovery"]["tier"] for g in got] == ["local", "peer"]
    assert (
        got[1]["recovery"]["bytes"]["persistent"] == 0 and got[1]["recovery"]["bytes"]["peer"] > 0
    )
    assert [g["mine"] for g in got] == [300, 301]
    # both nodes lost: the persistent tier
    shutil.rmtree(tmp_path / "local_a")
    shutil.rmtree(tmp_path / "local_b")
    got = run_distributed(load_latest, 2, str(tmp_path), NODES)
    assert [g["recovery"]["tier"] for g in got] == ["persistent", "persistent"]
    assert [g["mine"] for g in got] == [300, 301] and all(g["w_ok"] for g in got)


def flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def test_a_corrupt_local_copy_is_deleted_and_fetched_from_the_peer(tmp_path) -> None:
    run_distributed(save_steps, 2, str(tmp_path), NODES, [1, 2, 3], persist_every_n_saves=10)
    shards = sorted((tmp_path / "local_a/step_000000003").glob("*.distcp"))
    flip_byte(shards[0])
    got = run_distributed(load_latest, 2, str(tmp_path), NODES)
    assert [g["step"] for g in got] == [3, 3] and [g["mine"] for g in got] == [300, 301]
    assert [g["recovery"]["tier"] for g in got] == ["peer", "local"]
    assert all(g["recovery"]["bytes"]["persistent"] == 0 for g in got)


def test_a_local_tier_older_than_the_persistent_one_loses_to_it(tmp_path) -> None:
    run_distributed(save_steps, 2, str(tmp_path), NODES, [1, 2])
    for node in NODES:
        shutil.copytree(tmp_path / f"local_{node}", tmp_path / f"old_{node}")
    run_distributed(save_steps, 2, str(tmp_path), NODES, [3, 4])
    for node in NODES:  # the node is reused after a long time: its old copies are back
        shutil.rmtree(tmp_path / f"local_{node}")
        shutil.move(tmp_path / f"old_{node}", tmp_path / f"local_{node}")
    got = run_distributed(load_latest, 2, str(tmp_path), NODES)
    assert [g["step"] for g in got] == [4, 4]
    assert [g["recovery"]["tier"] for g in got] == ["persistent", "persistent"]


def test_a_changed_world_size_recovers_from_the_nodes_that_hold_every_shard(tmp_path) -> None:
    run_distributed(save_steps, 2, str(tmp_path), NODES, [1, 2], per_rank=False)
    got = run_distributed(load_latest, 3, str(tmp_path), ["a", "a", "b"], per_rank=False)
    assert [g["step"] for g in got] == [2, 2, 2] and all(g["w_ok"] for g in got)
    assert [g["recovery"]["tier"] for g in got] == ["local"] * 3
    assert [g["rank_state"] for g in got][2] is None  # a new rank: no state of its own
    shutil.rmtree(tmp_path / "local_b")  # scale down to node a alone: it holds b's replicas
    got = run_distributed(load_latest, 1, str(tmp_path), ["a"], per_rank=False)
    assert got[0]["step"] == 2 and got[0]["recovery"]["tier"] == "local"


def test_without_replicas_a_lost_node_is_recovered_from_the_persistent_tier(tmp_path) -> None:
    run_distributed(save_steps, 2, str(tmp_path), NODES, [1, 2, 3], replicas=0)
    assert len(files(tmp_path / "local_a/step_000000003")) == 3  # manifest, DCP metadata, own
    shutil.rmtree(tmp_path / "local_b")
    got = run_distributed(load_latest, 2, str(tmp_path), NODES, replicas=0)
    assert [g["step"] for g in got] == [3, 3]
    # each node gets the files its ranks read: their own and rank 0's (the small replicated
    # rest). a has both; b gets rank 0's from a and only its own lost shard from the
    # persistent tier
    a, b = (g["recovery"]["bytes"] for g in got)
    assert [g["recovery"]["plan_tier"] for g in got] == ["persistent", "persistent"]
    assert [g["recovery"]["tier"] for g in got] == ["local", "persistent"]
    assert a["peer"] == a["persistent"] == 0 and b["local"] == 0
    assert b["peer"] == a["local"] and 0 < b["persistent"] < a["local"]


def test_a_failing_persistent_tier_never_stops_local_commits_and_wait_raises(tmp_path) -> None:
    out = run_distributed(persist_fails, 2, str(tmp_path), NODES)
    for o in out:
        assert o["wait_error"].startswith("CheckpointSaveError") and "rank(s) 1" in o["wait_error"]
        assert o["persist_failures"] >= 2  # each save retried the persist
    # nothing partial was published on the persistent tier; the local tier kept committing
    assert not list((tmp_path / "persistent").glob("step_*/manifest.json"))
    assert names(tmp_path / "local_a")[-1] == "step_000000003"


def test_restarts_more_often_than_the_persist_cadence_still_move_the_persistent_tier(
    tmp_path,
) -> None:
    every = {"persist_every_n_saves": 3, "persist_last": False, "settle": True}
    run_distributed(save_steps, 2, str(tmp_path), NODES, [1, 2], **every)
    assert names(tmp_path / "persistent") == []  # two saves of three: nothing persisted yet
    # a restart resumes from step 2, which only the nodes hold: its first save is persisted
    run_distributed(save_steps, 2, str(tmp_path), NODES, [3, 4], resume=True, **every)
    assert names(tmp_path / "persistent") == ["step_000000003"]
    # resumed from step 4 (not persisted either): step 5 is persisted, then every third
    run_distributed(save_steps, 2, str(tmp_path), NODES, [5, 6, 7, 8], resume=True, **every)
    assert names(tmp_path / "persistent") == ["step_000000003", "step_000000005", "step_000000008"]


def test_the_files_a_load_plans_to_read_are_the_files_it_reads(tmp_path) -> None:
    """Recovery gives each node only the files its ranks read, planned before the load: the
    plan must name every file the load then reads (a missing one fails the load). With a
    sharded state a rank reads its own file and rank 0's (small replicated items, objects
    and per-rank lists are written by the lowest rank, not spread over every file)."""
    got = run_distributed(
        files_read, 3, str(tmp_path), ["a", "b", "c"], ["same", "none", "partial"]
    )
    for rank, shapes in enumerate(got):
        for shape, files in shapes.items():
            assert files["planned"] == files["read"], (rank, shape, files)
        ranks = sorted(int(f[-11:-7]) for f in shapes["partial"]["read"] if f.endswith(".distcp"))
        assert ranks == sorted({0, rank}), shapes


def test_each_node_gets_only_the_files_its_ranks_read_and_the_replicas_it_holds(
    tmp_path,
) -> None:
    """Three nodes, one rank each, a sharded state, replicas on the next node of the ring
    (a's on b, b's on c, c's on a). Each rank reads its own file and rank 0's (the small
    replicated rest); a node also keeps the replicas a save places on it. So a restart moves
    only rank 0's file to c, and a replaced b gets its own shard and a's (both read, and its
    replica), not c's."""
    nodes = ["a", "b", "c"]
    run_distributed(sharded_steps, 3, str(tmp_path), nodes, [1, 2], persist_every_n_saves=10)
    ckpt = "step_000000002"
    manifest = json.loads((tmp_path / "local_a" / ckpt / "manifest.json").read_text())
    size = {f.get("rank"): f["size"] for f in manifest["files"]}
    got = run_distributed(load_sharded, 3, str(tmp_path), nodes)
    assert all(g["ok"] and g["step"] == 2 for g in got), got
    bytes_ = [g["recovery"]["bytes"] for g in got]
    # a holds its own and c's shards, b its own and a's: nothing moves; c lacks rank 0's
    assert [b["peer"] for b in bytes_] == [0, 0, size[0]]
    assert all(b["persistent"] == 0 for b in bytes_)
    shutil.rmtree(tmp_path / "local_b")
    got = run_distributed(load_sharded, 3, str(tmp_path), nodes)
    assert all(g["ok"] and g["step"] == 2 for g in got), got
    b = got[1]["recovery"]
    assert b["tier"] == "peer" and b["bytes"]["local"] == 0 and b["bytes"]["persistent"] == 0
    assert b["bytes"]["peer"] == size[0] + size[1] + size[None]  # not c's shard
    held = files(tmp_path / "local_b" / ckpt)
    assert sum(f.endswith(".distcp") for f in held) == 2 and "manifest.json" in held, held
    assert not any(f.endswith("rank00002.distcp") for f in held), held


def test_saves_overwrite_the_files_retention_deleted_and_every_kept_checkpoint_verifies(
    tmp_path,
) -> None:
    """A node's lead keeps the large files of the checkpoints its retention deletes (a 2 MiB
    shard per rank and its replica here) and the next saves write into them; never a file a
    kept checkpoint still names; close deletes them; what was written over them loads and
    verifies."""
    from lightning_elastic.cli import main as cli

    steps = [1, 2, 3, 4, 5, 6]
    out = run_distributed(spare_cycle, 2, str(tmp_path), NODES, steps)
    for o in out:
        for pool, held in zip(o["pool"], o["checkpoints"], strict=True):
            assert not set(pool) & set(held), "a spare is a file of a kept checkpoint"
        assert not o["pool"][0] and not o["pool"][1], "nothing deleted by the second save"
        assert o["pool"][2], "the third save's retention kept the first save's large files"
        spared = set().union(*map(set, o["pool"]))
        later = set().union(*map(set, o["checkpoints"][3:]))
        assert spared & later, "no save wrote into a spare"
        assert o["before_close"] > 0 and o["after_close"] == []
    for node in NODES:
        local = tmp_path / f"local_{node}"
        assert names(local) == ["step_000000005", "step_000000006"]
        for name in names(local):
            assert cli(["verify", str(local / name)]) == 0
        assert ".spares" not in json.dumps(cli_ls(local))
    got = run_distributed(load_spared, 2, str(tmp_path), NODES)
    assert [(g["step"], g["tier"], g["ok"]) for g in got] == [(6, "local", True)] * 2


def test_spares_a_killed_run_left_are_written_over_and_the_rest_deleted_after_a_save(
    tmp_path,
) -> None:
    """A killed run leaves its spare files (close never ran): the next run's first save
    writes into them, and its node's lead then deletes those beyond what a save writes on the
    node, so they no longer hold their memory for the whole run."""
    out = run_distributed(spare_cycle, 2, str(tmp_path), NODES, [1, 2, 3], leftover=4)
    for o in out:
        assert len(o["planted"]) == 4
        assert set(o["planted"]) & set(o["checkpoints"][0]), "the first save took no leftover"
        assert o["pool_bytes"][0] < 8 << 20, "leftovers beyond one save's bytes were kept"
        assert all(p <= s for p, s in zip(o["pool_bytes"], o["saved_bytes"], strict=True)), o
        assert o["after_close"] == []
    got = run_distributed(load_spared, 2, str(tmp_path), NODES)
    assert [(g["step"], g["tier"], g["ok"]) for g in got] == [(3, "local", True)] * 2


def cli_ls(local: Path) -> list[str]:
    import contextlib
    import io

    from lightning_elastic.cli import main as cli

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        cli(["ls", str(local)])
    return buf.getvalue().splitlines()
