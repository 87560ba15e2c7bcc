"""The demo: LightningCLI on 2 CPU processes, asynchronous sharded checkpoints, a crash, a resume.

    python examples/demo.py [--dir demo_run]

1. fit with ElasticStrategy + DistributedCheckpoint (async, every 10 steps); both processes
   crash at step 25 (SIGKILL), like a lost node;
2. list the checkpoints: the saves that committed before the crash are valid; a save still
   being written when the processes died (often step 20's) is incomplete and never loaded;
3. run the very same command again: it resumes from the newest valid checkpoint (verified
   first) and finishes;
4. inspect the last checkpoint (resolved config, versions, files, the checkpoint it resumed
   from);
5. continue the same run on 1 process (the world size changed: the state is resharded and the
   epoch's remaining samples are dealt to the new ranks), then verify every checkpoint;
6. the run's report (``lightning-elastic report``): checkpoints, world sizes, each resume and
   the work the crash lost, from the manifests and the run history; an HTML page beside it.

The summary at the end is read from the checkpoints' own manifests (``lightning-elastic ls``
and ``inspect --json``), not assumed: which steps were committed when the processes died, and
which checkpoint each run resumed from.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
CLI = [sys.executable, "-m", "lightning_elastic.cli"]


def step(title: str) -> None:
    print(f"\n== {title} ==", flush=True)


def run(cmd: list[str], check: bool = True) -> tuple[int, str]:
    """Run ``cmd``, echoing its output as it comes; return its exit code and stdout."""
    print("$ " + " ".join(str(c) for c in cmd).replace(sys.executable, "python"), flush=True)
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, bufsize=1) as proc:
        assert proc.stdout is not None
        lines = []
        for line in proc.stdout:
            print(line, end="", flush=True)
            lines.append(line)
        code = proc.wait(timeout=900)
    if check and code != 0:
        raise SystemExit(f"command failed with exit code {code}")
    return code, "".join(lines)


def cli_json(*args: str) -> Any:
    """A ``lightning-elastic`` verb's ``--json`` output (not echoed)."""
    out = subprocess.run([*CLI, *args, "--json"], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def valid(listing: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [c for c in listing if c["status"] == "valid"]


def resumed_from(ckpts: Path, listing: list[dict[str, Any]]) -> str | None:
    """The checkpoint the run that wrote the newest valid checkpoint resumed from (its
    manifest records it), or ``None`` when that run started fresh."""
    newest = valid(listing)[-1]
    name: str | None = cli_json("inspect", str(ckpts / newest["name"]))["manifest"]["resumed_from"]
    return name


def step_of(name: str | None, *listings: list[dict[str, Any]]) -> str:
    """``"step N"`` for a checkpoint name, from any listing that saw it (retention may have
    deleted it since)."""
    if name is None:
        return "nothing (a fresh start)"
    for listing in listings:
        for c in listing:
            if c["name"] == name and c["step"] is not None:
                return f"step {c['step']}"
    return name


def steps(listing: list[dict[str, Any]], status: str) -> str:
    found = [str(c["step"]) for c in listing if c["status"] == status]
    return ", ".join(found) if found else "none"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dir", default="demo_run", help="where the run and its checkpoints go")
    args = parser.parse_args()
    run_dir = Path(args.dir).resolve()
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    config = (
        (HERE / "config.yaml")
        .read_text()
        .replace("default_root_dir: demo_run", f"default_root_dir: {run_dir}")
    )
    # not "config.yaml": LightningCLI saves the resolved config under that name in the run dir
    (run_dir / "demo-config.yaml").write_text(config)
    fit = [
        sys.executable,
        "-W",
        "ignore",
        str(HERE / "lightning_cli.py"),
        "fit",
        "--config",
        str(run_dir / "demo-config.yaml"),
    ]
    ckpts = run_dir / "checkpoints"

    step("1. train on 2 processes, checkpointing asynchronously every 10 steps; crash at step 25")
    code, out = run([*fit, "--model.kill_at_step", "25"], check=False)
    crash = re.search(r"simulated crash at step (\d+)", out)
    crashed_at = f"step {crash.group(1)}" if crash else f"exit code {code}"
    print(f"(the run died with exit code {code})", flush=True)

    step("2. what is on disk: only committed checkpoints are listed as valid")
    run([*CLI, "ls", str(ckpts)])
    after_crash = cli_json("ls", str(ckpts))

    step("3. the same command again: it resumes from the newest valid checkpoint and finishes")
    run(fit)
    after_resume = cli_json("ls", str(ckpts))
    first_resume = resumed_from(ckpts, after_resume)

    step("4. the last checkpoint: its manifest records the resolved config, versions and files")
    run([*CLI, "inspect", str(ckpts / valid(after_resume)[-1]["name"])])

    step("5. elastic: continue the same run on 1 process instead of 2, up to step 80")
    run([*fit, "--trainer.devices", "1", "--trainer.max_steps", "80"])
    run([*CLI, "ls", str(ckpts)])
    run([*CLI, "verify", str(ckpts)])
    final = cli_json("ls", str(ckpts))
    second_resume = resumed_from(ckpts, final)

    step("6. the run's report: checkpoints, world sizes, resumes and the work the crash lost")
    run([*CLI, "report", str(ckpts), "--output", str(run_dir / "report.html")])
    report = cli_json("report", str(ckpts))
    lost = report["totals"].get("lost_steps")

    print(
        f"\ndemo finished: crashed at {crashed_at} with steps {steps(after_crash, 'valid')}"
        f" committed (incomplete: {steps(after_crash, 'incomplete')});"
        f" resumed from {step_of(first_resume, after_crash, after_resume)} on 2 processes,"
        f" finished at step {valid(after_resume)[-1]['step']};"
        f" resumed from {step_of(second_resume, after_resume, final)} on 1 process,"
        f" finished at step {valid(final)[-1]['step']};"
        f" the crash lost {lost} step(s) of work (report: {run_dir / 'report.html'})",
        flush=True,
    )


if __name__ == "__main__":
    main()
