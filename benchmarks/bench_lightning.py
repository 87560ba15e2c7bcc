"""Training throughput under checkpointing: Lightning on 2 CPU processes, ~1.1 GB of state.

One run, interleaved: every round fits the same model once per configuration (rotated order,
same two processes, one torch thread each):

* none                 - no checkpointing (the reference);
* ModelCheckpoint      - Lightning's callback, synchronous ``torch.save`` on rank 0;
* ModelCheckpoint+Async - the same with ``AsyncCheckpointIO``;
* ModelCheckpoint+ElasticIO - the same with ``ElasticCheckpointIO`` (ours: rank 0 copies the
  state once into a reused host buffer, writes and commits in the background);
* DistributedCheckpoint - ours (async, sharded), with ``ElasticStrategy`` (lazy snapshots,
  the default: the copy overlaps the next step's forward and backward);
* DistributedCheckpoint[blocking] - the same with ``snapshot="blocking"`` (the copy before
  the save returns).

With ``--fsdp`` the model is sharded by FSDP2 (``fully_shard`` per layer) and the
configurations are:

* none                  - Lightning's ``ModelParallelStrategy``, no checkpointing;
* ModelParallelStrategy - the same with ``ModelCheckpoint``: Lightning's own sharded
  (``torch.distributed.checkpoint``) save, synchronous;
* DistributedCheckpoint - ours with ``ElasticFSDPStrategy`` (lazy snapshots), and
  DistributedCheckpoint[blocking] with ``snapshot="blocking"``.

Two kinds of step (``--step``):

* ``cpu`` (the default): forward, backward, DDP's gradient all-reduce and Adam on the host,
  one core per rank: training and every background thread (the writes) compete for the same
  2 cores. This bounds what a CPU-only job sees.
* ``accelerator``: the step's compute runs on a device and the host thread waits for it (a
  sleep of ``--step-ms``, where a CUDA synchronize would block), as on a GPU node: the host's
  cores are free for the background work. Manual optimization: the step sleeps, all-reduces
  one element (the ranks step together, as DDP's gradient sync makes them), calls
  ``optimizer.step()`` (where a lazy snapshot's guard waits) and changes the parameters in
  place; Adam's state is allocated once before the first step, so the checkpoint holds the
  same ~1.1 GB. The state stays in host memory: staging is a host copy, where a GPU node
  copies device to pinned host memory.

A checkpoint is due every K steps, K chosen so that a save falls every ~``--save-every-s``
(default 6.5) s of training.
Reported per configuration (medians over rounds): training steps/s relative to ``none``, seconds
the training loop was blocked per save (from the step times), and seconds from the save call
to the data being written (ours: to the durable commit, fsync included; Lightning's
``torch.save`` does not fsync).

    python benchmarks/bench_lightning.py [--small] [--fsdp] [--rounds 3] [--steps 40]
        [--layers 22 --width 2048]   (state: layers x (W*W + W) x 4 bytes x 3, with Adam)
        [--step cpu|accelerator --step-ms 250] [--save-every-s 6.5]
"""

from __future__ import annotations

import argparse
import gc
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

CONFIGS = [
    "none",
    "ModelCheckpoint",
    "ModelCheckpoint+Async",
    "ModelCheckpoint+ElasticIO",
    "DistributedCheckpoint",
    "DistributedCheckpoint[blocking]",
]
FSDP_CONFIGS = [
    "none",
    "ModelParallelStrategy",
    "DistributedCheckpoint",
    "DistributedCheckpoint[blocking]",
]


def build_module(
    layers: int, width: int, batch: int, fsdp: bool = False, device_step_s: float | None = None
) -> Any:
    """The benchmark's model; with ``device_step_s`` its step is the ``accelerator`` kind (the
    module docstring)."""
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader, TensorDataset

    class Big(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = device_step_s is None
            self.net = torch.nn.Sequential(
                *[
                    torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU())
                    for _ in range(layers)
                ]
            )

        def configure_model(self) -> None:
            if not fsdp:
                return
            from torch.distributed.fsdp import fully_shard

            mesh = self.device_mesh["data_parallel"]
            for layer in self.net:
                fully_shard(layer, mesh=mesh)
            fully_shard(self.net, mesh=mesh)

        def on_train_start(self) -> None:
            if device_step_s is None:
                return
            # no backward on the host: DDP must not wait for one after each forward
            self.trainer.strategy.model.require_backward_grad_sync = False
            optimizer = self.optimizers().optimizer
            for p in self.parameters():  # Adam's state, allocated as a first step would
                p.grad = torch.zeros_like(p)
            optimizer.step()  # (zero gradients: the parameters do not move)
            optimizer.zero_grad(set_to_none=True)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor | None:
            if device_step_s is not None:
                time.sleep(device_step_s)  # the host waits for the device's step
                dist.all_reduce(torch.zeros(1))  # the ranks step together
                self.optimizers().step()  # no gradients: the guard, and Adam's loop
                with torch.no_grad():  # the state changes between saves
                    first = self.net[0][0].weight
                    first[self.global_step % first.shape[0], 0] += 1.0
                return None
            (x,) = batch
            return self.net(x).pow(2).mean()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.Adam(self.parameters(), lr=1e-5)

        def train_dataloader(self) -> DataLoader:
            g = torch.Generator().manual_seed(0)
            return DataLoader(
                TensorDataset(torch.randn(4096, width, generator=g)), batch_size=batch
            )

    return Big()


class StepTimer:
    """Wall time of every training step (batch end to batch end), and the steps that saved."""

    def __new__(cls) -> Any:
        import lightning.pytorch as pl

        class _Timer(pl.Callback):
            def __init__(self) -> None:
                self.times: list[float] = []
                self.last: float | None = None

            def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
                now = time.perf_counter()
                if self.last is not None:
                    self.times.append(now - self.last)
                self.last = now

        return _Timer()


def timed_io() -> Any:
    from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

    class TimedIO(TorchCheckpointIO):
        def __init__(self) -> None:
            super().__init__()
            self.durations: list[float] = []

        def save_checkpoint(self, checkpoint: Any, path: Any, storage_options: Any = None) -> None:
            start = time.perf_counter()
            super().save_checkpoint(checkpoint, path, storage_options)
            self.durations.append(time.perf_counter() - start)

    return TimedIO()


def timed_elastic_io() -> Any:
    """``ElasticCheckpointIO`` noting each committed save's blocked and total seconds."""
    from lightning_elastic import ElasticCheckpointIO

    class TimedElasticIO(ElasticCheckpointIO):
        def __init__(self) -> None:
            super().__init__()
            self.commits: list[float] = []
            self.blocked: list[float] = []

        def _committed(self, result: Any) -> None:
            self.commits.append(result.total_s)
            self.blocked.append(result.blocked_s)

    return TimedElasticIO()


def run_fit(
    config: str,
    root: str,
    steps: int,
    every: int,
    layers: int,
    width: int,
    batch: int,
    fsdp: bool = False,
    device_step_s: float | None = None,
) -> dict[str, Any]:
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.plugins.io import AsyncCheckpointIO
    from lightning.pytorch.strategies import ModelParallelStrategy

    from lightning_elastic import DistributedCheckpoint, ElasticFSDPStrategy, ElasticStrategy

    pl.seed_everything(0, verbose=False)
    timer = StepTimer()
    callbacks: list[Any] = [timer]
    plugins: list[Any] = []
    strategy: Any = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)
    if not fsdp:
        strategy = "ddp"
    io = None
    ours = None
    elastic_io: Any = None
    saves: list[float] = []  # ModelParallelStrategy's own (synchronous) saves
    if config == "ModelParallelStrategy":
        callbacks.append(
            ModelCheckpoint(dirpath=f"{root}/mc", every_n_train_steps=every, save_top_k=1)
        )
        original_save = strategy.save_checkpoint

        def timed_save(*args: Any, **kwargs: Any) -> None:
            start = time.perf_counter()
            original_save(*args, **kwargs)
            saves.append(time.perf_counter() - start)

        strategy.save_checkpoint = timed_save
    elif config == "ModelCheckpoint+ElasticIO":
        callbacks.append(
            ModelCheckpoint(dirpath=f"{root}/mc", every_n_train_steps=every, save_top_k=1)
        )
        elastic_io = timed_elastic_io()
        plugins.append(elastic_io)
    elif config.startswith("ModelCheckpoint"):
        callbacks.append(
            ModelCheckpoint(dirpath=f"{root}/mc", every_n_train_steps=every, save_top_k=1)
        )
        io = timed_io()
        plugins.append(AsyncCheckpointIO(io) if config.endswith("Async") else io)
    elif config.startswith("DistributedCheckpoint"):
        ours = DistributedCheckpoint(
            f"{root}/dc",
            every_n_train_steps=every,
            keep_last_n=1,
            save_on_train_end=False,
            snapshot="blocking" if config.endswith("[blocking]") else "lazy",
        )
        callbacks.append(ours)
        strategy = ElasticFSDPStrategy() if fsdp else ElasticStrategy()
    commits: list[float] = []
    blocked: list[float] = []
    if ours is not None:
        original = ours._report

        def report(trainer: Any, handle: Any, **kwargs: Any) -> None:
            result = handle.result()
            commits.append(result.total_s)
            blocked.append(result.blocked_s)
            original(trainer, handle, **kwargs)

        ours._report = report  # type: ignore[method-assign]
    if elastic_io is not None:
        commits, blocked = elastic_io.commits, elastic_io.blocked  # rank 0's (the saver's)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_steps=steps,
        callbacks=callbacks,
        plugins=plugins or None,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=config != "none",
        default_root_dir=root,
    )
    model = build_module(layers, width, batch, fsdp, device_step_s)
    trainer.fit(model)
    del trainer, model  # each fit holds ~1.1 GB: free it before the next one
    gc.collect()
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(root, ignore_errors=True)
    dist.barrier()
    times = timer.times[3:]  # skip warm-up steps
    base = statistics.median(times)
    saves = [t - base for i, t in enumerate(timer.times) if i >= 3 and (i + 1) % every == 0]
    plain = [t for i, t in enumerate(timer.times) if i >= 3 and (i + 1) % every != 0]
    # Saves fall every `every` = 2W steps. Within the fit, compare the W steps that start
    # with a save (its blocking plus the background write) with the next W steps (none):
    # drift of the machine cancels out. times[s - 1] is the step that ends with save s.
    half = every // 2
    windows = []
    for s in range(2 * every, len(timer.times) + 1, every):  # skip the first save (arena)
        on, off = timer.times[s - 1 : s - 1 + half], timer.times[s - 1 + half : s - 1 + every]
        if len(on) == half and len(off) == half:
            windows.append((statistics.mean(on), statistics.mean(off)))
    return {
        "windows": windows,
        "steps_per_s": len(times) / sum(times),
        "median_step_s": statistics.median(plain) if plain else base,
        "blocked_per_save": statistics.median(saves) if saves else 0.0,
        "engine_blocked": statistics.median(blocked) if blocked else None,
        "commit_s": statistics.median(commits)
        if commits
        else (statistics.median(io.durations) if io is not None and io.durations else None)
        if not saves
        else statistics.median(saves),
    }


def worker(
    rounds: int,
    steps: int,
    layers: int,
    width: int,
    batch: int,
    scratch: str,
    fsdp: bool,
    device_step_s: float | None = None,
    save_every_s: float = 6.5,
    configs: list[str] | None = None,
) -> dict[str, Any]:
    torch.set_num_threads(1)  # two ranks on two cores
    rank = dist.get_rank()
    shape = (layers, width, batch, fsdp, device_step_s)
    # calibrate: the step time without checkpoints decides K (a save every ~save_every_s)
    probe = run_fit("none", f"{scratch}/probe", 8, 10**6, *shape)
    # a save every 2W steps, W ~ save_every_s of training: W-step windows with and without one
    every_t = torch.tensor([2 * max(2, round(save_every_s * probe["steps_per_s"]))])
    dist.all_reduce(every_t, op=dist.ReduceOp.MAX)
    every = int(every_t.item())
    steps = max(steps, 4 * every + 3)  # warm-up, the first save, then three measured cycles
    configs = configs or (FSDP_CONFIGS if fsdp else CONFIGS)
    results: dict[str, list[dict[str, Any]]] = {c: [] for c in configs}
    for r in range(rounds):
        order = configs[r % len(configs) :] + configs[: r % len(configs)]
        for config in order:
            results[config].append(run_fit(config, f"{scratch}/{config}", steps, every, *shape))
    return {"rank": rank, "every": every, "results": results}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--small", action="store_true", help="4 x Linear(512, 512): a quick run")
    parser.add_argument("--fsdp", action="store_true", help="FSDP2: ours vs ModelParallelStrategy")
    parser.add_argument(
        "--layers", type=int, default=None, help="Linear(W, W) layers (default 22; --small 4)"
    )
    parser.add_argument(
        "--width", type=int, default=None, help="their width W (default 2048; --small 512)"
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--out", default=None)
    parser.add_argument(
        "--step",
        choices=["cpu", "accelerator"],
        default="cpu",
        help="the step's compute on the host's cores, or a wait for a device (module docstring)",
    )
    parser.add_argument("--step-ms", type=float, default=250.0, help="the accelerator step")
    parser.add_argument("--save-every-s", type=float, default=6.5)
    parser.add_argument(
        "--configs", default=None, help="comma-separated configurations to run (default: all)"
    )
    args = parser.parse_args()
    device_step_s = args.step_ms / 1e3 if args.step == "accelerator" else None
    configs = FSDP_CONFIGS if args.fsdp else CONFIGS
    if args.configs:
        chosen = args.configs.split(",")
        unknown = sorted(set(chosen) - set(configs))
        if unknown or "none" not in chosen:
            parser.error(f"--configs: choose among {configs}, 'none' included (got {unknown})")
        configs = [c for c in configs if c in chosen]
    suffix = ("_fsdp" if args.fsdp else "") + ("_accelerator" if device_step_s else "")
    out_path = args.out or f"benchmarks/results/lightning{suffix}.json"
    layers, width = (4, 512) if args.small else (22, 2048)
    layers, width = args.layers or layers, args.width or width  # a size that fits the machine
    state_gb = layers * (width * width + width) * 4 * 3 / 1e9
    scratch = tempfile.mkdtemp(prefix="le-bench-pl-", dir=os.getcwd())
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        out = run_distributed(
            worker,
            2,
            args.rounds,
            args.steps,
            layers,
            width,
            args.batch,
            scratch,
            args.fsdp,
            device_step_s,
            args.save_every_s,
            configs,
            timeout=7200,
        )
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    rank0 = out[0]
    summary = {}
    none = rank0["results"]["none"]
    window = rank0["every"] // 2
    print(
        f"\n{state_gb:.2f} GB of model + Adam state, 2 ranks, {args.rounds} interleaved rounds (rank 0)."
    )
    print(
        f"Throughput with a checkpoint every {window} steps (~{args.save_every_s:g} s, {args.step} step): "
        f"within each fit, the {window} steps that"
    )
    print(
        f"start with a save against the next {window} steps without one ('vs none'; median over windows);"
    )
    print(
        "'per fit' compares whole fits with the no-checkpoint fit of the same round (drift-prone)."
    )
    print(
        f"{'configuration':<32}{'vs none':>9}{'per fit':>9}{'step s':>8}{'blocked/save s':>16}{'to written/commit s':>21}"
    )
    for config in configs:
        rows = rank0["results"][config]
        per_fit = [r["steps_per_s"] / n["steps_per_s"] for r, n in zip(rows, none, strict=True)]
        windows = [off / on for r in rows for on, off in r["windows"]]
        relative = statistics.median(windows) if windows else 1.0
        step = statistics.median(r["median_step_s"] for r in rows)
        blocked = statistics.median(r["blocked_per_save"] for r in rows)
        commits = [r["commit_s"] for r in rows if r["commit_s"] is not None]
        commit = statistics.median(commits) if commits else None
        summary[config] = {
            "relative": relative,
            "window_ratios": windows,
            "per_fit_relative": per_fit,
            "median_step_s": step,
            "blocked_per_save_s": blocked,
            "commit_s": commit,
        }
        commit_text = f"{commit:.2f}" if commit is not None else "-"
        print(
            f"{config:<32}{relative:>9.2f}{statistics.median(per_fit):>9.2f}{step:>8.2f}{blocked:>16.2f}{commit_text:>21}"
        )
    ratio = summary.get("DistributedCheckpoint", {}).get("relative")
    target = 0.95 if args.fsdp else 0.90
    if ratio is not None:
        print(
            f"\ntarget: DistributedCheckpoint >= {target:.2f}x of no checkpointing -> "
            f"{ratio:.2f}x {'MET' if ratio >= target else 'MISSED'}"
        )
    if "ModelCheckpoint+ElasticIO" in summary and ratio is not None:
        plugin = summary["ModelCheckpoint+ElasticIO"]["relative"]
        close = abs(plugin - ratio) <= 0.03
        print(
            f"target: ModelCheckpoint+ElasticIO >= 0.95x -> {plugin:.2f}x "
            f"{'MET' if plugin >= 0.95 else 'MISSED'}; within 0.03 of DistributedCheckpoint "
            f"({ratio:.2f}x) -> {'MET' if close else 'MISSED'}"
        )
    Path(out_path).parent.mkdir(parents=True, exist_ok=True)
    Path(out_path).write_text(
        json.dumps({"every": rank0["every"], "summary": summary, "raw": out}, indent=1)
    )
    print(f"wrote {out_path}")


if __name__ == "__main__":
    main()
