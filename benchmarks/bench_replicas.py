"""What finding per-rank entries costs a save: digests of a realistic Lightning checkpoint.

The state is Lightning's own checkpoint dict (``dump_checkpoint`` after a few training steps)
of a model of ``--layers`` blocks of Linear(width, width) + LayerNorm with Adam: parameters,
both Adam moments and the ``step`` counters, the loops' progress counters, callbacks
(ModelCheckpoint, EarlyStopping, Timer), hyperparameters, and a StatefulDataLoader-like state
per rank (its generator state differs between ranks).

Reported (medians over ``--rounds``):

* one process: entries, tensor bytes hashed, and the ms to digest the dict
  (the walk + the whole-state digest), which every rank pays at every save;
* 2 gloo processes: ``ReplicationCheck.split`` at the first save (digests, the all-reduce and
  the all-gather that finds the per-rank entries) and at later saves (digests and one
  all-reduce of a few integers).

    python benchmarks/bench_replicas.py [--layers 12] [--width 1024] [--rounds 20]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from lightning_elastic.testing.spawn import run_distributed


def lightning_checkpoint(layers: int, width: int, rank: int) -> dict[str, Any]:
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint, Timer
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_elastic.lightning._compat import dump_checkpoint

    class Net(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.save_hyperparameters({"layers": layers, "width": width, "lr": 1e-3})
            blocks = [
                torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.LayerNorm(width))
                for _ in range(layers)
            ]
            self.net = torch.nn.Sequential(*blocks)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            loss = self.net(batch[0]).pow(2).mean()
            self.log("loss", loss)
            return loss

        def configure_optimizers(self) -> Any:
            return torch.optim.Adam(self.parameters(), lr=1e-3)

        def train_dataloader(self) -> Any:
            return DataLoader(TensorDataset(torch.randn(16, width)), batch_size=4)

    pl.seed_everything(0, verbose=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = pl.Trainer(
            accelerator="cpu",
            devices=1,
            max_steps=3,
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            default_root_dir="/tmp/bench_replicas",
            callbacks=[
                ModelCheckpoint(monitor="loss"),
                EarlyStopping(monitor="loss"),
                Timer(),
            ],
        )
        trainer.fit(Net())
    checkpoint = dump_checkpoint(trainer)
    generator = torch.Generator().manual_seed(1000 + rank)
    checkpoint["loops"]["fit_loop"]["state_dict"]["combined_loader"] = [
        {"_num_yielded": 3, "_sampler_iter_state": {"generator": generator.get_state()}}
    ]
    return checkpoint


def one_process(layers: int, width: int, rounds: int) -> dict[str, Any]:
    from lightning_elastic.core.save.replicated import ReplicationCheck, state_nodes
    from lightning_elastic.core.save.walk import walk_state

    checkpoint = lightning_checkpoint(layers, width, 0)
    check = ReplicationCheck()
    nodes = state_nodes(checkpoint)
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        check.digest(walk_state(checkpoint), frozenset())
        times.append(time.perf_counter() - start)
    tensors = [t for t in _tensors(checkpoint)]
    return {
        "entries": len(nodes),
        "tensors": len(tensors),
        "state_MB": sum(t.numel() * t.element_size() for t in tensors) / 1e6,
        "digest_ms": 1e3 * statistics.median(times),
    }


def _tensors(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v)


def two_ranks(layers: int, width: int, rounds: int) -> dict[str, Any]:
    import torch.distributed as dist

    from lightning_elastic.core.dist.coordinator import Coordinator
    from lightning_elastic.core.save.replicated import ReplicationCheck

    torch.set_num_threads(1)
    checkpoint = lightning_checkpoint(layers, width, dist.get_rank())
    coord = Coordinator.from_environment()
    check = ReplicationCheck()
    start = time.perf_counter()
    first = check.split(coord, checkpoint)
    first_s = time.perf_counter() - start
    later = []
    for _ in range(rounds):
        coord.max_ints([0])  # line the ranks up, so a round measures the check, not a wait
        start = time.perf_counter()
        check.split(coord, checkpoint)
        later.append(time.perf_counter() - start)
    return {
        "per_rank": [list(p) for p in first.per_rank],
        "first_ms": 1e3 * first_s,
        "later_ms": 1e3 * statistics.median(later),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=20)
    args = parser.parse_args()
    local = one_process(args.layers, args.width, args.rounds)
    print(
        f"one process: {local['entries']} entries, {local['tensors']} tensors "
        f"({local['state_MB']:.0f} MB): digest {local['digest_ms']:.1f} ms"
    )
    results = run_distributed(two_ranks, 2, args.layers, args.width, args.rounds, timeout=600)
    for rank, r in enumerate(results):
        print(
            f"rank {rank}: first save {r['first_ms']:.1f} ms (finds {r['per_rank']}), "
            f"later saves {r['later_ms']:.1f} ms"
        )


if __name__ == "__main__":
    main()
