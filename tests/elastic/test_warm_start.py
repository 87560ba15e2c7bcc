"""``lightning-elastic run --warm-start``: workers forked from a server that imported torch and
Lightning, running the script as ``python script.py`` would."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_elastic.launcher import main as launch

pytestmark = pytest.mark.timeout(180)

PROBE = """
import atexit, json, os, sys
warm = "torch" in sys.modules and "lightning.pytorch" in sys.modules
import torch
import sibling  # next to the script: its folder is first on sys.path

record = {
    "rank": int(os.environ["RANK"]), "name": __name__, "argv": sys.argv[1:], "warm": warm,
    "path0": sys.path[0], "sibling": sibling.VALUE, "threads": torch.get_num_threads(),
    "omp": os.environ.get("OMP_NUM_THREADS"), "stdin": os.path.realpath("/proc/self/fd/0"),
}
out = os.path.join(os.path.dirname(os.path.abspath(__file__)), f"rank{record['rank']}")
atexit.register(lambda: open(out + ".atexit", "w").close())
with open(out + ".json", "w") as f:
    json.dump(record, f)
if "--fail" in sys.argv and record["rank"] == 1:
    sys.exit(3)
"""


def launch_probe(
    folder: Path, *args: str, launcher_args: tuple[str, ...] = ()
) -> subprocess.CompletedProcess:
    (folder / "probe.py").write_text(PROBE)
    (folder / "sibling.py").write_text("VALUE = 42\n")
    cmd = [
        sys.executable,
        "-c",
        "import sys; from lightning_elastic.cli import main; sys.exit(main())",
        "run",
        "--warm-start",
        *launcher_args,
        "--standalone",
        "--nproc-per-node=2",
        "--max-restarts=0",
        str(folder / "probe.py"),
        *args,
    ]
    env = {**os.environ, "PYTHONPATH": str(folder)}  # modules next to the script, for --preload
    return subprocess.run(cmd, capture_output=True, text=True, timeout=150, cwd="/", env=env)


def test_the_script_runs_as_python_would_run_it(tmp_path) -> None:
    done = launch_probe(tmp_path, "--lr", "0.1")
    assert done.returncode == 0, done.stderr[-3000:]
    for rank in range(2):
        record = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert record["warm"], "torch/Lightning were not imported before the script started"
        assert record["name"] == "__main__" and record["argv"] == ["--lr", "0.1"]
        assert record["path0"] == str(tmp_path.resolve()) and record["sibling"] == 42
        # torchrun's OMP_NUM_THREADS=1 for 2 workers reached torch, imported before it was set
        assert record["omp"] == "1" and record["threads"] == 1
        assert record["stdin"] == "/dev/null"
        assert (tmp_path / f"rank{rank}.atexit").exists(), "exit handlers did not run"


def test_sys_exit_none_ends_the_job_as_a_success(tmp_path) -> None:
    """torch's worker wrapper counts only SystemExit(0) as a success; a worker that exited 0
    without returning left the agent waiting forever."""
    done = launch_probe(tmp_path, "--exit-none")
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "rank1.atexit").exists()


def test_a_module_that_fails_to_preload_is_reported_and_left_to_the_workers(tmp_path) -> None:
    (tmp_path / "badmod.py").write_text("raise RuntimeError('broken at import')\n")
    done = launch_probe(tmp_path, launcher_args=("--preload", "badmod"))
    assert done.returncode == 0, done.stderr[-3000:]  # the probe does not import it
    assert "could not preload badmod (RuntimeError: broken at import)" in done.stderr
    assert json.loads((tmp_path / "rank0.json").read_text())["warm"]  # the rest was preloaded


def test_the_preload_variable_is_the_launchers() -> None:
    from lightning_elastic import _preload, launcher

    assert _preload.PRELOAD_ENV == launcher.PRELOAD_ENV


def test_a_failing_worker_fails_the_job_with_its_exit_code(tmp_path) -> None:
    done = launch_probe(tmp_path, "--fail")
    assert done.returncode == 1
    assert "exitcode  : 3" in done.stderr, done.stderr[-3000:]


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--preload", "no_such_module_here"], "no module named 'no_such_module_here'"),
        (["--preload", "no_such_package.sub"], "no module named 'no_such_package.sub'"),
        (["--warm-start", "-m"], "not with --no-python or -m"),
        (["--warm-start", "--no-python"], "not with --no-python or -m"),
    ],
)
def test_bad_warm_start_options_are_refused(args, says, capsys) -> None:
    assert launch([*args, "--standalone", "train.py"]) == 2
    assert says in capsys.readouterr().err
