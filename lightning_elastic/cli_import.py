"""``lightning-elastic import SOURCE DIR``: a Lightning ``.ckpt`` (any ``torch.save`` file) or a
``torch.distributed.checkpoint`` directory into one of our checkpoints, verified (the work is
:func:`lightning_elastic.core.load.import_ckpt.import_checkpoint`; this is its command line)."""

from __future__ import annotations

import argparse
import dataclasses
import json
from typing import Any

__all__ = ["HELP", "add_arguments", "run"]

HELP = (
    "turn a Lightning .ckpt (any torch.save file) or a torch.distributed.checkpoint directory "
    "into one of our checkpoints, verified"
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The verb's own arguments (the CLI adds ``--json`` and ``-o``)."""
    parser.add_argument("source", help="a .ckpt / torch.save file, or a DCP checkpoint directory")
    parser.add_argument("path", help="checkpoint root directory or URL to write into")
    parser.add_argument(
        "--name", default=None, help="the checkpoint's directory name (default: the source's)"
    )
    parser.add_argument(
        "--overwrite", action="store_true", help="replace a checkpoint of that name"
    )
    parser.add_argument(
        "--trusted",
        action="store_true",
        help="unpickle the source without the safe-loading allowlist (may run code from it): "
        "only for checkpoints you trust",
    )


def run(args: argparse.Namespace, storage_options: dict[str, Any]) -> int:
    """Import, then print where it went (JSON with ``--json``); errors are raised (typed) for
    the CLI to report."""
    from lightning_elastic.core.load.import_ckpt import import_checkpoint

    result = import_checkpoint(
        args.source,
        args.path,
        name=args.name,
        storage_options=storage_options,
        trusted=args.trusted,
        overwrite=args.overwrite,
    )
    if args.json:
        print(json.dumps(dataclasses.asdict(result)))
    else:
        print(
            f"imported {result.source} ({result.kind}, step {result.step}, "
            f"{result.bytes / 2**20:.1f} MiB) as {result.location}: verified"
        )
    return 0
