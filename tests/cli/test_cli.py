import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lightning_elastic import CheckpointEngine
from lightning_elastic.cli import main
from lightning_elastic.core.format.manifest import MANIFEST_FILE

CONFIG = "trainer:\n  max_steps: 10\nmodel:\n  lr: 0.1\n"


def populate(root: str, storage_options: dict | None = None, steps=(1, 2, 3), run_id=None) -> None:
    model = torch.nn.Linear(32, 32)
    with CheckpointEngine(root, storage_options=storage_options, run_id=run_id) as eng:
        for step in steps:
            eng.save(
                {"model": model.state_dict(), "step": step},
                step=step,
                epoch=0,
                metrics={"loss": 1.0 / step},
                metadata={"config": CONFIG, "hparams": {"lr": 0.1}},
            )


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def checkpoint_dirs(root: Path) -> list[str]:
    """The checkpoint directories (not the hidden ``.leases``) in ``root``, by name."""
    return sorted(p.name for p in root.iterdir() if not p.name.startswith("."))


def flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.fixture
def root(tmp_path) -> Path:
    populate(str(tmp_path))
    return tmp_path


def test_ls_table_and_json(root, capsys) -> None:
    code, out, _ = run(capsys, "ls", str(root))
    assert code == 0 and "step_000000003" in out and "STATUS" in out and out.count("valid") == 3
    code, out, _ = run(capsys, "ls", str(root), "--json")
    rows = json.loads(out)
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert {
            "path",
            "step",
            "epoch",
            "world_size",
            "run_id",
            "bytes",
            "created",
            "status",
        } <= set(r)
        assert r["status"] == "valid" and r["world_size"] == 1 and r["bytes"] > 0


def test_ls_shows_incomplete_and_corrupt(root, capsys) -> None:
    (root / "step_000000002" / MANIFEST_FILE).unlink()
    (root / "step_000000003" / MANIFEST_FILE).write_text("{not json")
    _, out, _ = run(capsys, "ls", str(root), "--json")
    # listed in commit order: the uncommitted ones (no sequence) come first
    statuses = {r["step"]: r["status"] for r in json.loads(out)}
    assert statuses == {1: "valid", 2: "incomplete", 3: "corrupt"}


def test_verify_lists_leftovers_without_failing_the_root(root, capsys) -> None:
    (root / "step_000000002" / MANIFEST_FILE).unlink()  # a crashed or in-flight save
    code, out, _ = run(capsys, "verify", str(root))
    assert code == 0 and "incomplete" in out and out.count("valid ") == 2
    code, out, _ = run(capsys, "verify", str(root), "--json")
    statuses = {r["step"]: r["status"] for r in json.loads(out)}
    assert code == 0 and statuses == {1: "valid", 2: "incomplete", 3: "valid"}
    # named alone, an incomplete directory is not a checkpoint: that fails
    assert run(capsys, "verify", str(root / "step_000000002"))[0] == 1


def test_inspect_shows_manifest_and_resolved_config(root, capsys) -> None:
    code, out, _ = run(capsys, "inspect", str(root / "step_000000002"))
    assert code == 0
    assert "step 2" in out and "max_steps: 10" in out and "loss=0.5" in out
    _, out, _ = run(capsys, "inspect", str(root / "step_000000002"), "--json")
    body = json.loads(out)
    assert body["manifest"]["metadata"]["config"] == CONFIG
    assert body["manifest"]["versions"]["torch"] == torch.__version__


def test_verify_exit_codes_and_names_bad_file(root, capsys) -> None:
    code, out, _ = run(capsys, "verify", str(root))
    assert code == 0 and out.count("valid") == 3
    shard = next((root / "step_000000002").glob("*.distcp"))
    flip_byte(shard)
    code, out, err = run(capsys, "verify", str(root))
    assert code == 1 and shard.name in err and "checksum" in err
    code, out, _ = run(capsys, "verify", str(root), "--json")
    statuses = {r["step"]: r["status"] for r in json.loads(out)}
    assert code == 1 and statuses == {1: "valid", 2: "corrupt", 3: "valid"}
    # a single checkpoint can be verified too
    assert run(capsys, "verify", str(root / "step_000000003"))[0] == 0
    assert run(capsys, "verify", str(root / "step_000000002"))[0] == 1


def test_verify_size_mode_catches_truncation(root, capsys) -> None:
    shard = next((root / "step_000000001").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:-1])
    code, _, err = run(capsys, "verify", str(root), "--mode", "size")
    assert code == 1 and "size is" in err


def test_verify_empty_dir_fails(tmp_path, capsys) -> None:
    assert run(capsys, "verify", str(tmp_path))[0] == 1


def test_prune_dry_run_then_real(root, capsys) -> None:
    code, out, _ = run(capsys, "prune", str(root), "--keep-last", "1", "--dry-run")
    assert code == 0 and out.count("would delete") == 2
    assert len(checkpoint_dirs(root)) == 3
    code, out, _ = run(capsys, "prune", str(root), "--keep-last", "1", "--json")
    assert [d["step"] for d in json.loads(out)["deleted"]] == [1, 2]
    assert checkpoint_dirs(root) == ["step_000000003"]


def test_prune_collects_old_leftovers_and_spares_young_ones(root, capsys) -> None:
    old, young = root / "step_000000007", root / "step_000000008"
    for leftover in (old, young):
        leftover.mkdir()
        (leftover / "0123456789abcdef-rank00000.distcp").write_bytes(b"partial")
    os.utime(old / "0123456789abcdef-rank00000.distcp", (1, 1))  # crashed long ago
    (root / "logs").mkdir()
    (root / "logs" / "events.txt").write_text("not ours")
    os.utime(root / "logs" / "events.txt", (1, 1))
    code, out, _ = run(capsys, "prune", str(root), "--keep-last", "5", "--dry-run")
    assert code == 0 and f"would remove leftover {old}" in out and old.exists()
    code, out, _ = run(capsys, "prune", str(root), "--keep-last", "5", "--json")
    assert code == 0 and json.loads(out)["leftovers_removed"] == [str(old)]
    assert not old.exists() and young.exists() and (root / "logs" / "events.txt").exists()
    assert len(checkpoint_dirs(root)) == 5  # 3 committed, the young leftover, logs


@pytest.mark.parametrize("grace", ["-1", "nan", "inf"])
def test_prune_refuses_a_bad_grace_before_deleting_anything(root, capsys, grace) -> None:
    code, _, err = run(capsys, "prune", str(root), "--keep-last", "1", f"--leftover-grace={grace}")
    assert code == 2 and "--leftover-grace" in err
    assert len(checkpoint_dirs(root)) == 3


def test_prune_keeps_each_runs_newest(tmp_path, capsys) -> None:
    populate(str(tmp_path), steps=(1, 2), run_id="a")
    populate(str(tmp_path), steps=(3, 4), run_id="b")
    run(capsys, "prune", str(tmp_path), "--keep-last", "1")
    assert checkpoint_dirs(tmp_path) == ["step_000000002", "step_000000004"]
    run(capsys, "prune", str(tmp_path), "--keep-last", "1", "--run-id", "a")
    code, _, err = run(capsys, "prune", str(tmp_path), "--keep-last", "1", "--run-id", "nope")
    assert code == 2 and "no valid checkpoint of run 'nope'" in err and "runs here: a, b" in err


def test_consolidate_writes_one_loadable_file(root, tmp_path, capsys) -> None:
    out_file = tmp_path / "model.pt"
    code, _, _ = run(capsys, "consolidate", str(root / "step_000000003"), str(out_file))
    assert code == 0
    state = torch.load(out_file, weights_only=False)
    assert state["step"] == 3 and state["model"]["weight"].shape == (32, 32)


def test_errors_are_clear(tmp_path, capsys) -> None:
    code, _, err = run(capsys, "inspect", str(tmp_path / "nope"))
    assert code == 2 and "no checkpoint" in err


@pytest.mark.s3
def test_cli_on_s3(s3_root, s3_server, capsys) -> None:
    populate(s3_root, s3_server.storage_options, steps=(5,))
    opts = [
        "-o",
        f"endpoint_url={s3_server.endpoint_url}",
        "-o",
        "key=testing",
        "-o",
        "secret=testing",
    ]
    code, out, _ = run(capsys, "ls", s3_root, "--json", *opts)
    assert code == 0 and json.loads(out)[0]["path"].startswith("s3://")
    assert run(capsys, "verify", s3_root, *opts)[0] == 0


def test_console_script_entry_point(root) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "lightning_elastic.cli", "ls", str(root), "--json"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert len(json.loads(proc.stdout)) == 3


def test_the_console_script_and_python_m_run_the_same_main(tmp_path) -> None:
    """``lightning-elastic`` (pyproject's entry point) and ``python -m lightning_elastic.cli``
    are one command line, whatever module layout is behind them."""
    import importlib

    import tomllib

    pyproject = Path(__file__).resolve().parents[2] / "pyproject.toml"
    target = tomllib.loads(pyproject.read_text())["project"]["scripts"]["lightning-elastic"]
    module, _, name = target.partition(":")
    assert getattr(importlib.import_module(module), name) is main
    done = subprocess.run(
        [sys.executable, "-m", "lightning_elastic.cli", "ls", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0 and "empty: no checkpoints" in done.stdout, done.stderr
