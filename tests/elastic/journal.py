"""A per-process journal of trained steps, and the reconstruction of the training that counts."""

from __future__ import annotations

import collections
import json
import os
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl

from lightning_elastic import DistributedCheckpoint


class Journal(pl.Callback):
    """Appends a record per training step (and at start/end) to a file of this process."""

    def __init__(self, directory: str | Path, extra: dict[str, Any] | None = None) -> None:
        self.directory = Path(directory)
        self.extra = extra or {}
        self.first = True
        self.incarnation = 0.0
        self.path: Path | None = None

    def write(self, **record: object) -> None:
        assert self.path is not None
        with open(self.path, "a") as f:
            f.write(json.dumps({"t": time.time(), "inc": self.incarnation, **record}) + "\n")

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.incarnation = trainer.strategy.broadcast(time.time())  # one id per worker group
        self.directory.mkdir(parents=True, exist_ok=True)
        self.path = (
            self.directory / f"pid{os.getpid()}-rank{trainer.global_rank}-{self.incarnation}.jsonl"
        )
        cost = next(
            (c.resume_cost for c in trainer.callbacks if isinstance(c, DistributedCheckpoint)),
            None,
        )
        self.write(
            kind="start",
            step=trainer.global_step,
            world=trainer.world_size,
            resumed_from=trainer.ckpt_path,
            ours_s=None if cost is None else cost.seconds,
            **self.extra,
        )

    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        self.write(
            kind="step",
            step=trainer.global_step - 1,
            epoch=trainer.current_epoch,
            world=trainer.world_size,
            ids=batch[0].tolist(),
            first=self.first,
        )
        self.first = False

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.write(kind="end", step=trainer.global_step)


def read(directory: str | Path) -> list[dict]:
    records = []
    for path in sorted(Path(directory).glob("*.jsonl")):
        for line in path.read_text().splitlines():
            if line.strip():
                records.append({**json.loads(line), "file": path.name})
    return sorted(records, key=lambda r: r["t"])


def effective_steps(records: list[dict]) -> dict[int, dict]:
    """Each step as trained by the last worker group that trained it (a later group resumed
    from a checkpoint and replaced whatever came after it)."""
    latest: dict[int, float] = {}
    for record in records:
        if record["kind"] == "step":
            latest[record["step"]] = max(latest.get(record["step"], 0.0), record["inc"])
    steps: dict[int, dict] = {}
    for record in records:
        if record["kind"] == "step" and record["inc"] == latest[record["step"]]:
            steps.setdefault(record["step"], {"epoch": record["epoch"], "ids": []})
            steps[record["step"]]["ids"] += record["ids"]
    return steps


def samples_per_epoch(records: list[dict], last_step: int) -> dict[int, collections.Counter]:
    steps = effective_steps(records)
    assert sorted(steps) == list(range(last_step)), "a step is missing"
    per_epoch: dict[int, collections.Counter] = collections.defaultdict(collections.Counter)
    for record in steps.values():
        per_epoch[record["epoch"]].update(record["ids"])
    return per_epoch
