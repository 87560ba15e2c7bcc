"""A training worker for the torchrun elastic tests: every step and every milestone of each
incarnation is appended to a JSONL file of its own (rank, restart count)."""

import time

T_START = time.time()  # before the heavy imports: the recovery-time split needs it

import argparse  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402

WARM = "lightning.pytorch" in sys.modules  # forked from `lightning-elastic run --warm-start`
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

import lightning.pytorch as pl  # noqa: E402

from lightning_elastic import DistributedCheckpoint, ElasticStrategy  # noqa: E402
from tests.elastic.journal import Journal  # noqa: E402
from tests.lightning.models import TinyModule  # noqa: E402

T_IMPORTED = time.time()


class StopWhenAsked(pl.Callback):
    """Stops training after the same step on every rank once ``path`` exists (a test ends a
    job whose length it cannot know in steps)."""

    def __init__(self, path: str) -> None:
        self.path = Path(path)

    def on_train_batch_end(self, trainer: pl.Trainer, *args: object) -> None:
        if trainer.strategy.reduce_boolean_decision(self.path.exists(), all=False):
            trainer.should_stop = True


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", required=True)
    parser.add_argument("--max-steps", type=int, default=60)
    parser.add_argument("--every", type=int, default=3)
    parser.add_argument("--step-sleep", type=float, default=0.0)
    parser.add_argument("--stop-file", default=None, help="stop once this file exists")
    args = parser.parse_args()
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
    journal = Journal(
        Path(args.root) / "journal",
        extra={
            "t_start": T_START,
            "t_imported": T_IMPORTED,
            "restart": restart,
            "warm": WARM,
            # a session (and process group) of its own, as torchrun starts its workers
            "session": os.getsid(0) == os.getpgid(0) == os.getpid(),
            # "False": the group's store is its rank 0's, not torch's shared agent store
            "agent_store": os.environ.get("TORCHELASTIC_USE_AGENT_STORE"),
        },
    )
    pl.seed_everything(7, verbose=False)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices="auto",
        strategy=ElasticStrategy(checkpoint_timeout=60),
        max_steps=args.max_steps,
        callbacks=[
            *([StopWhenAsked(args.stop_file)] if args.stop_file else []),
            journal,
            DistributedCheckpoint(
                f"{args.root}/ckpts", every_n_train_steps=args.every, keep_last_n=3
            ),
        ],
        default_root_dir=args.root,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(TinyModule(n=120, batch_size=4, step_sleep=args.step_sleep))


if __name__ == "__main__":
    main()
