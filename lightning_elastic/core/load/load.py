"""Loading a selected checkpoint, at any world size.

Which rank calls what: :func:`load_checkpoint` is called by all ranks together, after
:func:`~lightning_elastic.core.load.select.select_checkpoint` agreed on the checkpoint. The
tensors are loaded by ``torch.distributed.checkpoint.load`` on the checkpoint group, which
plans the reads and reshards N -> M; each rank then reads its own rank-local state without a
collective. :func:`read_rank_states` and :func:`read_full_state` run in one process.

Objects (everything that is not a tensor) are unpickled by
:func:`~lightning_elastic.core.load.safe.load_object`: with ``weights_only=True`` and an
allowlist unless the caller passes ``trusted=True``.
"""

from __future__ import annotations

import io
import logging
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import (
    DefaultLoadPlanner,
    create_default_local_load_plan,
)
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import ReadItem
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

from lightning_elastic.core._compat import flatten_nested, load_planner_mappings
from lightning_elastic.core.dist.coordinator import Coordinator
from lightning_elastic.core.format.catalog import VALID, CheckpointInfo
from lightning_elastic.core.format.dcp_json import ItemLocation, read_checkpoint_metadata
from lightning_elastic.core.format.integrity import Problem
from lightning_elastic.core.format.manifest import Manifest
from lightning_elastic.core.format.references import read_manifest, routes
from lightning_elastic.core.format.skeleton import Skeleton, build, subtree
from lightning_elastic.core.gcpause import paused_gc
from lightning_elastic.core.load.per_rank import PerRankRule, restore_per_rank
from lightning_elastic.core.load.reader import ShardReader
from lightning_elastic.core.load.safe import UnsafeObjectError, load_object, warn_trusted
from lightning_elastic.core.load.select import fused_share
from lightning_elastic.core.save.replicated import (
    PER_RANK_KEY,
    PER_RANK_VALUES_KEY,
    Path,
    decode_paths,
)
from lightning_elastic.core.storage.base import Storage
from lightning_elastic.errors import (
    CheckpointLoadError,
    CorruptWhileLoading,  # re-exported: it lived here
    ManifestError,
    Phase,
    RankFailure,
    UnsafeCheckpointError,
)

__all__ = [
    "RANK_LOCAL_KEY",
    "CorruptWhileLoading",
    "LoadResult",
    "Targets",
    "files_to_read",
    "load_checkpoint",
    "read_full_state",
    "read_into",
    "read_rank_states",
    "read_template",
]

log = logging.getLogger(__name__)
RANK_LOCAL_KEY = "__rank_local__"
# Where a tensor of the whole-checkpoint load lands: called with the leaf's path, the saved
# global shape and dtype; a tensor (a DTensor of the current layout, say) to load into, or
# None for a new plain tensor of the saved shape
Targets = Callable[[tuple[str | int, ...], torch.Size, torch.dtype], "torch.Tensor | None"]


@dataclass(frozen=True)
class LoadResult:
    """What was loaded, with the rank-local state this rank saved (``None`` for a new rank)."""

    info: CheckpointInfo
    manifest: Manifest
    rank_state: dict[str, Any] | None
    verify_s: float
    load_s: float
    bytes_read: int
    state: dict[str, Any] | None = None  # the loaded state (the caller's dict, or a new one)
    per_rank: tuple[Path, ...] = ()  # entries saved per rank (they differed between ranks)


def load_checkpoint(
    storage: Storage,
    coord: Coordinator,
    info: CheckpointInfo,
    state: dict[str, Any] | None,
    *,
    strict: bool = True,
    verify_s: float = 0.0,
    trusted: bool = False,
    per_rank_rules: Sequence[PerRankRule] = (),
    targets: Targets | None = None,
    fused: bool = False,
) -> LoadResult:
    """Load ``info`` into ``state`` in place (DCP semantics), or, with ``state=None``, the
    whole checkpoint into a fresh nested dict (``LoadResult.state``); plus this rank's
    rank-local state. With ``state=None``, ``targets`` may supply the tensor each saved
    tensor is loaded into (DCP reshards into it: a sharded model loads only its own shards).

    Entries that were saved per rank (:mod:`~lightning_elastic.core.save.replicated`) get
    this rank's own value at the saved world size; at another one ``per_rank_rules`` decide,
    and an entry no rule covers raises
    :class:`~lightning_elastic.errors.PerRankStateError` on every rank.

    Objects are loaded without running code from storage; a type outside the allowlist raises
    :class:`UnsafeCheckpointError`. ``trusted=True`` unpickles them with ``weights_only=False``
    (it can run code; logged).

    ``fused``: the checksums of the shard files (left out by
    :func:`~lightning_elastic.core.load.select.select_checkpoint` with ``fused=True``) are
    computed while the bytes are read, each file by one rank, and agreed at the end; a
    mismatch raises :class:`CorruptWhileLoading` on every rank, also when the corrupt bytes
    made the load itself fail first. What was read into ``state`` or ``targets`` by then is
    the corrupt checkpoint's: the caller loads again (an older checkpoint, or a fresh state).
    Not with ``trusted`` (objects would be unpickled before their bytes are verified).
    """
    if fused and trusted:
        raise ValueError("a fused verification unpickles before it verifies: not with trusted")
    with paused_gc():  # see core/gcpause.py
        return _load_checkpoint(
            storage, coord, info, state, strict, verify_s, trusted, per_rank_rules, targets, fused
        )


def _load_checkpoint(
    storage: Storage,
    coord: Coordinator,
    info: CheckpointInfo,
    state: dict[str, Any] | None,
    strict: bool,
    verify_s: float,
    trusted: bool,
    per_rank_rules: Sequence[PerRankRule],
    targets: Targets | None,
    fused: bool,
) -> LoadResult:
    assert info.manifest is not None
    manifest = info.manifest
    if trusted:
        warn_trusted(info.location)
    start = time.monotonic()
    ckpt = storage.child(info.name)
    metadata, skeleton = read_checkpoint_metadata(ckpt, manifest)
    share = fused_share(manifest, coord.rank, coord.world_size) if fused else []
    reader = ShardReader(
        ckpt,
        metadata,
        verify=share,
        algorithm=manifest.checksum_algorithm,
        routes=routes(ckpt, manifest),
    )
    failure: Exception | None = None
    try:
        if state is None:
            state = _template(metadata, skeleton, (), targets) or {}
            state.pop(RANK_LOCAL_KEY, None)
            strict = True
        if state or coord.distributed:  # a rank with nothing to load still joins the agreement
            planner = _LoadPlanner(allow_partial_load=not strict, trusted=trusted)
            _dcp_load(state, reader, planner, coord, info)
        rank_state = None
        prefix = (RANK_LOCAL_KEY, str(coord.rank))
        template = _template(metadata, skeleton, prefix)
        if template:
            planner = _LoadPlanner(trusted=trusted)
            _dcp_load(template, reader, planner, coord, info, collective=False)
            rank_state = template[RANK_LOCAL_KEY][str(coord.rank)]
        values = None if rank_state is None else rank_state.pop(PER_RANK_VALUES_KEY, None)
        if values is not None and not rank_state:
            rank_state = None  # it only carried the per-rank values
        paths = _per_rank_paths(state, metadata, skeleton, reader, coord, info, trusted)
    except Exception as exc:
        if not fused:
            raise
        failure = exc  # corrupt bytes can make the load fail: the verdict decides what it was
    if fused:
        verifying = time.monotonic()
        _agree_integrity(coord, info, reader.finish_verification(), reader.verify_error)
        verify_s += time.monotonic() - verifying
        if failure is not None:
            raise failure
    assert state is not None
    restore_per_rank(
        state,
        paths,
        values,
        coord,
        saved_world_size=info.manifest.world_size,
        rules=per_rank_rules,
        location=info.location,
    )
    return LoadResult(
        info=info,
        manifest=info.manifest,
        rank_state=rank_state,
        verify_s=verify_s,
        load_s=time.monotonic() - start,
        bytes_read=reader.bytes_read,
        state=state,
        per_rank=paths,
    )


def files_to_read(
    storage: Storage,
    coord: Coordinator,
    info: CheckpointInfo,
    state: dict[str, Any] | None,
    *,
    strict: bool = True,
    targets: Targets | None = None,
) -> set[str] | None:
    """The shard files :func:`load_checkpoint` on this rank reads with the same arguments
    (names in the checkpoint directory), planned as DCP plans that load - the same templates,
    DCP's own flattening and local load plan - without reading or allocating anything: what a
    node needs of ``info`` before this rank loads (multi-tier recovery). Only the DCP metadata
    must be in ``storage``. ``None`` when the load cannot be planned (it will fail, and say
    why, when it runs)."""
    assert info.manifest is not None
    try:
        metadata, skeleton = read_checkpoint_metadata(storage.child(info.name), info.manifest)
        storage_data = cast(dict[MetadataIndex, ItemLocation], metadata.storage_data)
        files: set[str] = set()

        def plan(tree: dict[str, Any], strict: bool) -> None:
            flat, _ = flatten_nested({str(k): v for k, v in tree.items()})
            for item in create_default_local_load_plan(flat, metadata, strict).items:
                files.add(storage_data[item.storage_index].file)

        if state is None:  # as _load_checkpoint: the whole state, into a template
            state = _template(metadata, skeleton, (), targets, device="meta") or {}
            state.pop(RANK_LOCAL_KEY, None)
            strict = True
        if state:
            plan(state, strict)
        for prefix in ((RANK_LOCAL_KEY, str(coord.rank)), (PER_RANK_KEY,)):
            template = _template(metadata, skeleton, prefix, device="meta")
            if template:
                plan(template, True)
    except Exception as exc:
        log.debug("cannot plan the files a load of %s reads: %r", info.location, exc)
        return None
    return files


def _agree_integrity(
    coord: Coordinator, info: CheckpointInfo, problems: list[Problem], error: Exception | None
) -> None:
    """Every rank together: raise :class:`CorruptWhileLoading` on all of them when any rank
    found a problem in the files it verified, else a :class:`CheckpointLoadError` naming the
    ranks whose verifying reads failed (one all-reduce; details travel only then)."""
    failures = [_Failure.of(coord.rank, error)] if error is not None else []
    if coord.distributed:
        found, broken = coord.max_ints(
            [1 if problems else 0, 1 if failures else 0],
            Phase.LOAD_VERIFY,
            error=CheckpointLoadError,
        )
        if found or broken:
            gathered = coord.all_gather(
                Phase.LOAD_VERIFY, lambda: (problems, failures), error=CheckpointLoadError
            )
            problems = [problem for verdict, _ in gathered for problem in verdict]
            failures = [failure for _, rank_failures in gathered for failure in rank_failures]
    if problems:
        raise CorruptWhileLoading(info.location, problems)
    if failures:
        ranks = [RankFailure(f.rank, Phase.LOAD_VERIFY, f.type_name, f.message) for f in failures]
        raise CheckpointLoadError(info.location, ranks) from error


def _per_rank_paths(
    state: dict[str, Any],
    metadata: Metadata,
    skeleton: Skeleton,
    reader: ShardReader,
    coord: Coordinator,
    info: CheckpointInfo,
    trusted: bool,
) -> tuple[Path, ...]:
    """The replicated list of per-rank entries (taken out of ``state`` when the template
    loaded it; read on its own, without a collective, for a caller's template)."""
    if PER_RANK_KEY in state:
        return decode_paths(state.pop(PER_RANK_KEY))
    template = _template(metadata, skeleton, (PER_RANK_KEY,))
    if not template:
        return ()
    _dcp_load(template, reader, _LoadPlanner(trusted=trusted), coord, info, collective=False)
    return decode_paths(template[PER_RANK_KEY])


def read_rank_states(
    storage: Storage, info: CheckpointInfo, key: str, *, trusted: bool = False
) -> dict[int, Any]:
    """Every saved rank's rank-local entry ``key`` (in this process, no collective): what a
    world-size change needs to redistribute per-rank state such as metric accumulators.
    ``trusted`` as for :func:`load_checkpoint`."""
    if trusted:
        warn_trusted(info.location)
    ckpt = storage.child(info.name)
    manifest = info.manifest or read_manifest(ckpt)
    metadata, skeleton = read_checkpoint_metadata(ckpt, manifest)
    reader = ShardReader(ckpt, metadata, routes=routes(ckpt, manifest))
    coord = Coordinator.single_process()
    out: dict[int, Any] = {}
    saved_world = info.manifest.world_size if info.manifest is not None else 0
    for rank in range(saved_world):
        prefix = (RANK_LOCAL_KEY, str(rank), key)
        template = _template(metadata, skeleton, prefix)
        if template:
            planner = _LoadPlanner(trusted=trusted)
            _dcp_load(template, reader, planner, coord, info, collective=False)
            out[rank] = template[RANK_LOCAL_KEY][str(rank)][key]
    return out


def read_full_state(
    ckpt: Storage, *, include_rank_state: bool = False, trusted: bool = False
) -> dict[str, Any]:
    """The whole checkpoint as one nested dict, in this process (for export/consolidation).
    ``trusted`` as for :func:`load_checkpoint`."""
    state = read_template(ckpt) or {}
    if not include_rank_state:  # what is left is rank 0's view, as in a Lightning file
        state.pop(RANK_LOCAL_KEY, None)
        state.pop(PER_RANK_KEY, None)
    read_into(ckpt, state, trusted=trusted)
    return state


def read_template(ckpt: Storage, prefix: tuple[str, ...] = ()) -> dict[str, Any] | None:
    """What checkpoint ``ckpt`` saved under the mapping keys ``prefix``, as an empty nested
    state nested under those keys: tensors allocated with the saved shapes and dtypes (not
    read), objects ``None``; ``None`` when nothing was saved there. Nothing but the DCP
    metadata is read: prune it and pass it to :func:`read_into` to read a part only."""
    metadata, skeleton = read_checkpoint_metadata(ckpt)
    node: dict[str, Any] | None = _template(metadata, skeleton, prefix)
    return node


def read_into(ckpt: Storage, state: dict[str, Any], *, trusted: bool = False) -> None:
    """Fill ``state`` (a :func:`read_template`, whole or pruned) from checkpoint ``ckpt`` in
    this process, no collective: only the bytes of the entries it holds are read (DCP
    reshards N -> 1). ``trusted`` as for :func:`load_checkpoint`."""
    manifest = read_manifest(ckpt)
    metadata, _ = read_checkpoint_metadata(ckpt, manifest)
    info = CheckpointInfo(ckpt.url, ckpt.display(), VALID)
    if trusted:
        warn_trusted(info.location)
    reader = ShardReader(ckpt, metadata, routes=routes(ckpt, manifest))
    coord = Coordinator.single_process()
    _dcp_load(state, reader, _LoadPlanner(trusted=trusted), coord, info, collective=False)


class _LoadPlanner(DefaultLoadPlanner):
    """DCP's planner, except that objects are unpickled safely (unless ``trusted``) and land
    under the template's own keys.

    DCP addresses objects by stringified paths and would put the value of ``{0: obj}`` under
    a new key ``"0"`` (an optimizer's per-parameter state, for one). DCP's own ``load_bytes``
    unpickles with ``weights_only=False``: neither branch below calls it.
    """

    def __init__(self, *args: Any, trusted: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.trusted = trusted

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        obj = load_object(value, fqn, trusted=self.trusted)
        if not self.flatten_state_dict:
            self.state_dict[fqn] = obj
            return
        mappings, original = load_planner_mappings(self)
        _assign(original, mappings[fqn], obj)


def _assign(root: Any, path: Sequence[str | int], value: Any) -> None:
    node = root
    for element in path[:-1]:
        node = node[_existing_key(node, element)]
    node[_existing_key(node, path[-1])] = value


def _existing_key(node: Any, element: str | int) -> Any:
    if isinstance(node, list) or element in node:
        return element
    for key in node:
        if str(key) == element:
            return key
    return element


def _dcp_load(
    state: dict[str, Any],
    reader: ShardReader,
    planner: DefaultLoadPlanner,
    coord: Coordinator,
    info: CheckpointInfo,
    *,
    collective: bool = True,
) -> None:
    """DCP's load of ``state`` on this rank. Every rank has the whole metadata, so each plans
    its own reads without DCP's gather and scatter of every rank's read plan (at 20,000
    tensors those pickled plans cost more than reading the bytes); with ``collective``, one
    agreement then makes a failure on any rank fail every rank, naming them all."""
    # DCP sorts the top-level keys (int and str do not compare); its FQNs are str(key) anyway.
    keyed = {str(k): v for k, v in state.items()}
    failures: list[_Failure] = []
    cause: BaseException | None = None  # this rank's own failure, chained to the error
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp_load(keyed, storage_reader=reader, planner=planner, no_dist=True)
    except CheckpointException as exc:
        cause = exc
        failures = [_Failure.of(coord.rank, err) for err in _failures(exc).values()]
    except Exception as exc:
        cause = exc
        failures = [_Failure.of(coord.rank, exc)]
    if collective and coord.distributed:
        failed = coord.max_ints([1 if failures else 0], Phase.LOAD, error=CheckpointLoadError)
        if failed[0]:
            gathered = coord.all_gather(Phase.LOAD, lambda: failures, error=CheckpointLoadError)
            failures = [f for rank_failures in gathered for f in rank_failures]
    if failures:
        ranks = [RankFailure(f.rank, Phase.LOAD, f.type_name, f.message) for f in failures]
        unsafe = sorted({t for f in failures for t in f.unsafe_types})
        if any(f.unsafe for f in failures):
            raise UnsafeCheckpointError(info.location, ranks, unsafe) from cause
        raise CheckpointLoadError(info.location, ranks) from cause
    for key in state:  # values DCP replaced rather than filled in place
        state[key] = keyed[str(key)]


@dataclass(frozen=True)
class _Failure:
    """One rank's load failure, as it travels to the other ranks (plain, picklable)."""

    rank: int
    type_name: str
    message: str
    unsafe: bool = False
    unsafe_types: tuple[str, ...] = ()

    @classmethod
    def of(cls, rank: int, exc: BaseException) -> _Failure:
        if isinstance(exc, UnsafeObjectError):
            return cls(rank, type(exc).__name__, str(exc), True, tuple(exc.types))
        return cls(rank, type(exc).__name__, str(exc))


def _template(
    metadata: Metadata,
    skeleton: Skeleton,
    prefix: tuple[str, ...],
    targets: Targets | None = None,
    device: str | None = None,
) -> Any:
    """An empty nested state shaped like what was saved under ``prefix`` (tensors allocated,
    on ``device``, or taken from ``targets``; objects ``None``), for DCP to load into;
    ``None`` when nothing was saved there."""
    leaves = {tuple(path): fqn for fqn, path in (metadata.planner_data or {}).items()}

    def leaf(path: tuple[str | int, ...]) -> Any:
        fqn = leaves.get(path)
        md = metadata.state_dict_metadata.get(fqn) if fqn is not None else None
        if isinstance(md, TensorStorageMetadata):
            target = None if targets is None else targets(path, md.size, md.properties.dtype)
            if target is not None:
                return target
            return torch.empty(md.size, dtype=md.properties.dtype, device=device)
        return None

    if skeleton is None:
        raise ManifestError("dcp_metadata.json records no skeleton of the saved state")
    try:
        node = build(subtree(skeleton, prefix), leaf, prefix)
    except KeyError:
        return None
    for key in reversed(prefix):
        node = {key: node}
    return node


def _failures(exc: CheckpointException) -> Mapping[int, BaseException]:
    out = {}
    for rank, failure in exc.failures.items():
        out[rank] = failure[0] if isinstance(failure, tuple) else failure
    return out
