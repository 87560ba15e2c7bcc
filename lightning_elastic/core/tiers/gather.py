"""Making every node's copy of a chosen checkpoint complete, for a multi-tier recovery.

Which rank calls what (every rank together, from the training thread, for
:mod:`~lightning_elastic.core.tiers.restore`, once the plan is agreed): :func:`gather`

1. with ``verify="full"``, each node's lead hashes the copies its node holds (one
   all-gather of the verdicts); a corrupt copy is deleted (a copy: the checkpoint lives on
   in other tiers) and the caller selects again;
2. downloads: a file no running node holds comes from the persistent root, fetched by one
   of the nodes that need it (checked against the manifest while reading), which passes it
   on; a corrupt persistent copy gets the checkpoint quarantined there;
3. node-to-node copies (point-to-point on the tier group, checked at the receiver); a corrupt
   source copy is deleted. One all-gather of every rank's outcome.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator, Mapping
from typing import Any

from lightning_elastic.core.forksafe import fork_safe_logger
from lightning_elastic.core.format.manifest import FileRecord, Manifest
from lightning_elastic.core.storage.base import Storage
from lightning_elastic.core.tiers.recovery import Fetch, RecoveryPlan
from lightning_elastic.core.tiers.runtime import TierSet
from lightning_elastic.core.tiers.transfer import Transfer, TransferError, execute_transfers
from lightning_elastic.errors import CheckpointLoadError, IntegrityError, Phase

__all__ = ["gather", "global_files", "routes"]

log = fork_safe_logger(__name__)
_CHUNK = 16 * 2**20


def gather(
    tiers: TierSet,
    manifest: Manifest,
    plan: RecoveryPlan,
    held: Mapping[str, Mapping[str, int]],
    verify: str,
    files: Collection[str] | None,
) -> set[str] | None:
    """Verify the node's copies among ``files`` (``None``: all) with ``verify="full"``, then
    make the plan's fetches. ``None`` when done, else what to exclude from the next attempt
    (an empty set: a corrupt copy was deleted, the nodes hold less now)."""
    if verify == "full" and _drop_corrupt(tiers, manifest, plan, held, files):
        return set()
    return _fetch(tiers, manifest, plan)


def global_files(manifest: Manifest) -> set[str]:
    """The files of no rank (the DCP metadata): every node needs them."""
    return {f"{manifest.name}/{f.path}" for f in manifest.files if f.rank is None}


def _my_fetches(tiers: TierSet, plan: RecoveryPlan) -> list[Any]:
    return [f for f in plan.fetches if f.dst_rank == tiers.coordinator.rank]


def _drop_corrupt(
    tiers: TierSet,
    manifest: Manifest,
    plan: RecoveryPlan,
    held: Mapping[str, Mapping[str, int]],
    files: Collection[str] | None = None,
) -> bool:
    """Each lead hashes its node's copies of the chosen checkpoint (``held``: name -> files,
    among ``files``: those its ranks read; ``None``: all); corrupt ones are deleted. ``True``
    (everywhere) when some node had one."""
    rank, name = tiers.coordinator.rank, manifest.name

    def check() -> list[str]:
        if not tiers.layout.is_lead(rank):
            return []
        # a copy this node sends to another is hashed by the sending itself (a corrupt one
        # fails the transfer at the source): hashing it here too would read it twice
        sent = {f.file for f in plan.fetches if f.src_rank == rank}
        bad = []
        for record in manifest.files:
            rel = f"{name}/{record.path}"
            if rel not in held.get(name, {}) or rel in sent:
                continue
            if files is not None and rel not in files:
                continue  # not read here: checked where it is read (or sent)
            got = tiers.local.hash_file(rel, manifest.checksum_algorithm)
            if got.checksum != record.checksum:
                log.warning(
                    "the node-local copy %s is corrupt (checksum %s, the manifest says %s): "
                    "deleting it; it is fetched from another tier",
                    tiers.local.display(rel),
                    got.checksum,
                    record.checksum,
                )
                tiers.local.delete(rel)
                bad.append(rel)
        return bad

    found = tiers.coordinator.all_gather(Phase.LOAD_VERIFY, check, error=CheckpointLoadError)
    return any(found)


def routes(plan: RecoveryPlan) -> tuple[list[Fetch], list[Fetch]]:
    """The downloads and the node-to-node copies of ``plan``, same on every rank. A file no
    node holds is downloaded from the persistent tier by ONE of the nodes that need it (the
    one with the fewest bytes to download so far, largest files first), which then passes it
    on: every node downloads a share, not the whole checkpoint (N nodes, N copies of egress)."""
    remote: dict[str, list[Fetch]] = {}
    relays = [f for f in plan.fetches if f.src_rank is not None]
    for f in plan.fetches:
        if f.src_rank is None:
            remote.setdefault(f.file, []).append(f)
    assigned: dict[int, int] = {}
    downloads: list[Fetch] = []
    for file in sorted(remote, key=lambda p: (-remote[p][0].size, p)):
        size = remote[file][0].size
        dsts = sorted(f.dst_rank for f in remote[file])
        who = min(dsts, key=lambda r: (assigned.get(r, 0), r))
        assigned[who] = assigned.get(who, 0) + size
        downloads.append(Fetch(file, size, who, None))
        relays += [Fetch(file, size, d, who) for d in dsts if d != who]
    return downloads, relays


def _fetch(tiers: TierSet, manifest: Manifest, plan: RecoveryPlan) -> set[str] | None:
    """Make every node's copy complete: downloads first (each rank its share), then the
    node-to-node copies (the relays of the downloads among them). ``None`` when done, else
    what to exclude from the next attempt: the checkpoint when its persistent copy is corrupt
    (quarantined there), nothing when a corrupt local source was deleted (fewer copies)."""
    coord, rank = tiers.coordinator, tiers.coordinator.rank
    records = {f"{manifest.name}/{f.path}": f for f in manifest.files}
    alg = manifest.checksum_algorithm
    for f in _my_fetches(tiers, plan):  # a wrong-size copy is not held: make room
        tiers.local.delete(f.file)
    downloads, relays = routes(plan)
    transfers = [
        Transfer(f.src_rank, f.dst_rank, f.file, f.size, records[f.file].checksum, alg)
        for f in relays
        if f.src_rank is not None
    ]

    def fetch() -> dict[str, Any]:
        outcome: dict[str, Any] = {"retry": False, "persistent_corrupt": None}
        for f in downloads:
            if f.dst_rank == rank:
                try:
                    _download(tiers.persistent.storage, tiers.local, f.file, records[f.file], alg)
                except IntegrityError as exc:
                    outcome["persistent_corrupt"] = [f.file, exc.reason]
        if transfers and tiers.group is not None:
            try:
                execute_transfers(
                    transfers,
                    rank=rank,
                    group=tiers.group,
                    storage=tiers.local,
                    timeout=tiers.timeout,
                )
            except TransferError as exc:
                for failure in exc.failures:
                    if failure.kind in ("communication", "write"):
                        raise
                    t = failure.transfer  # "source" / "integrity": plan again
                    if failure.kind == "integrity" and t.src == rank:
                        tiers.local.delete(t.path)  # our copy is the corrupt one
                    outcome["retry"] = True
        return outcome

    outcomes = coord.all_gather(Phase.LOAD, fetch, error=CheckpointLoadError)
    corrupt = [o["persistent_corrupt"] for o in outcomes if o["persistent_corrupt"]]
    if corrupt and rank == 0:
        file, reason = corrupt[0]
        try:
            tiers.persistent.catalog.quarantine(manifest.name, file, reason)
        except Exception as exc:
            log.warning("could not quarantine %s: %r", manifest.name, exc)
    if corrupt:
        return {manifest.name}
    if any(o["retry"] for o in outcomes):
        return set()  # a corrupt source was deleted: the next attempt sees fewer copies
    return None


def _download(src: Storage, dst: Storage, rel: str, record: FileRecord, alg: str) -> None:
    size, checksum = record.size, record.checksum

    def chunks() -> Iterator[bytes]:
        for start in range(0, size, _CHUNK):
            yield src.read_bytes(rel, start, min(_CHUNK, size - start))

    written = dst.write_stream(rel, chunks, checksum=alg, size=size)
    if written.size != size or written.checksum != checksum:
        dst.delete(rel)
        raise IntegrityError(
            rel.split("/", 1)[0],
            rel,
            f"the persistent copy has checksum {written.checksum}, the manifest says {checksum}",
        )
