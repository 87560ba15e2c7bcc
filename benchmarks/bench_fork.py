"""Fork-safety benchmark (#16 item 7): how often a forked child hangs, and what forks cost,
while other threads run: the evidence behind ``lightning_elastic/core/forksafe.py``.

Part 1, threads (each case in a fresh interpreter, stderr buffered as it is by default, i.e.
without ``PYTHONUNBUFFERED``): the main thread forks children that write to stderr and exit,
while two background threads

* ``none``            - do nothing (the floor);
* ``python-threads``  - start and join Python threads in a loop (each start and exit takes
                        the interpreter's HEAD_LOCK, with the GIL held);
* ``foreign-threads`` - start C threads (``pthread_create`` through ctypes) that call into
                        Python: each creates and deletes a thread state, taking HEAD_LOCK
                        *without* the GIL, as pybind11 callbacks on C++ threads do
                        (CPython gh-112275 on 3.10.14- / 3.11.9-);
* ``stderr-logger``   - log records to stderr in a loop (a writer thread that logs);
* ``stderr-logger-gated`` - the same through ``fork_safe_logger`` (the fork gate).

A child still running after ``--child-timeout`` seconds counts as hung (killed; its stack is
printed once with gdb when ``--gdb``); a case stops after ``--max-hangs`` hangs.

Part 2, the engine (one process, ``--mib`` MiB of state, async saves back to back): fork
latency with no save in flight and during saves, hung children, and seconds per save, for
three placements of the gate: ``off`` (no gate), ``records`` (what ships: log records of the
writer inside the gate) and ``chunks`` (also every written chunk inside the gate, the
alternative that was rejected).

    python benchmarks/bench_fork.py [--forks 1000] [--engine-forks 300] [--mib 64] [--out f.json]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import logging
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

THREAD_CASES = (
    "none",
    "python-threads",
    "foreign-threads",
    "stderr-logger",
    "stderr-logger-gated",
)


def fork_and_wait(child: Callable[[], None], timeout: float, gdb: bool) -> tuple[float, bool]:
    """Fork; return (seconds the parent spent in ``os.fork``, whether the child hung)."""
    start = time.perf_counter()
    pid = os.fork()
    if pid == 0:
        try:
            child()
        finally:
            os._exit(0)
    forked = time.perf_counter() - start
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        done, _ = os.waitpid(pid, os.WNOHANG)
        if done:
            return forked, False
        time.sleep(0.0005)
    if gdb:
        out = subprocess.run(
            ["gdb", "-p", str(pid), "-batch", "-ex", "bt 12"],
            capture_output=True,
            text=True,
            timeout=60,
        ).stdout
        frames = [line[:160] for line in out.splitlines() if line.startswith("#")]
        print("  hung child:\n    " + "\n    ".join(frames), file=sys.__stdout__, flush=True)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return forked, True


def child_writes_stderr() -> None:
    sys.stderr.write("child\n")  # a worker's warning; multiprocessing also flushes at exit
    sys.stderr.flush()


def child_flushes_stderr() -> None:
    sys.stderr.flush()  # what multiprocessing does when a worker exits


# ------------------------------------------------------------------ part 1: threads


def python_threads(stop: threading.Event) -> None:
    while not stop.is_set():
        thread = threading.Thread(target=lambda: None)
        thread.start()
        thread.join()


def foreign_threads(stop: threading.Event) -> None:
    libc = ctypes.CDLL(None)
    start_routine = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p)
    callback = start_routine(lambda arg: None)  # runs on the C thread, with a new thread state
    while not stop.is_set():
        tid = ctypes.c_ulong()
        libc.pthread_create(ctypes.byref(tid), None, callback, None)
        libc.pthread_join(tid, None)


def stderr_logger(gated: bool) -> Callable[[threading.Event], None]:
    from lightning_elastic.core.forksafe import fork_safe_logger

    name = f"bench.fork.{'gated' if gated else 'plain'}"
    logger = fork_safe_logger(name) if gated else logging.getLogger(name)

    def log_loop(stop: threading.Event) -> None:
        while not stop.is_set():
            logger.warning("a record from a background thread %s", "x" * 100)

    return log_loop


def run_thread_case(case: str, forks: int, timeout: float, max_hangs: int, gdb: bool) -> dict:
    logging.basicConfig(stream=sys.stderr, level=logging.INFO)
    background: Callable[[threading.Event], None] | None = {
        "none": None,
        "python-threads": python_threads,
        "foreign-threads": foreign_threads,
        "stderr-logger": stderr_logger(gated=False),
        "stderr-logger-gated": stderr_logger(gated=True),
    }[case]
    stop = threading.Event()
    count = 0 if background is None else 2
    threads = [threading.Thread(target=background, args=(stop,), daemon=True) for _ in range(count)]
    for thread in threads:
        thread.start()
    time.sleep(0.2)
    hangs, done, latencies = 0, 0, []
    start = time.monotonic()
    while done < forks and hangs < max_hangs:
        latency, hung = fork_and_wait(child_writes_stderr, timeout, gdb and hangs == 0)
        latencies.append(latency)
        hangs += hung
        done += 1
    stop.set()
    return {
        "case": case,
        "forks": done,
        "hangs": hangs,
        "fork_ms_median": 1e3 * statistics.median(latencies),
        "seconds": time.monotonic() - start,
    }


def thread_cases(args: argparse.Namespace) -> list[dict]:
    results = []
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    with tempfile.TemporaryDirectory() as scratch:
        for case in THREAD_CASES:
            command = [sys.executable, __file__, "--case", case, "--forks", str(args.forks)]
            command += ["--child-timeout", str(args.child_timeout)]
            command += ["--max-hangs", str(args.max_hangs)] + (["--gdb"] if args.gdb else [])
            with open(Path(scratch, f"{case}.stderr"), "w") as err:
                out = subprocess.run(
                    command, env=env, stdout=subprocess.PIPE, stderr=err, text=True, check=True
                )
            lines = out.stdout.strip().splitlines()
            if len(lines) > 1:  # a hung child's stack
                print("\n".join(lines[:-1]), flush=True)
            result = json.loads(lines[-1])
            results.append(result)
            print(
                f"{case:20s} forks {result['forks']:5d}  hung {result['hangs']:3d}"
                f" ({result['hangs'] / result['forks']:.1%})  fork median"
                f" {result['fork_ms_median']:.2f} ms  ({result['seconds']:.0f} s)",
                flush=True,
            )
    return results


# ------------------------------------------------------------------ part 2: the engine


class _NoGate:
    """A lock that never blocks: the gate turned off."""

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        return True

    def release(self) -> None:
        pass


def engine_case(placement: str, forks: int, mib: int, timeout: float) -> dict:
    import torch

    from lightning_elastic import CheckpointEngine, KeepLastN
    from lightning_elastic.core import forksafe
    from lightning_elastic.core.storage import local

    original_gate, original_write = forksafe._gate, local._LocalFile.write
    if placement == "off":
        forksafe._gate = _NoGate()  # type: ignore[assignment]
    elif placement == "chunks":

        def gated_write(self: Any, view: memoryview) -> None:
            with forksafe.fork_gate():
                original_write(self, view)

        local._LocalFile.write = gated_write  # type: ignore[method-assign]
    try:
        state = {"w": torch.randn(mib << 18)}  # float32
        idle = [fork_and_wait(child_flushes_stderr, timeout, False)[0] for _ in range(50)]
        busy, hangs, save_s, handle = [], 0, [], None
        with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_DIR")) as root:
            engine = CheckpointEngine(root, retention=[KeepLastN(1)])
            step = 0
            while len(busy) < forks:
                if handle is None or handle.done():
                    if handle is not None:
                        save_s.append(handle.result().total_s)
                    step += 1
                    handle = engine.save(state, step=step)
                    continue
                latency, hung = fork_and_wait(child_flushes_stderr, timeout, False)
                busy.append(latency)
                hangs += hung
            engine.close()
    finally:
        forksafe._gate, local._LocalFile.write = original_gate, original_write  # type: ignore[method-assign]
    busy.sort()
    return {
        "placement": placement,
        "fork_ms_idle_median": 1e3 * statistics.median(idle),
        "fork_ms_saving_median": 1e3 * statistics.median(busy),
        "fork_ms_saving_p99": 1e3 * busy[int(0.99 * (len(busy) - 1))],
        "fork_ms_saving_max": 1e3 * busy[-1],
        "forks_during_saves": len(busy),
        "hangs": hangs,
        "saves": len(save_s),
        "save_s_median": statistics.median(save_s) if save_s else None,
        "gb_per_s": (mib << 20) / 1e9 / statistics.median(save_s) if save_s else None,
    }


def engine_cases(args: argparse.Namespace) -> list[dict]:
    results = []
    print(f"\nengine: {args.mib} MiB, async saves back to back, forks while they run", flush=True)
    for placement in ("off", "records", "chunks"):
        r = engine_case(placement, args.engine_forks, args.mib, args.child_timeout)
        results.append(r)
        print(
            f"gate {placement:8s} fork ms idle {r['fork_ms_idle_median']:.2f}  saving median"
            f" {r['fork_ms_saving_median']:.2f} p99 {r['fork_ms_saving_p99']:.1f}"
            f" max {r['fork_ms_saving_max']:.1f}  hung {r['hangs']}/{r['forks_during_saves']}"
            f"  save {r['save_s_median']:.3f} s ({r['gb_per_s']:.2f} GB/s, {r['saves']} saves)",
            flush=True,
        )
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--forks", type=int, default=1000, help="forks per thread case")
    parser.add_argument("--engine-forks", type=int, default=300, help="forks per gate placement")
    parser.add_argument("--mib", type=int, default=64, help="state size for the engine part")
    parser.add_argument("--child-timeout", type=float, default=3.0)
    parser.add_argument("--max-hangs", type=int, default=10)
    parser.add_argument("--gdb", action="store_true", help="print a hung child's stack once")
    parser.add_argument("--case", choices=THREAD_CASES, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.case:  # one thread case, in this fresh interpreter
        result = run_thread_case(
            args.case, args.forks, args.child_timeout, args.max_hangs, args.gdb
        )
        print(json.dumps(result), file=sys.__stdout__, flush=True)
        return
    print(f"Python {sys.version.split()[0]}, {os.cpu_count()} cores", flush=True)
    summary = {"python": sys.version.split()[0], "threads": thread_cases(args)}
    summary["engine"] = engine_cases(args)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
