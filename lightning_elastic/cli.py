"""``lightning-elastic``: list, inspect, verify, prune and consolidate checkpoints.

Works on local paths and fsspec URLs (``-o key=value`` passes storage options, e.g.
``-o endpoint_url=http://127.0.0.1:9000``). Every verb takes ``--json``. ``verify`` exits 0
only when everything it checked is valid.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from typing import Any

from lightning_elastic.core.format.catalog import (
    CORRUPT,
    INCOMPLETE,
    VALID,
    Catalog,
    CheckpointInfo,
    split_location,
)
from lightning_elastic.core.format.integrity import verify_files
from lightning_elastic.core.format.manifest import MANIFEST_FILE, STAGING_FILE
from lightning_elastic.core.policy.housekeeping import delete_checkpoint
from lightning_elastic.core.policy.retention import KeepEveryNSteps, KeepLastN, plan_deletions
from lightning_elastic.core.storage.base import Storage
from lightning_elastic.errors import ElasticCheckpointError

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        code: int = args.func(args)
        return code
    except ElasticCheckpointError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lightning-elastic", description=__doc__)
    sub = parser.add_subparsers(required=True, dest="verb")

    def verb(name: str, help: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help, description=help)
        p.add_argument("--json", action="store_true", help="machine-readable output")
        p.add_argument(
            "-o",
            "--storage-option",
            action="append",
            default=[],
            metavar="KEY=VALUE",
            help="fsspec storage option (value parsed as JSON when possible); repeatable",
        )
        return p

    p = verb("ls", "list the checkpoints under a directory")
    p.add_argument("path", help="checkpoint root directory or URL")
    p.set_defaults(func=_ls)
    p = verb("inspect", "show one checkpoint's manifest")
    p.add_argument("path", help="checkpoint directory or URL")
    p.set_defaults(func=_inspect)
    p = verb("verify", "check sizes and checksums against the manifests")
    p.add_argument("path", help="a checkpoint, or a root holding several")
    p.add_argument("--mode", choices=["full", "size"], default="full")
    p.set_defaults(func=_verify)
    p = verb("prune", "delete old checkpoints (each run keeps its own)")
    p.add_argument("path", help="checkpoint root directory or URL")
    p.add_argument("--keep-last", type=int, required=True, metavar="N")
    p.add_argument("--keep-every-n-steps", type=int, default=None, metavar="N")
    p.add_argument("--run-id", default=None, help="only this run's checkpoints")
    p.add_argument("--dry-run", action="store_true", help="print what would be deleted")
    p.set_defaults(func=_prune)
    p = verb("consolidate", "write a checkpoint as one torch.save file (any world size)")
    p.add_argument("path", help="checkpoint directory or URL")
    p.add_argument("output", help="file to write (torch.save format)")
    p.add_argument("--include-rank-state", action="store_true")
    p.set_defaults(func=_consolidate)
    return parser


# ----------------------------------------------------------------------------- helpers


def _options(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in args.storage_option:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"error: storage option {item!r} is not KEY=VALUE")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


def _split(path: str) -> tuple[str, str]:
    parent, name = split_location(path)
    if not name or "/" not in path.rstrip("/"):
        raise SystemExit(f"error: {path!r} does not name a checkpoint directory")
    return parent, name


def _checkpoint(args: argparse.Namespace) -> tuple[Storage, Catalog, str]:
    parent, name = _split(args.path)
    storage = Storage(parent, storage_options=_options(args))
    return storage, Catalog(storage), name


def _is_checkpoint(storage: Storage) -> bool:
    return storage.exists(MANIFEST_FILE) or storage.exists(STAGING_FILE)


def _size(n: int | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return str(n)


def _table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows, strict=False)]
    lines = [
        "  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
        for r in [header, *rows]
    ]
    return "\n".join(lines)


def _row(info: CheckpointInfo) -> list[str]:
    d = info.to_json()
    return [
        info.name,
        str(d["step"] if d["step"] is not None else "-"),
        str(d["epoch"] if d["epoch"] is not None else "-"),
        str(d["world_size"] or "-"),
        str(d["run_id"] or "-"),
        _size(d["bytes"]),  # type: ignore[arg-type]
        str(d["created"] or "-"),
        info.status,
    ]


_HEADER = ["NAME", "STEP", "EPOCH", "WORLD", "RUN", "SIZE", "CREATED (UTC)", "STATUS"]


# ----------------------------------------------------------------------------- verbs


def _ls(args: argparse.Namespace) -> int:
    infos = Catalog(Storage(args.path, storage_options=_options(args))).scan()
    if args.json:
        print(json.dumps([i.to_json() for i in infos], indent=1))
    elif not infos:
        print(f"no checkpoints in {args.path}")
    else:
        print(_table([_row(i) for i in infos], _HEADER))
        for info in infos:
            if info.problem and info.status != VALID:
                print(f"  {info.name}: {info.problem}")
    return 0


def _inspect(args: argparse.Namespace) -> int:
    _, catalog, name = _checkpoint(args)
    info = catalog.info(name)
    m = info.manifest
    if args.json:
        body: dict[str, Any] = {**info.to_json()}
        if m is not None:
            body["manifest"] = json.loads(m.to_json())
        print(json.dumps(body, indent=1))
        return 0
    print(f"{info.location}: {info.status}" + (f" ({info.problem})" if info.problem else ""))
    if m is None:
        return 0
    created = info.to_json()["created"]
    print(f"  step {m.step}, epoch {m.epoch}, run {m.run_id}")
    print(f"  saved {created} by {m.world_size} rank(s)")
    print(
        f"  {_size(m.total_bytes)} in {len(m.files)} files, checksums {m.checksum_algorithm}"
        + (f", compression {m.compression}" if m.compression else "")
    )
    t = m.timings
    print(
        f"  timings: staging {t.staging_s:.3f}s, writing {t.writing_s:.3f}s, "
        f"commit {t.commit_s:.3f}s, total {t.total_s:.3f}s"
    )
    print("  versions: " + ", ".join(f"{k} {v}" for k, v in sorted(m.versions.items())))
    if m.resumed_from:
        print(f"  resumed from: {m.resumed_from}")
    if m.metrics:
        print("  metrics: " + ", ".join(f"{k}={v:g}" for k, v in sorted(m.metrics.items())))
    print(
        _table(
            [
                [f.path, _size(f.size), f.checksum, "-" if f.rank is None else str(f.rank)]
                for f in m.files
            ],
            ["FILE", "SIZE", "CHECKSUM", "RANK"],
        )
        .replace("\n", "\n  ")
        .join(["  ", ""])
    )
    print(
        _table(
            [
                [
                    str(r.rank),
                    r.host,
                    str(r.local_rank if r.local_rank is not None else "-"),
                    _size(r.bytes_written),
                    f"{r.staging_s:.3f}",
                    f"{r.writing_s:.3f}",
                ]
                for r in m.ranks
            ],
            ["RANK", "HOST", "LOCAL", "WROTE", "STAGE_S", "WRITE_S"],
        )
        .replace("\n", "\n  ")
        .join(["  ", ""])
    )
    for key, value in sorted(m.metadata.items()):
        text = value if isinstance(value, str) else json.dumps(value, indent=1, sort_keys=True)
        print(f"  metadata[{key}]:")
        print("    " + str(text).rstrip().replace("\n", "\n    "))
    return 0


def _verify(args: argparse.Namespace) -> int:
    options = _options(args)
    root = Storage(args.path, storage_options=options)
    if _is_checkpoint(root):
        parent, name = _split(args.path)
        catalog = Catalog(Storage(parent, storage_options=options))
        infos = [catalog.info(name)]
    else:
        catalog = Catalog(root)
        infos = catalog.scan()
        if not infos:
            print(f"error: no checkpoints in {args.path}", file=sys.stderr)
            return 1
    results = []
    for info in infos:
        status, problem = info.status, info.problem
        if info.status == VALID and info.manifest is not None:
            problems = verify_files(catalog.storage.child(info.name), info.manifest, args.mode)
            if problems:
                first = sorted(problems, key=lambda p: p.file)[0]
                status, problem = CORRUPT, f"{first.file}: {first.reason}"
        results.append((info, status, problem))
    if args.json:
        out = []
        for info, status, problem in results:
            out.append({**info.to_json(), "status": status, "problem": problem})
        print(json.dumps(out, indent=1))
    else:
        for info, status, problem in results:
            line = f"{status:10s} {info.location}"
            print(line + (f": {problem}" if problem and status != VALID else ""))
    bad = [r for r in results if r[1] != VALID]
    for info, status, problem in bad:
        if not args.json:
            print(f"error: {info.location} is {status}: {problem}", file=sys.stderr)
    return 1 if bad else 0


def _prune(args: argparse.Namespace) -> int:
    storage = Storage(args.path, storage_options=_options(args))
    catalog = Catalog(storage)
    policies: list[Any] = [KeepLastN(args.keep_last)]
    if args.keep_every_n_steps:
        policies.append(KeepEveryNSteps(args.keep_every_n_steps))
    infos = catalog.scan()
    runs = {i.run_id for i in infos if i.status == VALID and i.run_id}
    if args.run_id is not None:
        runs &= {args.run_id}
    doomed: list[CheckpointInfo] = []
    for run in sorted(runs):
        doomed += plan_deletions(infos, policies, run_id=run)
    doomed.sort(key=CheckpointInfo.sort_key)
    for info in doomed:
        if not args.dry_run:
            delete_checkpoint(storage, catalog, info.name)
    if args.json:
        print(
            json.dumps(
                {"dry_run": args.dry_run, "deleted": [i.to_json() for i in doomed]}, indent=1
            )
        )
    else:
        verb = "would delete" if args.dry_run else "deleted"
        for info in doomed:
            print(f"{verb} {info.location} (step {info.step}, run {info.run_id})")
        kept = len([i for i in infos if i.status == VALID]) - len(doomed)
        untouched = len([i for i in infos if i.status in (CORRUPT, INCOMPLETE)])
        print(
            f"{len(doomed)} checkpoint(s) {'to delete' if args.dry_run else 'deleted'}, "
            f"{kept} valid kept, "
            f"{untouched} corrupt/incomplete left alone"
        )
    return 0


def _consolidate(args: argparse.Namespace) -> int:
    import torch

    from lightning_elastic.core.load.load import read_full_state

    storage, catalog, name = _checkpoint(args)
    info = catalog.info(name)
    if info.status != VALID or info.manifest is None:
        print(f"error: {info.location} is {info.status}: {info.problem}", file=sys.stderr)
        return 1
    problems = verify_files(storage.child(name), info.manifest, "full")
    if problems:
        print(
            f"error: {info.location} is corrupt: {problems[0].file}: {problems[0].reason}",
            file=sys.stderr,
        )
        return 1
    start = time.monotonic()
    state = read_full_state(storage.child(name), include_rank_state=args.include_rank_state)
    torch.save(state, args.output)
    summary = {
        "checkpoint": info.location,
        "output": args.output,
        "seconds": time.monotonic() - start,
    }
    print(json.dumps(summary) if args.json else f"wrote {args.output} from {info.location}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
