"""Choosing the checkpoint to load, verifying it, and quarantining corrupt ones.

Which rank calls what: every function here is called by all ranks together. Rank 0 lists the
checkpoints and broadcasts the candidates (so every rank considers the same ones); the files
of a candidate are verified in parallel (file ``i`` by rank ``i % world_size``) and the
verdicts all-gathered; a corrupt candidate is quarantined by rank 0 and skipped by all.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Collection

from lightning_elastic.core.dist.coordinator import Coordinator
from lightning_elastic.core.format.catalog import CORRUPT, INCOMPLETE, Catalog, CheckpointInfo
from lightning_elastic.core.format.integrity import Problem, raise_first, verify_files
from lightning_elastic.core.format.manifest import SHARD_SUFFIX, FileRecord, Manifest
from lightning_elastic.core.format.references import reference_records, routes
from lightning_elastic.core.policy.retention import KeepBestK
from lightning_elastic.core.storage.base import Storage
from lightning_elastic.errors import (
    CheckpointLoadError,
    CheckpointNotFoundError,
    ConfigError,
    CorruptCheckpointWarning,
    Phase,
    UnsupportedFormatError,
)

__all__ = ["fused_share", "quarantine", "select_best", "select_checkpoint"]

log = logging.getLogger(__name__)


def select_checkpoint(
    storage: Storage,
    catalog: Catalog,
    coord: Coordinator,
    name: str | None,
    verify: str,
    *,
    run_id: str | None = None,
    order: Callable[[list[CheckpointInfo]], list[CheckpointInfo]] | None = None,
    skip_named: bool = False,
    fused: bool = False,
    exclude: Collection[str] = (),
) -> CheckpointInfo | None:
    """The checkpoint to load, verified with ``verify``.

    With ``name`` that checkpoint or an :class:`IntegrityError`. Without, the most recently
    committed valid one (commit order, not step; only run ``run_id``'s when given), walking
    back past corrupt ones, which are quarantined with a warning; or ``None``. ``order``
    replaces "newest first": it receives the scan (oldest first) and returns the candidates
    in the order to try (rank 0 calls it; e.g. best first by a metric, see ``KeepBestK``).
    ``skip_named`` leaves out the checkpoints of runs that were given their name explicitly
    (an unnamed job never continues, nor adopts, someone's named run).

    ``fused`` (with ``verify="full"``): the shard files are only checked for presence and
    size here; their checksums are left to the load, which computes them as it reads
    (:func:`fused_share`: each file by one rank), so their bytes cross the storage once.
    ``exclude`` names checkpoints not to consider (found corrupt by such a load).
    """
    if name is not None:
        info = coord.broadcast(
            Phase.LOAD_SELECT, lambda: catalog.info(name), error=CheckpointLoadError
        )
        if info.unsupported:
            raise UnsupportedFormatError(info.problem or info.location)
        if info.manifest is None or info.status != "valid":
            raise CheckpointNotFoundError(f"{info.location} is {info.status}: {info.problem}")
        raise_first(info.location, _verify(storage, coord, info, verify, fused))
        return info
    rank = order or _newest_first
    candidates = coord.broadcast(
        Phase.LOAD_SELECT, lambda: rank(catalog.scan()), error=CheckpointLoadError
    )
    for info in candidates:
        if info.name in exclude:
            continue
        if run_id is not None and info.run_id != run_id:
            continue  # another run sharing the directory: never resumed, never touched
        if skip_named and info.manifest is not None and info.manifest.metadata.get(RUN_NAMED):
            continue  # a named run: only a job given that name continues it
        if info.status == INCOMPLETE:
            log.info("skipping %s: %s", info.location, info.problem)
            continue
        if info.unsupported:
            raise UnsupportedFormatError(info.problem or info.location)
        if info.status == CORRUPT:
            if info.untrusted:  # the key may be wrong: refuse, leave no lasting mark
                _warn(info, "manifest", info.problem or "no valid HMAC", "it was skipped", 3)
            elif info.quarantine is None:
                quarantine(catalog, coord, info, "manifest", info.problem or "unreadable")
            else:
                log.info("skipping quarantined %s: %s", info.location, info.problem)
            continue
        problems = _verify(storage, coord, info, verify, fused)
        if not problems:
            return info
        first = sorted(problems, key=lambda p: p.file)[0]
        quarantine(catalog, coord, info, first.file, first.reason)
    return None


RUN_NAMED = "run_named"  # manifest metadata: the run id was given explicitly (run_name=...)


def select_best(
    storage: Storage,
    catalog: Catalog,
    coord: Coordinator,
    monitor: str,
    mode: str,
    verify: str,
    *,
    run_id: str | None = None,
) -> CheckpointInfo | None:
    """The valid checkpoint with the best ``monitor`` recorded in its manifest (``mode``:
    ``"min"`` or ``"max"``, ranked as ``KeepBestK`` ranks; ties go to the newer), verified
    with ``verify``, walking past corrupt ones (quarantined); ``None`` when none recorded it."""
    if not monitor or not isinstance(monitor, str):
        raise ConfigError(f"best() needs the name of a recorded metric, got {monitor!r}")
    ranking = KeepBestK(1, monitor, mode)  # validates mode (ConfigError)
    return select_checkpoint(
        storage, catalog, coord, None, verify, run_id=run_id, order=ranking.ranked
    )


def _newest_first(scan: list[CheckpointInfo]) -> list[CheckpointInfo]:
    return list(reversed(scan))


def fused_share(manifest: Manifest, rank: int, world_size: int) -> list[FileRecord]:
    """The shard files whose checksums ``rank`` computes while a fused load reads them: each
    file by one rank, its writer's rank modulo the world size (at the same world size every
    rank verifies the file it wrote, the one it reads most of)."""
    shards = [r for r in (*manifest.files, *reference_records(manifest)) if _is_shard(r)]
    return [
        r
        for i, r in enumerate(shards)
        if (r.rank if r.rank is not None else i) % world_size == rank
    ]


def _is_shard(record: FileRecord) -> bool:
    return record.path.endswith(SHARD_SUFFIX)


def _verify(
    storage: Storage, coord: Coordinator, info: CheckpointInfo, mode: str, fused: bool = False
) -> list[Problem]:
    assert info.manifest is not None
    manifest = info.manifest
    ckpt = storage.child(info.name)
    paths = routes(ckpt, manifest)
    if mode == "size":
        return coord.broadcast(
            Phase.LOAD_VERIFY,
            lambda: verify_files(ckpt, manifest, mode, routes=paths),
            error=CheckpointLoadError,
        )
    records = [*manifest.files, *reference_records(manifest)]
    sized: list[FileRecord] = []
    if fused and mode == "full":  # the load hashes the shard files as it reads them
        sized = [r for r in records if _is_shard(r)]
        records = [r for r in records if not _is_shard(r)]
    share = records[coord.rank :: coord.world_size]

    def check() -> list[Problem]:
        problems = verify_files(ckpt, manifest, mode, share, routes=paths)
        if sized and coord.rank == 0:
            problems += verify_files(ckpt, manifest, "size", sized, routes=paths)
        return problems

    verdicts = coord.all_gather(Phase.LOAD_VERIFY, check, error=CheckpointLoadError)
    return [problem for verdict in verdicts for problem in verdict]


def quarantine(
    catalog: Catalog, coord: Coordinator, info: CheckpointInfo, file: str, reason: str
) -> None:
    """Mark ``info`` corrupt (rank 0; every rank calls this together) and warn."""

    def mark() -> None:
        try:
            catalog.quarantine(info.name, file, reason)
        except Exception as exc:  # read-only storage: skipping it is still right
            log.warning("could not quarantine %s: %r", info.location, exc)

    if info.quarantine is None:
        coord.broadcast(Phase.LOAD_QUARANTINE, mark, error=CheckpointLoadError)
    _warn(info, file, reason, "it was quarantined and kept for inspection", 4)


def _warn(info: CheckpointInfo, file: str, reason: str, what: str, stacklevel: int) -> None:
    message = (
        f"skipping corrupt checkpoint {info.location} (step {info.step}): {file}: {reason}; {what}"
    )
    log.warning(message)
    warnings.warn(message, CorruptCheckpointWarning, stacklevel=stacklevel)
