"""One typed error hierarchy for everything lightning_elastic raises, and its warnings.

Every error class derives from :class:`ElasticCheckpointError` (an ``Exception``), so
``except ElasticCheckpointError`` catches all of them (one exception: :class:`UnsafeObjectError`,
raised inside DCP's read and turned into :class:`UnsafeCheckpointError` before it reaches a
caller). Messages say what happened, where, and what to do about it. Every warning class is
here too. ``tests/unit/test_errors.py`` keeps it so: an exception or warning class defined in
any other module of the package must be private to it (a leading underscore) or one of the two
that are not the library's (the command line's exit, the test helpers' assertion).
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from enum import Enum
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lightning_elastic.core.format.integrity import Problem
    from lightning_elastic.core.tiers.transfer import TransferFailure, TransferStats

# The public errors and warnings: ``lightning_elastic`` re-exports exactly these (docs/api.md
# lists them). The other names here are parts of the hierarchy a caller meets as attributes or
# more specific classes (``Phase``, ``RankFailure``, ``DistributedFailure``, ...), or errors
# raised and caught inside the package (``CorruptWhileLoading``, ``TransferError``, ...).
__all__ = [
    "CheckpointExistsError",
    "CheckpointLoadError",
    "CheckpointMismatchError",
    "CheckpointNotFoundError",
    "CheckpointSaveError",
    "CheckpointTimeoutError",
    "ConfigError",
    "CorruptCheckpointWarning",
    "DataShardingError",
    "ElasticCheckpointError",
    "ElasticDeprecationWarning",
    "ForkingWorkersWarning",
    "IntegrityError",
    "LoadTimeoutError",
    "ManifestError",
    "PerRankStateError",
    "ReplicaGroupError",
    "SaveTimeoutError",
    "SnapshotChangedError",
    "SnapshotFallbackWarning",
    "StaleWriterError",
    "StorageError",
    "StorageFullError",
    "StorageNotFoundError",
    "StoragePermissionError",
    "StragglerWarning",
    "TransientStorageError",
    "UnsafeCheckpointError",
    "UnsupportedFormatError",
    "UntrustedManifestError",
    "WarmStartError",
    "WeightsMismatchError",
    "WorldSizeError",
]


class ElasticCheckpointError(Exception):
    """Base class of every error raised by lightning_elastic."""


class ConfigError(ElasticCheckpointError, ValueError):
    """An option has a value outside its allowed range; the message names both."""


# ----------------------------------------------------------------------------- storage


class StorageError(ElasticCheckpointError, OSError):
    """A storage operation failed. ``op`` and ``path`` name what was attempted.

    The original exception is chained as ``__cause__``.
    """

    def __init__(self, op: str, path: str, cause: BaseException | str, hint: str = "") -> None:
        self.op = op
        self.path = path
        self.cause = cause
        self.hint = hint
        reason = cause if isinstance(cause, str) else f"{type(cause).__name__}: {cause}"
        message = f"storage {op} failed for {path!r}: {reason}"
        if hint:
            message += f". {hint}"
        super().__init__(message)

    def __reduce__(self) -> tuple[object, ...]:  # keep picklable across processes
        cause = (
            self.cause
            if isinstance(self.cause, str)
            else f"{type(self.cause).__name__}: {self.cause}"
        )
        return (type(self), (self.op, self.path, cause, self.hint))

    def __str__(self) -> str:
        return str(self.args[0])


class TransientStorageError(StorageError):
    """A retryable error persisted until the retry deadline ran out."""


class StoragePermissionError(StorageError):
    """Access was denied; fix the credentials or permissions of the path."""


class StorageFullError(StorageError):
    """The storage has no space (ENOSPC/EDQUOT). Committed checkpoints are untouched."""


class StorageNotFoundError(StorageError):
    """The path, bucket or container does not exist."""


# ----------------------------------------------------------------------------- checkpoints


class CheckpointNotFoundError(ElasticCheckpointError, FileNotFoundError):
    """No committed checkpoint exists where one was asked for."""


class CheckpointExistsError(ElasticCheckpointError, FileExistsError):
    """A committed checkpoint already exists at the requested name."""


class ManifestError(ElasticCheckpointError):
    """A manifest is missing, unparseable or inconsistent. The checkpoint is not usable."""


class UntrustedManifestError(ManifestError):
    """The manifest has no valid HMAC for the key in ``LIGHTNING_ELASTIC_HMAC_KEY``: it was
    modified, or written without (or with another) key. Refused, but not quarantined: the
    reader's key may be the wrong one."""


class UnsupportedFormatError(ManifestError):
    """The checkpoint was written in a newer format than this version can read."""


class IntegrityError(ElasticCheckpointError):
    """A checkpoint file does not match its manifest (missing, wrong size or checksum).

    ``file`` names the offending file; ``checkpoint`` the checkpoint directory.
    """

    def __init__(self, checkpoint: str, file: str, reason: str) -> None:
        self.checkpoint = checkpoint
        self.file = file
        self.reason = reason
        super().__init__(f"checkpoint {checkpoint!r} is corrupt: {file!r}: {reason}")

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (self.checkpoint, self.file, self.reason))


class CorruptWhileLoading(IntegrityError):
    """A fused load found shard files that do not match the manifest; raised on every rank
    (the load walk quarantines the checkpoint and tries the one before). ``problems``: each
    file and what was wrong with it."""

    def __init__(self, checkpoint: str, problems: Sequence[Problem]) -> None:
        self.problems = tuple(sorted(problems, key=lambda p: p.file))
        first = self.problems[0]
        super().__init__(checkpoint, first.file, first.reason)

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (self.checkpoint, self.problems))


class TransferError(ElasticCheckpointError):
    """Some of this rank's checkpoint file transfers between ranks failed (peer replication,
    recovery from a peer); ``failures`` lists them in list order, ``stats`` what this rank
    did. The peer of each failed transfer raises too (it saw the failure in the exchange),
    unless the connection to it broke."""

    def __init__(self, failures: Sequence[TransferFailure], stats: TransferStats) -> None:
        self.failures = tuple(failures)
        self.stats = stats
        shown = "; ".join(
            f"{f.transfer.path!r} from rank {f.transfer.src} to rank {f.transfer.dst} "
            f"({f.kind}): {f.reason}"
            for f in self.failures[:5]
        )
        more = f" (and {len(self.failures) - 5} more)" if len(self.failures) > 5 else ""
        ElasticCheckpointError.__init__(
            self, f"{len(self.failures)} checkpoint file transfer(s) failed: {shown}{more}"
        )

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (self.failures, self.stats))


class TransferIntegrityError(TransferError, IntegrityError):
    """Every failed transfer was a file whose bytes did not match its checksum or size (at
    the sender, or as received: the received copy was deleted). ``file`` is the first one."""

    def __init__(self, failures: Sequence[TransferFailure], stats: TransferStats) -> None:
        TransferError.__init__(self, failures, stats)
        first = self.failures[0]
        self.checkpoint = first.transfer.path.rpartition("/")[0]
        self.file, self.reason = first.transfer.path, first.reason


class UnsafeObjectError(Exception):
    """One object of a checkpoint cannot be loaded without running code from storage.

    ``types`` names the globals outside the allowlist (empty when torch's unpickler refused
    something else, ``reason`` says what). Raised inside DCP's read (so not an
    :class:`ElasticCheckpointError`: DCP wraps it) and gathered from every rank;
    :func:`lightning_elastic.core.load.load.load_checkpoint` turns it into
    :class:`UnsafeCheckpointError`.
    """

    def __init__(self, fqn: str, types: Sequence[str] = (), reason: str = "") -> None:
        self.fqn = fqn
        self.types = tuple(types)
        self.reason = reason
        if self.types:
            what = f"references {', '.join(self.types)}, not on the safe-loading allowlist"
        else:
            what = f"cannot be unpickled safely: {reason}"
        super().__init__(f"object {fqn!r} {what}")

    def __reduce__(self) -> tuple[object, ...]:  # travels between ranks inside DCP's errors
        return (type(self), (self.fqn, self.types, self.reason))


class WeightsMismatchError(ElasticCheckpointError, RuntimeError):
    """A checkpoint's weights do not fit the module they are loaded into (``load_weights``).

    ``key`` names the first mismatching entry; ``checkpoint_shape`` / ``model_shape`` are its
    shapes (``None`` on the side that lacks it). Nothing was loaded into the module.
    """

    def __init__(
        self,
        checkpoint: str,
        key: str,
        checkpoint_shape: tuple[int, ...] | None,
        model_shape: tuple[int, ...] | None,
        hint: str = "",
    ) -> None:
        self.checkpoint = checkpoint
        self.key = key
        self.checkpoint_shape = checkpoint_shape
        self.model_shape = model_shape
        self.hint = hint
        if checkpoint_shape is None:
            what = f"the model has {key!r} {_shape(model_shape)}, the checkpoint has no such key"
        elif model_shape is None:
            what = f"the checkpoint has {key!r} {_shape(checkpoint_shape)}, the model has not"
        else:
            what = (
                f"{key!r} is {_shape(checkpoint_shape)} in the checkpoint and "
                f"{_shape(model_shape)} in the model"
            )
        super().__init__(f"weights of {checkpoint} do not fit the model: {what}. {hint}".strip())

    def __reduce__(self) -> tuple[object, ...]:
        return (
            type(self),
            (self.checkpoint, self.key, self.checkpoint_shape, self.model_shape, self.hint),
        )


def _shape(shape: tuple[int, ...] | None) -> str:
    return "(not a tensor)" if shape is None else f"of shape {tuple(shape)}"


class WarmStartError(ElasticCheckpointError, RuntimeError):
    """``lightning-elastic run --warm-start``: the fork server died before it forked a worker
    (a module it imports ended the interpreter, the OOM killer, a signal); the node gives up
    before it joins the rendezvous, so the job's other nodes go on."""


class ReplicaGroupError(ElasticCheckpointError, RuntimeError):
    """Replica groups (``strategy="elastic_ft"``): no quorum formed within the quorum timeout
    (the Lighthouse is gone, or fewer groups than ``min_replica_groups`` are alive), or a step
    could not commit after many attempts. Nothing committed is lost: the groups' durable
    checkpoints are as they were; the message names the group and what it waited for."""


class CorruptCheckpointWarning(UserWarning):
    """A checkpoint failed verification and was skipped (and quarantined)."""


class ElasticDeprecationWarning(DeprecationWarning):
    """An option spelled the old way: it still works, and the message names the new spelling
    (shown by default, as Lightning shows its own deprecations)."""


# Python shows a DeprecationWarning only when __main__ triggers it; LightningCLI builds the
# callback from a YAML inside jsonargparse, where it would be hidden. A filter in front, as
# Lightning's for LightningDeprecationWarning (pytest's own filters still come first in tests)
warnings.simplefilter("default", ElasticDeprecationWarning)


class StragglerWarning(RuntimeWarning):
    """A rank was slower than the median rank by more than ``straggler_factor`` over a window
    (the message names the rank, its node and whether the time went into the step or saves)."""


class ForkingWorkersWarning(UserWarning):
    """Training dataloader workers are forked at every epoch while checkpoints are written
    in the background, on a Python where a forked worker can hang (CPython gh-112275)."""


class SnapshotFallbackWarning(RuntimeWarning):
    """A lazy snapshot saw a tensor change between the save point and its copy: that save was
    not committed (it would have been a mixed state) and the engine's saves take blocking
    snapshots from then on (warned once per engine; docs/guarantees.md)."""


class CheckpointMismatchError(ConfigError):
    """The checkpoint was written by a different model or experiment than the one being
    trained (other parameter names or shapes, other hyperparameters); the message names the
    first difference and what to pass instead."""


class WorldSizeError(ConfigError):
    """This world size cannot work with the configuration; the message says what would."""


class DataShardingError(ConfigError):
    """A training dataset would read other ranks' samples: it decided its rank and world size
    before the process group existed (e.g. LitData's ``StreamingDataset`` built at module
    level). Raised on every rank at setup; the message says where to build it instead."""


class PerRankStateError(WorldSizeError):
    """A checkpoint entry differed between the ranks that saved it, so it was saved per rank,
    and nothing says how to give it to another number of ranks.

    ``paths`` names the entries (as subscripts of the checkpoint dict), ``saved_world_size``
    and ``world_size`` the two worlds; the message says what to do. Raised on every rank,
    before anything was restored: giving every rank rank 0's value would silently replace
    the other ranks' state.
    """

    def __init__(
        self,
        checkpoint: str,
        paths: Sequence[str],
        saved_world_size: int,
        world_size: int,
        hint: str = "",
    ) -> None:
        self.checkpoint = checkpoint
        self.paths = tuple(paths)
        self.saved_world_size = saved_world_size
        self.world_size = world_size
        self.hint = hint
        shown = ", ".join(self.paths[:8]) + (" ..." if len(self.paths) > 8 else "")
        todo = hint or (
            f"Resume with {saved_world_size} processes; or make the entry the same on every "
            "rank before it is saved (e.g. reduce it across ranks); or pass a PerRankRule for "
            "it to CheckpointEngine.load(per_rank_rules=...) ('rank0': every rank takes rank "
            "0's value, 'fresh': the entry is dropped and its owner starts afresh)."
        )
        super().__init__(
            f"checkpoint {checkpoint} holds state that differed between its {saved_world_size} "
            f"ranks and was saved per rank: {shown}. Nothing says how to give it to a world of "
            f"{world_size}, and giving every rank rank 0's value would silently replace the "
            f"other ranks' state. {todo}"
        )

    def __reduce__(self) -> tuple[object, ...]:
        return (
            type(self),
            (self.checkpoint, self.paths, self.saved_world_size, self.world_size, self.hint),
        )


class Phase(str, Enum):
    """Where a save or load was when something failed (the value is what messages show)."""

    INIT = "init"
    AGREE = "agree"
    SAVE_DECIDE = "save/decide"
    SAVE_BUSY = "save/busy"
    SAVE_COMPARE = "save/compare"
    SAVE_PLAN = "save/plan"
    WRITE = "write"
    COMMIT = "commit"
    LOAD_SELECT = "load/select"
    LOAD_VERIFY = "load/verify"
    LOAD_QUARANTINE = "load/quarantine"
    LOAD = "load"

    def __str__(self) -> str:
        return self.value


class RankFailure:
    """What went wrong on one rank: the phase it was in and a message (picklable).

    ``phase`` is kept as the :class:`Phase`'s string value, so failures travel as JSON and
    a phase written by another version still reads back.
    """

    __slots__ = ("error_type", "message", "phase", "rank")

    def __init__(self, rank: int, phase: Phase | str, error_type: str, message: str) -> None:
        self.rank = rank
        self.phase: str = phase.value if isinstance(phase, Phase) else str(phase)
        self.error_type = error_type
        self.message = message

    @classmethod
    def from_exception(cls, rank: int, phase: Phase | str, exc: BaseException) -> RankFailure:
        """The failure of ``rank`` in ``phase`` described by ``exc`` (its type name and message)."""
        return cls(rank, phase, type(exc).__name__, str(exc))

    def to_json(self) -> dict[str, object]:
        """The failure as a JSON-safe dict (what :meth:`from_json` reads)."""
        return {
            "rank": self.rank,
            "phase": self.phase,
            "error_type": self.error_type,
            "message": self.message,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, object]) -> RankFailure:
        """The failure :meth:`to_json` wrote."""
        return cls(
            int(str(data["rank"])),
            str(data["phase"]),
            str(data["error_type"]),
            str(data["message"]),
        )

    def __repr__(self) -> str:
        return f"rank {self.rank} in {self.phase}: {self.error_type}: {self.message}"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RankFailure) and self.to_json() == other.to_json()

    def __hash__(self) -> int:
        return hash((self.rank, self.phase, self.error_type, self.message))


class DistributedFailure(ElasticCheckpointError):
    """Something failed on one or more ranks; raised identically on every rank.

    ``failures`` maps each failing rank to a :class:`RankFailure` (phase, type, message).
    """

    verb = "failed"

    def __init__(self, checkpoint: str, failures: Sequence[RankFailure]) -> None:
        self.checkpoint = checkpoint
        self.failures = {f.rank: f for f in failures}
        ranks = ", ".join(str(r) for r in sorted(self.failures))
        detail = "; ".join(repr(self.failures[r]) for r in sorted(self.failures))
        super().__init__(f"{checkpoint} {self.verb}: failure on rank(s) {ranks}: {detail}")

    @property
    def failed_ranks(self) -> list[int]:
        """The ranks that failed, in ascending order."""
        return sorted(self.failures)

    @property
    def phases(self) -> set[str]:
        """The phases the failing ranks were in (``Phase`` values)."""
        return {f.phase for f in self.failures.values()}

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (self.checkpoint, list(self.failures.values())))


class CheckpointSaveError(DistributedFailure):
    """A save failed. Nothing was committed: the previous checkpoint stays the newest valid one."""

    verb = "was not committed"


class StaleWriterError(CheckpointSaveError):
    """A newer job writes this run (it took a newer lease generation): this job's commit was
    refused, on every rank. The message names both writers; stop this copy of the job."""


class SnapshotChangedError(CheckpointSaveError):
    """A lazy snapshot's tensor changed in place between the save point and its copy (a
    change outside the guarded optimizer step): the save was not committed on any rank, as
    it would have mixed two states. Not fatal to training: the engine takes blocking
    snapshots from then on and says so once (:class:`SnapshotFallbackWarning`)."""


class CheckpointLoadError(DistributedFailure):
    """A load failed on some rank; the message names the ranks and what happened."""

    verb = "could not be loaded"


TRUSTED_HINT = (
    "nothing from it was executed. If you trust this checkpoint (you wrote it), load it with "
    "trusted=True (CheckpointEngine.load, ElasticStrategy(trusted=True), "
    "ElasticCheckpointIO(trusted=True), `lightning-elastic consolidate/import --trusted`) or "
    "weights_only=False (load_from_checkpoint, fit/validate/test), or allowlist the type with "
    "torch.serialization.add_safe_globals([...])"
)


class UnsafeCheckpointError(CheckpointLoadError):
    """A checkpoint holds an object that loading would have to run code from storage for.

    ``types`` names the offending globals (classes or functions). Nothing from the checkpoint
    was executed. Load it with ``trusted=True`` only if you trust where it came from.
    """

    verb = "was not loaded (unsafe object)"

    def __init__(
        self, checkpoint: str, failures: Sequence[RankFailure], types: Sequence[str] = ()
    ) -> None:
        self.types = tuple(types)
        super().__init__(checkpoint, failures)
        self.args = (f"{self.args[0]}; {TRUSTED_HINT}",)

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (self.checkpoint, list(self.failures.values()), self.types))

    def __str__(self) -> str:
        return str(self.args[0])


class CheckpointTimeoutError(DistributedFailure, TimeoutError):
    """Some ranks did not reach a synchronization point in time; ``missing_ranks`` names them.

    A timeout is a kind of failure of the operation it happened in: catch
    :class:`SaveTimeoutError` / :class:`LoadTimeoutError` (also caught by
    ``except CheckpointSaveError`` / ``except CheckpointLoadError``), or this class for both.
    """

    def __init__(
        self,
        checkpoint: str,
        phase: Phase | str,
        missing_ranks: Sequence[int],
        timeout_s: float,
        failures: Sequence[RankFailure] = (),
    ) -> None:
        self.missing_ranks = sorted(missing_ranks)
        self.phase_name = phase.value if isinstance(phase, Phase) else str(phase)
        self.timeout_s = timeout_s
        missing = [
            RankFailure(r, phase, "Timeout", f"did not report within {timeout_s:.1f}s")
            for r in self.missing_ranks
        ]
        super().__init__(checkpoint, [*failures, *missing])

    def __reduce__(self) -> tuple[object, ...]:
        others = [f for f in self.failures.values() if f.rank not in self.missing_ranks]
        return (
            type(self),
            (self.checkpoint, self.phase_name, self.missing_ranks, self.timeout_s, others),
        )


class SaveTimeoutError(CheckpointTimeoutError, CheckpointSaveError):
    """A save timed out waiting for ranks; nothing was committed."""


class ManifestNotReceivedError(SaveTimeoutError):
    """Multi-tier: rank 0 committed the save in its node's local directory, but its manifest
    did not reach this rank in time (rank 0 went silent right after its commit). Unlike
    other save timeouts, the checkpoint exists: on rank 0's node (and in the replicas already
    sent), not on this rank's node. A recovery can still choose it."""

    verb = (
        "was committed on rank 0's node, but its manifest did not reach this rank (this "
        "node keeps no copy of it; a recovery can still use the copy on rank 0's node)"
    )


class LoadTimeoutError(CheckpointTimeoutError, CheckpointLoadError):
    """A load timed out waiting for ranks."""


def timeout_error_for(error: type[DistributedFailure]) -> type[CheckpointTimeoutError]:
    """The timeout class that is also an ``error`` (a save, a load, or neither)."""
    if issubclass(error, CheckpointTimeoutError):
        return error
    if issubclass(error, CheckpointLoadError):
        return LoadTimeoutError
    if issubclass(error, CheckpointSaveError):
        return SaveTimeoutError
    return CheckpointTimeoutError
