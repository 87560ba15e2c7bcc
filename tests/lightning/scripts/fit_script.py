"""Fit TinyModule with DistributedCheckpoint under a launcher (torchrun, ddp_spawn, Lightning's)."""

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

import lightning.pytorch as pl

from lightning_elastic import DistributedCheckpoint
from tests.lightning.fsdp_workers import ShardedModule
from tests.lightning.models import TinyModule, make_trainer


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", required=True)
    parser.add_argument("--strategy", default="elastic")
    parser.add_argument("--devices", default="2")
    parser.add_argument("--max-steps", type=int, default=12)
    parser.add_argument("--sharded", action="store_true", help="FSDP2 model (elastic_fsdp)")
    args = parser.parse_args()
    pl.seed_everything(7, verbose=False)
    devices = args.devices if args.devices == "auto" else int(args.devices)
    checkpoint = DistributedCheckpoint(f"{args.root}/ckpts", every_n_train_steps=5)
    trainer = make_trainer(
        args.root,
        max_steps=args.max_steps,
        strategy=args.strategy,
        devices=devices,
        callbacks=[checkpoint],
    )
    model = ShardedModule() if args.sharded else TinyModule()
    trainer.fit(model)
    if trainer.is_global_zero:
        print(
            "RESULT "
            + json.dumps(
                {
                    "global_step": trainer.global_step,
                    "world": trainer.world_size,
                    "resumed_from": trainer.ckpt_path,
                }
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()
