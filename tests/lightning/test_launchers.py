"""The real launch paths: LightningCLI + Lightning's own launcher, torchrun, ddp_spawn."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from lightning_elastic.cli import main as cli_main

pytestmark = pytest.mark.timeout(300)
ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "lightning" / "scripts" / "fit_script.py"


def run(cmd: list[str], cwd: Path, timeout: int = 240) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env)


def result_line(proc: subprocess.CompletedProcess) -> dict:
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, proc.stdout[-2000:] + proc.stderr[-4000:]
    return json.loads(lines[-1][len("RESULT ") :])


def manifest(path: Path) -> dict:
    return json.loads((path / "manifest.json").read_text())


def test_lightning_cli_fit_kill_fit_again(tmp_path, capsys) -> None:
    run_dir = tmp_path / "run"
    # omegaconf resolves ${trainer.default_root_dir} when the file is parsed, so the
    # directory is set in (a copy of) the file rather than overridden on the command line
    config = (ROOT / "examples" / "config.yaml").read_text()
    (tmp_path / "config.yaml").write_text(
        config.replace("default_root_dir: demo_run", f"default_root_dir: {run_dir}")
    )
    base = [
        sys.executable,
        str(ROOT / "examples" / "lightning_cli.py"),
        "fit",
        "--config",
        str(tmp_path / "config.yaml"),
        "--trainer.max_steps",
        "40",
    ]
    crashed = run([*base, "--model.kill_at_step", "25"], cwd=tmp_path)
    assert crashed.returncode != 0, crashed.stderr[-3000:]
    ckpts = run_dir / "checkpoints"
    assert sorted(p.name for p in ckpts.glob("step_*")) == ["step_000000010", "step_000000020"]
    # step 20's save is asynchronous: on a loaded machine the kill at 25 may come before its
    # commit, and the resume then (rightly) takes step 10
    committed = sorted(p.parent.name for p in ckpts.glob("step_*/manifest.json"))
    assert committed[0] == "step_000000010", committed
    newest = committed[-1]

    resumed = run(base, cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert (
        f"Restoring states from the checkpoint at {ckpts}/{newest}"
        in resumed.stdout + resumed.stderr
    )
    final = manifest(ckpts / "step_000000040")
    config = final["metadata"]["config"]
    assert f"dirpath: {ckpts}" in config  # the interpolation, resolved
    assert final["world_size"] == 2 and final["resumed_from"] == newest
    # the config LightningCLI saved names only the strategy's own, portable arguments
    saved = yaml.safe_load((run_dir / "config.yaml").read_text())
    strategy_args = set(saved["trainer"]["strategy"]["init_args"])
    assert not strategy_args & {
        "bucket_cap_mb",
        "broadcast_buffers",
        "init_sync",
        "mixed_precision",
    }
    # and the CLI shows the resolved config
    assert cli_main(["inspect", str(ckpts / "step_000000040")]) == 0
    assert f"dirpath: {ckpts}" in capsys.readouterr().out


@pytest.mark.parametrize("strategy", ["elastic", "elastic_fsdp"])
def test_torchrun_with_devices_auto(tmp_path, strategy) -> None:
    sharded = ["--sharded"] if strategy == "elastic_fsdp" else []
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        str(SCRIPT),
        "--root",
        str(tmp_path),
        "--devices",
        "auto",
        "--strategy",
        strategy,
        *sharded,
        "--max-steps",
        "7",
    ]
    proc = run(cmd, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert result_line(proc) == {"global_step": 7, "world": 2, "resumed_from": None}
    assert manifest(tmp_path / "ckpts" / "step_000000007")["world_size"] == 2
    proc = run([*cmd[:-1], "9"], cwd=tmp_path)  # restart: resumes from step 7
    assert result_line(proc)["resumed_from"].endswith("step_000000007")


def test_elastic_fsdp_under_lightnings_launcher(tmp_path) -> None:
    cmd = [sys.executable, str(SCRIPT), "--root", str(tmp_path), "--strategy", "elastic_fsdp"]
    cmd += ["--sharded", "--max-steps", "6"]
    proc = run(cmd, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert result_line(proc) == {"global_step": 6, "world": 2, "resumed_from": None}
    proc = run([*cmd[:-1], "8"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert result_line(proc)["resumed_from"].endswith("step_000000006")
    body = manifest(tmp_path / "ckpts" / "step_000000008")
    assert body["resumed_from"] == "step_000000006" and body["world_size"] == 2


def test_ddp_spawn(tmp_path) -> None:
    cmd = [
        sys.executable,
        str(SCRIPT),
        "--root",
        str(tmp_path),
        "--strategy",
        "ddp_spawn",
        "--max-steps",
        "6",
    ]
    proc = run(cmd, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert sorted(p.name for p in (tmp_path / "ckpts").glob("step_*")) == [
        "step_000000005",
        "step_000000006",
    ]
    proc = run([*cmd[:-1], "8"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    body = manifest(tmp_path / "ckpts" / "step_000000008")
    assert body["resumed_from"] == "step_000000006" and body["world_size"] == 2
