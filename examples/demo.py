"""The demo: 2 CPU processes train with asynchronous checkpoints, get killed, and resume.

python examples/demo.py [--dir demo_checkpoints]
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def torchrun(*args: str) -> int:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        str(HERE / "train_core.py"),
        *args,
    ]
    print("$ " + " ".join(["torchrun", *cmd[3:]]), flush=True)
    return subprocess.run(cmd, timeout=600, check=False).returncode


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--dir", default="demo_checkpoints")
    args = parser.parse_args()
    shutil.rmtree(args.dir, ignore_errors=True)

    print("\n== 1. train, checkpointing every 5 steps; rank 0 dies at step 23 ==", flush=True)
    code = torchrun("--dir", args.dir, "--steps", "40", "--kill-at", "23")
    print(f"(exit code {code}: the job was interrupted)\n", flush=True)

    print("== 2. the checkpoints on disk ==", flush=True)
    subprocess.run([sys.executable, "-m", "lightning_elastic.cli", "ls", args.dir], check=True)

    print(
        "\n== 3. run again: it resumes from the newest valid checkpoint and finishes ==", flush=True
    )
    code = torchrun("--dir", args.dir, "--steps", "40")
    if code != 0:
        raise SystemExit(f"resumed run failed with exit code {code}")

    print("\n== 4. verify every checkpoint against its manifest ==", flush=True)
    subprocess.run([sys.executable, "-m", "lightning_elastic.cli", "verify", args.dir], check=True)
    print("\ndemo finished: interrupted at step 23, resumed from step 20, finished at step 40")


if __name__ == "__main__":
    main()
