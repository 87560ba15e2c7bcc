"""``lightning-elastic run --warm-start``: workers forked from a server that imported torch and
Lightning, running the script as ``python script.py`` would."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lightning_elastic.launcher import main as launch

pytestmark = pytest.mark.timeout(180)

PROBE = """
import atexit, json, multiprocessing, os, signal, sys
warm = "torch" in sys.modules and "lightning.pytorch" in sys.modules
handlers = {s: signal.getsignal(getattr(signal, s)) for s in ("SIGTERM", "SIGINT", "SIGHUP")}
with open(f"/proc/{os.getppid()}/status") as status:  # the server's ignored signals
    server_ignored = int(next(l for l in status if l.startswith("SigIgn:")).split()[1], 16)
import torch
import sibling  # next to the script: its folder is first on sys.path

record = {
    "rank": int(os.environ["RANK"]), "name": __name__, "argv": sys.argv[1:], "warm": warm,
    "path0": sys.path[0], "sibling": sibling.VALUE, "threads": torch.get_num_threads(),
    "omp": os.environ.get("OMP_NUM_THREADS"), "stdin": os.path.realpath("/proc/self/fd/0"),
    "session": os.getsid(0) == os.getpgid(0) == os.getpid(),
    "handlers": [h is signal.SIG_DFL or h is signal.default_int_handler for h in handlers.values()],
    "start_method": multiprocessing.get_start_method(allow_none=True),
    "server_ignores": [bool(server_ignored >> (s - 1) & 1) for s in (1, 2, 3, 15)],
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
    # modules next to the script, for --preload (and this checkout's package, not an installed one)
    path = [str(folder), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
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
        # a session of its own, as torchrun starts its workers, and the signal handlers of a
        # fresh interpreter (the server it was forked from ignores the agent's signals)
        assert record["session"] and record["handlers"] == [True] * 3
        assert record["server_ignores"] == [True] * 4  # SIGHUP, SIGINT, SIGQUIT, SIGTERM
        # multiprocessing's default, not the forkserver the worker was started by (a
        # DataLoader's workers would start through a server of their own)
        assert record["start_method"] is None
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


def test_the_preload_variables_are_the_launchers() -> None:
    from lightning_elastic import _preload, launcher

    assert _preload.PRELOAD_ENV == launcher.PRELOAD_ENV
    assert _preload.AGENT_ENV == launcher.AGENT_ENV


SERVER = """
import json, os
from lightning_elastic import launcher
os.environ.update({launcher.PRELOAD_ENV: "slowmod", launcher.AGENT_ENV: str(os.getpid())})
server = launcher.WarmServer(["slowmod"])
server.start()
waited = server.wait()
imported = os.path.exists("imported")
print(json.dumps({"waited": waited, "imported": imported, "again": server.wait()}))
"""


def env_with(folder: Path) -> dict[str, str]:
    """This environment with ``folder`` (modules for the server) first on ``PYTHONPATH``."""
    path = [str(folder), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(path)}


def test_the_server_is_ready_only_once_it_has_imported_its_modules(tmp_path) -> None:
    """What the agent waits for before joining its first rendezvous: a joining node then stops
    the running group only when its workers can start at once."""
    (tmp_path / "slowmod.py").write_text("import time\ntime.sleep(1.5)\nopen('imported', 'w')\n")
    done = subprocess.run(
        [sys.executable, "-c", SERVER],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env_with(tmp_path),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout)
    assert result["imported"] and result["waited"] >= 1.0 and result["again"] == 0.0


@pytest.mark.parametrize("server_dies", [False, True])
def test_a_warm_agent_starts_only_once_its_server_is_ready(
    monkeypatch, capsys, server_dies
) -> None:
    """The agent (and with it the rendezvous) starts after the server's imports; a server that
    died fails the node with one line before it has joined (an agent that fails closes the
    rendezvous for every node of the job)."""
    from lightning_elastic import launcher
    from lightning_elastic.errors import WarmStartError

    calls = []

    def wait(_: object) -> None:
        calls.append("server ready")
        if server_dies:
            raise WarmStartError("--warm-start: the fork server died while importing x")

    parser, config = launcher.torchrun_entry()[:2]
    monkeypatch.setattr(launcher.WarmServer, "start", lambda _: calls.append("server started"))
    monkeypatch.setattr(launcher.WarmServer, "wait", wait)
    monkeypatch.setattr(
        launcher, "torchrun_entry", lambda: (parser, config, lambda _: calls.append("agent"))
    )
    assert launch(["--warm-start", "--standalone", "train.py"]) == (1 if server_dies else 0)
    if server_dies:
        assert calls == ["server started", "server ready"]
        assert capsys.readouterr().err == (
            "error: --warm-start: the fork server died while importing x\n"
        )
    else:
        assert calls == ["server started", "server ready", "agent"]


def test_a_server_that_dies_while_importing_says_how_it_ended(tmp_path) -> None:
    """It failed later, in the agent, with multiprocessing's ``EOFError: unexpected EOF``."""
    (tmp_path / "exits.py").write_text("import os\nos._exit(3)\n")
    script = SERVER.replace("slowmod", "exits").replace(
        "waited = server.wait()", "waited = server.wait()  # raises"
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env_with(tmp_path),
    )
    assert done.returncode == 1
    assert (
        "WarmStartError: --warm-start: the fork server died while importing exits: exit "
        "code 3." in done.stderr
    ), done.stderr[-3000:]


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


INTERRUPTED = """
import os, sys, time
open(os.path.join(sys.argv[1], f"{os.getpid()}.pid"), "w").close()  # the test signals it
if sys.argv[2] == "raise":
    raise KeyboardInterrupt
time.sleep(120)
"""


def interrupted(folders: dict[str, Path], how: str) -> dict[str, tuple[int, str, float]]:
    """Run INTERRUPTED on 2 workers with plain torchrun (in ``folders["plain"]``) and with
    ``lightning-elastic run --warm-start`` (in ``folders["warm"]``), side by side, and interrupt
    both ``how``; for each, its exit code, output, and the seconds from the interrupt to its
    end."""
    launchers = {
        "plain": ["-m", "torch.distributed.run"],
        "warm": ["-c", LAUNCH, "run", "--warm-start"],
    }
    procs = {}
    for name, folder in folders.items():
        folder.mkdir()
        (folder / "script.py").write_text(INTERRUPTED)
        cmd = [
            sys.executable,
            *launchers[name],
            "--standalone",
            "--nproc-per-node=2",
            "--max-restarts=0",
            *[str(folder / "script.py"), str(folder), how],
        ]
        # a session of its own, as a shell gives a job: its process group is the agent's
        procs[name] = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
        )
    results, began = {}, {}
    try:
        for name, proc in procs.items():
            deadline = time.monotonic() + 120
            while len(pids := sorted(folders[name].glob("*.pid"))) < 2 and proc.poll() is None:
                assert time.monotonic() < deadline, f"the {name} workers did not start"
                time.sleep(0.1)
            began[name] = time.monotonic()
            if how == "worker":
                os.kill(int(pids[0].stem), signal.SIGINT)
            elif how == "group":
                os.killpg(proc.pid, signal.SIGINT)
        for name, proc in procs.items():
            out, _ = proc.communicate(timeout=60)
            results[name] = (proc.returncode, out, time.monotonic() - began[name])
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    return results


LAUNCH = "import sys; from lightning_elastic.cli import main; sys.exit(main())"


@pytest.mark.parametrize(
    "how",
    [
        "raise",  # the script raises KeyboardInterrupt
        "worker",  # SIGINT to one worker
        "group",  # a shell's Ctrl-C: SIGINT to the agent's process group (it reaches the agent)
    ],
)
def test_ctrl_c_ends_a_warm_job_as_it_ends_a_torchrun_job(tmp_path, how) -> None:
    """It hung: torch's worker wrapper takes a KeyboardInterrupt for a success, and the agent
    waited for ever for the result of a worker that had exited 0."""
    ran = interrupted({"plain": tmp_path / "plain", "warm": tmp_path / "warm"}, how)
    plain, warm = ran["plain"], ran["warm"]
    assert plain[0] == warm[0] != 0, (plain[1][-2000:], warm[1][-2000:])
    assert warm[2] < 30, f"the warm job took {warm[2]:.0f} s to end"
    if how != "group":  # the failure torchrun reports: each worker died by SIGINT
        for out in (plain[1], warm[1]):
            assert "exitcode  : -2" in out and "(SIGINT)" in out, out[-2000:]
        assert warm[1].count("KeyboardInterrupt") == plain[1].count("KeyboardInterrupt")
