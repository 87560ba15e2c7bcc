"""Scanning node-local roots into the inputs of ``plan_recovery``.

Real checkpoints are saved by one process (one shard and the DCP metadata file per save), then
split across two "nodes": node A holds the shard, node B the DCP metadata, both the manifest.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
from pathlib import Path

import pytest
import torch

from lightning_elastic.core.engine import CheckpointEngine
from lightning_elastic.core.format.catalog import Catalog
from lightning_elastic.core.format.manifest import MANIFEST_FILE, SHARD_SUFFIX, Manifest
from lightning_elastic.core.storage.base import Storage
from lightning_elastic.core.tiers import inventory
from lightning_elastic.core.tiers.inventory import (
    NodeScan,
    candidate_conflicts,
    holdings,
    merge_candidates,
    scan_node,
)
from lightning_elastic.core.tiers.recovery import Fetch, plan_recovery

OLD, NEW = "step_000000001", "step_000000002"


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A root with two committed checkpoints (steps 1 and 2)."""
    root = tmp_path_factory.mktemp("source")
    model = torch.nn.Linear(16, 16)
    with CheckpointEngine(root, async_save=False) as eng:
        for step in (1, 2):
            eng.save({"model": model.state_dict(), "step": step}, step=step)
    return root


def is_shard(name: str) -> bool:
    return name.endswith(SHARD_SUFFIX)


def split(source: Path, tmp_path: Path) -> tuple[Path, Path]:
    """Node A gets each checkpoint's shard and manifest, node B its other files and manifest."""
    a, b = tmp_path / "node_a", tmp_path / "node_b"
    for ckpt in (OLD, NEW):
        for f in (source / ckpt).iterdir():
            for node, wanted in ((a, is_shard(f.name)), (b, not is_shard(f.name))):
                if wanted or f.name == MANIFEST_FILE:
                    (node / ckpt).mkdir(parents=True, exist_ok=True)
                    shutil.copy2(f, node / ckpt / f.name)
    return a, b


def scan(root: Path) -> NodeScan:
    return scan_node(Storage(root))


def manifest_files(source: Path, ckpt: str) -> dict[str, int]:
    """Every file of ``ckpt`` by path relative to the root, as ``Transfer.path`` takes it."""
    m = Manifest.from_json((source / ckpt / MANIFEST_FILE).read_bytes(), "test")
    return {f"{ckpt}/{f.path}": f.size for f in m.files}


def tree(root: Path) -> list[tuple[str, int]]:
    return sorted((str(p.relative_to(root)), p.lstat().st_size) for p in root.rglob("*"))


def test_two_nodes_holding_halves_recover_the_newest_from_each_other(source, tmp_path):
    a, b = split(source, tmp_path)
    scan_a, scan_b = scan(a), scan(b)
    new_files = manifest_files(source, NEW)
    shard = next(p for p in new_files if is_shard(p))
    assert scan_a.checkpoints[NEW] == {shard: new_files[shard]}
    assert scan_b.checkpoints[NEW] == {p: s for p, s in new_files.items() if p != shard}

    candidates = merge_candidates([scan_a, scan_b])
    assert [c.name for c in candidates] == [OLD, NEW]
    catalog = Catalog(Storage(source))
    for c in candidates:
        assert c.order == catalog.info(c.name).sort_key()
        assert dict(c.files) == manifest_files(source, c.name) and not c.persisted

    nodes = [holdings(scan_a, node="a", ranks=[0]), holdings(scan_b, node="b", ranks=[1])]
    plan = plan_recovery(candidates, nodes, persistent_newest=None)
    assert plan.checkpoint == NEW and plan.tier == "peer" and plan.skipped == {}
    expected = {
        Fetch(p, s, 1 if p == shard else 0, 0 if p == shard else 1) for p, s in new_files.items()
    }
    assert set(plan.fetches) == expected
    assert plan.bytes_by_source()["persistent"] == 0


def test_a_node_with_only_the_manifest_is_not_corrupt_and_holds_nothing(source, tmp_path):
    root = tmp_path / "node"
    (root / NEW).mkdir(parents=True)
    shutil.copy2(source / NEW / MANIFEST_FILE, root / NEW / MANIFEST_FILE)
    before = tree(root)
    result = scan(root)
    assert result.checkpoints == {NEW: {}}
    assert [c.name for c in result.candidates] == [NEW]
    assert tree(root) == before  # nothing quarantined, written or deleted


def test_a_truncated_file_is_not_held_so_the_older_checkpoint_is_recovered(source, tmp_path):
    a, b = split(source, tmp_path)
    shard = next(p for p in (a / NEW).iterdir() if is_shard(p.name))
    shard.write_bytes(shard.read_bytes()[:-1])
    scan_a, scan_b = scan(a), scan(b)
    assert not any(is_shard(p) for p in scan_a.checkpoints[NEW])
    nodes = [holdings(scan_a, node="a", ranks=[0]), holdings(scan_b, node="b", ranks=[1])]
    plan = plan_recovery(merge_candidates([scan_a, scan_b]), nodes, persistent_newest=None)
    assert plan.checkpoint == OLD and plan.tier == "peer"
    assert "held by no node" in plan.skipped[NEW]


def test_quarantined_incomplete_and_unparseable_checkpoints_are_ignored(source, tmp_path):
    root = tmp_path / "node"
    for name in ("step_000000005", "step_000000006", "step_000000007", NEW):
        shutil.copytree(source / NEW, root / name)
    Catalog(Storage(root)).quarantine("step_000000005", "x.distcp", "checksum mismatch")
    os.remove(root / "step_000000006" / MANIFEST_FILE)
    (root / "step_000000007" / MANIFEST_FILE).write_text('{"format": "lightning_elastic", ')
    before = tree(root)
    result = scan(root)
    assert list(result.checkpoints) == [NEW]
    assert [c.name for c in result.candidates] == [NEW]
    assert tree(root) == before


def test_a_manifest_over_the_size_limit_is_not_read(source, tmp_path, monkeypatch):
    root = tmp_path / "node"
    shutil.copytree(source / NEW, root / NEW)
    monkeypatch.setattr(inventory, "MAX_MANIFEST_BYTES", 100)
    assert scan(root) == NodeScan()


def test_symbolic_links_are_not_followed(source, tmp_path):
    root = tmp_path / "node"
    shutil.copytree(source / NEW, root / NEW)
    shard = next(p for p in (root / NEW).iterdir() if is_shard(p.name))
    shard.unlink()
    shard.symlink_to(source / NEW / shard.name)  # same size, but a link
    (root / OLD).symlink_to(source / OLD, target_is_directory=True)
    linked = root / "step_000000009"
    shutil.copytree(source / NEW, linked)
    (linked / MANIFEST_FILE).unlink()
    (linked / MANIFEST_FILE).symlink_to(source / NEW / MANIFEST_FILE)
    result = scan(root)
    assert list(result.checkpoints) == [NEW]
    assert not any(is_shard(p) for p in result.checkpoints[NEW])
    assert len(result.checkpoints[NEW]) == len(manifest_files(source, NEW)) - 1


def rewrite_manifest(path: Path, **changes: object) -> None:
    m = Manifest.from_json(path.read_bytes(), str(path))
    path.write_text(dataclasses.replace(m, **changes).to_json())


@pytest.mark.parametrize("what", ["order", "files"])
def test_nodes_disagreeing_on_a_manifest_drop_that_checkpoint_only(source, tmp_path, what, caplog):
    a, b = split(source, tmp_path)
    manifest = b / NEW / MANIFEST_FILE
    m = Manifest.from_json(manifest.read_bytes(), "test")
    if what == "order":
        rewrite_manifest(manifest, sequence=m.sequence + 10)
    else:
        first = dataclasses.replace(m.files[0], size=m.files[0].size + 1)
        rewrite_manifest(manifest, files=(first, *m.files[1:]))
    scans = [scan(a), scan(b)]
    assert [c.name for c in scans[1].candidates] == [OLD, NEW]  # valid on its own
    with caplog.at_level(logging.WARNING, logger=inventory.__name__):
        candidates = merge_candidates(scans)
    assert [c.name for c in candidates] == [OLD]
    reason = candidate_conflicts(scans)[NEW]
    assert "scans 0 and 1 disagree" in reason
    named = candidate_conflicts(scans, labels=[str(a), str(b)])[NEW]
    assert named == reason.replace("scans 0 and 1", f"{a} and {b}")
    assert ("commit order" in reason) == (what == "order")
    assert NEW in caplog.text and reason in caplog.text
    nodes = [holdings(scans[0], node="a", ranks=[0]), holdings(scans[1], node="b", ranks=[1])]
    assert plan_recovery(candidates, nodes, persistent_newest=None).checkpoint == OLD


def test_the_same_checkpoint_on_many_nodes_is_one_candidate(source, tmp_path):
    a, b = split(source, tmp_path)
    scans = [scan(a), scan(b), scan(a)]
    assert candidate_conflicts(scans) == {}
    assert merge_candidates(scans) == scans[0].candidates


def test_an_empty_or_missing_root_is_an_empty_scan(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "logs").mkdir()
    (tmp_path / "other" / "logs" / "train.log").write_text("x")
    for root in ("empty", "missing", "other"):
        assert scan(tmp_path / root) == NodeScan()
    assert merge_candidates([]) == () and merge_candidates([NodeScan()]) == ()


def test_a_checkpoint_without_its_manifest_lists_the_save_files_it_holds(source, tmp_path):
    # rank 0 committed NEW on its node, then went silent: node B wrote its shard but never
    # got the manifest. Its files are listed apart (not a candidate); a temporary file of an
    # unfinished write, a stray file and a folder of something else are not
    _, b = split(source, tmp_path)
    (b / NEW / MANIFEST_FILE).unlink()
    shard = next(f.name for f in (source / NEW).iterdir() if is_shard(f.name))
    shutil.copy2(source / NEW / shard, b / NEW / shard)
    (b / NEW / f"{shard}.tmp-0123456789ab").write_bytes(b"partial")
    (b / NEW / "notes.txt").write_text("x")
    (b / "logs").mkdir()
    (b / "logs" / "train.log").write_text("x")
    found = scan(b)
    assert [c.name for c in found.candidates] == [OLD]
    files = {f.name: f.stat().st_size for f in (source / NEW).iterdir() if f.name != MANIFEST_FILE}
    assert found.uncommitted == {NEW: {f"{NEW}/{n}": size for n, size in files.items()}}
    assert NEW not in found.checkpoints


def test_a_node_is_the_host_name_unless_the_node_variable_names_it(tmp_path, monkeypatch) -> None:
    """Without ``node=`` an engine's node is ``$LIGHTNING_ELASTIC_NODE``, else the host name
    (what real nodes rely on: no variable to set per host)."""
    import socket

    from lightning_elastic.core.tiers.layout import NODE_ENV

    def node_of() -> str:
        with CheckpointEngine(tmp_path / "persistent", local_root=tmp_path / "local") as eng:
            tiers = eng._placement.tiers  # type: ignore[attr-defined]
            return tiers.node

    monkeypatch.delenv(NODE_ENV, raising=False)
    monkeypatch.setattr(socket, "gethostname", lambda: "host-7.cluster")
    assert node_of() == "host-7.cluster"
    monkeypatch.setenv(NODE_ENV, "rack2-node3")
    assert node_of() == "rack2-node3"
    monkeypatch.setenv(NODE_ENV, "")  # set but empty: the host name
    assert node_of() == "host-7.cluster"
