"""Rank functions for the per-rank state tests: a callback and a dataloader whose states
differ between ranks, as a user's do."""

from __future__ import annotations

import logging
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch.utils.data import Sampler, Subset

from lightning_elastic import DistributedCheckpoint, ElasticStrategy, TierOptions
from lightning_elastic.errors import PerRankStateError
from tests.lightning.models import IdDataset, TinyModule, make_trainer, worker_context


class RankTally(pl.Callback):
    """This rank's batches and the sum of the sample ids it trained on: a state that differs
    per rank, as a user's running statistic or counter does."""

    def __init__(self) -> None:
        self.rank = -1
        self.batches = 0
        self.id_sum = 0
        self.loaded: dict[str, Any] | None = None

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self.rank = trainer.global_rank

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.batches += 1
        self.id_sum += int(batch[0].sum())

    def state_dict(self) -> dict[str, Any]:
        return {"rank": self.rank, "batches": self.batches, "id_sum": self.id_sum}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.loaded = dict(state_dict)
        self.batches = state_dict["batches"]
        self.id_sum = state_dict["id_sum"]


class FreshTally(RankTally):
    """Declares that at another world size it starts from its initial state."""

    per_rank_state_on_resize = "fresh"


class ShardShuffle(Sampler[int]):
    """A rank's own shuffle of its shard, reseeded every epoch from its seed and the epoch
    (as DistributedSampler does, so the epoch after a resume is the same one too); its state
    holds its seed, as torchdata's RandomSampler holds its generator's state: it differs per
    rank."""

    def __init__(self, n: int, seed: int) -> None:
        self.n, self.seed, self.epoch, self.yielded, self._skip = n, seed, 0, 0, 0

    def __len__(self) -> int:
        return self.n

    def __iter__(self):
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        order = torch.randperm(self.n, generator=generator).tolist()
        start, self._skip = self._skip, 0
        self.yielded = start
        for index in order[start:]:
            self.yielded += 1
            yield index
        self.epoch += 1
        self.yielded = 0

    def state_dict(self) -> dict[str, int]:
        return {"seed": self.seed, "epoch": self.epoch, "yielded": self.yielded}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.seed, self.epoch, self._skip = state["seed"], state["epoch"], state["yielded"]


class ShardedLoaderModule(TinyModule):
    """Every rank trains on its own shard with its own shuffle, through torchdata's
    StatefulDataLoader (Lightning keeps the loader's state in its loop state)."""

    def train_dataloader(self) -> Any:
        from torchdata.stateful_dataloader import StatefulDataLoader

        rank, world = self.global_rank, self.trainer.world_size
        n = self.hparams.n
        shard = Subset(IdDataset(n), list(range(rank, n, world)))
        sampler = ShardShuffle(len(shard), seed=1000 + rank)
        workers = getattr(self, "loader_workers", 0)
        return StatefulDataLoader(
            shard,
            batch_size=self.hparams.batch_size,
            sampler=sampler,
            num_workers=workers,
            multiprocessing_context=worker_context(__name__) if workers else None,
            # one start per fit, not per epoch;
            # the saved state then comes from workers that outlived an epoch boundary
            persistent_workers=workers > 0,
        )


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def fit(
    root: str,
    max_steps: int,
    kill_at: int = -1,
    *,
    tally: str = "plain",
    loader: bool = False,
    every: int = 5,
    workers: int = 0,
    nodes: bool = False,
) -> dict[str, Any]:
    """Fit at the world size of the process group, with a per-rank tally and, with
    ``loader``, a StatefulDataLoader per rank; SIGKILL at ``kill_at`` (after the last save
    committed); resume from ``root`` when it holds a checkpoint. ``nodes``: multi-tier, each
    rank its own node (``"ab"[rank]``, local root ``<root>/local/<node>``), every 3rd save
    persisted."""
    records = _Records()
    logging.getLogger("lightning_elastic").addHandler(records)
    pl.seed_everything(7, verbose=False)
    model = (ShardedLoaderModule if loader else TinyModule)(kill_at=kill_at)
    model.loader_workers = workers  # StatefulDataLoader's worker processes
    counter = {"plain": RankTally, "fresh": FreshTally}[tally]()
    tiers: dict[str, Any] = {}
    if nodes:
        node = "ab"[dist.get_rank()]
        tiers = {"tiers": TierOptions(f"{root}/local/{node}", node=node, persist_every_n_saves=3)}
    checkpoint = DistributedCheckpoint(f"{root}/ckpts", every_n_train_steps=every, **tiers)
    trainer = make_trainer(
        root,
        max_steps=max_steps,
        strategy=ElasticStrategy(),
        devices=dist.get_world_size(),
        callbacks=[counter, checkpoint],
        use_distributed_sampler=False,
    )
    try:
        trainer.fit(model)
    except PerRankStateError as exc:
        return {"error": exc}
    return {
        "losses": model.losses,
        "seen": model.seen,
        "global_step": trainer.global_step,
        "resumed_from": trainer.ckpt_path,
        "tally": counter.state_dict(),
        "loaded": counter.loaded,
        "log": records.messages,
        "recovery": checkpoint.recovery,
    }
