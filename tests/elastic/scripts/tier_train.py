"""A training worker for the multi-tier torchrun tests (tests/elastic/test_tiers_torchrun.py).

Each torchrun agent plays one node: ``$LIGHTNING_ELASTIC_NODE`` is its node id and
``--local-root/local_<node>`` its node-local tier. Every incarnation journals (one JSONL file
per process, tests/elastic/journal.py) a start record with its rank, node and restart count,
the ``recovery`` dict of DistributedCheckpoint, and every step's loss as ``float.hex`` (exact).

Faults, each at most once per run directory (a marker file records that it happened, so a
resumed incarnation that trains the step again goes on):

* ``--crash-node N --crash-step S``: node N's worker exits with ``os._exit`` at step S, in
  restart 0 only (torchrun then restarts the group on the same nodes);
* ``--pause-at S1,S2,...``: every worker stops at step S, writes ``paused-S-rankR`` and waits
  for the file ``go-S`` (the test copies, wipes or kills meanwhile).

Before either, every rank waits for its checkpoint engine, so the saves before the step are
committed (locally, replicated, persisted when decided) and the resume point is known.
"""

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

import lightning.pytorch as pl

from lightning_elastic import (
    DistributedCheckpoint,
    ElasticStrategy,
    MonitoringOptions,
    TierOptions,
)
from tests.elastic.journal import Journal
from tests.lightning.models import TinyModule

NODE = os.environ.get("LIGHTNING_ELASTIC_NODE", "")
RESTART = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))


class LossJournal(Journal):
    """The journal, plus each step's exact loss on this rank."""

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, *args: Any
    ) -> None:
        self.write(
            kind="step",
            step=trainer.global_step - 1,
            rank=trainer.global_rank,
            loss=outputs["loss"].item().hex(),
            node=NODE,
        )


class TierModule(TinyModule):
    """TinyModule with the journal's recovery record and the faults of the module docstring."""

    journal: LossJournal
    faults: argparse.Namespace

    def on_train_start(self) -> None:
        # a module hook runs after every callback's: DistributedCheckpoint has set `recovery`
        ckpt = next(c for c in self.trainer.callbacks if isinstance(c, DistributedCheckpoint))
        self.journal.write(
            kind="recovery",
            rank=self.global_rank,
            node=NODE,
            restart=RESTART,
            step=self.global_step,
            recovery=ckpt.recovery,
        )

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        step, markers = self.global_step, Path(self.faults.root) / "markers"
        crash = self.faults.crash_step == step and RESTART == 0
        pause = step in self.faults.pause_at
        crash_done = markers / f"crashed-{step}"
        paused = markers / f"paused-{step}-rank{self.global_rank}"
        if (crash and not crash_done.exists()) or (pause and not paused.exists()):
            ckpt = next(c for c in self.trainer.callbacks if isinstance(c, DistributedCheckpoint))
            ckpt.engine.wait()
            markers.mkdir(exist_ok=True)
            if crash and self.faults.crash_node == NODE:
                crash_done.touch()
                os._exit(3)
            if pause:
                paused.touch()
                while not (markers / f"go-{step}").exists():
                    time.sleep(0.05)
        return super().training_step(batch, batch_idx)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", required=True, help="journal, markers, persistent tier")
    parser.add_argument("--max-steps", type=int, required=True)
    parser.add_argument("--crash-node", default="")
    parser.add_argument("--crash-step", type=int, default=-1)
    parser.add_argument("--pause-at", default="")
    args = parser.parse_args()
    args.pause_at = {int(s) for s in args.pause_at.split(",") if s}
    root = Path(args.root)
    journal = LossJournal(root / "journal", extra={"restart": RESTART, "node": NODE})
    pl.seed_everything(7, verbose=False)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices="auto",
        strategy=ElasticStrategy(checkpoint_timeout=60),
        max_steps=args.max_steps,
        callbacks=[
            journal,
            DistributedCheckpoint(
                root / "persistent",
                every_n_train_steps=2,
                tiers=TierOptions(
                    root / f"local_{NODE}", persist_every_n_saves=3, replicas=1, local_keep=2
                ),
                monitoring=MonitoringOptions(straggler_factor=None),
            ),
        ],
        default_root_dir=root,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    module = TierModule(n=64, batch_size=4)
    module.journal, module.faults = journal, args
    trainer.fit(module)


if __name__ == "__main__":
    main()
