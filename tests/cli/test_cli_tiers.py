"""``lightning-elastic ls DIR --local PATH ...``: which tiers hold each checkpoint.

Real checkpoints, saved once by a multi-tier engine in one process (node-local root, every
2nd save persisted), then split over two "nodes" as a two-node run leaves them: a node holds
the manifest and some of the files (its shard, or the DCP metadata, or all of them).
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from lightning_elastic.cli.format import size as _size
from lightning_elastic.core.engine import CheckpointEngine
from lightning_elastic.core.format.manifest import MANIFEST_FILE, SHARD_SUFFIX, Manifest
from tests.cli.test_cli import run

STEPS = range(1, 7)
PERSISTED = (2, 4, 6)  # persist_every_n_saves=2


def ckpt(step: int) -> str:
    return f"step_{step:09d}"


@dataclass(frozen=True)
class Source:
    local: Path  # the engine's node-local root: every save
    persistent: Path  # every 2nd save


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Source:
    root = tmp_path_factory.mktemp("source")
    model = torch.nn.Linear(16, 16)
    with CheckpointEngine(
        root / "persistent",
        local_root=root / "local",
        persist_every_n_saves=2,
        local_keep=len(STEPS),
        async_save=False,
    ) as eng:
        for step in STEPS:
            eng.save({"model": model.state_dict(), "step": step}, step=step)
            eng.wait()  # the persist too: one still running would defer the next (timing)
    src = Source(root / "local", root / "persistent")
    assert sorted(p.name for p in src.persistent.glob("step_*")) == [ckpt(s) for s in PERSISTED]
    return src


@dataclass(frozen=True)
class Cluster:
    dir: Path  # the persistent root, DIR of `ls`
    a: Path  # node A's local root
    b: Path  # node B's local root
    src: Source

    def place(self, node: Path, step: int, files: str) -> None:
        """Give ``node`` the manifest of ``step`` and ``files`` of it: ``all``, ``shard``,
        ``rest`` (all but the shard) or ``none``."""
        wanted = {
            "all": lambda name: True,
            "shard": lambda name: name.endswith(SHARD_SUFFIX),
            "rest": lambda name: not name.endswith(SHARD_SUFFIX),
            "none": lambda name: False,
        }[files]
        (node / ckpt(step)).mkdir(parents=True, exist_ok=True)
        for f in (self.src.local / ckpt(step)).iterdir():
            if f.name == MANIFEST_FILE or wanted(f.name):
                shutil.copy2(f, node / ckpt(step) / f.name)

    def ls(self, capsys: pytest.CaptureFixture[str], *extra: str) -> tuple[int, str, str]:
        return run(
            capsys, "ls", str(self.dir), "--local", str(self.a), "--local", str(self.b), *extra
        )

    def tiers(self, capsys: pytest.CaptureFixture[str]) -> dict[str, tuple[str, str]]:
        """Checkpoint name -> (STATUS, TIERS) from the table."""
        code, out, err = self.ls(capsys)
        assert code == 0, err
        lines = [line.split() for line in out.splitlines() if line.startswith("step_")]
        return {parts[0]: (parts[-2], parts[-1]) for parts in lines}

    def rows(self, capsys: pytest.CaptureFixture[str]) -> dict[str, dict]:
        code, out, err = self.ls(capsys, "--json")
        assert code == 0, err
        return {row["name"]: row for row in json.loads(out)}


@pytest.fixture
def cluster(source: Source, tmp_path: Path) -> Cluster:
    shutil.copytree(source.persistent, tmp_path / "dir")
    for node in ("a", "b"):
        (tmp_path / node).mkdir()
    return Cluster(tmp_path / "dir", tmp_path / "a", tmp_path / "b", source)


def shard_of(root: Path, step: int) -> Path:
    return next((root / ckpt(step)).glob(f"*{SHARD_SUFFIX}"))


def manifest(root: Path, step: int) -> Manifest:
    path = root / ckpt(step) / MANIFEST_FILE
    return Manifest.from_json(path.read_bytes(), str(path))


# ----------------------------------------------------------------------------- notation


def test_complete_on_both_nodes_is_local_2_of_2_with_or_without_a_persistent_copy(
    cluster, capsys
) -> None:
    for step in (5, 6):
        cluster.place(cluster.a, step, "all")
        cluster.place(cluster.b, step, "all")
    tiers = cluster.tiers(capsys)
    assert tiers[ckpt(5)] == ("local-only", "local:2/2")
    assert tiers[ckpt(6)] == ("valid", "persistent+local:2/2")
    assert tiers[ckpt(2)] == ("valid", "persistent")
    assert list(tiers) == [ckpt(s) for s in (2, 4, 5, 6)]  # commit order, DIR and nodes merged


def test_complete_on_one_node_lets_the_other_copy_from_a_peer(cluster, capsys) -> None:
    cluster.place(cluster.a, 5, "all")
    cluster.place(cluster.b, 5, "rest")
    assert cluster.tiers(capsys)[ckpt(5)] == ("local-only", "local:1/2+peer")
    tiers = cluster.rows(capsys)[ckpt(5)]["tiers"]
    assert [n["complete"] for n in tiers["nodes"].values()] == [True, False]
    assert tiers["recoverable_from_nodes"] is True


def test_complete_only_in_the_union_of_the_nodes_is_nodes(cluster, capsys) -> None:
    cluster.place(cluster.a, 5, "shard")
    cluster.place(cluster.b, 5, "rest")
    assert cluster.tiers(capsys)[ckpt(5)] == ("local-only", "nodes")
    tiers = cluster.rows(capsys)[ckpt(5)]["tiers"]
    nodes = list(tiers["nodes"].values())
    total = manifest(cluster.a, 5).total_bytes
    assert [n["complete"] for n in nodes] == [False, False]
    assert sum(n["held_bytes"] for n in nodes) == total
    assert all(n["total_bytes"] == total for n in nodes)
    assert tiers["recoverable_from_nodes"] is True and not tiers["persistent"]


def test_a_file_missing_on_every_node_is_partial_and_named(cluster, capsys) -> None:
    cluster.place(cluster.a, 5, "none")  # the manifest only
    cluster.place(cluster.b, 5, "rest")
    cluster.place(cluster.b, 6, "rest")  # persisted: the rest comes from DIR
    tiers = cluster.tiers(capsys)
    assert tiers[ckpt(5)] == ("local-only", "partial")
    assert tiers[ckpt(6)] == ("valid", "persistent+partial")
    _, out, _ = cluster.ls(capsys)
    shard = shard_of(cluster.src.local, 5).name
    assert f"{ckpt(5)}: no node holds 1 of its file(s) (first: {ckpt(5)}/{shard})" in out
    tiers = cluster.rows(capsys)[ckpt(5)]["tiers"]
    assert tiers["recoverable_from_nodes"] is False and tiers["missing_files"] == 1
    assert tiers["nodes"][str(cluster.a)]["held_bytes"] == 0


def test_persisted_only_and_on_no_node(cluster, capsys) -> None:
    cluster.place(cluster.a, 5, "all")  # the nodes hold another checkpoint
    tiers = cluster.tiers(capsys)
    assert tiers == {
        ckpt(2): ("valid", "persistent"),
        ckpt(4): ("valid", "persistent"),
        ckpt(5): ("local-only", "local:1/2+peer"),
        ckpt(6): ("valid", "persistent"),
    }
    t = cluster.rows(capsys)[ckpt(2)]["tiers"]
    assert t["persistent"] is True and t["recoverable_from_nodes"] is False
    total = manifest(cluster.dir, 2).total_bytes
    assert all(
        n == {"held_bytes": 0, "total_bytes": total, "complete": False} for n in t["nodes"].values()
    )


def test_a_truncated_local_copy_is_not_held(cluster, capsys) -> None:
    cluster.place(cluster.a, 5, "all")
    cluster.place(cluster.b, 5, "rest")
    shard = shard_of(cluster.a, 5)
    size = shard.stat().st_size
    shard.write_bytes(shard.read_bytes()[:-1])
    assert cluster.tiers(capsys)[ckpt(5)] == ("local-only", "partial")
    tiers = cluster.rows(capsys)[ckpt(5)]["tiers"]
    node_a = tiers["nodes"][str(cluster.a)]
    assert node_a["complete"] is False
    assert node_a["held_bytes"] == node_a["total_bytes"] - size
    cluster.place(cluster.b, 5, "all")  # a good copy elsewhere: the nodes recover it
    assert cluster.tiers(capsys)[ckpt(5)] == ("local-only", "local:1/2+peer")


def test_a_corrupt_persistent_copy_is_not_a_tier_but_the_nodes_still_show(cluster, capsys) -> None:
    cluster.place(cluster.a, 6, "all")
    shard = shard_of(cluster.dir, 6)
    shard.write_bytes(shard.read_bytes()[:-1])
    _, out, _ = cluster.ls(capsys)
    assert cluster.tiers(capsys)[ckpt(6)] == ("corrupt", "local:1/2+peer")
    assert f"{ckpt(6)}: {shard.name}" in out  # the DIR problem, as without --local


def rewrite_manifest(path: Path, **changes: object) -> None:
    m = Manifest.from_json(path.read_bytes(), str(path))
    path.write_text(dataclasses.replace(m, **changes).to_json())


def test_a_name_meaning_different_checkpoints_is_a_conflict_not_a_crash(cluster, capsys) -> None:
    for step in (5, 6):
        cluster.place(cluster.a, step, "all")
        cluster.place(cluster.b, step, "all")
    m5 = manifest(cluster.b, 5)
    rewrite_manifest(cluster.b / ckpt(5) / MANIFEST_FILE, sequence=m5.sequence + 10)
    m6 = manifest(cluster.a, 6)  # the nodes agree with each other, not with DIR
    for node in (cluster.a, cluster.b):
        rewrite_manifest(node / ckpt(6) / MANIFEST_FILE, created_unix=m6.created_unix + 1)
    tiers = cluster.tiers(capsys)
    assert tiers[ckpt(5)] == ("local-only", "conflict")
    assert tiers[ckpt(6)] == ("valid", "persistent+conflict")  # recovery uses DIR's copy
    _, out, _ = cluster.ls(capsys)
    assert f"{ckpt(5)}: conflict: {cluster.a} and {cluster.b} disagree: commit order" in out
    assert f"{ckpt(6)}: conflict: {cluster.a} and {cluster.dir} disagree: commit order" in out
    rows = cluster.rows(capsys)
    for step in (5, 6):
        tiers_json = rows[ckpt(step)]["tiers"]
        assert tiers_json["recoverable_from_nodes"] is False
        assert "disagree" in tiers_json["conflict"]


# ----------------------------------------------------------------------------- shapes


def test_json_rows_gain_a_tiers_object(cluster, capsys) -> None:
    cluster.place(cluster.a, 5, "shard")
    cluster.place(cluster.b, 5, "rest")
    code, out, _ = cluster.ls(capsys, "--json")
    rows = json.loads(out)
    assert code == 0 and [r["name"] for r in rows] == [ckpt(s) for s in (2, 4, 5, 6)]
    for r in rows:  # the rows of `ls --json`, plus "tiers"
        assert {"name", "path", "status", "checked", "step", "bytes", "tiers"} <= set(r)
        t = r["tiers"]
        assert set(t) == {
            "persistent",
            "nodes",
            "recoverable_from_nodes",
            "notation",
            "conflict",
            "missing_files",
        }
        assert list(t["nodes"]) == [str(cluster.a), str(cluster.b)]  # as given, in order
        for node in t["nodes"].values():
            assert set(node) == {"held_bytes", "total_bytes", "complete"}
            assert type(node["held_bytes"]) is int and type(node["complete"]) is bool
            assert node["total_bytes"] == r["bytes"]
    local = rows[2]
    assert local["status"] == "local-only" and local["checked"] == "size"
    assert local["path"] == str(cluster.a / ckpt(5)) and local["step"] == 5
    assert local["tiers"]["notation"] == "nodes" and local["tiers"]["conflict"] is None


def test_nodes_alone_are_listed_when_dir_is_empty(cluster, capsys) -> None:
    shutil.rmtree(cluster.dir)
    cluster.dir.mkdir()
    cluster.place(cluster.a, 5, "all")
    assert cluster.tiers(capsys) == {ckpt(5): ("local-only", "local:1/2+peer")}
    shutil.rmtree(cluster.a / ckpt(5))
    code, out, _ = cluster.ls(capsys)
    assert code == 0 and out == f"no checkpoints in {cluster.dir} or the 2 node-local root(s)\n"


def test_the_text_ends_with_what_was_checked_and_where_the_notation_is(cluster, capsys) -> None:
    cluster.place(cluster.a, 5, "all")
    _, out, _ = cluster.ls(capsys)
    lines = out.splitlines()
    assert lines[0].split()[-2:] == ["STATUS", "TIERS"]
    assert lines[-1].startswith("tiers: 2 node-local root(s), their files compared by size")
    with pytest.raises(SystemExit) as exit_:
        run(capsys, "ls", "--help")
    assert exit_.value.code == 0
    help_text = capsys.readouterr().out
    for term in ("--local PATH", "local:C/N", "peer", "nodes", "partial", "conflict"):
        assert term in help_text


def test_without_local_the_listing_has_no_tiers(cluster, capsys) -> None:
    code, out, _ = run(capsys, "ls", str(cluster.dir))
    assert code == 0 and "TIERS" not in out and "tiers:" not in out
    _, out, _ = run(capsys, "ls", str(cluster.dir), "--json")
    assert all("tiers" not in r for r in json.loads(out))


# ----------------------------------------------------------------------------- bad paths


def test_a_missing_local_root_is_a_usage_error(cluster, capsys) -> None:
    missing = cluster.a.parent / "node_c"
    code, out, err = run(
        capsys, "ls", str(cluster.dir), "--local", str(cluster.a), "--local", str(missing)
    )
    assert code == 2 and out == ""
    assert err == f"error: --local {missing} does not exist (no checkpoint there)\n"
    code, out, _ = run(capsys, "ls", str(cluster.dir), "--local", str(missing), "--json")
    assert code == 2 and json.loads(out) == {
        "error": f"--local {missing} does not exist (no checkpoint there)",
        "exit_code": 2,
    }


def test_a_local_root_that_is_a_file_a_checkpoint_or_given_twice_is_refused(
    cluster, capsys
) -> None:
    cluster.place(cluster.a, 5, "all")
    for bad, says in (
        (f"{cluster.a / ckpt(5) / MANIFEST_FILE}", "is a file"),
        (f"{cluster.a / ckpt(5)}", f"pass its parent, `--local {cluster.a}`"),
        (f"{cluster.a}/", "is given twice"),
    ):
        code, _, err = run(
            capsys, "ls", str(cluster.dir), "--local", str(cluster.a), "--local", bad
        )
        assert code == 2 and f"--local {bad}" in err and says in err


def test_ls_with_local_imports_neither_torch_nor_lightning(cluster) -> None:
    cluster.place(cluster.a, 5, "all")
    code = (
        "import sys\nfrom lightning_elastic.cli import main\n"
        f"assert main(['ls', {str(cluster.dir)!r}, '--local', {str(cluster.a)!r}]) == 0\n"
        "print('\\n'.join(sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], check=True, capture_output=True, text=True, timeout=60
    ).stdout
    loaded = set(out.split())
    assert "lightning_elastic.core.tiers.survey" in loaded
    assert "torch" not in loaded and "lightning" not in loaded


def test_save_files_no_tier_has_a_manifest_of_are_named_with_their_size(cluster, capsys) -> None:
    # step 5 never committed anywhere: node b holds its shard without a manifest; a folder
    # without a manifest whose checkpoint another node committed is that checkpoint's row
    cluster.place(cluster.b, 5, "shard")
    (cluster.b / ckpt(5) / MANIFEST_FILE).unlink()
    cluster.place(cluster.a, 6, "all")
    cluster.place(cluster.b, 6, "shard")
    (cluster.b / ckpt(6) / MANIFEST_FILE).unlink()
    code, out, err = cluster.ls(capsys)
    assert code == 0, err
    lines = [line for line in out.splitlines() if "not committed on any tier" in line]
    assert len(lines) == 1 and lines[0].startswith(f"  {ckpt(5)}: "), out
    assert lines[0].endswith(
        f"save files on {cluster.b} ({_size(shard_of(cluster.b, 5).stat().st_size)})"
    )
    assert not any(line.startswith(ckpt(5)) for line in out.splitlines())
    assert any(line.startswith(ckpt(6)) for line in out.splitlines())
