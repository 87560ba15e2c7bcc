"""Durable checkpoints under strategy="elastic_ft", in this process (one replica group): the
leader group writes the job's checkpoints; a group that led, was stopped while its
asynchronous save was in flight, and leads again after another group took the run's lease
gets that old save refused (it must never commit over the newer leader's checkpoints) and
goes on training; a refusal while the group still leads is another writer of the run and
stays an error. Lightning's own ModelCheckpoint(save_top_k, monitor) beside ours."""

from __future__ import annotations

import dataclasses
import threading
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from tests.replicas.harness import solo_group

pytestmark = pytest.mark.timeout(300)


class Tiny(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Linear(4, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.net(x), y), sync_dist=True)

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=0.01)

    def train_dataloader(self) -> DataLoader:  # type: ignore[type-arg]
        generator = torch.Generator().manual_seed(0)
        data = TensorDataset(torch.randn(40, 4, generator=generator), torch.randn(40, 1))
        return DataLoader(data, batch_size=4, shuffle=True)

    def val_dataloader(self) -> DataLoader:  # type: ignore[type-arg]
        generator = torch.Generator().manual_seed(1)
        data = TensorDataset(torch.randn(12, 4, generator=generator), torch.randn(12, 1))
        return DataLoader(data, batch_size=4)


class _AnotherLeader(pl.Callback):
    """While this group's save of step 3 is held before its commit, another group (a second
    engine on the same root, continuing the same run) takes the run's lease, as the leader
    of the groups that evicted this one does; then the held commit goes on."""

    def __init__(self, root: Path, release: threading.Event) -> None:
        self.root = root
        self.release = release

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step != 4:
            return
        from lightning_elastic.core.dist.coordinator import Coordinator
        from lightning_elastic.core.engine import CheckpointEngine
        from lightning_elastic.lightning.session import ElasticSession

        writer = ElasticSession.of(trainer).writer
        pending = next(cb for cb in trainer.callbacks if hasattr(cb, "_pending"))._pending
        assert writer is not None and pending is not None and not pending.done()
        other = CheckpointEngine(
            self.root, run_id=writer.run_id, coordinator=Coordinator.single_process()
        )
        other.take_over(renew=True)
        other.close()
        self.release.set()
        deadline = time.monotonic() + 60
        while not pending.done() and time.monotonic() < deadline:  # the commit was tried
            time.sleep(0.01)


@pytest.mark.parametrize("led_in_between", [True, False], ids=["healed", "still-leading"])
def test_an_old_leaders_save_in_flight_is_refused_and_it_trains_on(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, led_in_between: bool
) -> None:
    from lightning_elastic import DistributedCheckpoint, ElasticFTStrategy
    from lightning_elastic.core.engine import CheckpointEngine
    from lightning_elastic.core.replicas.group import ReplicaGroup
    from lightning_elastic.core.save import pipeline
    from lightning_elastic.errors import StaleWriterError

    release = threading.Event()
    commit = pipeline.commit_as_coordinator
    held = {"n": 0}

    def held_commit(*args: Any, **kwargs: Any) -> Any:
        # the save of step 3, written (its lazy copy done: training is not held), stopped
        # before its commit
        held["n"] += 1
        if held["n"] == 1:
            assert release.wait(60)
        return commit(*args, **kwargs)

    start_step = ReplicaGroup.start_step

    def healing_start(self: ReplicaGroup) -> Any:
        view = start_step(self)
        if led_in_between and view.step == 5:  # as after an eviction and a heal
            view = dataclasses.replace(view, healed=True)
        return view

    monkeypatch.setattr(pipeline, "commit_as_coordinator", held_commit)
    monkeypatch.setattr(ReplicaGroup, "start_step", healing_start)
    root = tmp_path / "ckpt"
    with solo_group(monkeypatch):
        trainer = pl.Trainer(
            strategy=ElasticFTStrategy(step_timeout=5, quorum_timeout=30),
            accelerator="cpu",
            devices=1,
            max_epochs=1,
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            limit_val_batches=0,
            callbacks=[
                DistributedCheckpoint(root, every_n_train_steps=3),
                _AnotherLeader(root, release),
            ],
        )
        if not led_in_between:
            with pytest.raises(StaleWriterError, match="newer"):
                trainer.fit(Tiny())
            return
        trainer.fit(Tiny())
    assert trainer.global_step == 10
    with CheckpointEngine(root) as engine:
        steps = [info.step for info in engine.list()]
    assert 3 not in steps and steps[-1] == 10 and 6 in steps, steps


def test_lightnings_model_checkpoint_keeps_its_top_k_beside_ours(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """ModelCheckpoint(save_top_k=2, monitor="val_loss") and DistributedCheckpoint in one fit,
    validation every 3 steps: the leader writes Lightning's files too, and exactly two stay."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_elastic import DistributedCheckpoint, ElasticFTStrategy

    top = ModelCheckpoint(tmp_path / "top", save_top_k=2, monitor="val_loss", every_n_train_steps=3)
    with solo_group(monkeypatch):
        trainer = pl.Trainer(
            strategy=ElasticFTStrategy(step_timeout=5, quorum_timeout=30),
            accelerator="cpu",
            devices=1,
            max_epochs=2,
            val_check_interval=3,
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            num_sanity_val_steps=0,
            callbacks=[top, DistributedCheckpoint(tmp_path / "ckpt", every_n_train_steps=4)],
        )
        trainer.fit(Tiny())
    assert trainer.global_step == 20
    kept = sorted(p.name for p in (tmp_path / "top").glob("*.ckpt"))
    assert len(kept) == 2, kept
    assert top.best_model_path and Path(top.best_model_path).exists()
