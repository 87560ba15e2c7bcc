"""``lightning-elastic verify PATH``: a checkpoint, or every one of a root, against its
manifest (sizes, or sizes and checksums); exit 1 when one is corrupt."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from lightning_elastic.cli.checks import check_all
from lightning_elastic.cli.common import (
    EXIT_BAD_CHECKPOINT,
    EXIT_OK,
    CliError,
    add_verb,
    checkpoint_at,
    is_checkpoint_dir,
    open_dir,
    progress_flag,
    scan_root,
)
from lightning_elastic.core.format.catalog import INCOMPLETE, VALID

__all__ = ["add_parser", "command"]


def add_parser(sub: Any) -> None:
    """Add ``verify`` to the subcommands."""
    p = add_verb(sub, "verify", "check sizes and checksums against the manifests")
    p.add_argument("path", help="a checkpoint, or a root holding several")
    p.add_argument("--mode", choices=["full", "size"], default="full")
    progress_flag(p)
    p.set_defaults(func=command)


def command(args: argparse.Namespace) -> int:
    """``lightning-elastic verify PATH``: check one checkpoint or every one under a root."""
    storage, entries = open_dir(args, args.path)
    if is_checkpoint_dir(entries):
        root, info = checkpoint_at(args, args.path)
        infos = [info]
    else:
        root, infos = storage, scan_root(storage, entries)
        if not infos:
            what = "is empty" if not entries else "holds no checkpoints"
            raise CliError(f"{args.path} {what}: nothing to verify", EXIT_BAD_CHECKPOINT)
    rows = check_all(args, root, infos, args.mode)
    # a root's leftovers (no manifest: a save in flight, or one that crashed and waits for
    # garbage collection) are listed but are not a failure; a directory named alone is
    bad = [
        r for r in rows if r.status != VALID.value and (len(infos) == 1 or r.status != INCOMPLETE)
    ]
    if args.json:
        print(json.dumps([r.to_json() for r in rows], indent=1))
        return EXIT_BAD_CHECKPOINT if bad else EXIT_OK
    for r in rows:
        line = f"{r.status:10s} {r.info.location}"
        print(line + (f": {r.problem}" if r.problem and r.status != VALID.value else ""))
    for r in bad:
        print(f"error: {r.info.location} is {r.status}: {r.problem}", file=sys.stderr)
    return EXIT_BAD_CHECKPOINT if bad else EXIT_OK
