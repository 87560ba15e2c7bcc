"""``lightning-elastic prune DIR --keep-last N``: delete old checkpoints by the retention rules
(each run keeps its own; a corrupt one is never deleted, nor counted as the newest valid one),
then the leftovers of crashed saves."""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Any

from lightning_elastic.cli import format as fmt
from lightning_elastic.cli.checks import Row, check_all
from lightning_elastic.cli.common import (
    EXIT_BAD_CHECKPOINT,
    EXIT_OK,
    CliError,
    add_verb,
    is_checkpoint_dir,
    open_dir,
    order,
    parent,
    positive,
    scan_root,
    seconds,
)
from lightning_elastic.core.format.catalog import VALID, Catalog, CheckpointInfo
from lightning_elastic.core.policy.housekeeping import (
    DEFAULT_GRACE_S,
    collect_garbage,
    delete_checkpoint,
)
from lightning_elastic.core.policy.retention import KeepEveryNSteps, KeepLastN, plan_deletions
from lightning_elastic.errors import ElasticCheckpointError

__all__ = ["add_parser", "command"]


def add_parser(sub: Any) -> None:
    """Add ``prune`` to the subcommands."""
    p = add_verb(sub, "prune", "delete old checkpoints (each run keeps its own)")
    p.add_argument("path", help="checkpoint root directory or URL")
    p.add_argument("--keep-last", type=positive, required=True, metavar="N")
    p.add_argument("--keep-every-n-steps", type=positive, default=None, metavar="N")
    p.add_argument("--run-id", default=None, help="only this run's checkpoints")
    p.add_argument("--dry-run", action="store_true", help="print what would be deleted")
    p.add_argument(
        "--leftover-grace",
        type=seconds,
        default=DEFAULT_GRACE_S,
        metavar="SECONDS",
        help="also remove leftovers of crashed saves (folders without a manifest, stray "
        "files) older than this (default: %(default)s; a save in flight is younger)",
    )
    p.set_defaults(func=command)


def command(args: argparse.Namespace) -> int:
    """``lightning-elastic prune ROOT``: apply retention to a root (dry run possible)."""
    if not 0 <= args.leftover_grace < math.inf:  # also refuses nan, before deleting anything
        raise CliError(
            f"--leftover-grace must be a number of seconds >= 0, got {args.leftover_grace}"
        )
    storage, entries = open_dir(args, args.path)
    if is_checkpoint_dir(entries):
        raise CliError(
            f"{args.path} is a checkpoint, not a directory of checkpoints: prune its parent, "
            f"`lightning-elastic prune {parent(args.path)} ...`"
        )
    policies: list[Any] = [KeepLastN(args.keep_last)]
    if args.keep_every_n_steps is not None:
        policies.append(KeepEveryNSteps(args.keep_every_n_steps))
    # A checkpoint whose files do not match the sizes in its manifest is corrupt: it is never
    # deleted, and never counted as the newest valid one that retention must keep.
    rows = check_all(args, storage, scan_root(storage, entries), "size")
    valid = [r.info for r in rows if r.status == VALID.value]
    runs = sorted({i.run_id for i in valid if i.run_id})
    if args.run_id is not None:
        if args.run_id not in runs:
            raise CliError(
                f"no valid checkpoint of run {args.run_id!r} in {args.path} (runs here: "
                f"{', '.join(runs) or 'none'})"
            )
        runs = [r for r in runs if r == args.run_id]
    doomed: list[CheckpointInfo] = []
    for run in runs:
        doomed += plan_deletions(valid, policies, run_id=run)
    doomed.sort(key=order)
    catalog = Catalog(storage)
    failed: list[tuple[CheckpointInfo, str]] = []
    deleted = []
    # newest first: a doomed incremental checkpoint goes before the doomed base it refers to
    # (delete_checkpoint keeps a base while anything refers to it, corrupt referrers too)
    for info in reversed(doomed):
        if args.dry_run:
            deleted.append(info)
            continue
        try:
            save_id = info.manifest.save_id if info.manifest is not None else None
            if delete_checkpoint(storage, catalog, info.name, save_id=save_id):  # as scanned
                deleted.append(info)
        except ElasticCheckpointError as exc:
            failed.append((info, str(exc)))
    deleted.sort(key=order)
    failed.sort(key=lambda f: order(f[0]))
    try:  # best effort, like after a commit: a failure here never fails the prune
        collected = collect_garbage(
            storage, catalog, grace_s=args.leftover_grace, dry_run=args.dry_run
        )
    except Exception as exc:
        print(f"warning: leftovers not collected: {type(exc).__name__}: {exc}", file=sys.stderr)
        collected = []
    left = [r for r in rows if r.status != VALID.value and r.info.location not in collected]
    _report_prune(args, rows, deleted, failed, left, collected, kept=len(valid) - len(deleted))
    return EXIT_BAD_CHECKPOINT if failed else EXIT_OK


def _report_prune(
    args: argparse.Namespace,
    rows: list[Row],
    deleted: list[CheckpointInfo],
    failed: list[tuple[CheckpointInfo, str]],
    left: list[Row],
    collected: list[str],
    kept: int,
) -> None:
    by_name = {r.info.name: r for r in rows}
    if args.json:
        body = {
            "dry_run": args.dry_run,
            "checked": "size",
            "deleted": [by_name[i.name].to_json() for i in deleted],
            "failed": [{**by_name[i.name].to_json(), "error": e} for i, e in failed],
            "kept_valid": kept,
            "left_alone": [r.to_json() for r in left],
            "leftovers_removed": collected,
        }
        print(json.dumps(body, indent=1))
        return
    if not rows:
        print(f"no checkpoints in {args.path}: nothing to prune")
        return
    verb = "would delete" if args.dry_run else "deleted"
    for info in deleted:
        print(f"{verb} {info.location} (step {fmt.show(info.step)}, run {fmt.show(info.run_id)})")
    for info, error in failed:
        print(f"could not delete {info.location}: {error}")
    for r in left:
        print(f"left alone: {r.info.location} is {r.status}: {r.problem}")
    for location in collected:
        print(f"{'would remove' if args.dry_run else 'removed'} leftover {location}")
    counts = {s: len([r for r in left if r.status == s]) for s in ("corrupt", "incomplete")}
    other = len(left) - sum(counts.values())
    summary = (
        f"{len(deleted)} checkpoint(s) {'to delete' if args.dry_run else 'deleted'}, "
        f"{kept} valid kept (file sizes checked, checksums not read), "
        f"{counts['corrupt']} corrupt and {counts['incomplete']} incomplete left alone"
    )
    if other:
        summary += f", {other} unreadable left alone"
    if failed:
        summary += f", {len(failed)} failed to delete"
    print(summary)
