"""``lightning-elastic ls DIR``: the checkpoints under a directory, each checked as
``--check`` says; with ``--local PATH`` (one per node's local root) the union of the tiers and
which of them hold each checkpoint (``ls --help`` explains the notation)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from collections.abc import Mapping
from typing import Any

from lightning_elastic.cli import format as fmt
from lightning_elastic.cli.checks import Row, check_all
from lightning_elastic.cli.common import (
    EXIT_OK,
    CliError,
    add_verb,
    info_of,
    is_checkpoint_dir,
    open_dir,
    order,
    parent,
    scan_root,
)
from lightning_elastic.core.format.catalog import VALID, Catalog
from lightning_elastic.core.format.manifest import Manifest
from lightning_elastic.core.storage.base import Storage, local_path
from lightning_elastic.core.tiers.inventory import NodeScan, scan_node
from lightning_elastic.core.tiers.recovery import CheckpointCandidate
from lightning_elastic.core.tiers.survey import NOTATION, TierView, survey

__all__ = ["add_parser", "command"]


def add_parser(sub: Any) -> None:
    """Add ``ls`` to the subcommands."""
    p = add_verb(sub, "ls", "list the checkpoints under a directory", check="size")
    p.add_argument("path", help="checkpoint root directory or URL")
    p.add_argument(
        "--local",
        action="append",
        default=[],
        metavar="PATH",
        help="one node's local checkpoint root (repeatable, one per node): adds a TIERS "
        "column and lists the checkpoints only the nodes hold too (STATUS local-only)",
    )
    p.epilog, p.formatter_class = NOTATION, argparse.RawDescriptionHelpFormatter
    p.set_defaults(func=command)


def command(args: argparse.Namespace) -> int:
    """``lightning-elastic ls ROOT``: the checkpoints under a root and their status."""
    storage, entries = open_dir(args, args.path)
    if is_checkpoint_dir(entries):
        raise CliError(
            f"{args.path} is a checkpoint, not a directory of checkpoints: run "
            f"`lightning-elastic inspect {args.path}` (or `lightning-elastic ls "
            f"{parent(args.path)}`)"
        )
    nodes = _open_nodes(args)  # before any manifest is read: a wrong path fails at once
    rows = check_all(args, storage, scan_root(storage, entries), args.check)
    if nodes:
        _ls_tiers(args, rows, nodes)
    elif args.json:
        print(json.dumps([r.to_json() for r in rows], indent=1))
    elif not entries:
        print(f"{args.path} is empty: no checkpoints")
    elif not rows:
        print(f"no checkpoints in {args.path} (it holds {len(entries)} other entries)")
    else:
        print(fmt.table([fmt.row(r) for r in rows], fmt.HEADER))
        for r in rows:
            if r.problem and r.status != VALID.value:
                print(f"  {r.info.name}: {r.problem}")
        print(fmt.what_was_checked(args.check, args.path))
    return EXIT_OK


def _open_nodes(args: argparse.Namespace) -> list[Storage]:
    """The ``--local`` roots, or a :class:`CliError` saying which one is not a node's root."""
    nodes: list[Storage] = []
    seen: set[str] = set()
    for path in args.local:
        local = local_path(path)
        key = os.path.normpath(local) if local is not None else path.rstrip("/")
        if key in seen:
            raise CliError(f"--local {path} is given twice (one --local per node)")
        seen.add(key)
        try:
            storage, entries = open_dir(args, path)
        except CliError as exc:
            raise CliError(f"--local {exc}", exc.code) from None
        if is_checkpoint_dir(entries):
            raise CliError(
                f"--local {path} is a checkpoint, not a node's local root: pass its parent, "
                f"`--local {parent(path)}`"
            )
        nodes.append(storage)
    return nodes


_LOCAL_ONLY = "local-only"  # the STATUS of a checkpoint that only node-local roots hold


def _ls_tiers(args: argparse.Namespace, rows: list[Row], nodes: list[Storage]) -> None:
    """``ls`` with ``--local``: the union of the checkpoints of DIR and of the node-local
    roots, each with the tiers that hold it (:mod:`lightning_elastic.core.tiers.survey`)."""
    scans = [scan_node(node) for node in nodes]
    if args.check == "full":
        scans = [_hashed(node, scan) for node, scan in zip(nodes, scans, strict=True)]
    persistent = [  # only a valid copy is a tier (and a sane manifest: _insane passed)
        CheckpointCandidate(r.info.name, r.info.sort_key(), _files(r.info.name, m), persisted=True)
        for r in rows
        if r.status == VALID.value and (m := r.info.manifest) is not None
    ]
    in_dir = {r.info.name: r for r in rows}
    views = survey(scans, persistent, labels=[*args.local, args.path], names=in_dir)
    listed = []
    for name, view in views.items():
        row = in_dir.get(name) or _local_row(nodes, scans, name)
        if row is not None:
            listed.append((row, view))
    listed.sort(key=lambda rv: order(rv[0].info))
    if args.json:
        body = [{**r.to_json(), "tiers": _tiers_json(v, args.local)} for r, v in listed]
        print(json.dumps(body, indent=1))
        return
    orphans = _uncommitted_everywhere(args.local, scans, views)
    if not listed:
        print(f"no checkpoints in {args.path} or the {len(nodes)} node-local root(s)")
        for line in orphans:
            print(line)
        return
    print(fmt.table([[*fmt.row(r), v.notation] for r, v in listed], [*fmt.HEADER, "TIERS"]))
    for r, v in listed:
        if r.problem and r.status not in (VALID.value, _LOCAL_ONLY):
            print(f"  {r.info.name}: {r.problem}")
        if v.conflict is not None:
            print(f"  {r.info.name}: conflict: {v.conflict}")
        elif v.missing:
            more = f" (first: {v.missing[0]})"
            print(f"  {r.info.name}: no node holds {len(v.missing)} of its file(s){more}")
    for line in orphans:
        print(line)
    print(fmt.what_was_checked(args.check, args.path))
    compared = "size and checksum" if args.check == "full" else "size"
    print(
        f"tiers: {len(nodes)} node-local root(s), their files compared by {compared} "
        "(TIERS: see `lightning-elastic ls --help`)"
    )


def _uncommitted_everywhere(
    paths: list[str], scans: list[NodeScan], views: Mapping[str, Any]
) -> list[str]:
    """Lines for the save folders on the nodes that no tier has a manifest of (a save that
    never committed: recovery ignores them; the space they take is shown, not freed)."""
    held: dict[str, list[str]] = {}
    for path, scan in zip(paths, scans, strict=True):
        for name, files in scan.uncommitted.items():
            if name not in views:
                held.setdefault(name, []).append(f"{path} ({fmt.size(sum(files.values()))})")
    return [
        f"  {name}: not committed on any tier (no manifest), save files on {', '.join(where)}"
        for name, where in sorted(held.items())
    ]


def _hashed(node: Storage, scan: NodeScan) -> NodeScan:
    """``scan`` with only the files whose checksum is their manifest's (``--check full``): a
    corrupt copy on a node is not held there."""
    held: dict[str, dict[str, int]] = {}
    for name, files in scan.checkpoints.items():
        info = info_of(Catalog(node), name)
        manifest = info.manifest if info is not None else None
        if manifest is None:
            continue
        sums = {f"{name}/{f.path}": f.checksum for f in manifest.files}
        held[name] = {}
        for rel, size in files.items():
            try:
                got = node.hash_file(rel, manifest.checksum_algorithm).checksum
            except Exception:
                continue  # unreadable: not held
            if got == sums.get(rel):
                held[name][rel] = size
    return dataclasses.replace(scan, checkpoints=held)


def _files(name: str, manifest: Manifest) -> dict[str, int]:
    """Every file of ``manifest`` by path relative to the root, as the scans key them."""
    return {f"{name}/{f.path}": f.size for f in manifest.files}


def _local_row(nodes: list[Storage], scans: list[NodeScan], name: str) -> Row | None:
    """The row of a checkpoint that DIR lacks, from the first node with a valid manifest."""
    for node, scan in zip(nodes, scans, strict=True):
        if name in scan.checkpoints:
            info = info_of(Catalog(node), name)
            if info is not None and info.status == VALID:
                return Row(info, _LOCAL_ONLY, None, "size")
    return None  # gone since the scan


def _tiers_json(view: TierView, paths: list[str]) -> dict[str, Any]:
    nodes = {
        path: {"held_bytes": s.held_bytes, "total_bytes": s.total_bytes, "complete": s.complete}
        for path, s in zip(paths, view.nodes, strict=True)
    }
    return {
        "persistent": view.persistent,
        "nodes": nodes,
        "recoverable_from_nodes": view.recoverable_from_nodes,
        "notation": view.notation,
        "conflict": view.conflict,
        "missing_files": len(view.missing),
    }
