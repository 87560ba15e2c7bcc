"""Lazy snapshots: the staging copy of a save runs while training goes on.

Between a save point and the next optimizer step the parameters and the optimizer state do not
change, so their copy into the host arena can overlap the next step's forward and backward
(DataStates-LLM's observation). A save with ``snapshot="lazy"`` therefore copies at once, on
the training thread, only what the caller does not guard (module buffers such as BatchNorm's
running statistics, which the forward changes in place, the scheduler's and the loops' tensors,
every serialized object) and hands the guarded tensors to a :class:`LazySnapshot` that the
writer thread copies before it writes. Whatever would change a guarded tensor first waits for
that copy (:meth:`LazySnapshot.wait`): the Lightning callback at ``on_before_optimizer_step``,
a plain-PyTorch loop through :func:`guard_optimizers` (torch's optimizer step pre-hooks), a
caller that knows neither the modules nor the optimizers (``ElasticCheckpointIO``: Lightning
hands it a checkpoint dict) through :class:`EveryOptimizerGuard` (torch's global step
pre-hook, which also names the optimizers whose tensors it can guard).

A change nobody guards (a user's in-place update of a parameter between the save point and the
copy) is caught by the tensors' version counters: recorded at the save point, compared before
and after each batch of copies and once more before the rank reports its shard written. A
changed tensor fails the save with :class:`_TensorChanged` (the commit turns it into
:class:`~lightning_elastic.errors.SnapshotChangedError` on every rank): a mixed state is never
committed. An update made through ``.data`` bypasses the counter (autograd gives ``.data`` a
counter of its own) and cannot be seen: guard it with :meth:`LazySnapshot.wait`.

Which thread calls what: the training thread builds the snapshot (inside
``CheckpointEngine.save``) and calls :meth:`LazySnapshot.wait` (any number of times, from the
guards); the writer thread calls :meth:`LazySnapshot.run` once, then :meth:`LazySnapshot.check`
before reporting its write. On CUDA the copy runs on a side stream into the pinned arena,
ordered after the work the training stream had queued at the save point.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from lightning_elastic.core._compat import foreach_copy, version_counter

__all__ = [
    "SNAPSHOT_MODES",
    "EveryOptimizerGuard",
    "LazyRule",
    "LazySnapshot",
    "_TensorChanged",
    "guard_optimizers",
    "guarded_tensors",
    "storage_key",
]

SNAPSHOT_MODES = ("blocking", "lazy")
# copies are issued in batches of about this many bytes: the counters are compared around
# each batch, and a guard waiting for the copy waits for whole batches only
BATCH_BYTES = 64 << 20


class _TensorChanged(RuntimeError):
    """A tensor of a lazy snapshot changed in place between the save point and its copy."""


def storage_key(tensor: torch.Tensor) -> int:
    """What identifies the memory a tensor (or any view of it) lives in: the address where its
    storage starts (0 for none). A DTensor is keyed by its local shard. Computed from the
    tensor's own address and offset: asking for its storage costs 5x more (20,000 tensors:
    30 ms per save against 6)."""
    t = tensor
    if type(t) not in _PLAIN:
        local = getattr(t, "_local_tensor", None)
        t = local if isinstance(local, torch.Tensor) else t
    try:
        return int(t.data_ptr() - t.storage_offset() * t.element_size())
    except (RuntimeError, NotImplementedError):  # a tensor without storage (meta, fake)
        return 0


_PLAIN = (torch.Tensor, torch.nn.Parameter)


class LazyRule:
    """Which tensors of a save a lazy snapshot copies late: those whose memory is one of
    ``guarded``'s (by storage, so a ``state_dict()``'s detached views count), or every tensor
    when ``guarded`` is ``None``."""

    def __init__(self, guarded: Iterable[torch.Tensor] | None = None) -> None:
        self.keys = None if guarded is None else {storage_key(t) for t in guarded} - {0}

    def __call__(self, tensor: torch.Tensor) -> bool:
        return self.keys is None or storage_key(tensor) in self.keys


def guarded_tensors(
    modules: Iterable[torch.nn.Module],
    optimizers: Iterable[torch.optim.Optimizer],
    *,
    parameters: bool = True,
) -> list[torch.Tensor]:
    """The tensors an optimizer step guard protects: every parameter of ``modules`` (frozen
    ones too: only an in-place update changes them, and the counters catch that), and every
    tensor of each optimizer's state (of the optimizer it wraps too: ZeRO-1's local one) and,
    with ``parameters``, each optimizer's parameters. Buffers are not among them: the forward
    changes BatchNorm's in place."""
    tensors: list[torch.Tensor] = []
    for module in modules:
        tensors.extend(module.parameters())
    seen: set[int] = set()
    pending: list[Any] = list(optimizers)
    while pending:
        opt = pending.pop()
        if id(opt) in seen:
            continue
        seen.add(id(opt))
        for group in getattr(opt, "param_groups", ()) if parameters else ():
            tensors.extend(p for p in group.get("params", ()) if isinstance(p, torch.Tensor))
        for values in getattr(opt, "state", {}).values():
            if isinstance(values, dict):
                tensors.extend(v for v in values.values() if isinstance(v, torch.Tensor))
        for attr in ("optim", "optimizer", "_optimizer"):  # ZeRO-1, Lightning's wrappers
            inner = getattr(opt, attr, None)
            if isinstance(inner, torch.optim.Optimizer) or hasattr(inner, "param_groups"):
                pending.append(inner)
    return tensors


class LazySnapshot:
    """The deferred part of one save's staging copy (see the module docstring).

    ``pairs``: each guarded tensor's destination view in the arena, its source and its FQN;
    the sources' version counters are recorded now, at the save point.
    """

    def __init__(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor, str]]) -> None:
        self._targets = [p[0] for p in pairs]
        self._sources = [p[1] for p in pairs]
        self._fqns = [p[2] for p in pairs]
        self._versions = [version_counter(s) for s in self._sources]
        self.nbytes = sum(t.numel() * t.element_size() for t in self._targets)
        self._done = threading.Event()
        self._lock = threading.Lock()
        self.copy_s = 0.0  # the writer thread's copy
        self.waited_s = 0.0  # what guards waited for the copy (counted as it ends)
        self.failed: str | None = None  # why the copy is not the save point's state
        self._event = _save_point_event(self._sources)
        # the counters when the training thread first reached a guard, if that was before the
        # writer's last check: every in-place op it issued before had ended by then
        self._at_guard: list[int] | None = None
        self._checked = False
        self._waiting_since: float | None = None

    @property
    def done(self) -> bool:
        """Whether the copy has ended (copied, or given up on a changed tensor)."""
        return self._done.is_set()

    def wait(self) -> float:
        """Training thread: block until the copy has ended; the seconds waited (0 when done).
        The writer thread adds the wait to :attr:`waited_s` as it ends the copy, so a result
        built right after counts it."""
        with self._lock:
            if self._at_guard is None and not self._checked:
                self._at_guard = [version_counter(s) for s in self._sources]
            if self._done.is_set():
                return 0.0
            start = self._waiting_since = time.monotonic()
        self._done.wait()
        return time.monotonic() - start

    def _finish(self) -> None:
        """Writer thread: the copy ended; release the waiter and count its wait."""
        with self._lock:
            if self._waiting_since is not None:
                self.waited_s += time.monotonic() - self._waiting_since
                self._waiting_since = None
            self._done.set()

    def run(self) -> None:
        """Writer thread: copy every source into its target, batch by batch, comparing the
        version counters around each batch; raises :class:`_TensorChanged` on a change (the
        copy is given up: its bytes are not the save point's). Ends the wait either way."""
        start = time.monotonic()
        try:
            for lo, hi in _batches(self._targets):
                self._check(lo, hi)
                _copy(self._targets[lo:hi], self._sources[lo:hi], self._event)
                self._check(lo, hi)
        except BaseException as exc:
            self.failed = str(exc)
            raise
        finally:
            self.copy_s = time.monotonic() - start
            self._event = None
            self._finish()

    def end(self) -> None:
        """Writer thread, when the save ends however it ends: no guard waits any longer (a
        save that failed before its copy ran)."""
        if not self._done.is_set():
            self.failed = self.failed or "the save ended before its copy ran"
            self._finish()

    def check(self) -> None:
        """Writer thread, after the write: raise :class:`_TensorChanged` if any source changed
        since the save point. An in-place update still running while its tensor was copied
        bumps the counter only when it ends; this last look catches one that ended during the
        write. Once the training thread reached a guard, the counters as they were then are
        compared instead (what the guarded step changes afterwards is no change of the copy)."""
        with self._lock:
            self._checked = True
            seen = self._at_guard
            if seen is None:
                seen = [version_counter(s) for s in self._sources]
        for k, now in enumerate(seen):
            if now != self._versions[k]:
                raise _TensorChanged(self._changed(k, now))

    def release(self) -> None:
        """Drop the references to the live tensors (after the write)."""
        self._sources = []
        self._targets = []

    def _check(self, lo: int, hi: int) -> None:
        for k in range(lo, hi):
            now = version_counter(self._sources[k])
            if now != self._versions[k]:
                raise _TensorChanged(self._changed(k, now))

    def _changed(self, k: int, now: int) -> str:
        return (
            f"{self._fqns[k]} changed in place between the save point and its lazy copy "
            f"(version {self._versions[k]} -> {now}); the save would mix two states"
        )


def _batches(targets: Sequence[torch.Tensor]) -> Iterable[tuple[int, int]]:
    lo, size = 0, 0
    for k, t in enumerate(targets):
        size += t.numel() * t.element_size()
        if size >= BATCH_BYTES:
            yield lo, k + 1
            lo, size = k + 1, 0
    if lo < len(targets):
        yield lo, len(targets)


def copy_pairs(targets: list[torch.Tensor], sources: list[torch.Tensor]) -> None:
    """``target.copy_(source)`` for every pair, host sources in one call, device sources
    without blocking and then synchronized (the training thread's staging copy)."""
    host = [(t, s) for t, s in zip(targets, sources, strict=True) if s.device.type == "cpu"]
    device = [(t, s) for t, s in zip(targets, sources, strict=True) if s.device.type != "cpu"]
    with torch.no_grad():
        for target, source in device:
            target.copy_(source, non_blocking=source.device.type == "cuda")
        if host:
            foreach_copy([t for t, _ in host], [s for _, s in host])
    if any(s.device.type == "cuda" for _, s in device):
        torch.cuda.synchronize()


def _save_point_event(sources: Sequence[torch.Tensor]) -> Any:
    """CUDA: an event recorded on the training thread's current stream at the save point, so
    the side stream copies the values as of then (``None`` without CUDA sources)."""
    if not any(s.device.type == "cuda" for s in sources):
        return None
    event = torch.cuda.Event()  # type: ignore[no-untyped-call]
    event.record()
    return event


def _copy(targets: list[torch.Tensor], sources: list[torch.Tensor], event: Any) -> None:
    """The writer thread's copy of one batch: host sources in one call; CUDA sources on a
    side stream (after ``event``) into the pinned arena, waited for before returning."""
    host = [(t, s) for t, s in zip(targets, sources, strict=True) if s.device.type != "cuda"]
    cuda = [(t, s) for t, s in zip(targets, sources, strict=True) if s.device.type == "cuda"]
    with torch.no_grad():
        if host:
            foreach_copy([t for t, _ in host], [s.cpu() for _, s in host])
        if cuda:  # pragma: no cover - needs a GPU
            device = cuda[0][1].device
            stream = torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]
            with torch.cuda.stream(stream):
                if event is not None:
                    stream.wait_event(event)
                for target, source in cuda:
                    target.copy_(source, non_blocking=True)
            stream.synchronize()


def guard_optimizers(
    optimizers: Iterable[torch.optim.Optimizer], wait: Callable[[], object]
) -> list[Any]:
    """Plain PyTorch: call ``wait`` (e.g. ``engine.wait_snapshot``) before every step of each
    optimizer (torch's step pre-hooks), so no step changes a tensor a lazy snapshot has not
    copied yet. Returns the hooks' handles (``handle.remove()`` undoes one).

    Not for a step that runs the forward and backward inside ``step(closure)`` (Lightning's
    automatic optimization): the hook runs before the closure and would wait before the
    forward; the Lightning callback waits at ``on_before_optimizer_step`` instead."""

    def hook(optimizer: Any, args: Any, kwargs: Any) -> None:
        wait()

    return [opt.register_step_pre_hook(hook) for opt in optimizers]


class EveryOptimizerGuard:
    """Every optimizer step of this process calls ``wait`` (torch's global step pre-hook)
    before it changes a tensor, and the optimizers seen stepping name the tensors it guards
    (:meth:`tensors`): for a caller that holds neither the modules nor the optimizers, only
    the state dicts they gave (``ElasticCheckpointIO``).

    A step given a closure (Lightning's automatic optimization runs the forward and backward
    in it; ``GradScaler.step`` and manual optimization call ``step()`` without one) waits
    after the closure returns, before the update, as the Lightning callback's
    ``on_before_optimizer_step`` does, so the copy overlaps the forward and backward; a first
    argument that is not callable is no closure (``step(scale)``) and the step waits first.
    The hook runs eagerly under ``torch.compile`` (a compiled step read every version counter
    as 0: each save looked changed). An optimizer that changes its tensors before it calls
    the closure (SAM's first step) is caught by the version counters: that save is not
    committed and lazy snapshots end (module docstring). Until an optimizer has stepped
    nothing is guarded (the first save copies everything at once). A step of any optimizer
    of the process waits, another thread's too. :meth:`remove` undoes the hook."""

    def __init__(self, wait: Callable[[], object]) -> None:
        self.optimizers: weakref.WeakSet[Any] = weakref.WeakSet()
        eager: Callable[[Any], Any] = torch.compiler.disable  # (untyped in torch)
        self._wait = eager(wait)
        self._handle = register_optimizer_step_pre_hook(eager(self._before_step))

    def tensors(self, *, parameters: bool = True) -> list[torch.Tensor]:
        """The state (with ``parameters``: and the parameters) of each optimizer that has
        stepped (:func:`guarded_tensors`)."""
        return guarded_tensors((), list(self.optimizers), parameters=parameters)

    def remove(self) -> None:
        """Unregister the hook (steps no longer wait; calling it again does nothing)."""
        self._handle.remove()

    def _before_step(self, optimizer: Any, args: Any, kwargs: Any) -> Any:
        self.optimizers.add(optimizer)
        # step(closure) or step(closure=...); args[0] is the optimizer itself
        closure = kwargs["closure"] if "closure" in kwargs else (args[1:2] or [None])[0]
        if closure is None or not callable(closure):
            self._wait()
            return None
        wait = self._wait

        def closure_then_wait(*a: Any, **kw: Any) -> Any:
            loss = closure(*a, **kw)
            wait()
            return loss

        if "closure" in kwargs:
            return args, {**kwargs, "closure": closure_then_wait}
        return (args[0], closure_then_wait, *args[2:]), kwargs
