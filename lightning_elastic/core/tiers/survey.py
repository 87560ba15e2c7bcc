"""Which tiers hold each checkpoint: the persistent root and the node-local roots, as
``lightning-elastic ls DIR --local PATH ...`` shows them (issue #11, the tools).

Pure: the caller scans each node-local root with
:func:`~lightning_elastic.core.tiers.inventory.scan_node` and reads the persistent root's
manifests; :func:`survey` only combines them. It judges a checkpoint the way recovery does
(:mod:`~lightning_elastic.core.tiers.restore`): a file counts as held when a node lists it
with the manifest's size; a name that two roots describe differently (commit order or files)
is not recoverable from the nodes, and a persistent copy that differs from the nodes' wins.

The notation (:attr:`TierView.notation`, the ``TIERS`` column of ``ls``) is
:data:`NOTATION`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from lightning_elastic.core.tiers.inventory import NodeScan, adoptable, candidate_conflicts
from lightning_elastic.core.tiers.recovery import CheckpointCandidate

__all__ = ["NOTATION", "NodeShare", "TierView", "survey"]

NOTATION = """\
TIERS (with --local), parts joined by "+" (e.g. persistent+local:2/2, local:1/2+peer);
N is the number of --local roots:
  persistent  valid in the listed root (as STATUS says)
  local:C/N   complete on C of the N node-local roots
  peer        (after local:C/N, C < N) the other nodes can copy it from a peer
  nodes       complete on no single node, but the nodes together hold every file
  partial     the nodes know it (its manifest) but together miss files
  conflict    two roots (two nodes, or a node and the listed root) hold different
              checkpoints of this name: recovery does not use the node copies
  -           none of the above
A node holds a file when it lists it with the manifest's size (checksums are not read).
STATUS local-only: on node-local roots only. With --json each row gains "tiers":
{"persistent", "nodes": {PATH: {"held_bytes", "total_bytes", "complete"}},
"recoverable_from_nodes", "notation", "conflict" (why, or null), "missing_files"}."""


@dataclass(frozen=True)
class NodeShare:
    """What one node-local root holds of one checkpoint.

    Args:
        held_bytes: Bytes of its files present there with the manifest's size.
        total_bytes: Bytes of all its files (the node's manifest, else another root's).
        complete: Every file is held there.
        known: A valid manifest of it is there (a node may hold a manifest and no file).
    """

    held_bytes: int
    total_bytes: int
    complete: bool
    known: bool


@dataclass(frozen=True)
class TierView:
    """Where one checkpoint is.

    Args:
        name: The checkpoint's name.
        persistent: Valid in the persistent root.
        nodes: One share per node-local root, in the order of the scans.
        recoverable_from_nodes: The nodes together hold every file and agree on what it is.
        missing: Files that no node holds (paths relative to the root), when some node knows
            the checkpoint and the roots agree.
        conflict: Why two roots disagree on this name, or ``None``.
    """

    name: str
    persistent: bool
    nodes: tuple[NodeShare, ...]
    recoverable_from_nodes: bool
    missing: tuple[str, ...] = ()
    conflict: str | None = None

    @property
    def notation(self) -> str:
        """The ``TIERS`` cell: see :data:`NOTATION`."""
        parts = ["persistent"] if self.persistent else []
        complete = sum(share.complete for share in self.nodes)
        if self.conflict is not None:
            parts.append("conflict")
        elif complete:
            parts.append(f"local:{complete}/{len(self.nodes)}")
            if complete < len(self.nodes):
                parts.append("peer")
        elif self.recoverable_from_nodes:
            parts.append("nodes")
        elif any(share.known for share in self.nodes):
            parts.append("partial")
        return "+".join(parts) or "-"


def survey(
    scans: Sequence[NodeScan],
    persistent: Sequence[CheckpointCandidate],
    *,
    labels: Sequence[str],
    names: Iterable[str] = (),
) -> dict[str, TierView]:
    """A :class:`TierView` for every checkpoint the scans, ``persistent`` or ``names`` mention.

    Args:
        scans: One per node-local root.
        persistent: The persistent root's checkpoints with a readable manifest; ``persisted``
            says whether each is valid there (only valid ones count as a tier, and only they
            can conflict with the nodes' copies).
        labels: One per scan, then one for the persistent root: how conflicts name the roots.
        names: More names to describe (a persistent directory without a manifest).
    """
    if len(labels) != len(scans) + 1:
        raise ValueError(f"{len(labels)} labels for {len(scans)} scans and the persistent root")
    valid = tuple(c for c in persistent if c.persisted)
    conflicts = candidate_conflicts([*scans, NodeScan(candidates=valid)], labels=labels)
    by_name = {c.name: c for c in persistent}
    every = {n for scan in scans for n in scan.checkpoints} | set(by_name) | set(names)
    manifests = [{c.name: c.files for c in scan.candidates} for scan in scans]
    return {
        name: _view(name, scans, manifests, by_name.get(name), conflicts.get(name))
        for name in sorted(every)
    }


def _view(
    name: str,
    scans: Sequence[NodeScan],
    manifests: Sequence[Mapping[str, Mapping[str, int]]],
    persisted: CheckpointCandidate | None,
    conflict: str | None,
) -> TierView:
    """``name``'s view; ``manifests[i]``: the files of each checkpoint per node ``i``."""
    own = [m.get(name) for m in manifests]
    reference = next((f for f in own if f is not None), None)
    if reference is None:
        reference = dict(persisted.files) if persisted is not None else {}
    shares = []
    union: set[str] = set()
    for scan, files in zip(scans, own, strict=True):
        held = scan.checkpoints.get(name)
        if held is None:  # a folder without a manifest: the files it lists, as recovery does
            held = adoptable(scan, name, reference)
        union.update(held)
        total = files if files is not None else reference
        complete = files is not None and all(path in held for path in files)
        known = files is not None
        shares.append(NodeShare(sum(held.values()), sum(total.values()), complete, known))
    on_nodes = any(share.known for share in shares)
    missing = tuple(sorted(set(reference) - union)) if on_nodes and conflict is None else ()
    return TierView(
        name,
        persistent=persisted is not None and persisted.persisted,
        nodes=tuple(shares),
        recoverable_from_nodes=on_nodes and conflict is None and not missing,
        missing=missing,
        conflict=conflict,
    )
