"""``lightning-elastic consolidate CKPT FILE``: one ``torch.save`` file from a checkpoint of any
world size. The only verb that imports torch, inside the verb."""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from lightning_elastic.cli.checks import progress_bar
from lightning_elastic.cli.common import (
    EXIT_BAD_CHECKPOINT,
    EXIT_OK,
    CliError,
    add_verb,
    checkpoint_at,
    progress_flag,
    storage_options,
)
from lightning_elastic.core.format.catalog import VALID
from lightning_elastic.errors import IntegrityError

__all__ = ["add_parser", "command"]


def add_parser(sub: Any) -> None:
    """Add ``consolidate`` to the subcommands."""
    p = add_verb(sub, "consolidate", "write a checkpoint as one torch.save file (any world size)")
    p.add_argument("path", help="checkpoint directory or URL")
    p.add_argument("output", help="local file to write (torch.save format)")
    p.add_argument("--include-rank-state", action="store_true")
    p.add_argument(
        "--trusted",
        action="store_true",
        help="unpickle objects without the safe-loading allowlist (may run code from the "
        "checkpoint): only for checkpoints you trust",
    )
    progress_flag(p)
    p.set_defaults(func=command)


def command(args: argparse.Namespace) -> int:
    """Checks that ``args.path`` names one checkpoint (the CLI's own diagnosis of what the path
    is instead), then :func:`lightning_elastic.core.load.consolidate.consolidate` does the rest:
    the same code as ``lightning_elastic.consolidate``."""
    _root, info = checkpoint_at(args, args.path)
    if info.status != VALID or info.manifest is None:
        raise CliError(f"{info.location} is {info.status}: {info.problem}", EXIT_BAD_CHECKPOINT)

    from lightning_elastic.core.load.consolidate import consolidate

    start = time.monotonic()
    try:
        consolidate(
            args.path,
            args.output,
            storage_options=storage_options(args),
            trusted=args.trusted,
            include_rank_state=args.include_rank_state,
            progress=lambda desc, total: progress_bar(args, total, desc),
        )
    except IntegrityError as exc:
        message = f"{info.location} is corrupt: {exc.file}: {exc.reason}"
        raise CliError(message, EXIT_BAD_CHECKPOINT) from None
    summary = {
        "checkpoint": info.location,
        "output": args.output,
        "seconds": time.monotonic() - start,
    }
    print(json.dumps(summary) if args.json else f"wrote {args.output} from {info.location}")
    return EXIT_OK
