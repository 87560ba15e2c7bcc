"""Incremental checkpoints against today's full saves, in one run (one process, local disk).

Two shapes, each saved ``--saves`` times after a training step by both methods, interleaved
(full, incremental, incremental, full sessions; medians over the saves after the first, which
is full for both):

* ``finetune`` - a frozen base (``--layers`` x Linear(``--width``), fp32; default 18 x 2048:
  302 MB) with rank-8 LoRA adapters on every layer (0.8 % of the weights) trained by AdamW:
  bytes written per save, seconds to a durable commit, seconds the call blocked, and the load
  of the newest checkpoint (through the chain: ``--full-every`` above ``--saves``, so the
  newest refers to the first save, the longest chain) against loading a full checkpoint of
  the same state;
* ``full`` - every weight trained by AdamW (``--full-layers`` x Linear(``--width``), all
  changing every step): the cost of the incremental machinery when nothing can be referred to.

Targets (issue 31): finetune bytes <= 0.05x and durable <= 0.2x a full save, load <= 1.1x;
full-training shape <= 1.02x today's time to durable.

    python benchmarks/bench_incremental.py [--saves 9] [--full-every 10] [--out FILE]

Loads (``--loads`` each, alternating, from fresh engines, after all the saves) read files
written the same way on both sides; whether the page cache holds them is not controlled, so
the fastest of them is compared (the median is reported beside it).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from lightning_elastic import CheckpointEngine, KeepLastN

DEFAULT_OUT = "benchmarks/results/incremental.json"


class LoRA(torch.nn.Module):
    """A frozen Linear with a trainable rank-``r`` update."""

    def __init__(self, width: int, r: int = 8) -> None:
        super().__init__()
        self.base = torch.nn.Linear(width, width)
        self.base.requires_grad_(False)
        self.a = torch.nn.Parameter(torch.randn(r, width) * 0.01)
        self.b = torch.nn.Parameter(torch.zeros(width, r))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + (x @ self.a.T) @ self.b.T


class Shape:
    """A model, its optimizer, and one training step."""

    def __init__(self, kind: str, layers: int, width: int) -> None:
        torch.manual_seed(0)
        if kind == "finetune":
            self.model: torch.nn.Module = torch.nn.Sequential(*[LoRA(width) for _ in range(layers)])
        else:
            self.model = torch.nn.Sequential(
                *[torch.nn.Linear(width, width) for _ in range(layers)]
            )
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(params, lr=1e-4)
        self.trainable = sum(p.numel() for p in params)
        self.total = sum(p.numel() for p in self.model.parameters())
        self.width = width

    def step(self) -> None:
        x = torch.randn(4, self.width)
        self.model(x).square().mean().backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def state(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "optim": self.opt.state_dict()}


def session(kind: str, method: str, args: argparse.Namespace, root: Path) -> dict[str, Any]:
    layers = args.layers if kind == "finetune" else args.full_layers
    shape = Shape(kind, layers, args.width)
    every = None if method == "full" else args.full_every
    saves = []
    with CheckpointEngine(root, full_every_n_saves=every, retention=[KeepLastN(2)]) as eng:
        for i in range(args.saves):
            shape.step()
            start = time.perf_counter()
            handle = eng.save(shape.state(), step=i + 1)
            assert handle is not None
            blocked = time.perf_counter() - start
            result = handle.result()
            durable = time.perf_counter() - start
            saves.append(
                {"bytes": result.bytes_written, "blocked_s": blocked, "durable_s": durable}
            )
    expected = {k: v.clone() for k, v in shape.model.state_dict().items()}
    later = saves[1:]
    return {
        "bytes": statistics.median(s["bytes"] for s in later),
        "blocked_s": statistics.median(s["blocked_s"] for s in later),
        "durable_s": statistics.median(s["durable_s"] for s in later),
        "first_durable_s": saves[0]["durable_s"],
        "trainable_fraction": shape.trainable / shape.total,
        "expected": expected,
    }


def timed_load(
    kind: str, args: argparse.Namespace, root: Path, expected: dict
) -> tuple[float, int]:
    """Seconds to load the newest checkpoint in ``root`` into a fresh state (in place), from
    a fresh engine, and the bytes read (verification included); checked bitwise."""
    layers = args.layers if kind == "finetune" else args.full_layers
    fresh = Shape(kind, layers, args.width)
    fresh.step()  # optimizer state to load into
    into = fresh.state()
    with CheckpointEngine(root) as eng:
        start = time.perf_counter()
        result = eng.load(into)
        seconds = time.perf_counter() - start
    for k, v in expected.items():
        assert torch.equal(into["model"][k], v), f"{root}: {k} differs after load"
    return seconds, result.bytes_read


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--saves", type=int, default=9)
    parser.add_argument("--loads", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=1, help="of 4 interleaved sessions")
    parser.add_argument("--shapes", default="finetune,full")
    parser.add_argument("--full-every", type=int, default=10)
    parser.add_argument("--layers", type=int, default=18)
    parser.add_argument("--full-layers", type=int, default=6)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--out", default=DEFAULT_OUT)
    args = parser.parse_args()
    torch.set_num_threads(1)
    report: dict[str, Any] = {"args": vars(args), "shapes": {}}
    base = Path(tempfile.mkdtemp(prefix="bench_incremental-"))
    try:
        for kind in args.shapes.split(","):
            runs: dict[str, list[dict[str, Any]]] = {"full": [], "incremental": []}
            roots: dict[str, Path] = {}
            order = ("full", "incremental", "incremental", "full") * args.rounds
            for i, method in enumerate(order):
                root = base / f"{kind}-{method}-{i}"
                runs[method].append(session(kind, method, args, root))
                if method in roots:
                    shutil.rmtree(root, ignore_errors=True)
                else:
                    roots[method] = root  # loaded below
            # loads alternate, both from files written the same way (the page cache may hold
            # either: compare the work of following references, not the disk)
            loads: dict[str, list[float]] = {"full": [], "incremental": []}
            read: dict[str, int] = {}
            for _ in range(args.loads):
                for method, root in roots.items():
                    expected = runs[method][0]["expected"]
                    seconds, read[method] = timed_load(kind, args, root, expected)
                    loads[method].append(seconds)
            for root in roots.values():
                shutil.rmtree(root, ignore_errors=True)
            for rs in runs.values():
                for r in rs:
                    del r["expected"]
            med = {
                m: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for m, rs in runs.items()
            }
            for m in med:  # the fastest load: the work, with the least of the box's noise
                med[m]["load_s"] = min(loads[m])
                med[m]["load_median_s"] = statistics.median(loads[m])
                med[m]["load_bytes"] = read[m]
            f, inc = med["full"], med["incremental"]
            ratios = {
                "bytes": inc["bytes"] / f["bytes"],
                "durable": inc["durable_s"] / f["durable_s"],
                "blocked": inc["blocked_s"] / f["blocked_s"],
                "load": inc["load_s"] / f["load_s"],
                "load_median": inc["load_median_s"] / f["load_median_s"],
                "load_bytes": inc["load_bytes"] / f["load_bytes"],
            }
            report["shapes"][kind] = {"full": f, "incremental": inc, "ratios": ratios}
            print(
                f"{kind:9s} trainable {f['trainable_fraction']:.2%}  "
                f"bytes {f['bytes'] / 1e6:8.1f} MB -> {inc['bytes'] / 1e6:8.2f} MB "
                f"({ratios['bytes']:.3f}x)  durable {f['durable_s']:.3f} s -> "
                f"{inc['durable_s']:.3f} s ({ratios['durable']:.3f}x)  blocked "
                f"{f['blocked_s']:.3f} -> {inc['blocked_s']:.3f} s  load {f['load_s']:.3f} s -> "
                f"{inc['load_s']:.3f} s ({ratios['load']:.3f}x, median {ratios['load_median']:.3f}x, "
                f"bytes read {ratios['load_bytes']:.3f}x)",
                flush=True,
            )
    finally:
        shutil.rmtree(base, ignore_errors=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
