"""``lightning-elastic ls --local`` on what a killed multi-tier run leaves: half-written local
manifests, corrupt local-only shards under ``--check full``, and copies without a manifest
judged as recovery judges them."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from lightning_elastic.core.engine import CheckpointEngine
from lightning_elastic.core.format.manifest import SHARD_SUFFIX
from lightning_elastic.core.storage.base import Storage
from lightning_elastic.core.tiers import candidates
from lightning_elastic.core.tiers.inventory import scan_node
from lightning_elastic.core.tiers.layout import NodeLayout
from lightning_elastic.testing.spawn import run_distributed
from tests.cli.test_cli import run
from tests.tiers import lightning_workers as w

NAME = "step_000000002"


def steps(root: Path) -> list[int]:
    return sorted(
        int(p.parent.name.split("_")[1].split("-")[0]) for p in root.glob("step_*/manifest.json")
    )


def local(root: Path, node: str) -> Path:
    return root / "local" / node


@pytest.fixture(scope="module")
def layout(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """What a killed two-node Lightning run leaves: steps 5 and 10 on both nodes' local
    roots, 10 persisted (persist_every_n_saves=2)."""
    root = tmp_path_factory.mktemp("layout")
    run_distributed(w.fit, 2, str(root), 20, 13, may_die={0, 1}, persist_every_n_saves=2)
    assert steps(root / "ckpts") == [10]
    assert steps(local(root, "a")) == steps(local(root, "b")) == [5, 10]
    return root


def _copy(layout: Path, tmp_path: Path) -> Path:
    shutil.copytree(layout, tmp_path / "run", symlinks=True)
    return tmp_path / "run"


def _ls(capsys, root: Path, *extra: str) -> tuple[int, str]:
    from tests.cli.test_cli import run

    code, out, err = run(
        capsys,
        "ls",
        str(root / "ckpts"),
        "--local",
        str(local(root, "a")),
        "--local",
        str(local(root, "b")),
        *extra,
    )
    assert "Traceback" not in err, err
    return code, out


def _tiers(out: str) -> dict[str, tuple[str, str]]:
    rows = [line.split() for line in out.splitlines() if line.startswith("step_")]
    return {r[0]: (r[-2], r[-1]) for r in rows}


def tiers_of(*nodes: str) -> SimpleNamespace:
    """What ``candidates.agree`` reads of a TierSet: rank ``r`` on ``nodes[r]``."""
    return SimpleNamespace(
        coordinator=SimpleNamespace(is_coordinator=False), layout=NodeLayout.of(list(nodes))
    )


def state_of(step: int) -> dict:
    return {"w": torch.full((8,), float(step)), "step": step}


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


@pytest.mark.timeout(120)
def test_ls_local_on_a_half_written_local_manifest(layout, tmp_path, capsys) -> None:
    root = _copy(layout, tmp_path)
    manifest = local(root, "b") / "step_000000005" / "manifest.json"
    manifest.write_bytes(manifest.read_bytes()[:100])  # a half-written copy on b
    code, out = _ls(capsys, root)
    assert code == 0
    assert _tiers(out)["step_000000005"] == ("local-only", "local:1/2+peer"), out
    code, out = _ls(capsys, root, "--json")
    row = {r["name"]: r for r in json.loads(out)}["step_000000005"]
    assert row["tiers"]["nodes"][str(local(root, "b"))]["complete"] is False
    # the broken older copy does not disturb the resume (from step 10, on both nodes)
    got = run_distributed(w.fit, 2, str(root), 12, persist_every_n_saves=2)
    assert [g["first_step"] for g in got] == [10, 10]


@pytest.mark.timeout(120)
def test_ls_check_full_does_not_list_a_corrupt_local_only_checkpoint_as_held(
    layout, tmp_path, capsys
) -> None:
    """Step 5 lives on the nodes only, and rank 0's shard is corrupt (same size) on both.
    ``ls --check full --local`` says "checked: manifests, file sizes and checksums", yet
    lists step 5 as ``local-only  local:2/2``: a checkpoint no recovery can load shown as
    complete on both nodes."""
    root = _copy(layout, tmp_path)
    for n in "ab":
        shard = next((local(root, n) / "step_000000005").glob("*rank00000.distcp"))
        body = bytearray(shard.read_bytes())
        body[len(body) // 2] ^= 0xFF
        shard.write_bytes(bytes(body))
    _, out = _ls(capsys, root, "--check", "full")
    assert "checksums" in out
    assert _tiers(out).get("step_000000005", ("", ""))[1] != "local:2/2", out


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
