"""Replica groups that leave and join while the others train: one step of the protocol.

A *replica group* is one or more processes with a process group of their own (one torchrun
job); the groups are kept in step by torchft's Lighthouse (which decides, at every step, the
quorum of groups taking part) and Manager (one per process). Every process of every group
calls, at every optimizer step, in this order:

1. :meth:`ReplicaGroup.start_step`: join the step's quorum (synchronous: it returns once the
   quorum is known). A group that is behind (new, restarted, or evicted while stopped) first
   receives the live state from a peer (torchft's heal, through
   :class:`~lightning_elastic.core.replicas.transport.LiveStateTransport`), handed to the
   ``put_state`` callback, and takes part in this very step. The returned :class:`StepView`
   says which *slot* of the step this process fills (``participant * group_size +
   group_rank``), so the caller takes that slot's samples (:mod:`.plan`).
2. forward and backward on those samples, locally (no DDP wrapper).
3. :meth:`ReplicaGroup.reduce`: the gradients, weighted by the samples each process trained,
   are summed over the group's own process group and then over the groups (torchft's fault-
   tolerant allreduce); a header summed alongside says how many samples contributed and which
   slots. ``None`` when a peer failed during the step.
4. :meth:`ReplicaGroup.commit`: torchft's commit vote. Only a committed step may be applied
   (optimizer step, data position); otherwise the caller starts the step again from 1 with
   the new quorum, and the step's samples are served again.

Survivors of a lost group never restart: they lose the step in flight (detected by the failed
allreduce, or after the Lighthouse's heartbeat timeout for a stopped group) and go on.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from lightning_elastic.core._compat import flatten_dense
from lightning_elastic.core.options import check_count, check_seconds
from lightning_elastic.core.replicas import _compat as ft
from lightning_elastic.core.replicas.transport import LiveStateTransport
from lightning_elastic.errors import ConfigError, ReplicaGroupError

__all__ = [
    "GROUP_ENV",
    "LIGHTHOUSE_ENV",
    "Reduced",
    "ReplicaEvent",
    "ReplicaGroup",
    "ReplicaOptions",
    "StepView",
]

log = logging.getLogger(__name__)

LIGHTHOUSE_ENV = "LIGHTNING_ELASTIC_LIGHTHOUSE"
GROUP_ENV = "LIGHTNING_ELASTIC_REPLICA_GROUP"
_STATE_KEY = "lightning_elastic"


@dataclasses.dataclass(frozen=True)
class ReplicaOptions:
    """How this group takes part: the Lighthouse's address (``http://host:port``; default
    ``$LIGHTNING_ELASTIC_LIGHTHOUSE``), this group's name (default
    ``$LIGHTNING_ELASTIC_REPLICA_GROUP``, then the host name and process id), the fewest
    groups a step may commit with, the timeout of one cross-group collective (a stopped peer
    holds the step this long at most, unless the Lighthouse evicts it first), of a quorum, and
    of the state transfer."""

    lighthouse: str | None = None
    name: str | None = None
    min_groups: int = 1
    step_timeout: float = 30.0
    quorum_timeout: float = 300.0
    connect_timeout: float = 30.0
    heartbeat_interval: float = 0.1
    max_failed_attempts: int = 100
    trusted: bool = False

    def __post_init__(self) -> None:
        check_count(self.min_groups, "min_groups")
        check_count(self.max_failed_attempts, "max_failed_attempts")
        for name in ("step_timeout", "quorum_timeout", "connect_timeout", "heartbeat_interval"):
            object.__setattr__(self, name, check_seconds(getattr(self, name), name))

    def resolved_lighthouse(self) -> str:
        """The Lighthouse address, or a ``ConfigError`` saying where to give it."""
        address = self.lighthouse or os.environ.get(LIGHTHOUSE_ENV)
        if not address:
            raise ConfigError(
                "replica groups need the Lighthouse's address: pass lighthouse='http://HOST:PORT' "
                f"or set {LIGHTHOUSE_ENV} (start one with `lightning-elastic lighthouse`)"
            )
        if "://" not in address:
            address = f"http://{address}"
        return address

    def resolved_name(self) -> str:
        """This group's name (the same on every process of the group)."""
        name = self.name or os.environ.get(GROUP_ENV)
        if not name:
            name = f"{os.uname().nodename}-{os.environ.get('TORCHELASTIC_RUN_ID', os.getppid())}"
        if ":" in name or not name.strip() or any(not c.isprintable() for c in name):
            raise ConfigError(
                f"replica group name {name!r} must be printable and may not contain ':'"
            )
        return name


@dataclasses.dataclass(frozen=True)
class StepView:
    """This process's part in the step being started: the committed steps so far (``step``),
    the quorum, the participating groups, this group's participant rank, and this process's
    slot among ``slots = participants * group_size`` (``None``: not taking part)."""

    step: int
    quorum_id: int
    participants: int
    participant: int | None
    group_rank: int
    group_size: int
    healed: bool

    @property
    def slots(self) -> int:
        """Data slots this step: one per process of every participating group."""
        return self.participants * self.group_size

    @property
    def slot(self) -> int | None:
        """This process's data slot this step (None when its group does not participate)."""
        if self.participant is None:
            return None
        return self.participant * self.group_size + self.group_rank


@dataclasses.dataclass(frozen=True)
class Reduced:
    """A step's reduction: the gradient sum divided by the samples that contributed, the
    slots that contributed, the number of contributing samples, whether this group asked to
    leave (any of its processes) and how many groups did, and per gradient whether any
    contributing process's backward pass produced it."""

    flats: list[torch.Tensor]
    contributed: list[bool]
    samples: float
    leaving: bool = False
    groups_leaving: int = 0
    used: list[bool] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class ReplicaEvent:
    """Something that happened to the quorum, as the health metrics and history record it:
    ``kind`` is ``"join"`` (this group healed: the state came from a peer), ``"change"`` (the
    participating groups changed), or ``"failed"`` (a step attempt failed and was redone);
    ``stall_s`` is the time the step lost to it."""

    kind: str
    step: int
    quorum_id: int
    participants: int
    stall_s: float = 0.0
    detail: dict[str, float] = dataclasses.field(default_factory=dict)


class ReplicaGroup:
    """This process's side of the replica groups; see the module docstring for the order of
    calls. ``get_state``/``put_state`` give and take the live state a healing group needs
    (everything that must be equal in every group); ``intra`` is the group's own process group
    (``None`` for a group of one process)."""

    def __init__(
        self,
        options: ReplicaOptions,
        *,
        get_state: Callable[[], Any],
        put_state: Callable[[Any], None],
        group_rank: int,
        group_size: int,
        store_addr: str,
        store_port: int,
        intra: Any = None,
    ) -> None:
        ft.require()
        self.options = options
        self.name = options.resolved_name()
        self.group_rank = group_rank
        self.group_size = group_size
        self._intra = intra
        self._get_state = get_state
        self._put_state = put_state
        self._healed = False
        self.events: list[ReplicaEvent] = []
        self.last_configure_s = 0.0
        self._last_participants = -1
        timeout = timedelta(seconds=options.step_timeout)
        self.transport = LiveStateTransport(timeout=timeout, trusted=options.trusted)
        self._pg = ft.make_process_group(timeout, self._configured)
        lighthouse = options.resolved_lighthouse()
        if group_rank == 0:  # the process that talks to the Lighthouse
            self._check_lighthouse(lighthouse)
        try:
            self.manager = self._make_manager(lighthouse, store_addr, store_port, timeout)
        except Exception as exc:
            self.transport.shutdown(wait=False)
            raise ReplicaGroupError(
                f"replica group {self.name!r}: torchft's Manager did not start (the "
                f"Lighthouse at {lighthouse}, the group's store at {store_addr}:{store_port}): "
                f"{exc}"
            ) from exc

    def _check_lighthouse(self, address: str) -> None:
        """A clear error within the connect timeout when no Lighthouse answers at ``address``
        (torchft's own waits for the whole quorum timeout when something else answers, or
        nothing does)."""
        problem = ft.probe_lighthouse(address, self.options.connect_timeout)
        if problem is None:
            return
        self.transport.shutdown(wait=False)
        raise ReplicaGroupError(
            f"replica group {self.name!r}: no Lighthouse answered at {address} within "
            f"{self.options.connect_timeout:g} s ({problem}); check the address "
            f"(ElasticFTStrategy(lighthouse=...) or ${LIGHTHOUSE_ENV}) and that "
            "`lightning-elastic lighthouse` runs there"
        )

    def _make_manager(
        self, lighthouse: str, store_addr: str, store_port: int, timeout: timedelta
    ) -> Any:
        options = self.options
        return ft.make_manager(
            process_group=self._pg,
            transport=self.transport,
            key=_STATE_KEY,
            get_state=self._give,
            put_state=self._take,
            min_groups=options.min_groups,
            group_rank=self.group_rank,
            group_size=self.group_size,
            store_addr=store_addr,
            store_port=store_port,
            lighthouse=lighthouse,
            name=self.name,
            timeout=timeout,
            quorum_timeout=timedelta(seconds=options.quorum_timeout),
            connect_timeout=timedelta(seconds=options.connect_timeout),
            heartbeat_interval=timedelta(seconds=options.heartbeat_interval),
            init_sync=True,
        )

    # ------------------------------------------------------------------ the step

    def start_step(self) -> StepView:
        """Join this step's quorum (see the module docstring); a group behind the others gets
        their state through ``put_state`` first. Raises :class:`ReplicaGroupError` when no
        quorum forms within the quorum timeout (the Lighthouse is gone, or too few groups)."""
        self._healed = False
        self.last_configure_s = 0.0
        began = time.perf_counter()
        try:
            self.manager.start_quorum(allow_heal=True)
        except _ApplyError as exc:  # the peer's state reached us but does not fit this group
            cause = exc.__cause__
            if isinstance(cause, ConfigError):
                raise cause from None
            raise ReplicaGroupError(
                f"replica group {self.name!r} received the live state of step "
                f"{self.manager.current_step()} from a peer but could not apply it (is every "
                f"group training the same model and configuration?): {cause!r}"
            ) from cause
        except Exception as exc:
            raise ReplicaGroupError(
                f"replica group {self.name!r} found no quorum within "
                f"{self.options.quorum_timeout:.0f} s (is the Lighthouse at "
                f"{self.options.resolved_lighthouse()} running, with at least "
                f"{self.options.min_groups} group(s)?): {exc}"
            ) from exc
        error = self.manager.errored()
        if error is not None:
            cause = getattr(error, "original_exception", error)
            if isinstance(cause, ConfigError):  # every later attempt would fail the same way
                raise cause
            # a heal whose source went away, a process group that did not form: this attempt
            # fails (this group takes part without counting) and the next quorum tries again
            log.warning("replica group %r: the quorum or the heal failed: %s", self.name, cause)
        participant = self.manager.participating_rank()
        participants = int(self.manager.num_participants())
        view = StepView(
            step=int(self.manager.current_step()),
            quorum_id=ft.quorum_id(self.manager),
            participants=participants,
            participant=None if participant is None else int(participant),
            group_rank=self.group_rank,
            group_size=self.group_size,
            healed=self._healed,
        )
        spent = time.perf_counter() - began
        if self._healed:
            stats = self.transport.stats
            self.events.append(
                ReplicaEvent(
                    "join",
                    view.step,
                    view.quorum_id,
                    participants,
                    spent,
                    {
                        "configure_s": self.last_configure_s,
                        "transfer_s": stats.received_s,
                        "transfer_bytes": float(stats.received_bytes),
                    },
                )
            )
        elif participants != self._last_participants and self._last_participants >= 0:
            self.events.append(
                ReplicaEvent(
                    "change",
                    view.step,
                    view.quorum_id,
                    participants,
                    spent,
                    {"configure_s": self.last_configure_s},
                )
            )
        self._last_participants = participants
        return view

    def reduce(
        self,
        grads: Sequence[torch.Tensor],
        *,
        samples: float,
        weight: float,
        view: StepView,
        leaving: bool = False,
        used: Sequence[bool] | None = None,
        agreement: int = 0,
    ) -> Reduced | None:
        """Sum ``grads`` times ``weight`` over every process of every participating group and
        divide by the samples that contributed (each process trained ``samples``); ``None``
        when the step failed (a peer is gone). With ``grads`` the gradient of the mean loss
        over the process's batch, ``weight = samples`` makes the result the gradient of the
        mean over every sample of the step, however unevenly they were split. ``leaving``:
        this process was asked to leave (a drain signal); the group leaves after this step if
        any of its processes was, and every group learns how many groups leave. ``used``: per
        gradient, whether this process's backward pass produced it (the result says which
        ones some process did: the others stay unused, as under DDP). ``agreement``: a number
        in ``[1, 2**16)`` that must be the same on every contributing process (a digest of
        what the step's plan depends on); a step where it differs raises ``ConfigError``.

        A process whose quorum or heal failed (the Manager has an error) cannot commit this
        attempt; it still takes its part in the step's collectives, contributing nothing, so
        the other groups commit without waiting for it (their ``contributed`` says its slots
        did not: its samples go back to the queue)."""
        errored = self.manager.errored() is not None
        slot = None if errored else view.slot
        counts = slot is not None
        slots = view.slots
        flags = list(used) if used is not None else [True] * len(grads)
        header = torch.zeros(_HEADER + slots + len(flags), dtype=torch.float64)
        if slot is not None:
            if samples > 0:
                header[0] = samples
                header[_HEADER + slot] = 1.0
            if agreement:
                header[3:6] = torch.tensor(
                    [1.0, agreement, float(agreement) ** 2], dtype=torch.float64
                )
            header[_HEADER + slots :] = torch.tensor(flags, dtype=torch.float64)
        header[1] = 1.0 if leaving else 0.0
        flats = _flatten_by_dtype(grads, weight if counts else 0.0)
        tensors = [header, *flats]
        if self._intra is not None and self.group_size > 1:
            for tensor in tensors:  # the group's own process group: a failure ends the group
                dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self._intra)
        group_leaving = bool(header[1] > 0)
        header[1] = 0.0
        header[2] = 1.0 if group_leaving else 0.0  # every rank r of a group: once per r's ring
        if errored:
            self._take_part(tensors)
            return None
        works = [self.manager.allreduce(t, reduce_op=dist.ReduceOp.SUM) for t in tensors]
        for work in works:
            work.wait()
        if self.manager.errored() is not None:
            return None
        if counts and agreement:
            _check_agreement(header[3:6].tolist(), agreement, self.name, view)
        total = float(header[0])
        contributed = [bool(v > 0.5) for v in header[_HEADER : _HEADER + slots].tolist()]
        if total > 0:
            for flat in flats:
                flat.div_(total)
        return Reduced(
            flats=flats,
            contributed=contributed,
            samples=total,
            leaving=group_leaving,
            groups_leaving=round(float(header[2])),
            used=[bool(v > 0.5) for v in header[_HEADER + slots :].tolist()],
        )

    def _take_part(self, tensors: Sequence[torch.Tensor]) -> None:
        """This attempt failed here (the quorum or the heal): take part in the step's ring
        with what ``tensors`` hold (nothing counted), directly on the process group, so the
        groups that are fine do not wait a step timeout for this one and fail too."""
        try:
            works = [ft.allreduce_sum(self._pg, tensor) for tensor in tensors]
            for work in works:
                work.wait()
        except Exception as exc:  # the ring itself is broken: the others fail this step too
            log.info("replica group %r: could not take part in the step: %s", self.name, exc)

    def commit(self) -> bool:
        """torchft's commit vote for this step (every process of the group calls it)."""
        try:
            return bool(self.manager.should_commit())
        except Exception as exc:
            raise ReplicaGroupError(
                f"replica group {self.name!r}: the commit vote of step "
                f"{self.manager.current_step()} failed: {exc}"
            ) from exc

    def failed(self, view: StepView, stall_s: float) -> None:
        """Record a step attempt that did not commit (the caller redoes the step)."""
        error = self.manager.errored()
        self.events.append(
            ReplicaEvent(
                "failed",
                view.step,
                view.quorum_id,
                view.participants,
                stall_s,
                {"error": 0.0} if error is None else {},
            )
        )
        if error is not None:
            log.warning(
                "replica group %r: step %d failed and is redone: %s", self.name, view.step, error
            )

    @property
    def step(self) -> int:
        """Committed steps (torchft's step counter; equal in every group)."""
        return int(self.manager.current_step())

    def state_dict(self) -> dict[str, int]:
        """torchft's own step state, for durable checkpoints."""
        return {str(k): int(v) for k, v in self.manager.state_dict().items()}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Restore :meth:`state_dict` (after a whole-job restart from a checkpoint)."""
        self.manager.load_state_dict({k: int(v) for k, v in state.items()})

    def close(self) -> None:
        """Leave: stop the Manager and the state server (the Lighthouse drops this group
        after its heartbeat timeout, or at once when the others' next quorum forms)."""
        try:
            self.manager.shutdown(wait=False)
        finally:
            self.transport.shutdown(wait=False)

    # ------------------------------------------------------------------ torchft callbacks

    def _give(self) -> Any:
        return self._get_state()

    def _take(self, state: Any) -> None:
        self._healed = True
        try:
            self._put_state(state)
        except Exception as exc:  # raised from start_quorum (the training thread)
            raise _ApplyError() from exc

    def _configured(self, seconds: float) -> None:
        self.last_configure_s = seconds


class _ApplyError(Exception):
    """``put_state`` failed on the live state a peer sent (the cause is chained)."""


# the header's fixed fields: samples, leaving, groups leaving, then the agreement's count, sum
# and sum of squares; the slots' contribution flags and the gradients' use flags follow
_HEADER = 6


def _check_agreement(sums: Sequence[float], mine: int, name: str, view: StepView) -> None:
    """Every contributing process had ``mine`` iff the sum is ``n * mine`` and the sum of
    squares ``n * mine**2`` (exact in float64: ``mine < 2**16``, ``n < 2**20`` processes)."""
    n, total, squares = sums
    if total != n * mine or squares != n * float(mine) ** 2:
        raise ConfigError(
            f"replica group {name!r}: the groups taking part in step {view.step} do not agree "
            "on the training data's plan (the dataset's length, shuffle, seed, drop_last, the "
            "DataLoader's batch_size, global_batch_size, accumulate_grad_batches, the number "
            "of processes per group, or the position in the epoch): every group must run the "
            "same training configuration"
        )


def _flatten_by_dtype(grads: Sequence[torch.Tensor], weight: float) -> list[torch.Tensor]:
    """One flat copy per dtype of ``grads`` times ``weight`` (in the order of first
    appearance)."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for grad in grads:
        by_dtype.setdefault(grad.dtype, []).append(grad)
    flats = []
    for group in by_dtype.values():
        flat = flatten_dense(group).clone() if len(group) == 1 else flatten_dense(group)
        flats.append(flat.mul_(weight))
    return flats


def unflatten_into(grads: Sequence[torch.Tensor], flats: Sequence[torch.Tensor]) -> None:
    """Copy ``flats`` (as :func:`_flatten_by_dtype` laid them out) back into ``grads``."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for grad in grads:
        by_dtype.setdefault(grad.dtype, []).append(grad)
    for group, flat in zip(by_dtype.values(), flats, strict=True):
        offset = 0
        for grad in group:
            n = grad.numel()
            grad.copy_(flat[offset : offset + n].view_as(grad))
            offset += n
