"""What the command line checks of a checkpoint against its manifest (nothing, file sizes,
checksums), the row it reports for each, and the progress bar of the long checks.

Imports neither torch nor Lightning (``tqdm`` only when a bar is drawn).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import Any

from lightning_elastic.cli import format as fmt
from lightning_elastic.core.format.catalog import CORRUPT, VALID, CheckpointInfo
from lightning_elastic.core.format.integrity import verify_files
from lightning_elastic.core.format.references import reference_records, routes
from lightning_elastic.core.storage.base import Storage
from lightning_elastic.errors import ElasticCheckpointError

__all__ = ["NoBar", "Row", "check", "check_all", "progress_bar"]


@dataclasses.dataclass(frozen=True)
class Row:
    """A checkpoint as the CLI reports it: the catalog's view plus what the CLI checked."""

    info: CheckpointInfo
    status: str
    problem: str | None
    checked: str  # none | size | full

    def to_json(self) -> dict[str, Any]:
        """The row as ``ls --json``/``verify --json`` print it."""
        info, m = self.info, self.info.manifest
        created = fmt.timestamp(fmt.get(lambda: info.created_unix))
        body: dict[str, Any] = fmt.jsonable(
            {
                "name": info.name,
                "path": info.location,
                "status": self.status,
                "checked": self.checked,
                "step": fmt.get(lambda: info.step),
                "epoch": fmt.get(lambda: m.epoch) if m else None,
                "world_size": fmt.get(lambda: m.world_size) if m else None,
                "run_id": fmt.get(lambda: info.run_id),
                "bytes": fmt.get(lambda: m.total_bytes) if m else None,
                # an incremental checkpoint: what it reads from earlier ones, and which
                "referenced_bytes": fmt.get(lambda: m.referenced_bytes) if m else None,
                "references": sorted(fmt.get(lambda: m.referenced_checkpoints) or ()) if m else [],
                "created": fmt.iso(created) if created else None,
                "problem": self.problem,
            }
        )
        return body


class NoBar:
    """A progress bar that draws nothing."""

    def update(self, n: int = 1) -> None:
        """Nothing to draw."""

    def close(self) -> None:
        """Nothing to close."""


def progress_bar(args: argparse.Namespace, total: float | None, desc: str) -> Any:
    """A tqdm bar on stderr: when asked (``--progress``), or when stderr is a terminal and the
    work lasts long enough to matter (tqdm's ``delay``); tqdm is imported only then."""
    wanted = getattr(args, "progress", False)
    if wanted is None:
        wanted = _isatty(sys.stderr)
    if not wanted:
        return NoBar()
    try:
        from tqdm import tqdm  # type: ignore[import-untyped, unused-ignore]
    except ImportError:
        return NoBar()
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


def check(root: Storage, info: CheckpointInfo, mode: str, bar: Any = None) -> Row:
    """Compare ``info``'s files with its manifest (``mode``: none, size or full)."""
    if info.status != VALID or info.manifest is None or mode == "none":
        return Row(info, info.status.value, info.problem, "none")
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
        return Row(info, "unreadable", f"could not check: {exc}", mode)
    if not problems:
        return Row(info, VALID.value, None, mode)
    return Row(info, CORRUPT.value, fmt.describe(problems), mode)


def _total(info: CheckpointInfo) -> int:
    manifest = info.manifest
    size = fmt.get(lambda: manifest.total_bytes) if manifest is not None else None
    return size if isinstance(size, int) and not isinstance(size, bool) else 0


def check_all(
    args: argparse.Namespace, root: Storage, infos: list[CheckpointInfo], mode: str
) -> list[Row]:
    """:func:`check` for each of ``infos``, with one progress bar over their bytes."""
    bar: Any = NoBar()
    if mode == "full":
        bar = progress_bar(args, sum(_total(i) for i in infos), "verifying")
    try:
        return [check(root, info, mode, bar) for info in infos]
    finally:
        bar.close()
