"""What is checked about node ids and node-local roots before anything is written: a local root
that is the persistent root spelled otherwise, nested with it, a file, unwritable on one node,
or shared by two node ids (two hosts reporting one id); node ids that are path components,
control characters or not UTF-8, refused with ``ConfigError`` on every rank, and every legal
id trains."""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path

import pytest
import torch

from lightning_elastic import DistributedCheckpoint, TierOptions
from lightning_elastic.core.engine import CheckpointEngine
from lightning_elastic.core.options import check_node_id
from lightning_elastic.errors import ConfigError
from lightning_elastic.testing.spawn import WorkerFailure, run_distributed
from tests.tiers import lightning_workers as w
from tests.tiers.engine_workers import (
    shared_local_root,
)
from tests.tiers.node_id_workers import bad_node_id_on_one_rank


def steps(root: Path) -> list[int]:
    return sorted(
        int(p.parent.name.split("_")[1].split("-")[0]) for p in root.glob("step_*/manifest.json")
    )


def state_of(step: int) -> dict:
    return {"w": torch.full((8,), float(step)), "step": step}


@pytest.mark.timeout(240)
@pytest.mark.slow
@pytest.mark.parametrize("alias", ["{p}/./", "file://{p}", "{p}/../p"])
def test_a_local_root_that_is_the_persistent_root_spelled_otherwise_is_refused(
    tmp_path, alias
) -> None:
    from lightning_elastic.core.dist.coordinator import Coordinator
    from lightning_elastic.core.engine import CheckpointEngine
    from lightning_elastic.errors import ConfigError

    p = str(tmp_path / "p")
    with pytest.raises(ConfigError):
        CheckpointEngine(
            p,
            local_root=alias.format(p=p),
            coordinator=Coordinator.single_process(),
            timeout=timedelta(seconds=10),
        ).close()


@pytest.mark.timeout(240)
@pytest.mark.slow
def test_two_hosts_reporting_one_node_id_do_not_fill_the_second_hosts_local_root(
    tmp_path,
) -> None:
    # refuse the layout (the ranks of one "node" do not see one local root), or keep the
    # local retention on every root that received shards: /dev/shm is RAM
    from tests.tiers.engine_workers import one_node_id_two_hosts

    try:
        run_distributed(one_node_id_two_hosts, 2, str(tmp_path), 6)
    except Exception as exc:
        assert "ConfigError" in str(exc)
        return
    held = sorted(p.name for p in (tmp_path / "host1").iterdir() if p.name.startswith("step_"))
    assert len(held) <= 2, held  # today: all 6 saves' shards, no manifest, never collected


@pytest.mark.timeout(240)
@pytest.mark.slow
def test_one_local_root_shared_by_two_node_ids_is_refused_at_construction(tmp_path) -> None:
    # local_dirpath on a shared file system: the replicas would land in the directory they
    # protect (every save warned "this node keeps no copy", recovery reported "local")
    with pytest.raises(WorkerFailure, match="see the local root of another node"):
        run_distributed(shared_local_root, 2, str(tmp_path), ["a", "b"], 2)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("inside", ["local_in_dirpath", "dirpath_in_local"])
def test_a_local_root_nested_with_the_persistent_root_is_refused(tmp_path, inside) -> None:
    from tests.lightning import workers

    ckpts, nested = tmp_path / "ckpts", tmp_path / "ckpts" / "local"
    if inside == "dirpath_in_local":  # the persistent root (<root>/ckpts) inside the local
        with pytest.raises(ConfigError, match="one holds the other"):
            workers.fit(
                str(tmp_path), 4, strategy="auto", devices=1, tiers=TierOptions(str(tmp_path))
            )
        return
    with pytest.raises(ConfigError, match="one holds the other"):
        workers.fit(str(tmp_path), 4, strategy="auto", devices=1, tiers=TierOptions(str(nested)))
    assert not list(ckpts.glob("step_*"))


@pytest.mark.timeout(120)
def test_an_unwritable_local_root_on_one_node_fails_every_rank_with_a_typed_error(
    tmp_path,
) -> None:
    """Node b's local root lies under a regular file (not creatable); node a's is fine. Both
    ranks must fail at setup with one clear error naming the local root, not hang and not
    train without a local tier on b."""
    (tmp_path / "file").write_text("not a directory")
    local_of = {"a": str(tmp_path / "local_a"), "b": str(tmp_path / "file" / "local_b")}
    got = run_distributed(w.fit_config, 2, str(tmp_path), 6, local_of, timeout=90)
    for g in got:
        assert "global_step" not in g, g
        assert g["error"] == "ConfigError", g
        assert "local_b" in g["message"] and "local_dirpath" in g["message"], g


@pytest.mark.timeout(120)
@pytest.mark.parametrize("node", ["a b", "..x", "nœud-1", "a*?", "a\\b", "x" * 255])
def test_a_node_id_accepted_by_the_options_trains(tmp_path, node) -> None:
    """Validation refuses '/', control characters and ids over 255 characters; every other
    id must then work (the shared-root probe once embedded the raw id in a file name: a
    backslash or a 240-character id failed at setup with a StorageError)."""
    DistributedCheckpoint(tmp_path / "ckpts", tiers=TierOptions(tmp_path / "local", node=node))
    local_of = {node: str(tmp_path / "local")}
    (got,) = run_distributed(w.fit_config, 1, str(tmp_path), 3, local_of, names=[node])
    assert got == {"global_step": 3}, got
    assert steps(tmp_path / "ckpts") == [3] and steps(tmp_path / "local") == [3]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("node", ["a\x00b", "a\nb", "x" * 256, "", "a/b"])
def test_an_illegal_node_id_is_a_config_error(tmp_path, node) -> None:
    """Refused with ConfigError, at construction (docs: "validated at construction") or at
    the latest at setup, never another error."""
    try:
        DistributedCheckpoint(tmp_path / "ckpts", tiers=TierOptions(tmp_path / "local", node=node))
    except ConfigError:
        return
    local_of = {node: str(tmp_path / "local")}
    (got,) = run_distributed(w.fit_config, 1, str(tmp_path), 3, local_of, names=[node])
    assert got.get("error") == "ConfigError", got
    assert not (tmp_path / "ckpts").exists() or not steps(tmp_path / "ckpts")


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
