"""``lightning-elastic report DIR``: the story of a checkpoint directory (checkpoints, world
sizes, resumes, lost work, problems, storage) as text, JSON or an HTML page; the report itself
is :mod:`lightning_elastic.report`."""

from __future__ import annotations

import argparse
import json
from typing import Any

from lightning_elastic.cli import format as fmt
from lightning_elastic.cli.checks import check_all
from lightning_elastic.cli.common import (
    EXIT_BAD_CHECKPOINT,
    EXIT_OK,
    CliError,
    add_verb,
    is_checkpoint_dir,
    open_dir,
    parent,
    scan_root,
)

__all__ = ["add_parser", "command"]


def add_parser(sub: Any) -> None:
    """Add ``report`` to the subcommands."""
    p = add_verb(
        sub,
        "report",
        "summarize the runs of a directory: checkpoints, world size, resumes, lost work, "
        "problems, storage (text, or JSON; --output writes a self-contained HTML page)",
        check="size",
    )
    p.add_argument("path", help="checkpoint root directory or URL")
    p.add_argument("--output", "--html", metavar="FILE", help="write the HTML page to FILE")
    p.add_argument("--run", dest="run_id", default=None, metavar="RUN_ID", help="only this run")
    p.set_defaults(func=command)


def command(args: argparse.Namespace) -> int:
    """The checks and the error messages of the other verbs; the report itself is
    :mod:`lightning_elastic.report` (matplotlib is imported only for ``--output``)."""
    from lightning_elastic.core.observe.history import read_history
    from lightning_elastic.report import CheckpointRow, build_report, render_html, render_text

    storage, entries = open_dir(args, args.path)
    if is_checkpoint_dir(entries):
        raise CliError(
            f"{args.path} is a checkpoint, not a directory of checkpoints: run "
            f"`lightning-elastic report {parent(args.path)}`"
        )
    rows = check_all(args, storage, scan_root(storage, entries), args.check)
    everything, skipped = read_history(storage)
    events = [e for e in everything if args.run_id in (None, e.run_id)]
    if args.run_id is not None:
        runs = sorted(
            {r.info.run_id for r in rows if r.info.run_id}
            | {e.run_id for e in everything if e.run_id}
        )
        rows = [r for r in rows if r.info.run_id == args.run_id]
        if not rows and not events:
            raise CliError(
                f"no checkpoint or history of run {args.run_id!r} in {args.path} (runs here: "
                f"{', '.join(runs) or 'none'})",
                EXIT_BAD_CHECKPOINT,
            )
    if not rows and not events:
        what = "is empty" if not entries else "holds no checkpoints and no history"
        raise CliError(f"{args.path} {what}: nothing to report", EXIT_BAD_CHECKPOINT)
    checkpoints = [CheckpointRow(r.info, r.status, r.problem) for r in rows]
    report = build_report(
        args.path, checkpoints, events, skipped=skipped, run_id=args.run_id, checked=args.check
    )
    if args.output:
        try:
            with open(args.output, "w", encoding="utf-8") as f:
                f.write(render_html(report))
        except OSError as exc:
            raise CliError(f"could not write {args.output}: {exc.strerror or exc}") from None
        report["html"] = args.output
    if args.json:
        print(json.dumps(fmt.jsonable(report), indent=1))
    else:
        print(render_text(report))
        if args.output:
            print(f"wrote {args.output}")
    return EXIT_OK
