"""``lightning-elastic import SOURCE DIR``: a Lightning ``.ckpt`` (any ``torch.save`` file) or a
``torch.distributed.checkpoint`` directory into one of our checkpoints, verified. Imports torch
inside the verb (the work is :func:`lightning_elastic.import_checkpoint`; this is its command
line). ``import`` is a Python keyword, hence the module's trailing underscore."""

from __future__ import annotations

import argparse
import dataclasses
import json
from typing import Any

from lightning_elastic.cli.common import EXIT_BAD_CHECKPOINT, EXIT_OK, CliError, add_verb
from lightning_elastic.cli.common import storage_options as options_of
from lightning_elastic.errors import CheckpointExistsError, IntegrityError

__all__ = ["add_parser", "command"]

HELP = (
    "turn a Lightning .ckpt (any torch.save file) or a torch.distributed.checkpoint directory "
    "into one of our checkpoints, verified"
)


def add_parser(sub: Any) -> None:
    """Add ``import`` to the subcommands."""
    p = add_verb(sub, "import", HELP)
    p.add_argument("source", help="a .ckpt / torch.save file, or a DCP checkpoint directory")
    p.add_argument("path", help="checkpoint root directory or URL to write into")
    p.add_argument(
        "--name", default=None, help="the checkpoint's directory name (default: the source's)"
    )
    p.add_argument("--overwrite", action="store_true", help="replace a checkpoint of that name")
    p.add_argument(
        "--trusted",
        action="store_true",
        help="unpickle the source without the safe-loading allowlist (may run code from it): "
        "only for checkpoints you trust",
    )
    p.set_defaults(func=command)


def command(args: argparse.Namespace) -> int:
    """Import, then say where it went (JSON with ``--json``). A corrupt source, or a checkpoint
    that does not read back as its source, exits 1; the other errors are typed and reported by
    the CLI (exit 2)."""
    from lightning_elastic.core.load.import_ckpt import import_checkpoint

    try:
        result = import_checkpoint(
            args.source,
            args.path,
            name=args.name,
            storage_options=options_of(args),
            trusted=args.trusted,
            overwrite=args.overwrite,
        )
    except IntegrityError as exc:  # the source, or what was written, is corrupt
        raise CliError(str(exc), EXIT_BAD_CHECKPOINT) from None
    except CheckpointExistsError as exc:
        hint = " (--overwrite)" if "overwrite=True" in str(exc) else ""
        raise CliError(f"{exc}{hint}") from None
    if args.json:
        print(json.dumps(dataclasses.asdict(result)))
    else:
        print(
            f"imported {result.source} ({result.kind}, step {result.step}, "
            f"{result.bytes / 2**20:.1f} MiB) as {result.location}: verified"
        )
    return EXIT_OK
