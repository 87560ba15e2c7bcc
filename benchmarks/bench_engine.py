"""Save-path benchmark: floors vs torch.distributed.checkpoint vs lightning_elastic, 2 ranks.

Measured in one run, interleaved (every round runs every method once, in the same order, on
both ranks at the same time), reported as medians and as ratios to the floors:

* copy floor      - copying this rank's bytes into an already touched, reused host buffer;
* write floor     - writing the same bytes to a file and fsync-ing it;
* dcp.save / dcp.async_save - DCP's own blocking and async saves;
* ours sync / ours async    - CheckpointEngine(async_save=False / True);
* ours async zstd           - the same with compression="zstd" (bytes saved, throughput).

Per method and rank: seconds blocked in the call, seconds to a durable commit, bytes written,
and peak extra RSS (VmHWM reset through /proc/self/clear_refs before each method).

Default state: 22 x Linear(2048, 2048) with Adam moments (~1.1 GB, replicated on 2 ranks);
``--small`` uses 4 x Linear(512, 512) for a quick run.

    python benchmarks/bench_engine.py [--small] [--rounds 3] [--out benchmarks/results/engine.json]

``--tensors N``: the per-tensor cost instead (#10): N replicated fp32 tensors of 4 KB each,
ours against ``dcp.async_save`` and ``dcp.load`` (same world size), interleaved; seconds
blocked, to a durable commit, and to load, against the targets (20,000 tensors on 2 ranks:
blocked <= 0.15 s, commit <= 1.0 s, load <= 1.0 s). Comma-separated ``--tensors`` and
``--ranks`` sweep the tensor count and the world size.

    python benchmarks/bench_engine.py --tensors 1000,5000,20000 --ranks 2,4,8 [--rounds 3]

With matplotlib installed (``pip install 'lightning_elastic[bench]'``) every run also writes a
PNG beside its JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.distributed as dist

from lightning_elastic.testing.spawn import run_distributed

CHUNK = 16 << 20
DEFAULT_OUT = "benchmarks/results/engine.json"


def build_state(layers: int, width: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=True) for _ in range(layers)])
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    return {"model": model.state_dict(), "optim": opt.state_dict()}


def reset_peak() -> int:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return rss_kib("VmRSS")


def rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def peak_extra(baseline_kib: int) -> int:
    return max(0, rss_kib("VmHWM") - baseline_kib) * 1024


def dir_bytes(path: str, rank: int | None = None) -> int:
    total = 0
    for p in Path(path).rglob("*"):
        if p.is_file() and (rank is None or f"__{rank}_" in p.name or f"rank{rank:05d}" in p.name):
            total += p.stat().st_size
    return total


def worker(layers: int, width: int, rounds: int, scratch: str) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp

    from lightning_elastic import CheckpointEngine

    torch.set_num_threads(1)  # two ranks share two cores
    rank = dist.get_rank()
    group = dist.new_group(backend="gloo")
    state = build_state(layers, width)
    state_bytes = sum(
        t.numel() * t.element_size()
        for part in (state["model"], *[s for s in state["optim"]["state"].values()])
        for t in (part.values() if isinstance(part, dict) else [])
        if isinstance(t, torch.Tensor)
    )
    ours_async = CheckpointEngine(f"{scratch}/ours_async")
    ours_sync = CheckpointEngine(f"{scratch}/ours_sync", async_save=False)
    ours_zstd = CheckpointEngine(f"{scratch}/ours_zstd", compression="zstd")
    # warm-up: first saves allocate the arenas and page in code paths
    my_bytes = ours_async.save(state, step=0).result().bytes_written
    ours_zstd.save(state, step=0).result()
    src = torch.empty(my_bytes, dtype=torch.uint8).random_(0, 255)
    dst = torch.zeros(my_bytes, dtype=torch.uint8)
    records: dict[str, list[dict[str, float]]] = {}

    def record(
        name: str, blocked: float, commit: float, nbytes: int, base: int, resident: int = 0
    ) -> None:
        # peak extra = transient growth during the call + buffers the method keeps between
        # calls (our reused arena; the floors' destination buffer)
        records.setdefault(name, []).append(
            {
                "blocked_s": blocked,
                "commit_s": commit,
                "bytes": nbytes,
                "peak_extra": peak_extra(base) + resident,
            }
        )

    def clean(path: str) -> None:  # rank 0 removes a method's output between measurements
        dist.barrier(group)
        if rank == 0:
            shutil.rmtree(path, ignore_errors=True)
        dist.barrier(group)

    def copy_floor(step: int) -> None:
        base = reset_peak()
        t0 = time.perf_counter()
        dst.copy_(src)
        t = time.perf_counter() - t0
        record("copy floor", t, t, my_bytes, base, resident=dst.numel())

    def write_floor(step: int) -> None:
        path = f"{scratch}/floor-{rank}.bin"
        view = memoryview(dst.numpy())
        base = reset_peak()
        t0 = time.perf_counter()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        for i in range(0, my_bytes, CHUNK):
            os.write(fd, view[i : i + CHUNK])
        os.fsync(fd)
        os.close(fd)
        t = time.perf_counter() - t0
        record("write floor", t, t, my_bytes, base)
        os.unlink(path)

    def dcp_sync(step: int) -> None:
        target = f"{scratch}/dcp_sync/{step}"
        base = reset_peak()
        t0 = time.perf_counter()
        dcp.save(state, checkpoint_id=target, process_group=group)
        t = time.perf_counter() - t0
        record("dcp.save", t, t, dir_bytes(target, rank), base)
        clean(f"{scratch}/dcp_sync")

    def dcp_async(step: int) -> None:
        target = f"{scratch}/dcp_async/{step}"
        base = reset_peak()
        t0 = time.perf_counter()
        fut = dcp.async_save(state, checkpoint_id=target, process_group=group)
        blocked = time.perf_counter() - t0
        fut.result()
        t = time.perf_counter() - t0
        record("dcp.async_save", blocked, t, dir_bytes(target, rank), base)
        clean(f"{scratch}/dcp_async")

    def ours(name: str, eng: CheckpointEngine):
        def run(step: int) -> None:
            base = reset_peak()
            t0 = time.perf_counter()
            handle = eng.save(state, step=step)
            blocked = time.perf_counter() - t0
            result = handle.result()
            t = time.perf_counter() - t0
            record(name, blocked, t, result.bytes_written, base, resident=eng.arena.capacity)
            dist.barrier(group)
            if rank == 0:
                shutil.rmtree(Path(eng.storage.url) / result.name, ignore_errors=True)
            dist.barrier(group)

        return run

    methods = [
        copy_floor,
        write_floor,
        dcp_sync,
        dcp_async,
        ours("ours sync", ours_sync),
        ours("ours async", ours_async),
        ours("ours async zstd", ours_zstd),
    ]
    for rnd in range(rounds):
        # rotate the order: the disk's speed depends on what was just written/deleted
        shift = rnd % len(methods)
        for method in methods[shift:] + methods[:shift]:
            dist.barrier(group)
            method(rnd + 1)
    for eng in (ours_async, ours_sync, ours_zstd):
        eng.close()
    return {"rank": rank, "state_bytes": state_bytes, "my_bytes": my_bytes, "records": records}


TENSOR_TARGETS = {"blocked_s": 0.15, "commit_s": 1.0, "load_s": 1.0}


def tensors_worker(count: int, rounds: int, scratch: str) -> dict[str, Any]:
    """Per-tensor cost: ``count`` replicated 4 KB tensors, ours vs DCP, save and load."""
    import torch.distributed.checkpoint as dcp

    from lightning_elastic import CheckpointEngine

    torch.set_num_threads(1)
    rank = dist.get_rank()
    group = dist.new_group(backend="gloo")
    torch.manual_seed(0)
    state = {"model": {f"layer{i}.weight": torch.randn(1024) for i in range(count)}}
    into = {"model": {k: torch.empty_like(v) for k, v in state["model"].items()}}
    engine = CheckpointEngine(f"{scratch}/ours")
    engine.save(state, step=0).result()  # warm-up: the arena, the plan cache
    dcp.save(state, checkpoint_id=f"{scratch}/dcp_load", process_group=group)  # dcp.load's
    records: dict[str, list[dict[str, float]]] = {}

    def ours_save(step: int) -> None:
        t0 = time.perf_counter()
        handle = engine.save(state, step=step)
        blocked = time.perf_counter() - t0
        result = handle.result()
        commit = time.perf_counter() - t0
        row = {"blocked_s": blocked, "commit_s": commit, "staging_s": result.staging_s}
        records.setdefault("ours", []).append(row)

    def dcp_save(step: int) -> None:
        target = f"{scratch}/dcp/{step}"
        t0 = time.perf_counter()
        future = dcp.async_save(state, checkpoint_id=target, process_group=group)
        blocked = time.perf_counter() - t0
        future.result()
        commit = time.perf_counter() - t0
        records.setdefault("dcp", []).append({"blocked_s": blocked, "commit_s": commit})
        dist.barrier(group)
        if rank == 0:
            shutil.rmtree(f"{scratch}/dcp", ignore_errors=True)

    def ours_load(step: int) -> None:
        t0 = time.perf_counter()
        engine.load(into)
        records["ours"][-1]["load_s"] = time.perf_counter() - t0

    def dcp_loads(step: int) -> None:
        t0 = time.perf_counter()
        dcp.load(into, checkpoint_id=f"{scratch}/dcp_load", process_group=group)
        records["dcp"][-1]["load_s"] = time.perf_counter() - t0

    for rnd in range(rounds):
        order = [(ours_save, ours_load), (dcp_save, dcp_loads)]
        for save, load in order if rnd % 2 == 0 else order[::-1]:
            dist.barrier(group)
            save(rnd + 1)
            dist.barrier(group)
            load(rnd + 1)
    assert all(torch.equal(into["model"][k], v) for k, v in state["model"].items())
    engine.close()
    return {"rank": rank, "records": records}


def report_tensors(
    results: list[dict[str, Any]], count: int, ranks: int, rounds: int
) -> dict[str, Any]:
    """Medians per method and rank, the worst rank of each, and (20,000 tensors on 2 ranks,
    the configuration the targets are set for) whether the targets are met."""
    keys = {"ours": (*TENSOR_TARGETS, "staging_s"), "dcp": tuple(TENSOR_TARGETS)}
    table = {
        name: [{key: median(res["records"][name], key) for key in keys[name]} for res in results]
        for name in ("ours", "dcp")
    }
    print(
        f"\n{count} replicated tensors of 4 KB on {ranks} ranks, {rounds} interleaved rounds "
        "(medians)"
    )
    print(f"{'method':<8}{'rank':>5}{'blocked s':>11}{'commit s':>10}{'load s':>9}")
    for name, per_rank in table.items():
        for r, row in enumerate(per_rank):
            print(
                f"{name:<8}{r:>5}{row['blocked_s']:>11.3f}{row['commit_s']:>10.3f}"
                f"{row['load_s']:>9.3f}"
            )
    worst = {
        name: {key: max(row[key] for row in per_rank) for key in keys[name]}
        for name, per_rank in table.items()
    }
    out: dict[str, Any] = {"tensors": count, "ranks": ranks, "table": table, "worst": worst}
    if (count, ranks) == (20000, 2):
        ours = worst["ours"]
        met = {key: ours[key] <= target for key, target in TENSOR_TARGETS.items()}
        print(
            "targets (ours, worst rank): "
            + ", ".join(
                f"{key} {ours[key]:.3f} <= {TENSOR_TARGETS[key]} {'MET' if met[key] else 'MISSED'}"
                for key in TENSOR_TARGETS
            )
        )
        out["met"] = met
    return out


def plot_tensors(rows: list[dict[str, Any]], png: Path) -> None:
    """Seconds against the tensor count (at the fewest ranks) and against the number of ranks
    (at the most tensors measured on several rank counts): ours solid, DCP dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    fewest = min(r["ranks"] for r in rows)
    by_count = sorted((r for r in rows if r["ranks"] == fewest), key=lambda r: r["tensors"])
    counts = {r["tensors"] for r in rows}
    swept = max(counts, key=lambda n: (sum(r["tensors"] == n for r in rows), n))
    by_ranks = sorted((r for r in rows if r["tensors"] == swept), key=lambda r: r["ranks"])
    for ax, series, xkey, xlabel in (
        (axes[0], by_count, "tensors", f"tensors of 4 KB ({fewest} ranks)"),
        (axes[1], by_ranks, "ranks", f"ranks ({swept} tensors of 4 KB, 2 cores)"),
    ):
        xs = [r[xkey] for r in series]
        for key, color in (("blocked_s", "C0"), ("commit_s", "C1"), ("load_s", "C2")):
            label = key.removesuffix("_s")
            ax.plot(
                xs,
                [r["worst"]["ours"][key] for r in series],
                "o-",
                color=color,
                label=f"ours {label}",
            )
            ax.plot(
                xs,
                [r["worst"]["dcp"][key] for r in series],
                "s--",
                color=color,
                label=f"DCP {label}",
                alpha=0.7,
            )
        ax.set_xlabel(xlabel)
        ax.set_ylabel("seconds (worst rank, median)")
        if xkey == "tensors":
            ax.set_xscale("log")
            ax.set_yscale("log")
        else:
            ax.set_xticks(xs)
        ax.grid(True, alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle("Per-tensor cost: async save blocked, time to durable commit, load")
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    print(f"wrote {png}")


def plot_engine(summary: dict[str, Any], state_bytes: int, png: Path) -> None:
    """Blocked and commit seconds of every method (rank 0), against the floors."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    table = summary["table"]
    names = list(table)
    fig, ax = plt.subplots(figsize=(9, 4))
    xs = range(len(names))
    ax.bar([x - 0.2 for x in xs], [table[n][0]["blocked_s"] for n in names], 0.4, label="blocked")
    ax.bar(
        [x + 0.2 for x in xs],
        [table[n][0]["commit_s"] for n in names],
        0.4,
        label="to durable commit",
    )
    ax.set_xticks(list(xs), names, rotation=25, ha="right", fontsize=8)
    ax.set_ylabel("seconds (rank 0, median)")
    ax.set_title(f"{state_bytes / 1e9:.2f} GB state on 2 ranks: ours against DCP and the floors")
    ax.legend()
    ax.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    print(f"wrote {png}")


def _plot(fn: Any, *args: Any) -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("no plot: pip install 'lightning_elastic[bench]' (matplotlib)")
        return
    fn(*args)


def median(rows: list[dict[str, float]], key: str) -> float:
    return statistics.median(r[key] for r in rows)


def summarize(results: list[dict[str, Any]]) -> dict[str, Any]:
    methods = list(results[0]["records"])
    table: dict[str, Any] = {}
    for name in methods:
        per_rank = []
        for res in results:
            rows = res["records"][name]
            per_rank.append(
                {
                    "blocked_s": median(rows, "blocked_s"),
                    "commit_s": median(rows, "commit_s"),
                    "bytes": int(median(rows, "bytes")),
                    "peak_extra": int(max(r["peak_extra"] for r in rows)),
                }
            )
        table[name] = per_rank
    ratios = []
    for r, res in enumerate(results):
        copy = table["copy floor"][r]["blocked_s"]
        write = table["write floor"][r]["commit_s"]
        row: dict[str, Any] = {"rank": r, "bytes": res["my_bytes"]}
        for name in methods:
            m = table[name][r]
            row[name] = {
                "blocked/copy": m["blocked_s"] / copy,
                "commit/write": m["commit_s"] / write,
                "peak/bytes": m["peak_extra"] / max(1, m["bytes"]),
            }
        ratios.append(row)
    return {"table": table, "ratios": ratios}


def print_report(summary: dict[str, Any], state_bytes: int, rounds: int) -> None:
    table, ratios = summary["table"], summary["ratios"]
    print(
        f"\nstate {state_bytes / 1e9:.2f} GB replicated on 2 ranks, {rounds} interleaved rounds (medians)"
    )
    header = (
        f"{'method':<18}{'rank':>5}{'blocked s':>11}{'commit s':>10}{'written MB':>12}{'peak+ MB':>10}"
        f"{'blk/copy':>10}{'commit/write':>14}{'peak/bytes':>12}"
    )
    print(header)
    print("-" * len(header))
    for name, per_rank in table.items():
        for r, m in enumerate(per_rank):
            q = ratios[r][name]
            print(
                f"{name:<18}{r:>5}{m['blocked_s']:>11.3f}{m['commit_s']:>10.3f}{m['bytes'] / 1e6:>12.1f}"
                f"{m['peak_extra'] / 1e6:>10.1f}{q['blocked/copy']:>10.2f}{q['commit/write']:>14.2f}"
                f"{q['peak/bytes']:>12.2f}"
            )
    print(
        "\ntargets (ours async, per rank): blocked <= 1.5x copy floor, commit <= 1.5x write floor, "
        "peak extra <= 1.25x bytes written"
    )
    for r, row in enumerate(ratios):
        q = row["ours async"]
        ok = q["blocked/copy"] <= 1.5 and q["commit/write"] <= 1.5 and q["peak/bytes"] <= 1.25
        print(
            f"  rank {r}: blocked/copy {q['blocked/copy']:.2f}, commit/write {q['commit/write']:.2f}, "
            f"peak/bytes {q['peak/bytes']:.2f} -> {'MET' if ok else 'MISSED'}"
        )
    z, plain = table["ours async zstd"], table["ours async"]
    saved = 1 - sum(m["bytes"] for m in z) / max(1, sum(m["bytes"] for m in plain))
    rate = sum(m["bytes"] for m in plain) / max(z[r]["commit_s"] for r in range(len(z))) / 1e9
    print(
        f"\nzstd: {saved * 100:.1f}% fewer bytes written; {rate:.2f} GB/s of raw state to durable commit"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--small", action="store_true", help="4 x Linear(512, 512): a quick run")
    parser.add_argument(
        "--rounds", type=int, default=7, help="7 = every method once in every position"
    )
    parser.add_argument("--out", default=DEFAULT_OUT)
    parser.add_argument(
        "--scratch", default=None, help="directory for the checkpoints (default: a temp dir)"
    )
    parser.add_argument(
        "--tensors",
        default=None,
        help="the per-tensor mode: N tensors of 4 KB (a comma-separated list sweeps them)",
    )
    parser.add_argument(
        "--ranks", default="2", help="per-tensor mode: world sizes, comma-separated (default 2)"
    )
    args = parser.parse_args()
    layers, width = (4, 512) if args.small else (22, 2048)
    scratch = args.scratch or tempfile.mkdtemp(prefix="le-bench-", dir=os.getcwd())
    if args.tensors is not None:
        counts = [int(n) for n in args.tensors.split(",")]
        worlds = [int(n) for n in args.ranks.split(",")]
        rows = []
        try:
            for ranks in worlds:
                for count in counts:
                    here = f"{scratch}/{ranks}-{count}"
                    results = run_distributed(
                        tensors_worker, ranks, count, args.rounds, here, timeout=3600
                    )
                    rows.append(report_tensors(results, count, ranks, args.rounds))
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        out = Path(args.out if args.out != DEFAULT_OUT else "benchmarks/results/tensors.json")
        out.parent.mkdir(parents=True, exist_ok=True)
        config = {"tensors": counts, "ranks": worlds, "tensor_bytes": 4096, "rounds": args.rounds}
        out.write_text(json.dumps({"config": config, "rows": rows}, indent=1))
        print(f"\nwrote {out}")
        _plot(plot_tensors, rows, out.with_suffix(".png"))
        return
    try:
        results = run_distributed(worker, 2, layers, width, args.rounds, scratch, timeout=3600)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    summary = summarize(results)
    print_report(summary, results[0]["state_bytes"], args.rounds)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(
        json.dumps(
            {
                "config": {"layers": layers, "width": width, "rounds": args.rounds},
                "state_bytes": results[0]["state_bytes"],
                **summary,
            },
            indent=1,
        )
    )
    print(f"\nwrote {args.out}")
    _plot(plot_engine, summary, results[0]["state_bytes"], Path(args.out).with_suffix(".png"))


if __name__ == "__main__":
    main()
