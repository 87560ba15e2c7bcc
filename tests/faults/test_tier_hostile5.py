"""Fifth hostile review of multi-tier checkpoints: the save folders a node holds without a
manifest (rank 0 went silent right after its local commit) and when recovery may count them,
``ckpt_path`` under a multi-tier ``dirpath`` (resume.py ``_tiered_engine``), node ids and an
unusable local root.

Unit-level where possible (hand-made scans, one-process engines); the multi-process tests use
two or three "nodes" on this machine (``<root>/local_<node>``)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from lightning_elastic.core.engine import CheckpointEngine
from lightning_elastic.core.format.catalog import VALID, Catalog
from lightning_elastic.core.format.manifest import MANIFEST_FILE, SHARD_SUFFIX
from lightning_elastic.core.options import check_node_id
from lightning_elastic.core.storage.base import Storage
from lightning_elastic.core.tiers import candidates
from lightning_elastic.core.tiers.inventory import NodeScan, scan_node
from lightning_elastic.core.tiers.layout import NodeLayout
from lightning_elastic.core.tiers.recovery import CheckpointCandidate
from lightning_elastic.errors import CheckpointNotFoundError, ConfigError
from lightning_elastic.lightning.resume import _tiered_engine
from lightning_elastic.testing.spawn import run_distributed
from tests.cli.test_cli import run
from tests.distributed.tier_engine_workers import load_latest
from tests.faults.tier_hostile3_workers import silent_after_local_commit
from tests.faults.tier_hostile5_workers import bad_node_id_on_one_rank

NAME = "step_000000002"
SAVE, OTHER = "0123456789abcdef", "fedcba9876543210"  # save ids (16 hex digits)
META = f"{NAME}/{SAVE}-dcp_metadata.json"
R0, R1 = f"{NAME}/{SAVE}-rank00000.distcp", f"{NAME}/{SAVE}-rank00001.distcp"


# ----------------------------------------------------------------------------- helpers


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


def state_of(step: int) -> dict:
    return {"w": torch.full((8,), float(step)), "step": step}


# ----------------------------------------------------------------------------- adoption, unit


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


# ----------------------------------------------------------------------------- ls --local


@pytest.fixture(scope="module")
def one_save(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A node-local root with one committed checkpoint (one shard and the DCP metadata)."""
    root = tmp_path_factory.mktemp("one_save")
    with CheckpointEngine(
        root / "persistent", local_root=root / "local", persist_every_n_saves=5, async_save=False
    ) as eng:
        eng.save(state_of(1), step=1)
        eng.save(state_of(2), step=2)
        eng.wait()
    return root / "local"


def test_ls_local_judges_a_copy_without_a_manifest_as_recovery_does(one_save, tmp_path, capsys):
    # the rank-0-silent layout: node a committed NAME (manifest + metadata), node b holds the
    # shard it wrote, without the manifest that never reached it. Recovery counts b's shard
    # (candidates.agree); `ls --local` must say the same: recoverable from the nodes, nothing
    # missing. It says "partial" / "no node holds 1 of its file(s)" and lists b's folder
    # nowhere (its "not committed on any tier" line is suppressed: a has a manifest)
    a, b = tmp_path / "a", tmp_path / "b"
    for node in (a, b):
        (node / NAME).mkdir(parents=True)
    for f in (one_save / NAME).iterdir():
        shutil.copy2(f, (b if f.name.endswith(SHARD_SUFFIX) else a) / NAME / f.name)
    (tmp_path / "dir").mkdir()
    scans = [scan_node(Storage(a)), scan_node(Storage(b))]
    surveys = [candidates.Survey(n, s) for n, s in zip("ab", scans, strict=True)]
    choice = candidates.agree(tiers_of("a", "b"), surveys, set())
    assert choice.plan.checkpoint == NAME and choice.plan.tier == "peer"  # recovery: yes
    code, out, err = run(
        capsys, "ls", str(tmp_path / "dir"), "--local", str(a), "--local", str(b), "--json"
    )
    assert code == 0, err
    (row,) = [r for r in json.loads(out) if r["name"] == NAME]
    assert row["tiers"]["missing_files"] == 0, row["tiers"]
    assert row["tiers"]["recoverable_from_nodes"] is True, row["tiers"]
    assert row["tiers"]["notation"] == "nodes", row["tiers"]


# ----------------------------------------------------------------------------- ckpt_path


def session_with(dirpath: str) -> SimpleNamespace:
    engine = SimpleNamespace(multi_tier=True, storage=Storage(dirpath))
    return SimpleNamespace(engines={dirpath: engine}), engine


def test_a_ckpt_path_of_dirpath_spelled_as_lightning_gives_it_is_matched(tmp_path) -> None:
    # regression guard: best_model_path / last_model_path (dirpath + "/" + name), with a
    # trailing slash; a Lightning file in dirpath, another dirpath and None are not
    dirpath = str(tmp_path / "ckpts")
    session, engine = session_with(dirpath)
    assert _tiered_engine(session, f"{dirpath}/{NAME}") is engine
    assert _tiered_engine(session, f"{dirpath}/{NAME}/") is engine
    assert _tiered_engine(session, f"{dirpath}/{NAME}-1") is engine
    assert _tiered_engine(session, f"{dirpath}/last.ckpt") is None
    assert _tiered_engine(session, f"{dirpath}/epoch=0-step=2.ckpt") is None
    assert _tiered_engine(session, str(tmp_path / "other" / NAME)) is None
    assert _tiered_engine(session, f"{dirpath}/{NAME}/{MANIFEST_FILE}") is None
    assert _tiered_engine(session, None) is None


@pytest.mark.parametrize("spelling", ["relative", "dot", "file_url", "double_slash"])
def test_a_ckpt_path_naming_a_save_of_dirpath_in_another_spelling_is_matched(
    tmp_path, monkeypatch, spelling
) -> None:
    # the same directory spelled otherwise than dirpath (a path relative to the working
    # directory, "./", a file:// URL, a doubled slash) is still a save of the multi-tier
    # dirpath: unmatched, it falls through to a non-tiered engine on the persistent root (a
    # second engine of the same root) or to Lightning's loader (FileNotFoundError) whenever
    # the save is on the nodes only - the bug the commit fixed, back for these spellings
    monkeypatch.chdir(tmp_path)
    dirpath = str(tmp_path / "ckpts")
    session, engine = session_with(dirpath)
    path = {
        "relative": f"ckpts/{NAME}",
        "dot": f"{dirpath}/./{NAME}",
        "file_url": f"file://{dirpath}/{NAME}",
        "double_slash": f"{tmp_path}//ckpts/{NAME}",
    }[spelling]
    assert os.path.realpath(path.removeprefix("file://")) == f"{dirpath}/{NAME}"
    assert _tiered_engine(session, path) is engine, path


def test_a_missing_named_checkpoint_with_tiers_is_named_in_the_error(tmp_path) -> None:
    # trainer.fit(ckpt_path=dirpath/step_000000099) now goes to the tiered engine: the error
    # must name what was asked for, as without tiers ("no checkpoint at .../step_...99"),
    # not "no valid checkpoint in ...; start without resuming or point to a directory"
    missing = "step_000000099"
    with CheckpointEngine(tmp_path / "plain", async_save=False) as eng:
        eng.save(state_of(1), step=1)
        with pytest.raises(CheckpointNotFoundError, match=missing):
            eng.load(state_of(0), checkpoint=missing)
    with CheckpointEngine(
        tmp_path / "persistent", local_root=tmp_path / "local", async_save=False
    ) as eng:
        eng.save(state_of(1), step=1)
        eng.wait()
        with pytest.raises(CheckpointNotFoundError) as caught:
            eng.load(state_of(0), checkpoint=missing)
    assert missing in str(caught.value), str(caught.value)


def test_another_jobs_checkpoint_of_the_same_name_in_the_local_root_is_never_loaded(
    tmp_path,
) -> None:
    # two jobs share one node-local root (both use /dev/shm/ckpt): job Y committed step 2
    # there; job X persisted its own step 2. X's recovery must load X's step 2 (from its
    # persistent root), never Y's copy under the same name
    shared = tmp_path / "shared_local"
    with CheckpointEngine(tmp_path / "y", local_root=shared, async_save=False) as eng:
        for step in (1, 2):
            eng.save({"w": torch.full((8,), 70.0 + step), "step": step}, step=step)
        eng.wait()
    with CheckpointEngine(tmp_path / "x", local_root=tmp_path / "x_local", async_save=False) as e:
        for step in (1, 2):
            e.save({"w": torch.full((8,), 50.0 + step), "step": step}, step=step, persist=True)
        e.wait()
    shutil.rmtree(tmp_path / "x_local")  # X restarts on the machine Y used
    before = sorted(p.name for p in (shared / NAME).iterdir())
    state = {"w": torch.zeros(8), "step": -1}
    # X's files would go beside Y's under one name, and the node's manifest is Y's: X is
    # refused, typed and told what to do, and neither checkpoint is touched (not Y's 72)
    with (
        CheckpointEngine(tmp_path / "x", local_root=shared, async_save=False) as eng,
        pytest.raises(ConfigError, match="own local_dirpath"),
    ):
        eng.load(state)
    assert state["step"] == -1 and torch.equal(state["w"], torch.zeros(8))
    assert sorted(p.name for p in (shared / NAME).iterdir()) == before
    assert Catalog(Storage(shared)).info(NAME).status == VALID
    assert Catalog(Storage(tmp_path / "x")).info(NAME).status == VALID


# ----------------------------------------------------------------------------- node ids, roots


@pytest.mark.parametrize("node", ["a\x85b", "a\x9bb", "a\u2028b"])
def test_a_node_id_with_a_line_break_or_c1_control_character_is_refused(node) -> None:
    # "no control characters": U+0085 (NEL) and U+009B (CSI) are control characters too
    # (Unicode Cc), and U+0085 / U+2028 break a line in str.splitlines (logs, `ls` output)
    with pytest.raises(ConfigError):
        check_node_id(node)


def test_a_node_id_that_utf8_cannot_encode_is_a_config_error(tmp_path) -> None:
    # $LIGHTNING_ELASTIC_NODE with bytes that are not UTF-8 reaches Python as a surrogate
    # escape: check_node_id accepts it, then the shared-root probe's hash raises
    # UnicodeEncodeError at construction (the kind of setup failure the check was for)
    node = os.fsdecode(b"node-\xff")
    with pytest.raises(ConfigError):
        CheckpointEngine(tmp_path / "persistent", local_root=tmp_path / "local", node=node)


def test_legal_node_ids_of_255_characters_dots_and_backslashes_construct(tmp_path) -> None:
    # regression guard: ids are no longer file names (the probe hashes them); only "." and
    # ".." themselves are refused (they read as path components)
    for i, node in enumerate(["n" * 255, "..a", ".b", "a\\b", "ümlaut node"]):
        with CheckpointEngine(
            tmp_path / f"p{i}", local_root=tmp_path / f"l{i}", node=node, async_save=False
        ) as eng:
            eng.save(state_of(1), step=1)
            eng.wait()
        assert not any(p.name.startswith(".tier-probe") for p in (tmp_path / f"l{i}").iterdir())
    with pytest.raises(ConfigError):
        check_node_id("n" * 256)


@pytest.mark.parametrize("node", ["..", ".", "node\u202e1", "node\u20661", "a\u200bb"])
def test_a_node_id_from_the_environment_that_is_a_path_component_or_holds_bidi_controls_is_refused(
    tmp_path, monkeypatch, node
) -> None:
    # $LIGHTNING_ELASTIC_NODE (else the host name) is checked as node= is: U+202E (RIGHT-TO-
    # LEFT OVERRIDE) would make log lines naming the node show other text than they hold
    monkeypatch.setenv("LIGHTNING_ELASTIC_NODE", node)
    with pytest.raises(ConfigError, match=r"LIGHTNING_ELASTIC_NODE.*not '\.' or '\.\.'") as info:
        CheckpointEngine(tmp_path / "persistent", local_root=tmp_path / "local")
    assert str(info.value).isascii()


@pytest.mark.parametrize("kind", ["file", "under_a_file"])
def test_a_local_root_that_is_a_file_or_below_one_is_a_config_error(tmp_path, kind) -> None:
    (tmp_path / "f").write_text("not a directory")
    local = tmp_path / "f" if kind == "file" else tmp_path / "f" / "local"
    with pytest.raises(ConfigError, match="local_dirpath"):
        CheckpointEngine(tmp_path / "persistent", local_root=local)
    assert (tmp_path / "f").read_text() == "not a directory"


@pytest.mark.timeout(60)
def test_an_illegal_node_id_on_one_rank_is_a_config_error_on_every_rank(tmp_path) -> None:
    # rank 1's $LIGHTNING_ELASTIC_NODE has a newline (each host sets its own): NodeLayout.
    # gather checks this rank's id BEFORE its all-gather, so rank 1 raises ConfigError at
    # once while rank 0 waits in the all-gather for a rank that never comes and fails only
    # at the timeout (8 s here, 10 min by default) with a communication error. Every rank
    # must get the ConfigError, promptly
    got = run_distributed(bad_node_id_on_one_rank, 2, str(tmp_path), ["a", "b\n"], timeout=50)
    assert got[1]["error"] == "ConfigError", got
    assert got[0]["error"] == "ConfigError", got
    assert got[0]["seconds"] < 5, got


# ----------------------------------------------------------------------------- processes


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
