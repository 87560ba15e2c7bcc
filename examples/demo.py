"""The demo: LightningCLI on 2 CPU processes, asynchronous sharded checkpoints, a crash, a resume.

    python examples/demo.py [--dir demo_run]

1. fit with ElasticStrategy + DistributedCheckpoint (async, every 10 steps); both processes
   crash at step 25 (SIGKILL), like a lost node;
2. list the checkpoints: steps 10 and 20 are committed, nothing partial is visible;
3. run the very same command again: it resumes from step 20 (verified first) and finishes;
4. inspect the last checkpoint (resolved config, versions, files);
5. continue the same run on 1 process (the world size changed: the state is resharded and the
   epoch's remaining samples are dealt to the new ranks), then verify every checkpoint.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def step(title: str) -> None:
    print(f"\n== {title} ==", flush=True)


def run(cmd: list[str], check: bool = True) -> int:
    print("$ " + " ".join(str(c) for c in cmd).replace(sys.executable, "python"), flush=True)
    code = subprocess.run(cmd, timeout=900, check=False).returncode
    if check and code != 0:
        raise SystemExit(f"command failed with exit code {code}")
    return code


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
    cli = [sys.executable, "-m", "lightning_elastic.cli"]
    ckpts = run_dir / "checkpoints"

    step("1. train on 2 processes, checkpointing asynchronously every 10 steps; crash at step 25")
    code = run([*fit, "--model.kill_at_step", "25"], check=False)
    print(f"(the run died with exit code {code})", flush=True)

    step("2. what is on disk: only committed checkpoints are listed as valid")
    run([*cli, "ls", str(ckpts)])

    step("3. the same command again: it resumes from the newest valid checkpoint and finishes")
    run(fit)

    step("4. the last checkpoint: its manifest records the resolved config, versions and files")
    newest = sorted(p for p in ckpts.iterdir() if p.is_dir())[-1]
    run([*cli, "inspect", str(newest)])

    step("5. elastic: continue the same run on 1 process instead of 2, up to step 80")
    run([*fit, "--trainer.devices", "1", "--trainer.max_steps", "80"])
    run([*cli, "ls", str(ckpts)])
    run([*cli, "verify", str(ckpts)])
    print(
        "\ndemo finished: crashed at step 25, resumed from step 20 on 2 processes, finished at 60;"
        " resumed from 60 on 1 process, finished at 80",
        flush=True,
    )


if __name__ == "__main__":
    main()
