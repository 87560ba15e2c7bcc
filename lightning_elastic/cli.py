"""``lightning-elastic``: list, inspect, verify, prune and consolidate checkpoints, report on
a run; ``run`` launches training like torchrun (see :mod:`lightning_elastic.launcher`).

Works on local paths and fsspec URLs (``-o key=value`` passes storage options, e.g.
``-o endpoint_url=http://127.0.0.1:9000``). Every verb takes ``--json``: then everything it
prints on stdout is JSON, errors included (``{"error": "...", "exit_code": N}``).
Multi-tier runs: ``ls DIR --local PATH`` (one per node's local root) adds the tiers holding
each checkpoint (``ls --help`` explains the notation).

What is checked: ``ls``, ``inspect`` and ``prune`` read the manifests and compare the file
sizes they record with one listing per checkpoint (``--check none|size|full`` for ``ls`` and
``inspect``; ``prune`` never deletes a checkpoint whose sizes do not match, and counts it as
corrupt). Only ``verify`` (and ``--check full``) reads the data and compares checksums.
``verify`` and ``consolidate`` draw a progress bar on stderr when stderr is a terminal.

Exit codes:

* 0: done; for ``verify``, every checkpoint it checked is valid;
* 1: ``verify``/``consolidate`` found a checkpoint corrupt (or, named alone, incomplete), or
  had nothing to check (``report``: neither checkpoints nor history); ``prune`` could not
  delete a checkpoint it planned to delete. In a root, ``verify`` lists directories without
  a manifest as ``incomplete`` (a save in flight, or a crashed one that the next save or
  ``prune`` collects) without failing for them;
* 2: bad arguments, or a path that is not what the verb needs (missing, a file, a checkpoint
  root where one checkpoint is expected or the reverse), or a storage error;
* 3: an unexpected error (one line; ``LIGHTNING_ELASTIC_DEBUG=1`` shows the traceback);
* 130: interrupted; 141: stdout was closed early (``lightning-elastic ls DIR | head -1``).

The manifest-only verbs (``ls``, ``inspect``, ``prune``, ``verify --mode size``, ``report``)
import neither Lightning nor torch.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NoReturn

from lightning_elastic.core.format.catalog import (
    CORRUPT,
    INCOMPLETE,
    VALID,
    Catalog,
    CheckpointInfo,
    holds_checkpoint_files,
)
from lightning_elastic.core.format.integrity import Problem, verify_files
from lightning_elastic.core.format.manifest import MANIFEST_FILE, Manifest
from lightning_elastic.core.format.references import reference_records, routes
from lightning_elastic.core.options import check_count, check_seconds
from lightning_elastic.core.policy.housekeeping import (
    DEFAULT_GRACE_S,
    collect_garbage,
    delete_checkpoint,
)
from lightning_elastic.core.policy.retention import KeepEveryNSteps, KeepLastN, plan_deletions
from lightning_elastic.core.storage.base import Entry, Storage, local_path
from lightning_elastic.core.tiers.inventory import NodeScan, scan_node
from lightning_elastic.core.tiers.recovery import CheckpointCandidate
from lightning_elastic.core.tiers.survey import NOTATION, TierView, survey
from lightning_elastic.errors import (
    CheckpointNotFoundError,
    ConfigError,
    ElasticCheckpointError,
    IntegrityError,
)

__all__ = ["main"]

EXIT_OK, EXIT_BAD_CHECKPOINT, EXIT_USAGE, EXIT_UNEXPECTED = 0, 1, 2, 3
EXIT_INTERRUPTED, EXIT_PIPE_CLOSED = 130, 141
_DEBUG_ENV = "LIGHTNING_ELASTIC_DEBUG"
# What each --check level compared, as ls/inspect/verify print it.
_CHECKED = {"none": "manifest only", "size": "sizes checked", "full": "checksums checked"}


class CliError(Exception):
    """A one-line error for the user and the exit code that goes with it."""

    def __init__(self, message: str, code: int = EXIT_USAGE) -> None:
        super().__init__(message)
        self.code = code


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line on ``argv`` (default: ``sys.argv[1:]``) and return the exit code.
    Errors are printed (as JSON with ``--json``), not raised; see the module docstring."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["run"]:  # torchrun's own command line, passed through untouched
        from lightning_elastic.launcher import main as launch

        return launch(argv[1:])
    as_json = "--json" in argv
    try:
        args = _parser().parse_args(argv)
        code: int = args.func(args)
        sys.stdout.flush()  # a closed pipe fails here, not at interpreter exit
        return code
    except BrokenPipeError:
        return _pipe_closed()
    except CliError as exc:
        return _fail(str(exc), exc.code, as_json)
    except ElasticCheckpointError as exc:
        return _fail(str(exc), EXIT_USAGE, as_json)
    except KeyboardInterrupt:
        return _fail("interrupted", EXIT_INTERRUPTED, as_json)
    except Exception as exc:
        if os.environ.get(_DEBUG_ENV):
            raise
        message = f"unexpected {type(exc).__name__}: {exc} (set {_DEBUG_ENV}=1 for a traceback)"
        return _fail(message, EXIT_UNEXPECTED, as_json)


def _fail(message: str, code: int, as_json: bool) -> int:
    try:
        if as_json:
            print(json.dumps({"error": message, "exit_code": code}))
            sys.stdout.flush()
        else:
            print(f"error: {message}", file=sys.stderr)
    except BrokenPipeError:
        return _pipe_closed()
    return code


def _pipe_closed() -> int:
    """The reader went away: say nothing, and keep Python's final flush from complaining."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):
        pass  # not a real file (captured in tests): nothing will be flushed to it
    return EXIT_PIPE_CLOSED


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # argparse prints usage and exits; we raise
        raise CliError(f"{self.prog}: {message} (see `{self.prog} --help`)")


def _positive(text: str) -> int:
    """A whole number >= 1 (``1e3`` and ``2.0`` refused, as the Python options refuse them:
    the message says which numbers are)."""
    value: object = text
    with contextlib.suppress(ValueError):
        value = int(text)
    try:
        return check_count(value, "N")
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _seconds(text: str) -> float:
    """A duration in seconds >= 0 (``nan``, ``inf`` and negative ones refused)."""
    value: object = text
    with contextlib.suppress(ValueError):
        value = float(text)
    try:
        return check_seconds(value, "SECONDS", zero=True, given=text, what="a number of seconds")
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="lightning-elastic",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(required=True, dest="verb")
    # handled before parsing (main): listed here for --help only
    sub.add_parser(
        "run",
        help="torchrun (same arguments), except that a planned membership change does not "
        "use up --max-restarts; --warm-start forks workers with torch and Lightning imported",
    )

    from lightning_elastic import lighthouse

    beacon = sub.add_parser(
        "lighthouse",
        help="torchft's Lighthouse for replica groups (strategy='elastic_ft'), in the "
        "foreground until SIGTERM/Ctrl-C",
        description=lighthouse.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    lighthouse.add_arguments(beacon)
    beacon.set_defaults(func=lighthouse.serve)

    def verb(name: str, help: str, *, check: str | None = None) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help, description=help)
        p.add_argument("--json", action="store_true", help="machine-readable output (JSON)")
        p.add_argument(
            "-o",
            "--storage-option",
            action="append",
            default=[],
            metavar="KEY=VALUE",
            help="fsspec storage option (value parsed as JSON when possible); repeatable",
        )
        if check is not None:
            p.add_argument(
                "--check",
                choices=["none", "size", "full"],
                default=check,
                help="what to compare with the manifests: nothing, file sizes (one listing per "
                "checkpoint) or checksums (reads everything); default %(default)s",
            )
        return p

    p = verb("ls", "list the checkpoints under a directory", check="size")
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
    p.set_defaults(func=_ls)
    p = verb("inspect", "show one checkpoint's manifest", check="size")
    p.add_argument("path", help="checkpoint directory or URL")
    p.set_defaults(func=_inspect)
    p = verb("verify", "check sizes and checksums against the manifests")
    p.add_argument("path", help="a checkpoint, or a root holding several")
    p.add_argument("--mode", choices=["full", "size"], default="full")
    _progress_flag(p)
    p.set_defaults(func=_verify)
    p = verb("prune", "delete old checkpoints (each run keeps its own)")
    p.add_argument("path", help="checkpoint root directory or URL")
    p.add_argument("--keep-last", type=_positive, required=True, metavar="N")
    p.add_argument("--keep-every-n-steps", type=_positive, default=None, metavar="N")
    p.add_argument("--run-id", default=None, help="only this run's checkpoints")
    p.add_argument("--dry-run", action="store_true", help="print what would be deleted")
    p.add_argument(
        "--leftover-grace",
        type=_seconds,
        default=DEFAULT_GRACE_S,
        metavar="SECONDS",
        help="also remove leftovers of crashed saves (folders without a manifest, stray "
        "files) older than this (default: %(default)s; a save in flight is younger)",
    )
    p.set_defaults(func=_prune)
    p = verb("consolidate", "write a checkpoint as one torch.save file (any world size)")
    p.add_argument("path", help="checkpoint directory or URL")
    p.add_argument("output", help="local file to write (torch.save format)")
    p.add_argument("--include-rank-state", action="store_true")
    p.add_argument(
        "--trusted",
        action="store_true",
        help="unpickle objects without the safe-loading allowlist (may run code from the "
        "checkpoint): only for checkpoints you trust",
    )
    _progress_flag(p)
    p.set_defaults(func=_consolidate)
    p = verb(
        "report",
        "summarize the runs of a directory: checkpoints, world size, resumes, lost work, "
        "problems, storage (text, or JSON; --output writes a self-contained HTML page)",
        check="size",
    )
    p.add_argument("path", help="checkpoint root directory or URL")
    p.add_argument("--output", "--html", metavar="FILE", help="write the HTML page to FILE")
    p.add_argument("--run", dest="run_id", default=None, metavar="RUN_ID", help="only this run")
    p.set_defaults(func=_report)
    return parser


def _progress_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="progress bar on stderr (default: when stderr is a terminal)",
    )


# ----------------------------------------------------------------------------- locations


def _options(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in args.storage_option:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise CliError(f"storage option {item!r} is not KEY=VALUE")
        try:
            out[key.strip()] = json.loads(value)
        except json.JSONDecodeError:
            out[key.strip()] = value
    return out


def _open(args: argparse.Namespace, path: str) -> tuple[Storage, list[Entry]]:
    """``path`` as a storage and its listing, or a :class:`CliError` saying why it is not a
    directory (local paths only: an object store cannot tell missing from empty)."""
    local = local_path(path)
    if local is not None:
        if not os.path.lexists(local):
            raise CliError(f"{path} does not exist (no checkpoint there)")
        if not os.path.isdir(local):
            hint = ""
            if os.path.basename(local) == MANIFEST_FILE:
                hint = f": to see this checkpoint, run `lightning-elastic inspect {_parent(path)}`"
            raise CliError(f"{path} is a file, not a directory of checkpoints{hint}")
        if not os.access(local, os.R_OK | os.X_OK):
            raise CliError(f"{path} is not readable (permission denied)")
    storage = Storage(path, storage_options=_options(args))
    return storage, storage.listdir()


def _is_checkpoint_dir(entries: list[Entry]) -> bool:
    return holds_checkpoint_files(e.name for e in entries if not e.is_dir)


def _parent(path: str) -> str:
    return _split(path)[0]


def _split(path: str) -> tuple[str, str]:
    """``root/name`` -> (root, name) for local paths and URLs."""
    local = local_path(path)
    if local is None:
        scheme, rest = path.split("://", 1)
        head, sep, name = rest.rstrip("/").rpartition("/")
        if not sep or not name:
            raise CliError(f"{path} names a bucket, not a checkpoint directory")
        return f"{scheme}://{head}", name
    norm = os.path.normpath(local)
    if os.path.basename(norm) in ("", ".", ".."):
        norm = os.path.abspath(norm)
    parent, name = os.path.split(norm)
    if not name:
        raise CliError(f"{path} is the filesystem root, not a checkpoint directory")
    return parent or ".", name


def _scan(storage: Storage, entries: list[Entry]) -> list[CheckpointInfo]:
    """Like :meth:`Catalog.scan` over a listing already made, except that one unreadable or
    odd checkpoint becomes a corrupt row instead of failing the whole listing."""
    catalog = Catalog(storage)
    infos = []
    for entry in entries:
        if entry.is_dir and not entry.name.startswith("."):
            info = _info(catalog, entry.name)
            if info is not None:
                infos.append(info)
    return sorted(infos, key=_order)


def _info(catalog: Catalog, name: str) -> CheckpointInfo | None:
    try:
        info = catalog.info(name)
    except CheckpointNotFoundError:
        return None
    except Exception as exc:
        location = catalog.storage.display(name)
        return CheckpointInfo(name, location, CORRUPT, problem=f"unreadable: {exc}")
    problem = _insane(info)
    if problem is not None:
        return dataclasses.replace(info, status=CORRUPT, problem=problem)
    return info


def _insane(info: CheckpointInfo) -> str | None:
    """What in a parsed manifest the CLI's decisions cannot rely on (whatever the parser let
    through: a hand-edited file may hold anything)."""
    m = info.manifest
    if m is None or info.status != VALID:
        return None
    checks: list[tuple[str, bool]] = [
        ("step", _is_int(m.step)),
        ("epoch", m.epoch is None or _is_int(m.epoch)),
        ("sequence", _is_int(m.sequence)),
        ("world_size", _is_int(m.world_size)),
        ("created_unix", _timestamp(m.created_unix) is not None),
        ("run_id", isinstance(m.run_id, str)),
        ("checksum_algorithm", isinstance(m.checksum_algorithm, str)),
        (
            "files",
            all(isinstance(f.path, str) and _is_int(f.size) for f in _tuple(m.files)),
        ),
    ]
    bad = [field for field, ok in checks if not ok]
    return f"manifest field {bad[0]} is invalid: {_show(getattr(m, bad[0], None))}" if bad else None


def _tuple(value: Any) -> tuple[Any, ...]:
    return tuple(value) if isinstance(value, (tuple, list)) else ()


def _order(info: CheckpointInfo) -> tuple[int, float, str]:
    m = info.manifest
    sequence = m.sequence if m is not None and _is_int(m.sequence) else 0
    return (sequence, _timestamp(_get(lambda: info.created_unix)) or 0.0, info.name)


def _checkpoint(args: argparse.Namespace, path: str) -> tuple[Storage, CheckpointInfo]:
    """The checkpoint at ``path`` (its parent storage and info), or a :class:`CliError` that
    says what ``path`` is instead and what to run."""
    storage, entries = _open(args, path)
    if not _is_checkpoint_dir(entries):
        if not entries:
            raise CliError(f"{path} is an empty directory, not a checkpoint")
        infos = _scan(storage, entries)
        if infos:
            newest = infos[-1].location
            raise CliError(
                f"{path} is a checkpoint root holding {len(infos)} checkpoint(s), not a "
                f"checkpoint: run `lightning-elastic ls {path}`, or name one, e.g. "
                f"`lightning-elastic {args.verb} {newest}`"
            )
        raise CliError(f"{path} is not a checkpoint (no {MANIFEST_FILE}) and holds no checkpoints")
    parent, name = _split(path)
    root = Storage(parent, storage_options=_options(args))
    info = _info(Catalog(root), name)
    if info is None:
        raise CliError(f"{path} holds no files of a checkpoint")
    return root, info


# ----------------------------------------------------------------------------- checking


@dataclasses.dataclass(frozen=True)
class _Row:
    """A checkpoint as the CLI reports it: the catalog's view plus what the CLI checked."""

    info: CheckpointInfo
    status: str
    problem: str | None
    checked: str  # none | size | full

    def to_json(self) -> dict[str, Any]:
        info, m = self.info, self.info.manifest
        created = _timestamp(_get(lambda: info.created_unix))
        body: dict[str, Any] = _jsonable(
            {
                "name": info.name,
                "path": info.location,
                "status": self.status,
                "checked": self.checked,
                "step": _get(lambda: info.step),
                "epoch": _get(lambda: m.epoch) if m else None,
                "world_size": _get(lambda: m.world_size) if m else None,
                "run_id": _get(lambda: info.run_id),
                "bytes": _get(lambda: m.total_bytes) if m else None,
                # an incremental checkpoint: what it reads from earlier ones, and which
                "referenced_bytes": _get(lambda: m.referenced_bytes) if m else None,
                "references": sorted(_get(lambda: m.referenced_checkpoints) or ()) if m else [],
                "created": _iso(created) if created else None,
                "problem": self.problem,
            }
        )
        return body


class _NoBar:
    def update(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        pass


def _bar(args: argparse.Namespace, total: float | None, desc: str) -> Any:
    """A tqdm bar on stderr: when asked (``--progress``), or when stderr is a terminal and the
    work lasts long enough to matter (tqdm's ``delay``); tqdm is imported only then."""
    wanted = getattr(args, "progress", False)
    if wanted is None:
        wanted = _isatty(sys.stderr)
    if not wanted:
        return _NoBar()
    try:
        from tqdm import tqdm  # type: ignore[import-untyped, unused-ignore]
    except ImportError:
        return _NoBar()
    forced = getattr(args, "progress", None) is True
    return tqdm(
        total=total,
        desc=desc,
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        file=sys.stderr,
        delay=0.0 if forced else 0.5,
        leave=False,
        dynamic_ncols=True,
    )


def _isatty(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError, OSError):
        return False


def _check(root: Storage, info: CheckpointInfo, mode: str, bar: Any = None) -> _Row:
    """Compare ``info``'s files with its manifest (``mode``: none, size or full)."""
    if info.status != VALID or info.manifest is None or mode == "none":
        return _Row(info, info.status.value, info.problem, "none")
    manifest = info.manifest
    try:
        ckpt = root.child(info.name)
        paths = routes(ckpt, manifest)  # an incremental checkpoint's referenced files
        if mode == "size":
            problems = verify_files(ckpt, manifest, "size", routes=paths)
        else:
            problems = []
            for record in (*manifest.files, *reference_records(manifest)):
                problems += verify_files(ckpt, manifest, "full", files=[record], routes=paths)
                if bar is not None:
                    bar.update(record.size)
    except ElasticCheckpointError as exc:
        return _Row(info, "unreadable", f"could not check: {exc}", mode)
    if not problems:
        return _Row(info, VALID.value, None, mode)
    return _Row(info, CORRUPT.value, _describe(problems), mode)


def _total(info: CheckpointInfo) -> int:
    manifest = info.manifest
    size = _get(lambda: manifest.total_bytes) if manifest is not None else None
    return size if isinstance(size, int) and not isinstance(size, bool) else 0


def _describe(problems: list[Problem]) -> str:
    first = sorted(problems, key=lambda p: p.file)[0]
    more = f" (and {len(problems) - 1} more file(s))" if len(problems) > 1 else ""
    return f"{first.file}: {first.reason}{more}"


def _check_all(
    args: argparse.Namespace, root: Storage, infos: list[CheckpointInfo], mode: str
) -> list[_Row]:
    bar: Any = _NoBar()
    if mode == "full":
        bar = _bar(args, sum(_total(i) for i in infos), "verifying")
    try:
        return [_check(root, info, mode, bar) for info in infos]
    finally:
        bar.close()


# ----------------------------------------------------------------------------- verbs


def _ls(args: argparse.Namespace) -> int:
    storage, entries = _open(args, args.path)
    if _is_checkpoint_dir(entries):
        raise CliError(
            f"{args.path} is a checkpoint, not a directory of checkpoints: run "
            f"`lightning-elastic inspect {args.path}` (or `lightning-elastic ls "
            f"{_parent(args.path)}`)"
        )
    nodes = _open_nodes(args)  # before any manifest is read: a wrong path fails at once
    rows = _check_all(args, storage, _scan(storage, entries), args.check)
    if nodes:
        _ls_tiers(args, rows, nodes)
    elif args.json:
        print(json.dumps([r.to_json() for r in rows], indent=1))
    elif not entries:
        print(f"{args.path} is empty: no checkpoints")
    elif not rows:
        print(f"no checkpoints in {args.path} (it holds {len(entries)} other entries)")
    else:
        print(_table([_row(r) for r in rows], _HEADER))
        for r in rows:
            if r.problem and r.status != VALID.value:
                print(f"  {r.info.name}: {r.problem}")
        print(_what_was_checked(args.check, args.path))
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
            storage, entries = _open(args, path)
        except CliError as exc:
            raise CliError(f"--local {exc}", exc.code) from None
        if _is_checkpoint_dir(entries):
            raise CliError(
                f"--local {path} is a checkpoint, not a node's local root: pass its parent, "
                f"`--local {_parent(path)}`"
            )
        nodes.append(storage)
    return nodes


_LOCAL_ONLY = "local-only"  # the STATUS of a checkpoint that only node-local roots hold


def _ls_tiers(args: argparse.Namespace, rows: list[_Row], nodes: list[Storage]) -> None:
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
    listed.sort(key=lambda rv: _order(rv[0].info))
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
    print(_table([[*_row(r), v.notation] for r, v in listed], [*_HEADER, "TIERS"]))
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
    print(_what_was_checked(args.check, args.path))
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
                held.setdefault(name, []).append(f"{path} ({_size(sum(files.values()))})")
    return [
        f"  {name}: not committed on any tier (no manifest), save files on {', '.join(where)}"
        for name, where in sorted(held.items())
    ]


def _hashed(node: Storage, scan: NodeScan) -> NodeScan:
    """``scan`` with only the files whose checksum is their manifest's (``--check full``): a
    corrupt copy on a node is not held there."""
    held: dict[str, dict[str, int]] = {}
    for name, files in scan.checkpoints.items():
        info = _info(Catalog(node), name)
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


def _local_row(nodes: list[Storage], scans: list[NodeScan], name: str) -> _Row | None:
    """The row of a checkpoint that DIR lacks, from the first node with a valid manifest."""
    for node, scan in zip(nodes, scans, strict=True):
        if name in scan.checkpoints:
            info = _info(Catalog(node), name)
            if info is not None and info.status == VALID:
                return _Row(info, _LOCAL_ONLY, None, "size")
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


def _what_was_checked(mode: str, path: str) -> str:
    if mode == "full":
        return "checked: manifests, file sizes and checksums"
    what = "manifests and file sizes" if mode == "size" else "manifests only (not the files)"
    return f"checked: {what}; checksums not read (run `lightning-elastic verify {path}`)"


def _inspect(args: argparse.Namespace) -> int:
    root, info = _checkpoint(args, args.path)
    row = _check_all(args, root, [info], args.check)[0]
    m = info.manifest
    if args.json:
        body = row.to_json()
        if m is not None:
            body["manifest"] = _jsonable(_get(lambda: json.loads(m.to_json())))
        print(json.dumps(body, indent=1))
        return EXIT_OK
    status = row.status
    if row.status == VALID.value:
        status += f" ({_CHECKED[row.checked]})"
    print(f"{info.location}: {status}" + (f": {row.problem}" if row.problem else ""))
    if m is not None:
        _print_manifest(m)
    if row.status == VALID.value and row.checked != "full":
        print(f"  checksums not read: run `lightning-elastic verify {args.path}`")
    return EXIT_OK


def _print_manifest(m: Any) -> None:
    created = _iso(_timestamp(_get(lambda: m.created_unix)))
    print(f"  step {_show(m.step)}, epoch {_show(m.epoch)}, run {_show(m.run_id)}")
    print(f"  saved {created or '?'} by {_show(m.world_size)} rank(s)")
    files = _tuple(m.files)
    print(
        f"  {_size(_get(lambda: m.total_bytes))} in {len(files)} files, "
        f"checksums {_show(m.checksum_algorithm)}"
        + (f", compression {_show(m.compression)}" if m.compression else "")
    )
    t = m.timings
    print(
        f"  timings: staging {_secs(_get(lambda: t.staging_s))}, "
        f"writing {_secs(_get(lambda: t.writing_s))}, commit {_secs(_get(lambda: t.commit_s))}, "
        f"total {_secs(_get(lambda: t.total_s))}"
    )
    print("  versions: " + ", ".join(f"{_show(k)} {_show(v)}" for k, v in _items(m.versions)))
    if m.resumed_from:
        print(f"  resumed from: {_show(m.resumed_from)}")
    if m.metrics:
        print("  metrics: " + ", ".join(f"{_show(k)}={_num(v)}" for k, v in _items(m.metrics)))
    rows = [[_show(f.path), _size(f.size), _show(f.checksum), _show(f.rank)] for f in files]
    print(_indent(_table(rows, ["FILE", "SIZE", "CHECKSUM", "RANK"])))
    refs = _tuple(_get(lambda: m.references) or ())
    if refs:  # an incremental checkpoint: unchanged tensors are read from these files
        print(f"  refers to {len(refs)} file(s) of earlier checkpoints (unchanged tensors):")
        rows = [
            [_show(r.checkpoint), _show(r.path), _size(r.size), _show(r.checksum), _show(r.rank)]
            for r in refs
        ]
        print(_indent(_table(rows, ["CHECKPOINT", "FILE", "SIZE", "CHECKSUM", "RANK"])))
    ranks = [
        [
            _show(r.rank),
            _show(r.host),
            _show(r.local_rank),
            _size(r.bytes_written),
            _num(r.staging_s, ".3f"),
            _num(r.writing_s, ".3f"),
        ]
        for r in _tuple(m.ranks)
    ]
    print(_indent(_table(ranks, ["RANK", "HOST", "LOCAL", "WROTE", "STAGE_S", "WRITE_S"])))
    for key, value in _items(m.metadata):
        text = value if isinstance(value, str) else json.dumps(_jsonable(value), indent=1)
        print(f"  metadata[{_show(key)}]:")
        print("    " + str(text).rstrip().replace("\n", "\n    "))


def _verify(args: argparse.Namespace) -> int:
    storage, entries = _open(args, args.path)
    if _is_checkpoint_dir(entries):
        root, info = _checkpoint(args, args.path)
        infos = [info]
    else:
        root, infos = storage, _scan(storage, entries)
        if not infos:
            what = "is empty" if not entries else "holds no checkpoints"
            raise CliError(f"{args.path} {what}: nothing to verify", EXIT_BAD_CHECKPOINT)
    rows = _check_all(args, root, infos, args.mode)
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


def _prune(args: argparse.Namespace) -> int:
    if not 0 <= args.leftover_grace < math.inf:  # also refuses nan, before deleting anything
        raise CliError(
            f"--leftover-grace must be a number of seconds >= 0, got {args.leftover_grace}"
        )
    storage, entries = _open(args, args.path)
    if _is_checkpoint_dir(entries):
        raise CliError(
            f"{args.path} is a checkpoint, not a directory of checkpoints: prune its parent, "
            f"`lightning-elastic prune {_parent(args.path)} ...`"
        )
    policies: list[Any] = [KeepLastN(args.keep_last)]
    if args.keep_every_n_steps is not None:
        policies.append(KeepEveryNSteps(args.keep_every_n_steps))
    # A checkpoint whose files do not match the sizes in its manifest is corrupt: it is never
    # deleted, and never counted as the newest valid one that retention must keep.
    rows = _check_all(args, storage, _scan(storage, entries), "size")
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
    doomed.sort(key=_order)
    catalog = Catalog(storage)
    failed: list[tuple[CheckpointInfo, str]] = []
    deleted = []
    for info in doomed:
        if args.dry_run:
            deleted.append(info)
            continue
        try:
            save_id = info.manifest.save_id if info.manifest is not None else None
            delete_checkpoint(storage, catalog, info.name, save_id=save_id)  # as scanned
            deleted.append(info)
        except ElasticCheckpointError as exc:
            failed.append((info, str(exc)))
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
    rows: list[_Row],
    deleted: list[CheckpointInfo],
    failed: list[tuple[CheckpointInfo, str]],
    left: list[_Row],
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
        print(f"{verb} {info.location} (step {_show(info.step)}, run {_show(info.run_id)})")
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


def _consolidate(args: argparse.Namespace) -> int:
    """Checks that ``args.path`` names one checkpoint (the CLI's own diagnosis of what the path
    is instead), then :func:`lightning_elastic.core.load.consolidate.consolidate` does the rest:
    the same code as ``lightning_elastic.consolidate``."""
    _root, info = _checkpoint(args, args.path)
    if info.status != VALID or info.manifest is None:
        raise CliError(f"{info.location} is {info.status}: {info.problem}", EXIT_BAD_CHECKPOINT)

    from lightning_elastic.core.load.consolidate import consolidate

    start = time.monotonic()
    try:
        consolidate(
            args.path,
            args.output,
            storage_options=_options(args),
            trusted=args.trusted,
            include_rank_state=args.include_rank_state,
            progress=lambda desc, total: _bar(args, total, desc),
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


def _report(args: argparse.Namespace) -> int:
    """The checks and the error messages of the other verbs; the report itself is
    :mod:`lightning_elastic.report` (matplotlib is imported only for ``--output``)."""
    from lightning_elastic.core.observe.history import read_history
    from lightning_elastic.report import CheckpointRow, build_report, render_html, render_text

    storage, entries = _open(args, args.path)
    if _is_checkpoint_dir(entries):
        raise CliError(
            f"{args.path} is a checkpoint, not a directory of checkpoints: run "
            f"`lightning-elastic report {_parent(args.path)}`"
        )
    rows = _check_all(args, storage, _scan(storage, entries), args.check)
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
        print(json.dumps(_jsonable(report), indent=1))
    else:
        print(render_text(report))
        if args.output:
            print(f"wrote {args.output}")
    return EXIT_OK


# ----------------------------------------------------------------------------- formatting
# Everything below takes whatever a manifest held (a hand-edited one may hold anything) and
# never raises.


def _get(fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except Exception:
        return None


def _is_int(value: Any) -> bool:
    return type(value) is int


def _timestamp(value: Any) -> float | None:
    """``value`` as Unix seconds when it can be one (``time.gmtime`` accepts it)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    if not math.isfinite(value) or not 0 <= value <= 1e11:
        return None
    return float(value)


def _iso(unix: float | None) -> str | None:
    if unix is None:
        return None
    try:
        return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(unix))
    except (OverflowError, OSError, ValueError):
        return None


def _show(value: Any, limit: int = 80) -> str:
    text = "-" if value is None else str(value)
    text = text.replace("\n", " ")
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _num(value: Any, spec: str = "g") -> str:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return _show(value)
    if spec.endswith("f") and math.isfinite(value) and abs(value) >= 1e9:
        spec = ".4g"  # 1e300 seconds as 300 digits helps nobody
    try:
        return _show(format(value, spec))
    except (ValueError, TypeError, OverflowError):
        return _show(value)


def _secs(value: Any) -> str:
    text = _num(value, ".3f")
    return f"{text}s" if isinstance(value, (int, float)) and not isinstance(value, bool) else text


def _items(value: Any) -> list[tuple[Any, Any]]:
    try:
        return sorted(value.items(), key=lambda kv: str(kv[0]))
    except Exception:
        return []


def _jsonable(value: Any) -> Any:
    """``value`` with what strict JSON cannot hold replaced (non-finite floats -> null,
    unknown types -> their string)."""
    if value is None or isinstance(value, (str, bool, int)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return str(value)


def _size(n: Any) -> str:
    if isinstance(n, bool) or not isinstance(n, (int, float)) or not math.isfinite(n):
        return "-" if n is None else _show(n)
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            if unit == "B":
                return f"{value:.0f} {unit}"
            return f"{value:.1f} {unit}" if abs(value) < 1e6 else f"{value:.3g} {unit}"
        value /= 1024
    return str(n)


def _table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows, strict=False)]
    lines = [
        "  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
        for r in [header, *rows]
    ]
    return "\n".join(lines)


def _indent(text: str) -> str:
    return "  " + text.replace("\n", "\n  ")


def _row(r: _Row) -> list[str]:
    d = r.to_json()
    status = r.status
    if r.status == VALID.value and r.checked == "none":
        status = "valid (manifest only)"
    return [
        r.info.name,
        _show(d["step"]),
        _show(d["epoch"]),
        _show(d["world_size"]),
        _show(d["run_id"], 24),
        _size(d["bytes"]) + (f" (+{_size(d['referenced_bytes'])} ref)" if d["references"] else ""),
        _show(d["created"]),
        status,
    ]


_HEADER = ["NAME", "STEP", "EPOCH", "WORLD", "RUN", "SIZE", "CREATED (UTC)", "STATUS"]


if __name__ == "__main__":
    raise SystemExit(main())
