"""One process of a replica group (strategy="elastic_ft"), for tests/replicas.

A tiny regression whose samples are identified by index; after every committed step each
process appends one JSON line to its group's journal: the group, pid, rank, step, epoch, the
sample ids it trained in that step, a digest of every parameter (equal in every group when
the groups are in step) and the group's failed step attempts so far. Environment:

* ``LIGHTNING_ELASTIC_LIGHTHOUSE`` / ``LIGHTNING_ELASTIC_REPLICA_GROUP``: where and who;
* ``JOURNAL``: the journal file (one per group; ranks append to it);
* ``SAMPLES``, ``BATCH``, ``EPOCHS``, ``STEP_SLEEP``: the workload;
* ``CKPT``: a ``DistributedCheckpoint`` directory (saves every ``CKPT_EVERY`` steps);
* ``DIE_AFTER``: SIGKILL this process inside the training_step that follows its N-th committed
  step (before that step's commit; counted from this process's start, so a group that joins
  late still dies inside a step; not after a restart by torchrun);
* ``ACCUMULATE``: ``accumulate_grad_batches``;
* ``HEAL_FAILS``: the first N fetches of a peer's live state fail (the peer went away).
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import time

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, Dataset

from lightning_elastic import DistributedCheckpoint, ElasticFTStrategy

SAMPLES = int(os.environ.get("SAMPLES", "48"))
BATCH = int(os.environ.get("BATCH", "4"))


class Numbered(Dataset):  # type: ignore[type-arg]
    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        generator = torch.Generator().manual_seed(index)
        return torch.tensor(index), torch.randn(8, generator=generator)


class Regression(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)
        )
        first_start = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        self.die_after = int(os.environ.get("DIE_AFTER", "-1")) if first_start else -1
        self.committed = 0
        self.sleep = float(os.environ.get("STEP_SLEEP", "0.05"))
        self.events_seen = 0

    def training_step(
        self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int
    ) -> torch.Tensor:
        _, x = batch
        if self.committed == self.die_after:
            os.kill(os.getpid(), signal.SIGKILL)
        loss = self.net(x).square().mean()
        self.log("loss", loss, on_step=True, on_epoch=True)
        time.sleep(self.sleep)
        return loss

    def on_train_batch_end(self, outputs: object, batch: object, batch_idx: int) -> None:
        trainer = self.trainer
        if trainer.fit_loop._should_accumulate():
            return
        self.committed += 1
        strategy = trainer.strategy
        digest = hashlib.sha1()
        for parameter in self.parameters():
            digest.update(parameter.detach().cpu().numpy().tobytes())
        events = strategy.replicas.events if strategy.replicas is not None else []
        record = {
            "kind": "step",
            "t": time.time(),
            "group": os.environ.get("LIGHTNING_ELASTIC_REPLICA_GROUP"),
            "pid": os.getpid(),
            "rank": trainer.global_rank,
            "step": trainer.global_step,
            "epoch": trainer.current_epoch,
            "ids": strategy.committed_samples,
            "params": digest.hexdigest(),
            "failed": sum(1 for e in events if e.kind == "failed"),
            "participants": None if strategy.view is None else strategy.view.participants,
        }
        new_events = events[self.events_seen :]
        self.events_seen = len(events)
        with open(os.environ["JOURNAL"], "a") as journal:
            journal.write(json.dumps(record) + "\n")
            for event in new_events:  # the quorum events this group saw, for the benchmark
                entry = {"kind": "event", "event": event.kind, "at_step": event.step}
                entry.update(stall_s=event.stall_s, participants=event.participants)
                journal.write(json.dumps({**entry, **event.detail, "t": time.time()}) + "\n")

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=0.01)

    def train_dataloader(self) -> DataLoader:  # type: ignore[type-arg]
        return DataLoader(Numbered(), batch_size=BATCH, shuffle=True)


def _failing_heals(count: int) -> None:
    from lightning_elastic.core.replicas.transport import LiveStateTransport

    receive = LiveStateTransport.recv_checkpoint
    left = [count]

    def recv_checkpoint(self: LiveStateTransport, *args: object, **kwargs: object) -> object:
        if left[0] > 0:
            left[0] -= 1
            raise ConnectionError("injected: the peer serving the live state went away")
        return receive(self, *args, **kwargs)  # type: ignore[arg-type]

    LiveStateTransport.recv_checkpoint = recv_checkpoint  # type: ignore[method-assign]


def main() -> None:
    pl.seed_everything(0)
    _failing_heals(int(os.environ.get("HEAL_FAILS", "0")))
    callbacks = []
    if os.environ.get("CKPT"):
        callbacks.append(
            DistributedCheckpoint(
                os.environ["CKPT"],
                every_n_train_steps=int(os.environ.get("CKPT_EVERY", "5")),
                keep_last_n=3,
            )
        )
    trainer = pl.Trainer(
        strategy=ElasticFTStrategy(step_timeout=5.0, quorum_timeout=60.0),
        devices="auto",
        accelerator="cpu",
        max_epochs=int(os.environ.get("EPOCHS", "3")),
        accumulate_grad_batches=int(os.environ.get("ACCUMULATE", "1")),
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=bool(callbacks),
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(Regression())


if __name__ == "__main__":
    main()
