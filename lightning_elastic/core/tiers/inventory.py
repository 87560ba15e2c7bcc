"""What a node-local checkpoint root holds, as the inputs of
:func:`~lightning_elastic.core.tiers.recovery.plan_recovery`.

How the pieces of recovery fit (issue #11); which rank calls what, in what order:

1. **Scan.** One rank per node (or every rank; the result is the same) calls
   :func:`scan_node` on its node's local root. I/O is listings and manifest reads only: a file
   counts as held when the listing shows it, not a link, with the manifest's size. Checksums are
   not read here: the load verifies them anyway (fused with the read), and a corrupt copy then
   fails like a corrupt remote one.
2. **All-gather** the :class:`NodeScan` of every node (with its node id and ranks) on the
   checkpoint gloo group; it is plain data (str, int, float, bool, tuples and dicts).
3. **Every rank** calls :func:`merge_candidates` on the gathered scans (same list, same order,
   so the same result everywhere), builds one :func:`holdings` per node running ranks now, and
   calls ``plan_recovery(candidates, holdings, persistent_newest=...)``.
4. Each :class:`~lightning_elastic.core.tiers.recovery.Fetch` of the plan becomes a
   :class:`~lightning_elastic.core.tiers.transfer.Transfer` (``src=src_rank``,
   ``dst=dst_rank``, ``path=fetch.file``, size and checksum from the manifest), or a read from
   the persistent tier when ``src_rank`` is ``None``; all ranks then run
   :func:`~lightning_elastic.core.tiers.transfer.execute_transfers` with the same list.

**Paths.** Every file path here is relative to the local root, ``"<checkpoint dir>/<file>"``
(``"step_000000010/ab12cd34ef56ab78-rank00001.distcp"``): the form ``Transfer.path`` takes and
the keys :class:`NodeHoldings` and :class:`CheckpointCandidate` are compared by. The manifest
itself is not among a candidate's files (it does not list itself); a node that receives files
of a checkpoint also needs its manifest, which the recovery step writes or copies beside them.

**What is trusted.** The listing and parsing are :class:`~lightning_elastic.core.format.catalog.
Catalog`'s, with its guarantees: symbolic links are never followed (a linked checkpoint
directory is not listed, a linked file is not held, a linked manifest is unreadable), hidden
folders are skipped, manifests are strictly validated (file names are plain names, so no
``..``). Only ``valid`` checkpoints count: no manifest (incomplete), an unparseable, untrusted or
newer-format manifest, or a quarantine record, and the checkpoint contributes nothing, except
that the save files of a folder without a manifest are listed apart (``NodeScan.uncommitted``:
recovery may count them for the same-named checkpoint another node committed, by path and
size, and verifies them as it verifies every copy). A
manifest over :data:`MAX_MANIFEST_BYTES` is not read at all. Missing files are normal in the
local tier (a node holds its own shards and replicas), so they never make a checkpoint corrupt,
and this module never quarantines or deletes anything. A storage error on one checkpoint skips
it, and one on the root gives an empty scan (both logged): one node's bad disk must not stop
the recovery of the others, which then fetch from peers or the persistent tier.

**Disagreement.** A checkpoint name seen by several nodes must have the same commit order and
files everywhere. When two nodes' manifests disagree, :func:`merge_candidates` drops the
checkpoint (with a logged warning; :func:`candidate_conflicts` gives the reasons) and keeps the
others; it never raises.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from lightning_elastic.core.format.catalog import VALID, Catalog, is_save_file
from lightning_elastic.core.format.manifest import MANIFEST_FILE
from lightning_elastic.core.storage.base import Storage
from lightning_elastic.core.tiers.recovery import CheckpointCandidate, NodeHoldings
from lightning_elastic.errors import CheckpointNotFoundError, StorageError

__all__ = [
    "MAX_MANIFEST_BYTES",
    "NodeScan",
    "adoptable",
    "candidate_conflicts",
    "holdings",
    "merge_candidates",
    "scan_node",
]

log = logging.getLogger(__name__)

# A manifest lists one record per rank and per file: ~0.4 KB per rank, so 1 MB at 2,048 ranks.
# Anything near this bound was not written by a save; reading it would only cost memory.
MAX_MANIFEST_BYTES = 64 * 2**20


@dataclass(frozen=True)
class NodeScan:
    """What one node's local root holds.

    Args:
        checkpoints: Checkpoint name -> {path relative to the root: size} of the files present
            with the manifest's size (only for valid checkpoints; possibly empty).
        candidates: One per valid checkpoint, sorted by name: ``order`` is
            :meth:`CheckpointInfo.sort_key`, ``files`` every file of its manifest (paths
            relative to the root), ``persisted=False``.
        uncommitted: Checkpoint directory without a manifest -> {path: size} of its files: a
            save this node wrote its shards of, whose commit did not reach it (rank 0 went
            silent right after committing on its own node). Not a candidate here; another
            node's manifest of the same name may list these files (recovery then counts
            those of the listed size as held, and verifies them like any copy).
    """

    checkpoints: Mapping[str, Mapping[str, int]] = field(default_factory=dict)
    candidates: tuple[CheckpointCandidate, ...] = ()
    uncommitted: Mapping[str, Mapping[str, int]] = field(default_factory=dict)


def scan_node(storage: Storage) -> NodeScan:
    """Scan the node-local root ``storage`` (see the module docstring for what counts).

    A missing or empty root gives an empty scan; so does a root that cannot be listed."""
    catalog = Catalog(storage)
    try:
        entries = storage.listdir()
    except StorageError as e:
        log.warning("cannot list the local checkpoint root %s: %s", storage.display(), e)
        return NodeScan()
    checkpoints: dict[str, dict[str, int]] = {}
    candidates: list[CheckpointCandidate] = []
    uncommitted: dict[str, dict[str, int]] = {}
    for entry in entries:
        if not entry.is_dir or entry.is_link or entry.name.startswith("."):
            continue  # as Catalog.scan: links and hidden folders are not checkpoints
        try:
            found = _scan_checkpoint(storage, catalog, entry.name)
        except StorageError as e:
            log.warning("skipping local checkpoint %s: %s", storage.display(entry.name), e)
            continue
        if found is None:
            continue
        files, cand = found
        if cand is None:
            if files:
                uncommitted[entry.name] = files
        else:
            checkpoints[entry.name] = files
            candidates.append(cand)
    return NodeScan(checkpoints, tuple(sorted(candidates, key=lambda c: c.name)), uncommitted)


def _scan_checkpoint(
    storage: Storage, catalog: Catalog, name: str
) -> tuple[dict[str, int], CheckpointCandidate | None] | None:
    """The held files and the candidate of the checkpoint directory ``name``; without a
    manifest its files (path -> size) and no candidate; ``None`` when it is not a valid
    checkpoint."""
    sizes = {e.name: e.size for e in storage.listdir(name) if not e.is_dir and not e.is_link}
    manifest_size = sizes.get(MANIFEST_FILE)
    if manifest_size is None:  # no manifest, or a link planted as one: not a checkpoint here
        saved = {f"{name}/{n}": size for n, size in sizes.items() if _saved(n)}
        return saved, None
    if manifest_size > MAX_MANIFEST_BYTES:
        log.warning(
            "skipping local checkpoint %s: its manifest has %d bytes (limit %d)",
            storage.display(name),
            manifest_size,
            MAX_MANIFEST_BYTES,
        )
        return None
    try:
        info = catalog.info(name)
    except CheckpointNotFoundError:
        return None  # emptied since it was listed
    if info.status != VALID or info.manifest is None:
        log.debug("ignoring local checkpoint %s: %s (%s)", info.location, info.status, info.problem)
        return None
    files = {f"{name}/{f.path}": f.size for f in info.manifest.files}
    held = {rel: size for rel, size in files.items() if sizes.get(rel[len(name) + 1 :]) == size}
    return held, CheckpointCandidate(name, info.sort_key(), files, persisted=False)


def _saved(name: str) -> bool:
    """A file a save wrote (not a temporary one of a write that did not finish)."""
    return is_save_file(name) and ".tmp-" not in name


def adoptable(scan: NodeScan, name: str, listed: Mapping[str, int]) -> dict[str, int]:
    """The files of ``scan``'s folder ``name`` without a manifest that count as held for the
    checkpoint of that name whose manifest lists ``listed`` (path -> size): those at a listed
    path with the listed size (recovery and ``ls --local`` count them alike)."""
    files = scan.uncommitted.get(name, {})
    return {path: size for path, size in files.items() if listed.get(path) == size}


def holdings(scan: NodeScan, *, node: str, ranks: Sequence[int]) -> NodeHoldings:
    """The :class:`NodeHoldings` of ``node``, running ``ranks`` now, from its scan.

    Raises:
        ConfigError: when ``ranks`` is empty or invalid (see :class:`NodeHoldings`).
    """
    return NodeHoldings(node, tuple(ranks), scan.checkpoints)


def candidate_conflicts(
    scans: Sequence[NodeScan], *, labels: Sequence[str] | None = None
) -> dict[str, str]:
    """Checkpoint name -> why the scans disagree on it (commit order or files), for every
    checkpoint two scans describe differently. Scans are named by their index in ``scans``, or
    by ``labels[i]`` when given (one per scan: a node's root, for a user)."""
    if labels is not None and len(labels) != len(scans):
        raise ValueError(f"{len(labels)} labels for {len(scans)} scans")
    first: dict[str, tuple[int, CheckpointCandidate]] = {}
    conflicts: dict[str, str] = {}
    for i, scan in enumerate(scans):
        for cand in scan.candidates:
            seen = first.setdefault(cand.name, (i, cand))
            if cand.name in conflicts or seen[0] == i:
                continue
            why = _disagreement(seen[1], cand)
            if why:
                a, b = (labels[seen[0]], labels[i]) if labels else (f"scans {seen[0]}", str(i))
                conflicts[cand.name] = f"{a} and {b} disagree: {why}"
    return conflicts


def merge_candidates(scans: Sequence[NodeScan]) -> tuple[CheckpointCandidate, ...]:
    """The candidates of all ``scans`` (one per name, sorted by name), without the checkpoints
    the scans disagree on: each of those is logged as a warning and left out. Never raises."""
    conflicts = candidate_conflicts(scans)
    for name, reason in sorted(conflicts.items()):
        log.warning("local checkpoint %s is not a recovery candidate: %s", name, reason)
    merged: dict[str, CheckpointCandidate] = {}
    for scan in scans:
        for cand in scan.candidates:
            if cand.name not in conflicts:
                merged.setdefault(cand.name, cand)
    return tuple(merged[name] for name in sorted(merged))


def _disagreement(a: CheckpointCandidate, b: CheckpointCandidate) -> str:
    """Why ``a`` and ``b`` (same name) are not the same checkpoint, or ``""``."""
    if tuple(a.order) != tuple(b.order):
        return f"commit order {tuple(a.order)!r} vs {tuple(b.order)!r}"
    fa, fb = dict(a.files), dict(b.files)
    if fa != fb:
        differ = sorted(set(fa) ^ set(fb) | {p for p in set(fa) & set(fb) if fa[p] != fb[p]})
        return f"{len(fa)} vs {len(fb)} file(s), {len(differ)} differ (first: {differ[0]!r})"
    return ""
