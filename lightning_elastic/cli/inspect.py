"""``lightning-elastic inspect CKPT``: one checkpoint's manifest (step, run, files, checksums,
ranks, timings, metadata), its files checked as ``--check`` says."""

from __future__ import annotations

import argparse
import json
from typing import Any

from lightning_elastic.cli import format as fmt
from lightning_elastic.cli.checks import check_all
from lightning_elastic.cli.common import EXIT_OK, add_verb, checkpoint_at
from lightning_elastic.core.format.catalog import VALID

__all__ = ["add_parser", "command"]


def add_parser(sub: Any) -> None:
    """Add ``inspect`` to the subcommands."""
    p = add_verb(sub, "inspect", "show one checkpoint's manifest", check="size")
    p.add_argument("path", help="checkpoint directory or URL")
    p.set_defaults(func=command)


def command(args: argparse.Namespace) -> int:
    """``lightning-elastic inspect PATH``: one checkpoint's manifest, files and status."""
    root, info = checkpoint_at(args, args.path)
    row = check_all(args, root, [info], args.check)[0]
    m = info.manifest
    if args.json:
        body = row.to_json()
        if m is not None:
            body["manifest"] = fmt.jsonable(fmt.get(lambda: json.loads(m.to_json())))
        print(json.dumps(body, indent=1))
        return EXIT_OK
    status = row.status
    if row.status == VALID.value:
        status += f" ({fmt.CHECKED[row.checked]})"
    print(f"{info.location}: {status}" + (f": {row.problem}" if row.problem else ""))
    if m is not None:
        _print_manifest(m)
    if row.status == VALID.value and row.checked != "full":
        print(f"  checksums not read: run `lightning-elastic verify {args.path}`")
    return EXIT_OK


def _print_manifest(m: Any) -> None:
    created = fmt.iso(fmt.timestamp(fmt.get(lambda: m.created_unix)))
    print(f"  step {fmt.show(m.step)}, epoch {fmt.show(m.epoch)}, run {fmt.show(m.run_id)}")
    print(f"  saved {created or '?'} by {fmt.show(m.world_size)} rank(s)")
    files = fmt.as_tuple(m.files)
    print(
        f"  {fmt.size(fmt.get(lambda: m.total_bytes))} in {len(files)} files, "
        f"checksums {fmt.show(m.checksum_algorithm)}"
        + (f", compression {fmt.show(m.compression)}" if m.compression else "")
    )
    t = m.timings
    print(
        f"  timings: staging {fmt.secs(fmt.get(lambda: t.staging_s))}, "
        f"writing {fmt.secs(fmt.get(lambda: t.writing_s))}, "
        f"commit {fmt.secs(fmt.get(lambda: t.commit_s))}, "
        f"total {fmt.secs(fmt.get(lambda: t.total_s))}"
    )
    print(
        "  versions: " + ", ".join(f"{fmt.show(k)} {fmt.show(v)}" for k, v in fmt.items(m.versions))
    )
    if m.resumed_from:
        print(f"  resumed from: {fmt.show(m.resumed_from)}")
    if m.metrics:
        print(
            "  metrics: "
            + ", ".join(f"{fmt.show(k)}={fmt.num(v)}" for k, v in fmt.items(m.metrics))
        )
    rows = [
        [fmt.show(f.path), fmt.size(f.size), fmt.show(f.checksum), fmt.show(f.rank)] for f in files
    ]
    print(fmt.indent(fmt.table(rows, ["FILE", "SIZE", "CHECKSUM", "RANK"])))
    refs = fmt.as_tuple(fmt.get(lambda: m.references) or ())
    if refs:  # an incremental checkpoint: unchanged tensors are read from these files
        print(f"  refers to {len(refs)} file(s) of earlier checkpoints (unchanged tensors):")
        rows = [
            [
                fmt.show(r.checkpoint),
                fmt.show(r.path),
                fmt.size(r.size),
                fmt.show(r.checksum),
                fmt.show(r.rank),
            ]
            for r in refs
        ]
        print(fmt.indent(fmt.table(rows, ["CHECKPOINT", "FILE", "SIZE", "CHECKSUM", "RANK"])))
    ranks = [
        [
            fmt.show(r.rank),
            fmt.show(r.host),
            fmt.show(r.local_rank),
            fmt.size(r.bytes_written),
            fmt.num(r.staging_s, ".3f"),
            fmt.num(r.writing_s, ".3f"),
        ]
        for r in fmt.as_tuple(m.ranks)
    ]
    print(fmt.indent(fmt.table(ranks, ["RANK", "HOST", "LOCAL", "WROTE", "STAGE_S", "WRITE_S"])))
    for key, value in fmt.items(m.metadata):
        text = value if isinstance(value, str) else json.dumps(fmt.jsonable(value), indent=1)
        print(f"  metadata[{fmt.show(key)}]:")
        print("    " + str(text).rstrip().replace("\n", "\n    "))
