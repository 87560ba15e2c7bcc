"""What every verb of the command line shares: exit codes and the one-line error, argument
types, the options every verb takes, and where a path leads (a checkpoint, a root of them,
something else: the error says which and what to run instead).

Imports neither torch nor Lightning (the manifest-only verbs rely on it).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
from typing import Any, NoReturn

from lightning_elastic.cli import format as fmt
from lightning_elastic.core.format.catalog import (
    CORRUPT,
    VALID,
    Catalog,
    CheckpointInfo,
    holds_checkpoint_files,
)
from lightning_elastic.core.format.manifest import MANIFEST_FILE
from lightning_elastic.core.options import check_count, check_seconds
from lightning_elastic.core.storage.base import Entry, Storage, local_path
from lightning_elastic.errors import CheckpointNotFoundError, ConfigError

__all__ = [
    "DEBUG_ENV",
    "EXIT_BAD_CHECKPOINT",
    "EXIT_INTERRUPTED",
    "EXIT_OK",
    "EXIT_PIPE_CLOSED",
    "EXIT_UNEXPECTED",
    "EXIT_USAGE",
    "CliError",
    "Parser",
    "add_verb",
    "checkpoint_at",
    "info_of",
    "is_checkpoint_dir",
    "open_dir",
    "order",
    "parent",
    "positive",
    "progress_flag",
    "scan_root",
    "seconds",
    "split_path",
    "storage_options",
]

EXIT_OK, EXIT_BAD_CHECKPOINT, EXIT_USAGE, EXIT_UNEXPECTED = 0, 1, 2, 3
EXIT_INTERRUPTED, EXIT_PIPE_CLOSED = 130, 141
DEBUG_ENV = "LIGHTNING_ELASTIC_DEBUG"


class CliError(Exception):
    """A one-line error for the user and the exit code that goes with it."""

    def __init__(self, message: str, code: int = EXIT_USAGE) -> None:
        super().__init__(message)
        self.code = code


class Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` that raises :class:`CliError` instead of exiting."""

    def error(self, message: str) -> NoReturn:  # argparse prints usage and exits; we raise
        raise CliError(f"{self.prog}: {message} (see `{self.prog} --help`)")


def positive(text: str) -> int:
    """A whole number >= 1 (``1e3`` and ``2.0`` refused, as the Python options refuse them:
    the message says which numbers are)."""
    value: object = text
    with contextlib.suppress(ValueError):
        value = int(text)
    try:
        return check_count(value, "N")
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def seconds(text: str) -> float:
    """A duration in seconds >= 0 (``nan``, ``inf`` and negative ones refused)."""
    value: object = text
    with contextlib.suppress(ValueError):
        value = float(text)
    try:
        return check_seconds(value, "SECONDS", zero=True, given=text, what="a number of seconds")
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_verb(
    sub: Any, name: str, help: str, *, check: str | None = None
) -> argparse.ArgumentParser:
    """A verb's subparser with the options every verb takes (``--json``, ``-o``) and, with
    ``check``, ``--check`` defaulting to it."""
    p: argparse.ArgumentParser = sub.add_parser(name, help=help, description=help)
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


def progress_flag(p: argparse.ArgumentParser) -> None:
    """Add ``--progress`` (draw a progress bar on stderr) to ``p``."""
    p.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="progress bar on stderr (default: when stderr is a terminal)",
    )


def storage_options(args: argparse.Namespace) -> dict[str, Any]:
    """The ``--storage-option KEY=VALUE`` flags as fsspec options (values parsed as JSON when
    they are)."""
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


def open_dir(args: argparse.Namespace, path: str) -> tuple[Storage, list[Entry]]:
    """``path`` as a storage and its listing, or a :class:`CliError` saying why it is not a
    directory (local paths only: an object store cannot tell missing from empty)."""
    local = local_path(path)
    if local is not None:
        if not os.path.lexists(local):
            raise CliError(f"{path} does not exist (no checkpoint there)")
        if not os.path.isdir(local):
            hint = ""
            if os.path.basename(local) == MANIFEST_FILE:
                hint = f": to see this checkpoint, run `lightning-elastic inspect {parent(path)}`"
            raise CliError(f"{path} is a file, not a directory of checkpoints{hint}")
        if not os.access(local, os.R_OK | os.X_OK):
            raise CliError(f"{path} is not readable (permission denied)")
    storage = Storage(path, storage_options=storage_options(args))
    return storage, storage.listdir()


def is_checkpoint_dir(entries: list[Entry]) -> bool:
    """Whether a listing is the inside of one checkpoint rather than a root of them."""
    return holds_checkpoint_files(e.name for e in entries if not e.is_dir)


def parent(path: str) -> str:
    """The directory or URL that holds ``path``."""
    return split_path(path)[0]


def split_path(path: str) -> tuple[str, str]:
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


def scan_root(storage: Storage, entries: list[Entry]) -> list[CheckpointInfo]:
    """Like :meth:`Catalog.scan` over a listing already made, except that one unreadable or
    odd checkpoint becomes a corrupt row instead of failing the whole listing."""
    catalog = Catalog(storage)
    infos = []
    for entry in entries:
        if entry.is_dir and not entry.name.startswith("."):
            info = info_of(catalog, entry.name)
            if info is not None:
                infos.append(info)
    return sorted(infos, key=order)


def info_of(catalog: Catalog, name: str) -> CheckpointInfo | None:
    """The catalog's info of checkpoint ``name``, or ``None`` when it holds none of that name."""
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
        ("step", fmt.is_int(m.step)),
        ("epoch", m.epoch is None or fmt.is_int(m.epoch)),
        ("sequence", fmt.is_int(m.sequence)),
        ("world_size", fmt.is_int(m.world_size)),
        ("created_unix", fmt.timestamp(m.created_unix) is not None),
        ("run_id", isinstance(m.run_id, str)),
        ("checksum_algorithm", isinstance(m.checksum_algorithm, str)),
        (
            "files",
            all(isinstance(f.path, str) and fmt.is_int(f.size) for f in fmt.as_tuple(m.files)),
        ),
    ]
    bad = [field for field, ok in checks if not ok]
    return (
        f"manifest field {bad[0]} is invalid: {fmt.show(getattr(m, bad[0], None))}" if bad else None
    )


def order(info: CheckpointInfo) -> tuple[int, float, str]:
    """Sort key of a checkpoint: sequence, creation time, name (odd manifest values count as 0)."""
    m = info.manifest
    sequence = m.sequence if m is not None and fmt.is_int(m.sequence) else 0
    return (sequence, fmt.timestamp(fmt.get(lambda: info.created_unix)) or 0.0, info.name)


def checkpoint_at(args: argparse.Namespace, path: str) -> tuple[Storage, CheckpointInfo]:
    """The checkpoint at ``path`` (its parent storage and info), or a :class:`CliError` that
    says what ``path`` is instead and what to run."""
    local = local_path(path)
    if local is not None and os.path.islink(local):
        # save_last="link"'s last.ckpt: its target (listings below a root never follow links)
        path = os.path.realpath(local)
    storage, entries = open_dir(args, path)
    if not is_checkpoint_dir(entries):
        if not entries:
            raise CliError(f"{path} is an empty directory, not a checkpoint")
        infos = scan_root(storage, entries)
        if infos:
            newest = infos[-1].location
            raise CliError(
                f"{path} is a checkpoint root holding {len(infos)} checkpoint(s), not a "
                f"checkpoint: run `lightning-elastic ls {path}`, or name one, e.g. "
                f"`lightning-elastic {args.verb} {newest}`"
            )
        raise CliError(f"{path} is not a checkpoint (no {MANIFEST_FILE}) and holds no checkpoints")
    parent, name = split_path(path)
    root = Storage(parent, storage_options=storage_options(args))
    info = info_of(Catalog(root), name)
    if info is None:
        raise CliError(f"{path} holds no files of a checkpoint")
    return root, info
