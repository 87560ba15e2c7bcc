"""Save folders a node holds without a manifest: rank 0 went silent right after its local commit,
so its node has the manifest and the others only their shards. When recovery may count such a
copy (the listed path at the listed size, of the listed save), and the restarts after it (nodes
swapped, a stray file beside the shard, the manifest's node gone)."""

from __future__ import annotations

import shutil
from types import SimpleNamespace

import pytest

from lightning_elastic.core.format.catalog import VALID, Catalog
from lightning_elastic.core.format.manifest import MANIFEST_FILE
from lightning_elastic.core.storage.base import Storage
from lightning_elastic.core.tiers import candidates
from lightning_elastic.core.tiers.inventory import NodeScan
from lightning_elastic.core.tiers.layout import NodeLayout
from lightning_elastic.core.tiers.recovery import CheckpointCandidate
from lightning_elastic.errors import CheckpointSaveError
from lightning_elastic.testing.spawn import run_distributed
from tests.distributed.tier_engine_workers import load_latest
from tests.tiers.recovery_workers import (
    silent_after_local_commit,
)

CKPT = "step_000000002"
NAME = "step_000000002"
SAVE, OTHER = "0123456789abcdef", "fedcba9876543210"
META = f"{NAME}/{SAVE}-dcp_metadata.json"
R0, R1 = f"{NAME}/{SAVE}-rank00000.distcp", f"{NAME}/{SAVE}-rank00001.distcp"


def tiers_of(*nodes: str) -> SimpleNamespace:
    """What ``candidates.agree`` reads of a TierSet: rank ``r`` on ``nodes[r]``."""
    return SimpleNamespace(
        coordinator=SimpleNamespace(is_coordinator=False), layout=NodeLayout.of(list(nodes))
    )


def committed_on_a() -> NodeScan:
    """Node a committed NAME (rank 0's node): the manifest, the metadata and rank 0's shard."""
    files = {META: 10, R0: 100, R1: 100}
    cand = CheckpointCandidate(NAME, (1, 5, 5.0), files, persisted=False)
    return NodeScan({NAME: {META: 10, R0: 100}}, (cand,))


def plan_of(scan_b: NodeScan, excluded: set[str] | None = None) -> candidates.Choice:
    surveys = [candidates.Survey("a", committed_on_a()), candidates.Survey("b", scan_b)]
    return candidates.agree(tiers_of("a", "b"), surveys, set(excluded or ()))


@pytest.mark.timeout(240)
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


def test_an_uncommitted_copy_counts_only_for_the_listed_path_at_the_listed_size() -> None:
    # b wrote its shard of NAME but the commit never reached it; its folder also holds a
    # file of an older aborted save under the same name (another save id) and a copy of
    # rank 0's shard at a wrong size. Only the listed path at the listed size is held there
    scan_b = NodeScan(
        uncommitted={NAME: {R1: 100, f"{NAME}/{OTHER}-rank00001.distcp": 100, R0: 99}}
    )
    choice = plan_of(scan_b)
    assert choice.plan.checkpoint == NAME
    assert choice.held["b"][NAME] == {R1: 100}
    fetches = {(f.file, f.dst_rank, f.src_rank) for f in choice.plan.fetches}
    # b gets the metadata and rank 0's shard from a, a gets rank 1's shard from b
    assert fetches == {(META, 1, 0), (R0, 1, 0), (R1, 0, 1)}


def test_an_uncommitted_copy_of_the_wrong_size_or_another_save_is_not_held() -> None:
    # the shard b holds is of another save of the same name (a rollback's older branch, an
    # aborted save) or truncated: NAME is then incomplete on the nodes and is skipped
    for files in ({f"{NAME}/{OTHER}-rank00001.distcp": 100}, {R1: 99}):
        choice = plan_of(NodeScan(uncommitted={NAME: files}))
        assert choice.plan.checkpoint is None, files
        assert NAME in choice.plan.skipped
        assert choice.held["b"][NAME] == {}


def test_an_uncommitted_folder_no_manifest_names_or_an_excluded_one_is_never_held() -> None:
    # a folder without a manifest whose name no node's manifest has (another job's save that
    # never committed) is no candidate; nor is one recovery excluded (found corrupt)
    scan_b = NodeScan(uncommitted={"step_000000009": {"step_000000009/x-rank00001.distcp": 1}})
    choice = plan_of(scan_b)
    assert "step_000000009" not in choice.held["b"]
    choice = plan_of(NodeScan(uncommitted={NAME: {R1: 100}}), excluded={NAME})
    assert choice.plan.checkpoint is None and NAME not in choice.held["b"]


@pytest.mark.timeout(120)
def test_a_silent_commit_recovers_with_the_nodes_swapped_and_a_stray_beside_the_shard(
    tmp_path,
) -> None:
    # after the rank-0-silent save of step 2 (a: manifest + rank 0's shard, b: rank 1's
    # shard only), b's folder also holds a file of an aborted save of that name. The job
    # restarts with the ranks swapped (rank 0 on b): b's shard is rank 1's, still counted,
    # rank 0's comes from a; each rank gets its own saved state; b's copy is committed
    # with the stray left aside
    nodes = ["a", "b"]
    run_distributed(silent_after_local_commit, 2, str(tmp_path), nodes, may_die={0})
    b = tmp_path / "local_b" / NAME
    assert not (b / MANIFEST_FILE).exists()
    (shard,) = b.glob("*rank00001.distcp")
    stray = b / f"{OTHER}-rank00001.distcp"
    stray.write_bytes(shard.read_bytes()[:-1] + b"x")
    loaded = run_distributed(load_latest, 2, str(tmp_path), ["b", "a"])
    assert [r["step"] for r in loaded] == [2, 2], loaded
    assert [r["mine"] for r in loaded] == [200.0, 201.0]
    assert all(r["w_ok"] for r in loaded)
    info = Catalog(Storage(tmp_path / "local_b")).info(NAME)
    assert info.status == VALID and info.manifest is not None
    assert all((b / f.path).exists() for f in info.manifest.files if f.rank in (None, 0, 1))


@pytest.mark.timeout(120)
def test_a_silent_commit_whose_manifest_node_is_gone_falls_back_a_save(tmp_path) -> None:
    # regression guard: node a (the only manifest of step 2) is replaced by a fresh node c;
    # b's shard of step 2 has no manifest anywhere: never adopted, the job recovers step 1
    nodes = ["a", "b"]
    run_distributed(silent_after_local_commit, 2, str(tmp_path), nodes, may_die={0})
    shutil.rmtree(tmp_path / "local_a")
    loaded = run_distributed(load_latest, 2, str(tmp_path), ["c", "b"])
    assert [r["step"] for r in loaded] == [1, 1], loaded
    assert [r["mine"] for r in loaded] == [100.0, 101.0]
    assert not (tmp_path / "local_b" / NAME / MANIFEST_FILE).exists()
