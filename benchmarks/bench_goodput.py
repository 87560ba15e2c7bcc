"""Goodput of an elastic run under membership changes: 2 ``lightning-elastic run`` agents as
nodes on this machine, a fixed step time, checkpoints every ``--every`` steps, and every
``--period`` seconds an event on node B:

* ``loss``: node B's agent and worker are SIGKILLed; a fresh node B joins ``--rejoin`` s later;
* ``planned``: node B is drained (SIGTERM: the agreed checkpoint, exit 143) and a fresh node B
  joins ``--rejoin`` s later; ``--delivery`` says to whom the SIGTERM goes: its agent
  (``agent``: what a node drain does), its agent's process group (``group``: a shell's
  Ctrl-C, ``kill -TERM -PGID``, systemd's control-group stop) or every process of the node
  (``node``: SLURM's scancel, a container runtime's stop);
* ``none``: no event (the fault-free rate the others are compared with).

Reported: goodput = steps kept / (wall time x fault-free steps per second), steps re-executed,
and for every restarted worker group the recovery split: from the event to the process start
(torchrun's detection + rendezvous), process start to imports done (interpreter, torch,
Lightning), imports to training start (Trainer and process group setup plus our checkpoint
selection, verification, load and resharding, the last reported alone as ``ours_s``), training
start to the first step; for joins and leaves apart. Two more per restart: the pause (the
previous group's last step to this group's first) and the start skew (its first worker's start
to its last one's: a worker that waited for its node's imports holds the whole group back).

    python benchmarks/bench_goodput.py --mode loss --period 60 --duration 300
    python benchmarks/bench_goodput.py --mode none --duration 60
    python benchmarks/bench_goodput.py --mode planned --warm-start   # workers forked warm
    python benchmarks/bench_goodput.py --mode planned --warm-start --delivery group
    python benchmarks/bench_goodput.py --mode loss --ft   # replica groups beside the restart path

``--ft`` runs the same workload with replica groups (``strategy="elastic_ft"``, see
``goodput_ft.py``) and the restart path, each with its fault-free run first, and prints both.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.elastic import journal  # noqa: E402

SCRIPT = ROOT / "tests" / "elastic" / "scripts" / "elastic_train.py"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def kill_tree(pid: int, sig: int = signal.SIGKILL) -> None:
    with contextlib.suppress(psutil.NoSuchProcess):
        parent = psutil.Process(pid)
        for proc in [*parent.children(recursive=True), parent]:
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.send_signal(sig)


def deliver(how: str, pid: int) -> None:
    """SIGTERM for the node whose agent is ``pid`` (a session of its own): to the agent, to its
    process group, or to every process of the node."""
    if how == "agent":
        os.kill(pid, signal.SIGTERM)
    elif how == "group":
        os.killpg(pid, signal.SIGTERM)
    else:
        kill_tree(pid, signal.SIGTERM)


def start_agent(root: Path, port: int, args: argparse.Namespace, name: str) -> subprocess.Popen:
    cmd = [
        sys.executable,
        "-c",
        "import sys; from lightning_elastic.cli import main; sys.exit(main())",
        "run",
        *(["--warm-start"] if args.warm_start else []),
        "--nnodes=1:2",
        "--nproc-per-node=1",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{port}",
        "--rdzv-id=goodput",
        f"--rdzv-conf=join_timeout=300,last_call_timeout={args.last_call},"
        f"keep_alive_interval={args.keep_alive},keep_alive_max_attempt={args.keep_alive_attempts}",
        "--max-restarts=1000",
        "--monitor-interval=0.5",
        str(SCRIPT),
        "--root",
        str(root),
        "--max-steps",
        str(args.max_steps),
        "--every",
        str(args.every),
        "--step-sleep",
        str(args.step_time),
    ]
    env = {
        **os.environ,
        "PYTHONWARNINGS": "ignore",
        "OMP_NUM_THREADS": "1",
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
    }
    log = (root / f"agent-{name}.log").open("w")
    return subprocess.Popen(
        cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
    )


def run(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    port = free_port()
    host = start_agent(root, port, args, "a")
    time.sleep(1.0)
    nodes = [start_agent(root, port, args, "b0")]
    events: list[tuple[str, float]] = []
    deadline = time.time() + 300
    while not any(r["kind"] == "step" for r in journal.read(root / "journal")):
        if time.time() > deadline or host.poll() is not None:
            kill_tree(host.pid)
            kill_tree(nodes[0].pid)
            raise SystemExit("no training step: " + (root / "agent-a.log").read_text()[-3000:])
        time.sleep(0.5)
    began = time.time()  # the clock starts at the first step
    end = began + args.duration
    next_event = began + args.period
    try:
        while time.time() < end and host.poll() is None:
            time.sleep(0.2)
            if args.mode == "none" or time.time() < next_event:
                continue
            node = nodes[-1]
            events.append(("leave", time.time()))
            if args.mode == "loss":
                kill_tree(node.pid)
            else:
                deliver(args.delivery, node.pid)
            with contextlib.suppress(subprocess.TimeoutExpired):
                node.wait(timeout=120)
            time.sleep(args.rejoin)
            events.append(("join", time.time()))
            nodes.append(start_agent(root, port, args, f"b{len(nodes)}"))
            next_event = events[-2][1] + args.period
    finally:
        stopped = time.time()
        for proc in [host, *nodes]:
            if proc.poll() is None:
                kill_tree(proc.pid)
            proc.wait()
    recs = journal.read(root / "journal")
    steps = [r for r in recs if r["kind"] == "step"]
    wall = stopped - began
    kept = len({r["step"] for r in steps})
    trained = {(r["inc"], r["step"]) for r in steps}
    groups = sorted({r["inc"] for r in recs if r["kind"] == "start"})
    splits = []
    for previous, inc in itertools.pairwise(groups):
        workers = [r for r in recs if r["kind"] == "start" and r["inc"] == inc]
        start = min(workers, key=lambda r: r["t_start"])
        first = min((r["t"] for r in steps if r["inc"] == inc), default=None)
        last = max((r["t"] for r in steps if r["inc"] == previous), default=None)
        # a join grows the world, a leave shrinks it: the latest event of that kind (a leave's
        # restart may come after the rejoin was started, when detecting the leave took longer)
        before = next(r for r in recs if r["kind"] == "start" and r["inc"] == previous)
        kind = "join" if start["world"] > before["world"] else "leave"
        event = max(
            (e for e in events if e[0] == kind and e[1] <= start["t_start"]),
            default=None,
            key=lambda e: e[1],
        )
        if first is None or last is None or event is None:
            continue
        splits.append(
            {
                "event": event[0],
                "detect_rendezvous_s": start["t_start"] - event[1],
                "process_imports_s": start["t_imported"] - start["t_start"],
                "setup_and_load_s": start["t"] - start["t_imported"],
                # of which ours: checkpoint selection, verification, read, resharding
                "ours_s": start.get("ours_s") or 0.0,
                "first_step_s": first - start["t"],
                "total_s": first - event[1],
                "pause_s": first - last,
                "start_skew_s": max(r["t_start"] for r in workers) - start["t_start"],
            }
        )
    return {
        "mode": args.mode,
        "delivery": args.delivery if args.mode == "planned" else None,
        "warm_start": args.warm_start,
        "period_s": args.period,
        "wall_s": wall,
        "steps_kept": kept,
        "steps_trained": len(trained),
        "steps_re_executed": len(trained) - kept,
        "events": len(events),
        "worker_groups": len(groups),
        "recovery": splits,
    }


def summary(result: dict[str, Any], fault_free_steps_per_s: float) -> dict[str, Any]:
    goodput = result["steps_kept"] / (result["wall_s"] * fault_free_steps_per_s)
    medians = {}
    for event in ("leave", "join"):
        splits = [s for s in result["recovery"] if s["event"] == event]
        if splits:
            medians[event] = {
                k: statistics.median(s[k] for s in splits) for k in splits[0] if k != "event"
            }
    return {
        **{k: v for k, v in result.items() if k != "recovery"},
        "goodput": goodput,
        "median_recovery": medians,
    }


def table(out: dict[str, Any]) -> str:
    """The run as a row of the table in docs/elastic.md (and its header)."""
    how = {
        "none": "no event",
        "loss": "node loss (SIGKILL of its process tree)",
        "planned": {
            "agent": "planned drain, SIGTERM to the agent",
            "group": "planned drain, SIGTERM to the agent's process group",
            "node": "planned drain, SIGTERM to every process of the node",
        }.get(out["delivery"], ""),
    }[out["mode"]]
    join = out["median_recovery"].get("join", {})
    cells = [
        f"{how}{', warm' if out['warm_start'] else ''} every {out['period_s']:.0f} s "
        f"({out['wall_s']:.0f} s)",
        f"{out['goodput']:.2f}",
        f"{out['steps_re_executed']} (of {out['steps_kept']} kept)",
        str(out["worker_groups"]),
        f"{join.get('pause_s', float('nan')):.1f} s / {join.get('start_skew_s', float('nan')):.1f} s",
    ]
    header = "| events | goodput | steps re-executed | worker groups | join: pause / start skew |"
    return header + "\n|---|---|---|---|---|\n| " + " | ".join(cells) + " |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", choices=["none", "loss", "planned"], default="loss")
    parser.add_argument(
        "--delivery",
        choices=["agent", "group", "node"],
        default="agent",
        help="planned: SIGTERM to node B's agent, its process group, or every process of B",
    )
    parser.add_argument("--period", type=float, default=60.0, help="seconds between events")
    parser.add_argument("--rejoin", type=float, default=5.0, help="seconds until B rejoins")
    parser.add_argument("--duration", type=float, default=300.0, help="seconds of wall time")
    parser.add_argument("--step-time", type=float, default=0.25)
    parser.add_argument("--every", type=int, default=8, help="checkpoint every N steps")
    parser.add_argument("--keep-alive", type=int, default=1)
    parser.add_argument("--keep-alive-attempts", type=int, default=3)
    parser.add_argument("--last-call", type=int, default=2)
    parser.add_argument(
        "--fault-free-steps-per-s",
        type=float,
        default=None,
        help="measured with --mode none (default: 1 / step-time)",
    )
    parser.add_argument(
        "--warm-start",
        action="store_true",
        help="lightning-elastic run --warm-start: workers forked with torch and Lightning imported",
    )
    parser.add_argument(
        "--ft",
        action="store_true",
        help="replica groups (elastic_ft) beside the restart path, fault-free runs included",
    )
    parser.add_argument("--heartbeat", type=float, default=1.0, help="--ft: Lighthouse heartbeat")
    parser.add_argument("--join", type=float, default=0.5, help="--ft: Lighthouse join timeout")
    parser.add_argument("--json", type=Path, default=None, help="also write the result here")
    args = parser.parse_args()
    args.max_steps = 1_000_000  # the run is ended by --duration
    if args.ft:
        from benchmarks.goodput_ft import compare

        both = json.dumps(compare(args, run, summary), indent=1)
        print(both)
        if args.json is not None:
            args.json.write_text(both)
        return
    with tempfile.TemporaryDirectory(prefix="goodput-") as tmp:
        result = run(args, Path(tmp))
    rate = args.fault_free_steps_per_s or 1.0 / args.step_time
    if args.mode == "none":
        rate = result["steps_kept"] / result["wall_s"]
    out = summary(result, rate)
    out["fault_free_steps_per_s"] = rate
    out["recovery"] = result["recovery"]
    text = json.dumps(out, indent=1)
    print(text)
    print(table(out))
    if args.json is not None:
        args.json.write_text(text)


if __name__ == "__main__":
    main()
